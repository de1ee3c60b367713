"""MindFormers' training patterns in plain MindSpore (issue 14), so they are tested without it.

* a training cell that holds the optimizer (``Model(train_cell)``: ``cb_params.optimizer`` is
  None, as under MindFormers' ``Trainer``) and calls a learning-rate Cell every step, like
  ``MFTrainOneStepCell``;
* graph mode: nothing of ours may be compiled into the graph, and compaction must rebind what
  the compiled graph reads;
* Transformer layers called with keyword arguments (LLaMA's ``batch_valid_length=``) inside
  pool mode's recompute groups.

The same runs through the real MindFormers ``Trainer`` are in tests/test_mindformers.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Tensor, nn, ops  # noqa: E402
from mindspore.dataset import GeneratorDataset  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402

from ms_memopt.mindspore import CompactionCallback, LayoutScanCallback, enable_pool_mode  # noqa: E402
from ms_memopt.mindspore.cells import split_training_cell  # noqa: E402
from ms_memopt.mindspore.sources import _itemsize  # noqa: E402

pytestmark = pytest.mark.mindspore

DIM, LAYERS, BATCH, STEPS = 8, 4, 4, 6


class Block(nn.Cell):
    """A residual block called with a keyword argument, as MindFormers' LLaMA calls its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Dense(DIM, DIM)
        self.act = nn.Tanh()

    def construct(self, x, scale=None):
        y = self.act(self.fc(x))
        if scale is not None:
            y = y * scale
        return x + y


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.CellList([Block() for _ in range(LAYERS)])
        self.head = nn.Dense(DIM, 1)

    def construct(self, x, y):
        scale = ops.ones_like(x) * 0.5
        for layer in self.layers:
            x = layer(x, scale=scale)
        return ((self.head(x) - y) ** 2).mean()


class TrainCell(nn.TrainOneStepCell):
    """Holds the optimizer and calls a learning-rate Cell every step (like MFTrainOneStepCell)."""

    def __init__(self, network, optimizer) -> None:
        super().__init__(network, optimizer)
        self.lr_schedule = nn.CosineDecayLR(1e-4, 1e-2, 10)

    def construct(self, x, y):
        loss = super().construct(x, y)
        return ops.depend(loss, self.lr_schedule(self.optimizer.global_step))


