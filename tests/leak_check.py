"""Train a tiny GPT and print the real pool's memory in use at every step end (one JSON line).

Run as a script, in its own process: the pool log must be turned on before ``import
mindspore`` (``poolcapture.start``). ``tests/test_device_path.py`` runs it with
``MS_MEMOPT_NATIVE=0``, which makes ``FusedAdamW`` take the device step an Ascend card takes.

The forward and backward pass are one ``ms.jit`` graph (MindSpore's functional training loop)
and the optimizer runs from Python, as in PyNative. Why jit: MindSpore 2.10's CPU PyNative
reduce ops leak by themselves (``Tensor.sum()`` left 3 buffers of 512 B in use per call, every
call, with nothing of ours loaded), so a PyNative forward pass grows the pool whatever
optimizer runs; in a graph they do not. ``--pynative`` runs the whole step in PyNative
(``nn.TrainOneStepCell``) to compare the growth against ``nn.AdamWeightDecay``'s.

    python tests/leak_check.py POOL_LOG --optimizer fused|adamw [--pool-mode] [--compact-every N]
        [--scan-every N] [--steps N] [--pynative]
"""
from __future__ import annotations

import argparse
import json
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pool_log")
    parser.add_argument("--optimizer", choices=("fused", "adamw"), default="fused")
    parser.add_argument("--pool-mode", action="store_true")
    parser.add_argument("--compact-every", type=int, default=0)
    parser.add_argument("--scan-every", type=int, default=0)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pynative", action="store_true")
    args = parser.parse_args()

    from ms_memopt.mindspore import poolcapture
    capture = poolcapture.start(args.pool_log)
    import mindspore as ms
    from mindspore import nn

    from ms_memopt.mindspore.compaction import CompactionCallback
    from ms_memopt.mindspore.fused_adamw import FusedAdamW
    from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss, synthetic_batches
    from ms_memopt.mindspore.pool_log_source import wait_for_queued_ops
    from ms_memopt.mindspore.pool_mode import enable_pool_mode

    cfg = GPTConfig(num_layers=2, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64)
    net = GPTWithLoss(GPT(cfg))
    if args.optimizer == "fused":
        opt = FusedAdamW(net.trainable_params(), learning_rate=1e-3, weight_decay=0.01)
    else:
        opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3, weight_decay=0.01)
    if args.pool_mode:
        enable_pool_mode(net, opt, checkpoint_every=2, batch_size=4)
    compaction = CompactionCallback(every=args.compact_every, barrier=None) if args.compact_every else None
    scanner = None
    if args.scan_every:
        from ms_memopt.mindspore.scan_callback import Scanner

        scanner = Scanner(net, opt, every=args.scan_every, log_dir=None, source="pool-log")
    batches = [(ms.Tensor(x), ms.Tensor(y)) for x, y in synthetic_batches(cfg, 4, 4)]
    if args.pynative:
        train_step = nn.TrainOneStepCell(net, opt)
    else:
        grad_fn = ms.value_and_grad(net, None, opt.parameters)
        forward_backward = ms.jit(grad_fn)

        def train_step(x, y):
            loss, grads = forward_backward(x, y)
            opt(grads)
            return loss

    in_use, losses = [], []
    for step in range(1, args.steps + 1):
        x, y = batches[step % len(batches)]
        losses.append(float(train_step(x, y).asnumpy()))
        if compaction is not None:
            compaction.step(step, network=net, optimizer=opt)
        if scanner is not None:
            scanner.step(step)
        wait_for_queued_ops()
        capture.poll()
        in_use.append(capture.parser.counters.get("in_use", 0))
    native = getattr(opt, "_native", None)
    records = compaction.records if compaction is not None else []
    print(json.dumps({"in_use": in_use, "losses": losses, "native": native,
                      "compactions": len(records),
                      "scans": len(scanner.records) if scanner is not None else 0,
                      "moved": [r["live"]["tensors"] if r["live"] else 0 for r in records]}))
    capture.stop()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
