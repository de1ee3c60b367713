"""Standalone training on one device: the job behind ``ms-memopt run RECIPE``.

Trains the GPT of :mod:`ms_memopt.mindspore.model`, sized by the recipe's
``model.model_config``, on one device (``auto``: an Ascend card when MindSpore can use one,
else the CPU) with the recipe's memory tooling switched on:

* **data**: ``memopt.train.dataset: synthetic`` (seeded token batches), or a path to a
  ``.npy`` file of token ids: a 1-D array (a token stream cut into consecutive windows of
  ``seq_length + 1``) or a 2-D array ``(samples, seq_length + 1)``; integer ids in
  ``[0, vocab_size)``. Batch ``i`` always holds the same samples, so a resumed run sees the
  data an uninterrupted one would.
* **optimizer**: ``FusedAdamW`` when ``optimizer.type`` names it or pool mode is on, else
  MindSpore's ``nn.AdamWeightDecay``; learning rate ``memopt.train.learning_rate``.
* **pool mode** (``memopt.pool_mode``): ``enable_pool_mode(net, optimizer, checkpoint_every)``.
* **callbacks**, driven by this module's loop through MindSpore's ``Callback`` protocol
  (``on_train_begin``/``on_train_step_end``/... with a ``RunContext`` whose
  ``original_args()`` carries ``cur_step_num`` (the global step), ``net_outputs``,
  ``network``, ``train_network``, ``optimizer``...): ``LayoutScanCallback`` every
  ``memopt.scan_every`` steps, ``CompactionCallback`` every ``memopt.compact_every`` steps,
  a checkpoint writer, a JSONL step log and a tqdm progress bar (step, loss, step time, frag
  ratio).
* **out directory**: ``train.jsonl`` (one line per step), ``scan.jsonl``, ``layouts.jsonl``
  (pool layouts at a few scans, for the memory map), ``checkpoints/step_NNNNNN.ckpt``
  (``mindspore.save_checkpoint`` of the network and the optimizer state, plus the step),
  ``run.json`` (what ran, where, how long).

Resume: ``resume=True`` loads the newest checkpoint and continues at the next step with the
same batches, so the losses equal those of an uninterrupted run (tested on CPU).

Why our own loop rather than ``Model.train``: ``Model.train`` numbers steps from 1 in every
call, and resuming mid-epoch needs both the global step (for the ``every N`` callbacks) and
the data position; driving the callbacks directly keeps both exact and the callbacks
unchanged.

Example:
    >>> from ms_memopt.config.recipe import load_recipe                        # doctest: +SKIP
    >>> result = run_standalone(load_recipe("recipes/demo_cpu.yaml"), "out/run")  # doctest: +SKIP
    >>> result.losses[-1] < result.losses[0]                           # doctest: +SKIP
    True
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn
from mindspore.train import Callback, RunContext

from ms_memopt.config.recipe import Recipe
from ms_memopt.core.errors import InputError
from ms_memopt.core.jsontext import read_json_lines
from ms_memopt.core.layout import Layout
from ms_memopt.workload.step import sequence_lengths as workload_sequence_lengths
from ms_memopt.io.layouts import LAYOUTS_NAME, layout_to_dict
from ms_memopt.mindspore.compaction import CompactionCallback
from ms_memopt.mindspore.fused_adamw import FusedAdamW
from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss, synthetic_batches
from ms_memopt.mindspore.pool_mode import enable_pool_mode
from ms_memopt.mindspore import poolcapture
from ms_memopt.mindspore.scan_callback import LayoutScanCallback
from ms_memopt.mindspore.steps import mark_step

__all__ = ["RunResult", "select_device", "gpt_config_from_recipe", "token_batches", "sequence_lengths",
           "run_standalone",
           "latest_checkpoint", "TRAIN_LOG_NAME", "RUN_META_NAME"]

logger = logging.getLogger("ms_memopt.standalone")

TRAIN_LOG_NAME = "train.jsonl"
RUN_META_NAME = "run.json"
RUN_LOG_NAME = "run.log"
SCAN_LOG_NAME = "scan.jsonl"   # under rank_N/, written by LayoutScanCallback
_CKPT_DIR = "checkpoints"
_CKPT_RE = re.compile(r"^step_(\d+)\.ckpt$")
_FUSED_NAMES = {"fusedadamw", "fused_adamw"}


@dataclass
class RunResult:
    """What a standalone run did. Times in seconds, sizes in bytes.

    ``losses[i]`` is the loss of step ``start_step + i`` (steps are 1-based); ``notes`` says
    what the run did differently from what the recipe describes (e.g. a LLaMA FFN as a GELU MLP).
    """
    out: str
    device: str
    start_step: int
    steps: int
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    checkpoints: list[str] = field(default_factory=list)
    scans: int = 0
    compactions: int = 0
    optimizer: str = ""
    pool_mode: bool = False
    notes: list[str] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    #: the job's device-memory pool (:meth:`~ms_memopt.mindspore.pool_info.PoolInfo.to_dict`),
    #: with ``explain``: what fragmentation means on it
    pool: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _pool_summary() -> dict:
    from ms_memopt.mindspore.pool_info import detect_pool

    info = detect_pool()
    return {**info.to_dict(), "explain": info.explain()}


# --- device, model, data -------------------------------------------------------------------------

def _ascend_visible() -> bool:
    # Asking MindSpore about Ascend on a machine without CANN prints a loud dlopen error; the
    # toolkit's environment (or its default install dir) is the cheap, quiet first test.
    return bool(os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")
                or Path("/usr/local/Ascend").exists())


def select_device(requested: str = "auto") -> str:
    """``"CPU"`` or ``"Ascend"``: ``auto`` takes Ascend when MindSpore can use it, else CPU.

    Raises:
        InputError: ``ascend`` asked for where no Ascend device is usable, or an unknown name.
    """
    name = (requested or "auto").lower()
    if name not in ("auto", "cpu", "ascend"):
        raise InputError(f"got {requested!r}; expected auto, cpu or ascend", key="--device")
    if name == "cpu":
        return "CPU"
    usable = False
    if _ascend_visible():
        try:
            usable = bool(ms.hal.is_available("Ascend"))
        except Exception:  # a broken CANN install is the same as none for our choice
            usable = False
    if name == "ascend" and not usable:
        raise InputError("no usable Ascend device here (MindSpore's Ascend backend did not load); "
                         "use --device cpu or auto", key="--device")
    return "Ascend" if usable else "CPU"


def _use_device(target: str) -> None:
    """Select the device once; a process whose runtime already runs on ``target`` keeps it."""
    if ms.get_context("device_target") == target:
        return
    try:
        ms.set_device(target)
    except RuntimeError as exc:   # MindSpore's runtime is initialised for another device
        raise InputError(f"this process already runs MindSpore on {ms.get_context('device_target')}; "
                         f"cannot switch to {target} ({exc})", key="--device") from None


def gpt_config_from_recipe(recipe: Recipe, device: str):
    """The :class:`~ms_memopt.mindspore.model.GPTConfig` for ``recipe`` on ``device``, and notes.

    The demo GPT has LayerNorm, a plain GELU MLP of width ``intermediate_size`` and full
    multi-head attention, so ``n_kv_heads`` and the gated FFN of a LLaMA config are not
    reproduced (noted). bfloat16 becomes float32 on CPU, whose bf16 kernels are incomplete.
    """

    m = recipe.model
    notes = []
    dtype, param_dtype = m.compute_dtype, m.param_init_type
    if device == "CPU":
        if "bfloat16" in (dtype, param_dtype):
            notes.append("bfloat16 replaced by float32 on CPU (MindSpore's CPU bf16 kernels are incomplete)")
        dtype = "float32" if dtype == "bfloat16" else dtype
        param_dtype = "float32" if param_dtype == "bfloat16" else param_dtype
    if m.n_kv_heads != m.num_heads:
        notes.append(f"n_kv_heads={m.n_kv_heads} not modelled: the GPT uses {m.num_heads} full heads")
    if m.ffn_gated:
        notes.append("gated FFN (SwiGLU) modelled as a plain GELU MLP of the same width")
    cfg = GPTConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_heads,
                    seq_length=m.seq_length, vocab_size=m.vocab_size,
                    intermediate_size=m.intermediate_size, dtype=dtype, param_dtype=param_dtype,
                    seed=recipe.memopt.train.seed)
    return cfg, notes


def _load_token_file(path: str, seq_length: int, vocab_size: int) -> np.ndarray:
    """``(samples, seq_length + 1)`` int32 windows from a ``.npy`` of token ids."""
    key = "memopt.train.dataset"
    p = Path(path)
    if p.suffix != ".npy":
        raise InputError(f"got {path!r}; expected 'synthetic' or a .npy file of token ids", key=key)
    try:
        data = np.load(p, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read token ids from {path}: {exc}", key=key) from None
    if not np.issubdtype(data.dtype, np.integer):
        raise InputError(f"{path}: expected integer token ids, got dtype {data.dtype}", key=key)
    width = seq_length + 1
    if data.ndim == 1:
        count = data.size // width
        if count == 0:
            raise InputError(f"{path}: {data.size} tokens, need at least seq_length + 1 = {width}", key=key)
        windows = data[: count * width].reshape(count, width)
    elif data.ndim == 2:
        if data.shape[1] != width:
            raise InputError(f"{path}: rows of {data.shape[1]} tokens; expected seq_length + 1 = {width}", key=key)
        windows = data
    else:
        raise InputError(f"{path}: a {data.ndim}-D array; expected 1-D (a token stream) or 2-D "
                         f"(samples, seq_length + 1)", key=key)
    if windows.size and (windows.min() < 0 or windows.max() >= vocab_size):
        raise InputError(f"{path}: token ids in [{windows.min()}, {windows.max()}]; expected "
                         f"[0, vocab_size={vocab_size})", key=key)
    return windows.astype(np.int32)


def token_batches(config, dataset: str, batch_size: int, steps: int, seed: int = 0,
                  start: int = 0, seq_lengths: Sequence[int] | None = None
                  ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches ``start .. steps-1`` as ``(input_ids, labels)`` int32 arrays of shape (B, S).

    ``dataset`` is ``"synthetic"`` or a ``.npy`` path (see the module docstring); a file's
    samples are used in order and wrap around. Batch ``i`` does not depend on ``start``.
    ``seq_lengths[i]`` (when given) cuts batch ``i`` to that many tokens: a dynamic-shape run.
    """
    def cut(index: int, inputs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if seq_lengths is None:
            return inputs, labels
        length = seq_lengths[index % len(seq_lengths)]
        return inputs[:, :length], labels[:, :length]

    if dataset == "synthetic":

        for index, batch in enumerate(synthetic_batches(config, batch_size, steps, seed)):
            if index >= start:
                yield cut(index, *batch)
        return
    windows = _load_token_file(dataset, config.seq_length, config.vocab_size)
    n = len(windows)
    for index in range(start, steps):
        rows = windows[[(index * batch_size + j) % n for j in range(batch_size)]]
        yield cut(index, rows[:, :-1], rows[:, 1:])


def sequence_lengths(recipe: Recipe, steps: int, seq_length: int) -> list[int] | None:
    """Per-step sequence lengths for a run whose recipe asks for dynamic shapes
    (``memopt.workload.dynamic_seq``), seeded by ``memopt.workload.seed``; ``None`` for fixed
    shapes. The rules are the simulator's, by the same function
    (:func:`ms_memopt.workload.step.draw_sequence_length`: ``seq_distribution``, ``long_tail``,
    ``seq_align`` rounding down, ``seq_buckets``), one draw per step (the simulator draws one
    per micro-batch).

    Example:
        >>> sequence_lengths(load_recipe("recipes/demo_cpu.yaml"), 4, 32)   # doctest: +SKIP
        [20, 12, 8, 8]
    """
    return workload_sequence_lengths(recipe.memopt.workload, steps, seq_length)


# --- checkpoints ---------------------------------------------------------------------------------

def latest_checkpoint(out: str | Path) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest ``checkpoints/step_NNNNNN.ckpt`` under ``out``, or None."""
    found = []
    folder = Path(out) / _CKPT_DIR
    if folder.is_dir():
        for entry in folder.iterdir():
            match = _CKPT_RE.match(entry.name)
            if match:
                found.append((int(match.group(1)), entry))
    return max(found) if found else None


# --- callbacks -----------------------------------------------------------------------------------

class _CallbackParams(dict):
    """What ``RunContext.original_args()`` returns: a dict readable by attribute, like MindSpore's."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value


class _LogWriteGuard:
    """Keeps a log that cannot be written (full disk, a directory in the way) from stopping
    training, like the scan callback (``Scanner._safe_write``): the line is skipped, the first
    failure of a streak is a warning, the next ones only debug messages (one warning per step
    would flood the console), and a write that works again says so."""

    def __init__(self, what: str, path: Path) -> None:
        self.what, self.path, self.failing = what, path, False

    def write(self, write) -> None:
        try:
            write()
        except OSError as exc:
            if not self.failing:
                logger.warning("cannot write the %s %s (%s); skipping its lines until it works again, "
                               "training goes on", self.what, self.path, exc)
            else:
                logger.debug("still cannot write the %s %s: %s", self.what, self.path, exc)
            self.failing = True
        else:
            if self.failing:
                logger.warning("writing the %s %s works again", self.what, self.path)
            self.failing = False


class _StepLog(Callback):
    """Appends ``{"step", "loss", "step_seconds", "time"}`` to ``train.jsonl`` every step."""

    def __init__(self, path: Path, start_step: int) -> None:
        super().__init__()
        _truncate_jsonl(path, keep_through=start_step)
        self.file = open(path, "a", encoding="utf-8")
        self.guard = _LogWriteGuard("step log", path)

    def on_train_step_end(self, run_context):
        p = run_context.original_args()
        line = {"step": p.cur_step_num, "loss": p.loss_value, "step_seconds": round(p.step_seconds, 6),
                "time": time.time()}
        self.guard.write(lambda: self._append(json.dumps(line) + "\n"))

    def _append(self, text: str) -> None:
        self.file.write(text)
        self.file.flush()

    def on_train_end(self, run_context):
        self.guard.write(self.file.close)


class _Checkpointer(Callback):
    """Saves network + optimizer state every ``every`` steps and at the end; keeps ``keep`` files."""

    def __init__(self, folder: Path, every: int | None, total: int, keep: int = 3) -> None:
        super().__init__()
        self.folder, self.every, self.total, self.keep = folder, every, total, keep
        self.saved: list[str] = []

    def on_train_step_end(self, run_context):
        p = run_context.original_args()
        step = p.cur_step_num
        if step == self.total or (self.every and step % self.every == 0):
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / f"step_{step:06d}.ckpt"
            ms.save_checkpoint(p.train_network, str(path), append_dict={"step": step})
            self.saved.append(str(path))
            for old in sorted(self.folder.glob("step_*.ckpt"))[:-self.keep]:
                old.unlink(missing_ok=True)


class _ProgressBar(Callback):
    """tqdm bar: step, loss, step time and the frag ratio of the latest scan."""

    def __init__(self, total: int, initial: int, scan_callback: LayoutScanCallback, enabled: bool) -> None:
        super().__init__()
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, disable=not enabled,
                        desc="train")
        self.scan_callback = scan_callback
        self.frag: float | None = None

    def on_train_step_end(self, run_context):
        p = run_context.original_args()
        records = self.scan_callback.records
        if records:
            self.frag = records[-1].frag_ratio
        frag = "n/a" if self.frag is None else f"{self.frag:.2f}"
        self.bar.set_postfix_str(f"loss={p.loss_value:.4f} step={p.step_seconds * 1000:.0f}ms frag={frag}",
                                 refresh=False)
        self.bar.update(1)

    def on_train_end(self, run_context):
        self.bar.close()