class LossLog(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def on_train_step_end(self, run_context) -> None:
        self.losses.append(float(run_context.original_args().net_outputs.asnumpy()))


def _data():
    rng = np.random.default_rng(0)
    rows = [(rng.standard_normal(DIM).astype(np.float32), rng.standard_normal(1).astype(np.float32))
            for _ in range(STEPS * BATCH)]
    return GeneratorDataset(rows, column_names=["x", "y"], shuffle=False).batch(BATCH)


@pytest.fixture(params=[ms.PYNATIVE_MODE, ms.GRAPH_MODE], ids=["pynative", "graph"])
def mode(request):
    before = ms.get_context("mode")
    ms.set_context(mode=request.param)
    yield request.param
    ms.set_context(mode=before)


def _train(callbacks=(), pool: bool = False):
    ms.set_seed(0)
    net = Net()
    if pool:
        enable_pool_mode(net, checkpoint_every=2, activation_estimator=lambda batch: (batch * DIM * 12, batch * DIM * 4))
    train_cell = TrainCell(net, nn.Adam(net.trainable_params(), learning_rate=1e-2))
    log = LossLog()
    Model(train_cell).train(1, _data(), callbacks=[log, *callbacks], dataset_sink_mode=False)
    return log.losses, net


def _records(log_dir):
    return [json.loads(line) for line in (log_dir / "rank_0" / "scan.jsonl").read_text().splitlines()]


def test_scans_and_compaction_under_a_training_cell_that_holds_the_optimizer(tmp_path, mode):
    reference, _ = _train()
    scan = LayoutScanCallback(every=2, log_dir=tmp_path, source="model")
    compaction = CompactionCallback(every=2, log_dir=tmp_path)
    losses, net = _train([scan, compaction])
    assert losses == reference                       # bit-identical through 3 compactions
    records = _records(tmp_path)
    # the scanner also takes a first scan at step 1
    assert [(r.get("kind", "scan"), r["step"]) for r in records if r["step"] > 1] == [
        (kind, step) for step in (2, 4, 6) for kind in ("scan", "compaction")]
    trainable = sum(p.size * p.itemsize for p in net.trainable_params())
    scans = [r for r in records if r.get("kind", "scan") == "scan"]
    # cb_params.optimizer is None: the gradients are the network's, not also adam's m and v
    assert all(r["extra"]["gradient_bytes"] == trainable for r in scans)
    compactions = [r for r in records if r.get("kind") == "compaction"]
    # everything long-lived moved: weights, both moments, the optimizer's counters
    assert all(r["live"]["verified"] and r["live"]["recompiled"] and r["bytes_moved"] > 3 * trainable
               for r in compactions)
    if mode == ms.GRAPH_MODE:
        assert all(r["extra"]["activations"].startswith("not observed: graph mode") for r in scans)
        assert all(r["extra"]["activations_observed"] == 0 for r in scans)
    else:
        assert all(r["extra"]["activations_observed"] > 0 for r in scans)


def test_the_learning_rate_cell_is_not_taken_for_a_layer():
    ms.set_seed(0)
    net = Net()
    train_cell = TrainCell(net, nn.Adam(net.trainable_params()))
    scan = LayoutScanCallback(every=1, log_dir=None, source="model")
    Model(train_cell).train(1, _data(), callbacks=[scan], dataset_sink_mode=False)
    source = scan.scanner.sources[0] if scan.scanner else None
    assert scan.records and all(r.extra["gradient_bytes"] == sum(p.size * 4 for p in net.trainable_params())
                                for r in scan.records)
    observed = {event.cell for event in scan.records and _last_observed(train_cell)}
    assert observed and not any("lr_schedule" in name or "optimizer" in name for name in observed)
    del source


def _last_observed(train_cell):
    from ms_memopt.mindspore.sources import ShadowModelSource
    source = ShadowModelSource(train_cell)
    train_cell.network(Tensor(np.ones((BATCH, DIM), np.float32)), Tensor(np.ones((BATCH, 1), np.float32)))
    events = source.observed()
    source.close()
    return events


def test_training_parts_of_a_wrapper():
    net = Net()
    opt = nn.Adam(net.trainable_params())
    parts = split_training_cell(TrainCell(net, opt))
    assert parts.network is net and parts.optimizer is opt
    assert split_training_cell(net).network is net and split_training_cell(net).optimizer is None


def test_pool_mode_passes_keyword_arguments_through_recompute_groups(mode):
    reference, _ = _train()
    losses, net = _train(pool=True)
    assert net._pool_plan.notes["recompute_groups"] == [[0, 1], [2, 3]]
    np.testing.assert_allclose(losses, reference, rtol=1e-6)


def test_pool_mode_warns_when_the_activation_region_would_be_empty():
    with pytest.warns(UserWarning, match="activation region is 0 bytes"):
        plan = enable_pool_mode(Net(), checkpoint_every=2)
    assert plan.region("activations").size == 0


def test_no_old_style_callback_method_names(monkeypatch):
    """MindSpore's own check (``Model._check_methods_for_custom_callbacks``) finds nothing to warn about."""
    from mindspore.train import model as model_module
    warnings = []
    monkeypatch.setattr(model_module.logger, "warning", lambda *args: warnings.append(args))
    Model._check_methods_for_custom_callbacks(
        [LayoutScanCallback(every=1, log_dir=None), CompactionCallback(every=1)], "train")
    assert warnings == []


def test_dtype_sizes_from_the_current_api():
    assert [_itemsize(t) for t in (ms.float32, ms.float16, ms.bfloat16, ms.int64, ms.uint8)] == [4, 2, 2, 8, 1]


def test_pool_mode_estimates_activations_from_a_model_config():
    """A network with a MindFormers-style ``config`` (flat keys, read by the recipe reader) gets an
    activation region without an explicit estimator."""
    from ms_memopt.analysis.estimate import layer_activation_bytes, layer_input_bytes
    from ms_memopt.mindspore.pool_mode import config_activation_estimator
    from ms_memopt.config.recipe import recipe_from_dict

    class Config(dict):
        def to_dict(self):
            return dict(self)

    config = Config(num_layers=LAYERS, hidden_size=DIM, num_heads=2, seq_length=4, vocab_size=16,
                    intermediate_size=16, compute_dtype="float32", param_init_type="float32",
                    parallel_config={"data_parallel": 1})     # nested sections are skipped
    net = Net()
    net.config = config
    plan = enable_pool_mode(net, checkpoint_every=2, batch_size=BATCH)
    model = recipe_from_dict({"model": {"model_config": {k: v for k, v in config.items() if k != "parallel_config"}}}).model
    assert config_activation_estimator(config)(BATCH) == (layer_activation_bytes(model, seq=4, micro_batch=BATCH),
                                                          layer_input_bytes(model, seq=4, micro_batch=BATCH))
    assert plan.region("activations").size > 0


def test_tensor_sizes_use_no_deprecated_mindspore_api(tmp_path):
    """The demo printed MindSpore's deprecation warning for ``mindspore.dtype_to_nptype`` (issue 15):
    sizing tensors of every dtype the shadow source sees logs no deprecation of ours."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import mindspore as ms\n"
            "from ms_memopt.mindspore.sources import _nbytes\n"
            "sizes = [_nbytes(ms.Tensor([[1, 2], [3, 4]], dt)) for dt in (ms.float32, ms.float16, ms.bfloat16, ms.int32, ms.int8)]\n"
            "print(sizes)\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[-2] == "[16, 8, 8, 16, 4]"
    assert "dtype_to_nptype" not in done.stderr
