"""Pool mode: the framework-free PoolPlan, and recompute groups / regions on MindSpore Cells."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.core.errors import InputError
from ms_memopt.core.poolplan import PURPOSES, PoolPlan

HAS_MINDSPORE = importlib.util.find_spec("mindspore") is not None


# -- PoolPlan (no MindSpore) ------------------------------------------------------------------

def test_plan_orders_regions_by_purpose_and_aligns():
    plan = PoolPlan.build({"activations": 1000, "parameters.float16": 10, "optimizer": 600,
                           "parameters.float32": 513, "gradients": 1}, alignment=512,
                          rings=["activations"])
    assert [r.name for r in plan.regions] == ["parameters.float16", "parameters.float32", "gradients",
                                              "optimizer", "activations"]
    assert [r.offset for r in plan.regions] == [0, 512, 1536, 2048, 3072]
    assert plan.total == 4096
    assert plan.region("parameters.float32").dtype == "float32"
    assert plan.region("activations").ring and not plan.region("optimizer").ring
    assert plan.size_of("parameters") == 523
    with pytest.raises(KeyError):
        plan.region("nope")


@pytest.mark.parametrize("sizes,kwargs", [
    ({"weights": 10}, {}),
    ({"gradients": -1}, {}),
    ({"gradients": 1.5}, {}),
    ({"gradients": 1}, {"alignment": 0}),
    ({"gradients": 1}, {"rings": ["activations"]}),
])
def test_plan_rejects_bad_input(sizes, kwargs):
    with pytest.raises(InputError):
        PoolPlan.build(sizes, **kwargs)


region_names = st.sampled_from(PURPOSES).flatmap(
    lambda p: st.sampled_from([p, f"{p}.a", f"{p}.b"]))


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(region_names, st.integers(0, 10**7), min_size=1, max_size=8),
       st.sampled_from([1, 8, 512, 4096]))
def test_plan_regions_are_aligned_disjoint_and_round_trip(sizes, alignment):
    plan = PoolPlan.build(sizes, alignment)
    plan.check()
    cursor = 0
    for region in plan.regions:
        assert region.offset % alignment == 0 and region.offset >= cursor
        assert region.offset - cursor < alignment  # back to back: only alignment padding
        assert region.size == sizes[region.name]
        cursor = region.end
    assert plan.total >= cursor and plan.total - cursor < alignment and plan.total % alignment == 0
    assert [PURPOSES.index(r.purpose) for r in plan.regions] == sorted(PURPOSES.index(r.purpose)
                                                                       for r in plan.regions)
    assert PoolPlan.from_dict(plan.to_dict()) == plan


def test_from_dict_rejects_overlap():
    data = PoolPlan.build({"gradients": 1000, "optimizer": 10}).to_dict()
    data["regions"][1]["offset"] = 512
    with pytest.raises(InputError):
        PoolPlan.from_dict(data)


def test_poolplan_imports_no_mindspore():
    import subprocess
    import sys
    code = "import sys, ms_memopt.core.poolplan; assert 'mindspore' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- MindSpore side ---------------------------------------------------------------------------

def _ms():
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_memopt.mindspore import model, pool_mode
    return ms, Tensor, nn, model, pool_mode


TINY = dict(num_layers=4, hidden_size=16, num_heads=2, seq_length=8, vocab_size=32, seed=4)


def _grads(net, x, y):
    import mindspore as ms
    params = net.trainable_params()
    loss, grads = ms.value_and_grad(net, None, params)(x, y)
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}


@pytest.mark.mindspore
@pytest.mark.skipif(not HAS_MINDSPORE, reason="MindSpore is not installed")
@pytest.mark.parametrize("k", [1, 2, 3])
def test_recompute_groups_give_equal_gradients_and_rerun_forward(k, monkeypatch):
    ms, Tensor, nn, model, pool_mode = _ms()
    cfg = model.GPTConfig(**TINY)
    x, y = (Tensor(a) for a in next(model.synthetic_batches(cfg, 2, 1)))
    calls = []
    original = model.GPTBlock.construct

    def counting(self, h):
        calls.append(1)
        return original(self, h)
    monkeypatch.setattr(model.GPTBlock, "construct", counting)

    plain = model.GPTWithLoss(model.GPT(cfg))
    loss_a, grads_a = _grads(plain, x, y)
    plain_calls = len(calls)
    calls.clear()

    pooled = model.GPTWithLoss(model.GPT(cfg))
    plan = pool_mode.enable_pool_mode(pooled, checkpoint_every=k, batch_size=2)
    loss_b, grads_b = _grads(pooled, x, y)
    assert plain_calls == cfg.num_layers
    assert len(calls) == 2 * cfg.num_layers, "recompute did not re-run the blocks in backward"
    assert loss_a == loss_b
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        np.testing.assert_allclose(grads_b[name], grads_a[name], rtol=1e-6, atol=1e-7, err_msg=name)
    expected_groups = [list(range(i, min(i + k, 4))) for i in range(0, 4, k)]
    assert plan.notes["recompute_groups"] == expected_groups


@pytest.mark.mindspore
@pytest.mark.skipif(not HAS_MINDSPORE, reason="MindSpore is not installed")
def test_indexed_parent_still_runs_every_block_once_in_order():
    ms, Tensor, nn, model, pool_mode = _ms()

    class AddConst(nn.Cell):
        def __init__(self, c):
            super().__init__()
            self.w = ms.Parameter(Tensor(np.float32(c)), name="w")

        def construct(self, x):
            return x * 2 + self.w

    class Parent(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([AddConst(i) for i in range(5)])

        def construct(self, x):
            for i in range(5):
                x = self.layers[i](x)
            return x

    net = Parent()
    x = Tensor(np.ones((2,), np.float32))
    before = net(x).asnumpy()
    names = [p.name for p in net.trainable_params()]
    plan = pool_mode.enable_pool_mode(net, checkpoint_every=2, activation_estimator=lambda b: (100, 10))
    np.testing.assert_array_equal(net(x).asnumpy(), before)
    assert [p.name for p in net.trainable_params()] == names
    assert plan.notes["recompute_groups"] == [[0, 1], [2, 3], [4]]
    assert plan.region("activations").size == 3 * 10 + 2 * 100


@pytest.mark.mindspore
@pytest.mark.skipif(not HAS_MINDSPORE, reason="MindSpore is not installed")
def test_find_blocks_automatic_explicit_and_errors():
    ms, Tensor, nn, model, pool_mode = _ms()
    net = model.GPTWithLoss(model.GPT(model.GPTConfig(**TINY)))
    container, indices = pool_mode.find_blocks(net)
    assert container is net.network.blocks and indices == [0, 1, 2, 3]
    blocks = list(net.network.blocks)
    container, indices = pool_mode.find_blocks(net, blocks[1:3])
    assert indices == [1, 2]
    with pytest.raises(ValueError):
        pool_mode.find_blocks(net, [blocks[0], blocks[2]])
    with pytest.raises(ValueError):
        pool_mode.find_blocks(nn.Dense(2, 2))


@pytest.mark.mindspore
@pytest.mark.skipif(not HAS_MINDSPORE, reason="MindSpore is not installed")
def test_parameters_are_contiguous_by_dtype_and_plan_sizes_add_up():
    ms, Tensor, nn, model, pool_mode = _ms()
    cfg = model.GPTConfig(**TINY)
    net = model.GPTWithLoss(model.GPT(cfg))
    plan = pool_mode.enable_pool_mode(net, checkpoint_every=2, batch_size=4)
    params = net.trainable_params()
    ptrs = [p.data_ptr() for p in params]
    offsets = np.cumsum([0] + [p.size * 4 for p in params[:-1]])
    assert ptrs == [ptrs[0] + int(o) for o in offsets]
    n_bytes = sum(p.size * 4 for p in params)
    assert plan.region("parameters.float32").size == n_bytes
    assert plan.region("gradients").size == n_bytes
    assert plan.region("optimizer").size == 2 * n_bytes
    # The per-layer figures are the recipe estimator's (one formula for plan and pool mode).
    from ms_memopt.analysis.estimate import layer_activation_bytes, layer_input_bytes
    layer = pool_mode.layer_model_config(cfg)
    per_block = layer_activation_bytes(layer, seq=cfg.seq_length, micro_batch=4)
    boundary = layer_input_bytes(layer, seq=cfg.seq_length, micro_batch=4)
    assert boundary == 4 * cfg.seq_length * cfg.hidden_size * 4
    # Korthikanti's count for a float32 GPT block without dropout: 64h + 4as bytes per token.
    assert per_block == 4 * cfg.seq_length * (64 * cfg.hidden_size + 4 * cfg.num_heads * cfg.seq_length)
    assert plan.notes["activation_without_recompute"] == 4 * per_block
    assert plan.region("activations").size == 2 * boundary + 2 * per_block
    # ... composed by the same function `ms-memopt plan` uses for memopt.checkpoint_every
    from ms_memopt.analysis.estimate import recompute_group_bytes
    assert plan.region("activations").size == recompute_group_bytes(4, 2, per_block, boundary)
    assert plan.notes["reservation"].startswith("not reserved")


@pytest.mark.mindspore
@pytest.mark.skipif(not HAS_MINDSPORE, reason="MindSpore is not installed")
def test_fused_adamw_regions_feed_the_plan():
    ms, Tensor, nn, model, pool_mode = _ms()
    from ms_memopt.mindspore.fused_adamw import FusedAdamW
    cfg = model.GPTConfig(**{**TINY, "dtype": "float16"})
    net = model.GPTWithLoss(model.GPT(cfg))
    opt = FusedAdamW(net.trainable_params(), 1e-3)
    plan = pool_mode.enable_pool_mode(net, opt, checkpoint_every=2)
    n = sum(p.size for p in net.trainable_params())
    assert plan.region("parameters.float16").size == 2 * n
    assert plan.region("optimizer").size == 12 * n  # fp32 m, v and master


@pytest.mark.mindspore
@pytest.mark.skipif(not HAS_MINDSPORE, reason="MindSpore is not installed")
@pytest.mark.parametrize("use_fused", [False, True])
def test_pool_mode_training_matches_normal_training(use_fused):
    ms, Tensor, nn, model, pool_mode = _ms()
    from ms_memopt.mindspore.fused_adamw import FusedAdamW
    cfg = model.GPTConfig(**TINY)
    batches = list(model.synthetic_batches(cfg, 2, 3, seed=1))

    def run(pool):
        net = model.GPTWithLoss(model.GPT(cfg))
        opt = (FusedAdamW if use_fused else nn.AdamWeightDecay)(net.trainable_params(), 1e-2)
        if pool:
            pool_mode.enable_pool_mode(net, opt, checkpoint_every=2, batch_size=2)
        step = nn.TrainOneStepCell(net, opt)
        losses = [float(step(Tensor(x), Tensor(y)).asnumpy()) for x, y in batches]
        return losses, net.trainable_params()[3].asnumpy()

    (normal, w_normal), (pooled, w_pooled) = run(False), run(True)
    np.testing.assert_allclose(pooled, normal, rtol=1e-5)
    np.testing.assert_allclose(w_pooled, w_normal, rtol=1e-5, atol=1e-6)
    w_init = model.GPT(cfg).trainable_params()[3].asnumpy()
    assert not np.allclose(w_pooled, w_init), "the pooled parameters did not train"


def test_package_exports_are_lazy():
    import subprocess
    import sys
    code = ("import sys, ms_memopt.mindspore as m; assert 'mindspore' not in sys.modules; "
            "assert {'FusedAdamW', 'enable_pool_mode', 'GPT', 'GPTConfig'} <= set(dir(m))")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.mindspore
@pytest.mark.skipif(not HAS_MINDSPORE, reason="MindSpore is not installed")
def test_sequentialcell_blocks_and_double_enable():
    ms, Tensor, nn, model, pool_mode = _ms()

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.body = nn.SequentialCell([nn.Dense(4, 4) for _ in range(4)])
            self.head = nn.Dense(4, 1)

        def construct(self, x):
            return self.head(self.body(x))

    net = Net()
    x = Tensor(np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4))
    grads_before = [g.asnumpy() for g in ms.value_and_grad(net, None, net.trainable_params())(x)[1]]
    plan = pool_mode.enable_pool_mode(net, checkpoint_every=2, activation_estimator=lambda b: (64, 32))
    assert plan.notes["recompute_groups"] == [[0, 1], [2, 3]]
    grads_after = [g.asnumpy() for g in ms.value_and_grad(net, None, net.trainable_params())(x)[1]]
    for a, b in zip(grads_before, grads_after):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError):
        pool_mode.enable_pool_mode(net, checkpoint_every=2)