class _LayoutSnapshots(Callback):
    """Writes the scanned pool's layout at a few scan steps to ``layouts.jsonl`` (memory map)."""

    def __init__(self, path: Path, scan_callback, steps: set[int]) -> None:
        super().__init__()
        self.path, self.scan_callback, self.steps = path, scan_callback, steps
        self.guard = _LogWriteGuard("layout log", path)

    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        if step not in self.steps:
            return
        layout = _scanned_layout(self.scan_callback)
        if layout is None:
            return
        line = json.dumps(layout_to_dict(layout, step=step, label=f"run step {step}")) + "\n"
        self.guard.write(lambda: self._append(line))

    def _append(self, line: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)


def _scanned_layout(scan_callback: LayoutScanCallback) -> Layout | None:
    """The layout behind the scan callback's first source that knows one block by block."""
    if scan_callback.scanner is None:
        return None
    return next((layout for source in scan_callback.scanner.sources
                 if (layout := source.layout()) is not None), None)


def _clear_outputs(out: Path) -> None:
    """A fresh run in a used directory starts its logs and checkpoints over."""
    for name in (TRAIN_LOG_NAME, LAYOUTS_NAME, RUN_META_NAME, RUN_LOG_NAME):
        (out / name).unlink(missing_ok=True)
    for old in out.glob(f"rank_*/{SCAN_LOG_NAME}"):
        old.unlink()
    for old in (out / _CKPT_DIR).glob("step_*.ckpt"):
        old.unlink()


