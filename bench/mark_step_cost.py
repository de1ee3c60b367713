"""What ``ms_memopt.mindspore.mark_step`` costs (docs/simulation.md).

Times, in one process (PyNative, ``launch_blocking``): an idle ``mark_step(seq=.., batch=..)``
(no queued work: the wait for queued ops plus the line, which is written only under
``ms-memopt record``), and a training step of the demo GPT with and without a ``mark_step``
after it, alternating, median of ``--steps`` each. Run it plain and under ``ms-memopt record``
(``MS_MEMOPT_RECORD=1``) to see both. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_memopt.mindspore import mark_step
    from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss

    ms.runtime.launch_blocking()
    cfg = GPTConfig(num_layers=2, hidden_size=64, num_heads=4, seq_length=128, vocab_size=256)
    net = GPTWithLoss(GPT(cfg))
    train = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3))
    train.set_train(True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (4, 33)).astype(np.int32)
    x, y = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])
    for _ in range(3):
        train(x, y)
    start = time.perf_counter()
    for _ in range(args.calls):
        mark_step(seq=32, batch=4)
    idle_us = (time.perf_counter() - start) / args.calls * 1e6
    plain, marked = [], []
    for i in range(2 * args.steps):      # alternating which of the pair goes first
        with_mark = (i % 2 == 0) == (i // 2 % 2 == 0)
        t0 = time.perf_counter()
        train(x, y)
        if with_mark:
            mark_step(seq=32, batch=4)
        (marked if with_mark else plain).append(time.perf_counter() - t0)
    p, m = statistics.median(plain) * 1e3, statistics.median(marked) * 1e3
    recording = bool(os.environ.get("MS_MEMOPT_RECORD"))
    print(f"recording {recording}: idle mark_step {idle_us:.1f} us; step {p:.2f} ms plain, {m:.2f} ms with "
          f"mark_step ({(m - p) / p:+.1%})", file=sys.stdout)
    print(json.dumps({"bench": "mark_step_cost", "recording": recording, "idle_mark_step_us": round(idle_us, 2),
                      "step_ms": round(p, 3), "step_with_mark_ms": round(m, 3)}))


if __name__ == "__main__":
    main()
