"""A tiny LLaMA trained through MindFormers' ``Trainer`` on CPU, with and without ms-memopt.

Used by tests/test_mindformers.py in a subprocess (MindFormers' context is set once per
process)::

    python tiny_llama.py trainer MODE OUT_DIR     # runs below, losses etc. to OUT_DIR/result.json
    python tiny_llama.py entry MODE OUT_DIR       # the YAML's callbacks: list, as run_mindformer.py

``trainer`` runs, each with the same seed, data and model initialisation (the model is built
here and handed to ``Trainer(model=...)``):

* ``plain``: MindFormers' AdamW, no ms-memopt;
* ``callbacks``: + ``LayoutScanCallback`` and ``CompactionCallback`` (every 2 steps);
* ``pool``: + ``enable_pool_mode`` (recompute every layer, contiguous parameters) and both callbacks;
* ``fused_plain``: ``FusedAdamW`` instead of AdamW (same betas, eps, weight decay and
  learning-rate schedule, built from the YAML like the Trainer builds AdamW's), no ms-memopt
  otherwise; in graph mode its step is compiled into MindFormers' training graph;
* ``fused_pool``: ``FusedAdamW`` + pool mode + both callbacks.

``entry`` does what MindFormers' ``run_mindformer.py`` does with ``--register_path``
(``run_mindformer.py`` is not in the mindformers wheel): ``REGISTER_PATH`` set and the folder
on ``sys.path``, then ``MindFormerConfig(yaml)`` (which applies MindFormers' config template in
2.0.0), ``set_output_path``, ``build_context``, ``Trainer(config).train()``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
RECIPE = REPO / "recipes" / "mindformers_llama_memopt.yaml"
STEPS = 6          # 3 compactions at steps 2, 4, 6
BATCH = 2
SEQ = 16
VOCAB = 64


def token_rows() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, size=(STEPS * BATCH, SEQ + 1)).astype(np.int32)


def write_mindrecord(path: Path) -> Path:
    """The training data as a MindRecord file (what MindFormers' MindDataset loader reads)."""
    from mindspore.mindrecord import FileWriter
    writer = FileWriter(str(path), shard_num=1, overwrite=True)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}}, "tiny llama tokens")
    writer.write_raw_data([{"input_ids": row} for row in token_rows()])
    writer.commit()
    return path


def load_config(mode: int, out: Path):
    from mindformers import MindFormerConfig
    from mf_cpu import cpu_overrides
    config = MindFormerConfig(str(RECIPE))
    cpu_overrides(config)
    config.context.mode = mode
    config.output_dir = str(out / "output")
    return config


class LossLog:
    """Records each step's loss (the first output of MindFormers' training cell)."""

    def __new__(cls):
        from mindspore.train import Callback

        class _LossLog(Callback):
            def __init__(self):
                super().__init__()
                self.losses = []

            def on_train_step_end(self, run_context):
                out = run_context.original_args().net_outputs
                loss = out[0] if isinstance(out, (tuple, list)) else out
                self.losses.append(float(loss.asnumpy()))
        return _LossLog()


def _dataset():
    from mindspore.dataset import GeneratorDataset
    return GeneratorDataset([(row,) for row in token_rows()], column_names=["input_ids"],
                            shuffle=False).batch(BATCH, drop_remainder=True)


def _model(config):
    from mindformers import LlamaConfig, LlamaForCausalLM
    model_config = {k: v for k, v in config.model.model_config.items() if k != "type"}
    return LlamaForCausalLM(LlamaConfig(**model_config))


def _lr_schedule(config):
    """The YAML's learning-rate schedule as the Trainer builds it for its own AdamW
    (``total_steps: -1`` becomes epochs x steps per epoch)."""
    import copy
    from mindformers.core.lr import build_lr
    lr_config = copy.deepcopy(config.lr_schedule)
    if lr_config.total_steps in (None, -1):
        lr_config.total_steps = STEPS * config.runner_config.epochs
    return build_lr(lr_config)


def _state_in_one_region(optimizer) -> bool | None:
    """Graph mode: whether FusedAdamW's state Parameters are still back-to-back views of one
    buffer (the optimizer region) holding their values; None for the PyNative step (flat
    per-bucket state)."""
    if not optimizer._graph:
        return None
    state = optimizer._state_order
    ptrs = [p.data_ptr() for p in state]
    whole = np.concatenate([p.asnumpy().reshape(-1) for p in state])
    return (all(b == a + p.nbytes for a, b, p in zip(ptrs, ptrs[1:], state))
            and ptrs[0] == optimizer._state_handle[0:1].data_ptr()
            and bool(np.array_equal(optimizer._state_handle[0:whole.size].asnumpy(), whole)))