def _truncate_jsonl(path: Path, keep_through: int) -> None:
    """Drop lines whose ``step`` is after ``keep_through`` (they are redone on resume)."""
    if not path.exists():
        return
    kept = [obj for _, obj in read_json_lines(path) if obj.get("step", 0) <= keep_through]
    path.write_text("".join(json.dumps(obj) + "\n" for obj in kept), encoding="utf-8")


# --- the job -------------------------------------------------------------------------------------

def _make_optimizer(recipe: Recipe, params, pool_mode: bool):
    lr = recipe.memopt.train.learning_rate
    wanted = (recipe.train.optimizer_type or "").replace("-", "_").lower()
    if wanted in _FUSED_NAMES or pool_mode:

        return FusedAdamW(params, learning_rate=lr), "FusedAdamW"
    return nn.AdamWeightDecay(params, learning_rate=lr), "nn.AdamWeightDecay"


def _scan_callback(recipe: Recipe, out: Path) -> LayoutScanCallback:
    """The layout scans the recipe asks for; on CPU their source is the shadow allocator model."""
    mem = recipe.memopt
    allocator = mem.allocator
    options = {"increase_size": allocator.increase_size, "pregrow": allocator.pregrow}
    if allocator.init_size:
        options["init_size"] = allocator.init_size
    name = allocator.name.replace("_", "-")
    if name == "pool":  # the shadow replays tensors through a plain pool; pool mode has its own regions
        name, options = "mindspore", {"increase_size": allocator.increase_size}
    if name != "mindspore":
        options.pop("pregrow", None), options.pop("init_size", None)
    return LayoutScanCallback(every=mem.scan_every, log_dir=str(out), watch=dict(mem.watch) or None,
                              capacity=recipe.capacity, source="auto",
                              model_options={"allocator": name, "options": options})


