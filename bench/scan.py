"""Cost of layout scans in training: per scan call, and as a share of step time at every=100.

CPU demo model: a small GPT (2 layers, hidden 64, 4 heads, seq 32, batch 8) trained with
``Model.train`` in PyNative mode. Runs alternate without / with ``LayoutScanCallback(every=100)``
so machine noise hits both alike, for two sources:

* the shadow model (this process);
* the real pool followed live from its log (``pool-log``, a child process started with
  ``--pool-log-child``: the log must be switched on before ``import mindspore``). Its cost has
  two parts: MindSpore writing one line per pool call, on every step whether scanned or not
  (``log_cost_pct``: the child's median step time without the callback against this
  process's), and reading them (``overhead_pct`` of the child, as below: the callback's
  per-step poll of the new lines plus the scan).

overhead_pct = (scan_seconds / every + per-step cost) / step time * 100, where the per-step
cost is what the callback adds on every step (its forward hooks and its step-end
bookkeeping), timed directly around those calls; ``ab_overhead_pct`` is the plain A/B
difference of median step times with and without the callback (at ~1 s PyNative steps on a
shared machine it is mostly noise). Last line: one JSON object.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__" and "--pool-log-child" in sys.argv:
    from ms_memopt.mindspore import poolcapture  # noqa: E402

    poolcapture.start(Path(tempfile.mkdtemp(prefix="scan-bench-")) / poolcapture.LOG_NAME)

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
import mindspore.dataset as ds  # noqa: E402
from mindspore import nn, ops  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402

from ms_memopt.mindspore import sources as _sources  # noqa: E402
from ms_memopt.mindspore.scan_callback import LayoutScanCallback  # noqa: E402

_spent = {"hook": 0.0, "step_end": 0.0, "calls": 0}
def _timed(hook):
    def timed(*args):
        t = time.perf_counter()
        result = hook(*args)
        _spent["hook"] += time.perf_counter() - t
        return result
    return timed


def _timed_factory(factory):
    """The shadow source builds one hook per cell (a closure): time each one it builds."""
    def make(self, *args):
        return _timed(factory(self, *args))
    return make


for _name in ("_leaf_hook", "_group_enter_hook", "_group_exit_hook"):
    setattr(_sources.ShadowModelSource, _name, _timed_factory(getattr(_sources.ShadowModelSource, _name)))
_sources.ShadowModelSource._forward_begins = _timed(_sources.ShadowModelSource._forward_begins)


class TimedScanCallback(LayoutScanCallback):
    """The callback, timing its step-end work on steps it does not scan."""

    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        due = self.scanner is not None and self.scanner.due(step)
        t = time.perf_counter()
        super().on_train_step_end(run_context)
        if not due:
            _spent["step_end"] += time.perf_counter() - t
            _spent["calls"] += 1

LAYERS, HIDDEN, HEADS, SEQ, BATCH, VOCAB = 2, 64, 4, 32, 8, 256
EVERY = 100
STEPS = 105
ROUNDS = 1


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm((HIDDEN,)), nn.LayerNorm((HIDDEN,))
        self.qkv, self.proj = nn.Dense(HIDDEN, 3 * HIDDEN), nn.Dense(HIDDEN, HIDDEN)
        self.fc1, self.fc2, self.act = nn.Dense(HIDDEN, 4 * HIDDEN), nn.Dense(4 * HIDDEN, HIDDEN), nn.GELU()
        self.softmax = nn.Softmax(-1)

    def construct(self, x):
        b, s, h = x.shape
        q, k, v = ops.split(self.qkv(self.ln1(x)), HIDDEN, -1)
        q = q.reshape(b, s, HEADS, h // HEADS).transpose(0, 2, 1, 3)
        k = k.reshape(b, s, HEADS, h // HEADS).transpose(0, 2, 3, 1)
        v = v.reshape(b, s, HEADS, h // HEADS).transpose(0, 2, 1, 3)
        att = self.softmax(ops.matmul(q, k) / (h // HEADS) ** 0.5)
        x = x + self.proj(ops.matmul(att, v).transpose(0, 2, 1, 3).reshape(b, s, h))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class GPT(nn.Cell):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.SequentialCell([Block() for _ in range(LAYERS)])
        self.head = nn.Dense(HIDDEN, VOCAB)

    def construct(self, x):
        return self.head(self.blocks(self.emb(x))).reshape(-1, VOCAB)


class StepTimer(Callback):
    def __init__(self):
        super().__init__()
        self.times, self._t = [], None

    def on_train_step_begin(self, run_context):
        self._t = time.perf_counter()

    def on_train_step_end(self, run_context):
        self.times.append(time.perf_counter() - self._t)


def _data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (STEPS * BATCH, SEQ)).astype(np.int32)
    y = rng.integers(0, VOCAB, (STEPS * BATCH, SEQ)).astype(np.int32).reshape(STEPS * BATCH, SEQ)
    return ds.NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(BATCH)


class _Loss(nn.Cell):
    def __init__(self):
        super().__init__()
        self.ce = nn.CrossEntropyLoss()

    def construct(self, logits, y):
        return self.ce(logits, y.reshape(-1))


def run(with_scan: bool, log_dir: Path) -> tuple[list[float], list[float], list[float]]:
    ms.set_seed(0)
    net = GPT()
    opt = nn.AdamWeightDecay(net.trainable_params(), 1e-3)
    timer = StepTimer()
    callbacks = [timer]
    cb = None
    if with_scan:
        cb = TimedScanCallback(every=EVERY, log_dir=log_dir, watch={"allreduce": "4.2GB"})
        callbacks.insert(0, cb)
    Model(net, _Loss(), opt).train(1, _data(), callbacks=callbacks, dataset_sink_mode=False)
    steps = timer.times[5:]                         # drop warm-up
    scanned = set(range(EVERY, STEPS + 1, EVERY)) | {1}
    plain = [t for i, t in enumerate(timer.times, start=1) if i > 5 and i not in scanned]
    scans = [r.extra["scan_seconds"] for r in cb.records] if cb else []
    return steps, plain, scans


def _measure() -> dict:
    base_steps, base_plain, cb_steps, cb_plain, scans = [], [], [], [], []
    sources = set()
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(ROUNDS):
            s, p, _ = run(False, Path(tmp))
            base_steps += s; base_plain += p
            s, p, sc = run(True, Path(tmp) / f"r{round_}")
            cb_steps += s; cb_plain += p; scans += sc
            sources |= {line.split('"source":"')[1].split('"')[0]
                        for line in (Path(tmp) / f"r{round_}" / "rank_0" / "scan.jsonl").read_text().splitlines()
                        if '"source":"' in line}
    step_time = statistics.median(base_plain)
    per_step = (_spent["hook"] + _spent["step_end"]) / max(1, len(cb_steps) + 5 * ROUNDS)
    scan_seconds = statistics.median(scans)
    return {"source": ",".join(sorted(sources)), "scan_seconds": scan_seconds,
            "overhead_pct": (scan_seconds / EVERY + per_step) / step_time * 100,
            "ab_overhead_pct": (statistics.median(cb_plain) / step_time - 1) * 100,
            "step_seconds": step_time, "cb_step_seconds": statistics.median(cb_plain),
            "per_step_seconds": per_step, "scans": len(scans)}


def _table(name: str, m: dict) -> None:
    print(f"-- source {m['source']} ({name})")
    print(f"{'figure':<38}{'value':>14}")
    print(f"{'step time (median, no callback)':<38}{m['step_seconds'] * 1e3:>11.2f} ms")
    print(f"{'step time (median, callback, no scan)':<38}{m['cb_step_seconds'] * 1e3:>11.2f} ms")
    print(f"{'per-step cost of callback + hooks':<38}{m['per_step_seconds'] * 1e6:>11.1f} us")
    print(f"{'scan cost per call (median of %d)' % m['scans']:<38}{m['scan_seconds'] * 1e3:>11.3f} ms")
    print(f"{'overhead at every=%d' % EVERY:<38}{m['overhead_pct']:>12.3f} %")
    print(f"{'A/B median step time difference':<38}{m['ab_overhead_pct']:>12.3f} %")


def main() -> None:
    if "--pool-log-child" in sys.argv:
        print(json.dumps(_measure()))
        return
    shadow = _measure()
    child = subprocess.run([sys.executable, __file__, "--pool-log-child"], capture_output=True, text=True)
    if child.returncode != 0:
        raise SystemExit(f"pool-log child failed:\n{child.stderr[-3000:]}")
    pool_log = json.loads(child.stdout.strip().splitlines()[-1])
    log_cost_pct = (pool_log["step_seconds"] / shadow["step_seconds"] - 1) * 100
    print(f"CPU demo GPT: {LAYERS} layers, hidden {HIDDEN}, seq {SEQ}, batch {BATCH}; {STEPS} steps x {ROUNDS} rounds")
    _table("this process", shadow)
    _table("child process with VLOG_v=12906", pool_log)
    print(f"{'pool log writing (step time vs above)':<38}{log_cost_pct:>12.3f} %")
    out = {key: shadow[key] for key in ("scan_seconds", "overhead_pct", "ab_overhead_pct", "step_seconds",
                                        "per_step_seconds", "scans")}
    out.update({"every": EVERY, "steps": STEPS, "rounds": ROUNDS, "source": shadow["source"],
                "pool_log": dict(pool_log, log_cost_pct=log_cost_pct)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