def train_run(name: str, mode: int, out: Path) -> dict:
    import mindspore as ms
    from mindformers import Trainer
    from ms_memopt.mindspore import CompactionCallback, FusedAdamW, LayoutScanCallback, enable_pool_mode
    config = load_config(mode, out)
    config.callbacks = [{"type": "MFLossMonitor"}]
    ms.set_seed(0)
    np.random.seed(0)
    model = _model(config)
    result: dict = {"name": name}
    if "pool" in name:
        plan = enable_pool_mode(model, checkpoint_every=1, batch_size=BATCH)   # activations from model.config
        result["pool_regions"] = {r.name: r.size for r in plan.regions}
    optimizer = None
    if name.startswith("fused"):
        optimizer = FusedAdamW(model.trainable_params(), learning_rate=_lr_schedule(config),
                               beta1=config.optimizer.betas[0], beta2=config.optimizer.betas[1],
                               eps=config.optimizer.eps, weight_decay=config.optimizer.weight_decay)
        result["fused_graph_step"] = optimizer._graph
    losses = LossLog()
    callbacks = [losses]
    log_dir = out / name / "memlog"
    scan = compaction = None
    if name in ("callbacks", "pool", "fused_pool"):
        scan = LayoutScanCallback(every=2, log_dir=log_dir)
        compaction = CompactionCallback(every=2, log_dir=log_dir)
        callbacks += [scan, compaction]
    trainer = Trainer(args=config, model=model, train_dataset=_dataset(), callbacks=callbacks,
                      optimizers=optimizer)
    started = time.perf_counter()
    trainer.train()
    result["seconds"] = time.perf_counter() - started
    result["losses"] = losses.losses
    result["trainable_bytes"] = int(sum(p.size * p.itemsize for p in model.trainable_params()))
    # the final weights, to compare runs closer than their losses show
    np.savez(out / f"{name}.weights.npz", **{p.name: p.asnumpy() for p in model.trainable_params()})
    if optimizer is not None:
        result["optimizer_steps"] = int(optimizer.global_step.asnumpy().reshape(-1)[0])
        result["state_in_one_region"] = _state_in_one_region(optimizer)
    if scan is not None:
        result["scans"] = [r.to_dict() if hasattr(r, "to_dict") else r.__dict__ for r in scan.records]
        result["compactions"] = compaction.records
    return result


def main_trainer(mode: int, out: Path) -> None:
    names = sys.argv[4].split(",")
    from mindformers.core.context import build_context
    build_context(load_config(mode, out))
    from mindformers.core.callback.build_callback import build_callback
    from ms_memopt.mindspore.mindformers import register_callbacks
    results = {"registered": {"names": register_callbacks(),   # a launcher's own registration
                              "built": [type(cb).__name__ for cb in build_callback(
                                  [{"type": "LayoutScanCallback", "every": 3, "log_dir": None},
                                   {"type": "CompactionCallback", "every": 4}])]}}
    for name in names:
        try:
            results[name] = train_run(name, mode, out)
        except Exception as exc:  # reported to the test, which names the run
            results[name] = {"name": name, "error": f"{type(exc).__name__}: {exc}"[:20000]}
            print(f"run {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        (out / "result.json").write_text(json.dumps(results, default=str))


def main_entry(mode: int, out: Path) -> None:
    """What ``run_mindformer.py --config RECIPE --register_path DIR --train_dataset_dir DATA`` does."""
    from ms_memopt.mindspore.mindformers import register_path
    folder = str(register_path())
    os.environ["REGISTER_PATH"] = folder
    if folder not in sys.path:
        sys.path.append(folder)
    from mindformers import Trainer
    from mindformers.core.context import build_context
    from mindformers.utils.file_utils import set_output_path
    config = load_config(mode, out)
    config.train_dataset.data_loader.dataset_dir = str(write_mindrecord(out / "tokens.mindrecord"))
    for entry in config.callbacks:          # the YAML's log_dir, under this run's output folder
        if "log_dir" in entry:
            entry["log_dir"] = str(out / "memlog")
    set_output_path(config.output_dir)
    build_context(config)
    import mindspore as ms
    ms.set_seed(0)
    Trainer(config).train()
    (out / "result.json").write_text(json.dumps({"done": True}))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    command, mode, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    {"trainer": main_trainer, "entry": main_entry}[command](mode, out)