def _compaction_callback(recipe: Recipe, out: Path, scan_cb: LayoutScanCallback) -> CompactionCallback:
    """CompactionCallback every ``compact_every`` steps (``scan_every`` when only a frag threshold
    is given), gated by the latest scan's frag ratio; its records join the rank's scan log."""
    mem = recipe.memopt

    def latest_frag():
        records = scan_cb.records
        return records[-1].frag_ratio if records else None

    return CompactionCallback(every=mem.compact_every or mem.scan_every, when_frag_above=mem.compact_when_frag_above,
               frag_fn=latest_frag, log_dir=str(out))


def _snapshot_steps(first: int, total: int, every: int) -> set[int]:
    """Scan steps for the memory map: the first, the middle and the last scan of the run."""
    scans = [s for s in range(first, total + 1) if s % every == 0] or [total]
    return {scans[0], scans[len(scans) // 2], scans[-1]}


def run_standalone(recipe: Recipe, out: str | Path, *, device: str = "auto", steps: int | None = None,
                   resume: bool = False, progress: bool = True) -> RunResult:
    """Train ``recipe``'s model on one device; logs, checkpoints and ``run.json`` go to ``out``.

    Args:
        recipe: the validated recipe (``memopt.train`` sets steps, batch size, seed, data).
        out: output directory (created).
        device: ``auto``, ``cpu`` or ``ascend``.
        steps: total steps (overrides ``memopt.train.steps``); with ``resume`` the run stops
            at this global step.
        resume: continue from the newest checkpoint in ``out`` (no checkpoint: start fresh).
        progress: show the tqdm bar.

    Raises:
        InputError: bad dataset path or contents, an unusable ``--device``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    resume_from = latest_checkpoint(out) if resume else None
    if resume_from is None:
        _clear_outputs(out)
    # the package's warnings and notes (scans, compaction, this job) also go to OUT/run.log
    handler = logging.FileHandler(out / RUN_LOG_NAME, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    package_logger = logging.getLogger("ms_memopt")
    package_logger.addHandler(handler)
    if package_logger.level == logging.NOTSET or package_logger.level > logging.INFO:
        previous_level = package_logger.level
        package_logger.setLevel(logging.INFO)
    else:
        previous_level = None
    try:
        result = _train(recipe, out, device=device, steps=steps, resume_from=resume_from, progress=progress)
        # the run is over (its network freed): its own pool log (a CPU run's) is replayed once, here;
        # the report reads the summary (ms_memopt.replay.pool_log_check)
        from ms_memopt.replay.pool_log_check import write_summary
        write_summary(out)
        return result
    finally:
        package_logger.removeHandler(handler)
        handler.close()
        if previous_level is not None:
            package_logger.setLevel(previous_level)


def _train(recipe: Recipe, out: Path, *, device: str, steps: int | None, resume_from: tuple[int, Path] | None,
           progress: bool) -> RunResult:

    started = time.perf_counter()
    tr, mem = recipe.memopt.train, recipe.memopt
    total = int(steps or tr.steps)
    target = select_device(device)
    _use_device(target)
    ms.set_seed(tr.seed)
    np.random.seed(tr.seed)

    cfg, notes = gpt_config_from_recipe(recipe, target)
    start = 0
    if resume_from is not None:
        start = resume_from[0]
        if start >= total:
            notes.append(f"checkpoint at step {start} already reaches --steps {total}: nothing to train")
    # fail on a bad dataset before building the model
    seq_lengths = sequence_lengths(recipe, total, cfg.seq_length)
    if seq_lengths is not None:
        notes.append(f"dynamic shapes (memopt.workload.dynamic_seq): sequence lengths {min(seq_lengths)}.."
                     f"{max(seq_lengths)} tokens, a new one each step")
    batches = token_batches(cfg, tr.dataset, tr.batch_size, total, seed=tr.seed, start=start,
                            seq_lengths=seq_lengths)
    if tr.dataset != "synthetic":
        _load_token_file(tr.dataset, cfg.seq_length, cfg.vocab_size)

    net = GPT(cfg)
    net_with_loss = GPTWithLoss(net)
    optimizer, opt_name = _make_optimizer(recipe, net.trainable_params(), mem.pool_mode)
    if mem.pool_mode:
        k = mem.checkpoint_every or max(1, min(6, cfg.num_layers))
        plan = enable_pool_mode(net, optimizer, checkpoint_every=k, batch_size=tr.batch_size)
        notes.append(f"pool mode: checkpoint_every={k}; regions "
                     + ", ".join(f"{r.name}={r.size}" for r in plan.regions))
    train_net = nn.TrainOneStepCell(net_with_loss, optimizer)
    train_net.set_train(True)
    if resume_from is not None:
        try:    # a checkpoint cut short or not MindSpore's: MindSpore raises ValueError or RuntimeError
            params = ms.load_checkpoint(str(resume_from[1]))
            params.pop("step", None)
            missing, _ = ms.load_param_into_net(train_net, params, strict_load=True)
        except (ValueError, RuntimeError, TypeError, OSError, EOFError) as exc:
            raise InputError(f"cannot resume from this checkpoint ({type(exc).__name__}: {str(exc)[:300]}); "
                             "delete it to resume from the one before, or run without --resume",
                             source=str(resume_from[1])) from None
        if missing:
            raise InputError(f"checkpoint does not match the recipe's model: missing {missing[:5]}",
                             source=str(resume_from[1]))
        notes.append(f"resumed from {resume_from[1].name} (step {start})")
        _truncate_jsonl(out / LAYOUTS_NAME, keep_through=start)

    callbacks: list[Callback] = []
    scan_cb = _scan_callback(recipe, out)
    callbacks.append(scan_cb)
    callbacks.append(_LayoutSnapshots(out / LAYOUTS_NAME, scan_cb,
                                      _snapshot_steps(start + 1, total, mem.scan_every)))
    compaction_cb = None
    if mem.compact_every or mem.compact_when_frag_above:
        compaction_cb = _compaction_callback(recipe, out, scan_cb)
        callbacks.append(compaction_cb)
    checkpointer = _Checkpointer(out / _CKPT_DIR, tr.checkpoint_every_steps, total)
    callbacks += [checkpointer, _StepLog(out / TRAIN_LOG_NAME, start),
                  _ProgressBar(total, start, scan_cb, progress)]

    params = _CallbackParams(
        network=net_with_loss, train_network=train_net, optimizer=optimizer, train_dataset=None,
        epoch_num=1, cur_epoch_num=1, batch_num=total, cur_step_num=start, net_outputs=None,
        loss_value=None, step_seconds=0.0, parallel_mode="stand_alone", device_number=1,
        mode="train", dataset_sink_mode=False, device_target=target)
    context = RunContext(params)
    result = RunResult(out=str(out), device=target, start_step=start + 1, steps=total, optimizer=opt_name,
                       pool_mode=mem.pool_mode, notes=notes, model=cfg.to_dict(), pool=_pool_summary())
    for cb in callbacks:
        cb.on_train_begin(context)
        cb.on_train_epoch_begin(context)
    # with the pool log followed, each step's end is marked in it with its shape: the log is a
    # recording `ms-memopt learn` takes (docs/simulation.md)
    marking = poolcapture.active() is not None
    if marking:
        mark_step()
    try:
        for input_ids, labels in batches:
            params.cur_step_num += 1
            for cb in callbacks:
                cb.on_train_step_begin(context)
            t0 = time.perf_counter()
            loss = train_net(Tensor(input_ids), Tensor(labels))
            value = float(loss.asnumpy())
            params.step_seconds = time.perf_counter() - t0
            params.net_outputs, params.loss_value = loss, value
            result.losses.append(value)
            result.step_seconds.append(params.step_seconds)
            for cb in callbacks:
                cb.on_train_step_end(context)
            if marking:
                mark_step(seq=int(input_ids.shape[1]), batch=int(input_ids.shape[0]))
            if context.get_stop_requested():
                notes.append(f"a callback stopped training at step {params.cur_step_num}")
                break
    finally:
        for cb in callbacks:
            cb.on_train_epoch_end(context)
            cb.on_train_end(context)
    result.checkpoints = checkpointer.saved
    result.scans = len(scan_cb.records)
    result.compactions = len(compaction_cb.records) if compaction_cb is not None else 0
    result.seconds = time.perf_counter() - started
    logger.info("trained steps %d..%d of %d on %s in %.1f s; %d scans, %d compactions", start + 1,
                params.cur_step_num, total, target, result.seconds, result.scans, result.compactions)
    for text in notes:
        logger.info("note: %s", text)
    meta = {"recipe": recipe.source, **result.to_dict()}
    meta.pop("losses"), meta.pop("step_seconds")
    (out / RUN_META_NAME).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    return result
