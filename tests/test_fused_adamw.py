"""FusedAdamW: numerics against a float64 numpy AdamW, groups, Model.train, checkpoint resume."""
from __future__ import annotations

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
from mindspore import Parameter, Tensor, nn  # noqa: E402

from ms_memopt.mindspore.fused_adamw import FusedAdamW, FusedAdamWGraph  # noqa: E402
from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss, synthetic_batches, synthetic_dataset  # noqa: E402

pytestmark = pytest.mark.mindspore

SHAPES = [(3, 4), (5,), (2, 2, 2), (7, 3)]


def reference_adamw(p0, grads, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.0, bias_correction=True):
    """Float64 AdamW exactly as the issue states it."""
    p = p0.astype(np.float64)
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g.astype(np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1 ** t) if bias_correction else m
        v_hat = v / (1 - b2 ** t) if bias_correction else v
        p = p - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * p)
    return p


def _params(np_dtype, seed=0, names=None):
    rng = np.random.default_rng(seed)
    init = [rng.normal(size=s).astype(np_dtype) for s in SHAPES]
    names = names or [f"w{i}" for i in range(len(SHAPES))]
    return init, [Parameter(Tensor(a), name=n) for a, n in zip(init, names)]


def _grads(np_dtype, steps, seed=1):
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=s).astype(np_dtype) for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("np_dtype,tol", [(np.float32, 2e-6), (np.float16, 2e-3)])
def test_matches_float64_reference(np_dtype, tol, bias_correction):
    init, params = _params(np_dtype)
    opt = FusedAdamW(params, learning_rate=1e-2, weight_decay=0.1, bias_correction=bias_correction)
    grads = _grads(np_dtype, 6)
    for g in grads:
        opt(tuple(Tensor(x) for x in g))
    for i, p in enumerate(params):
        ref = reference_adamw(init[i], [g[i] for g in grads], 1e-2, wd=0.1, bias_correction=bias_correction)
        assert p.dtype == Tensor(init[i]).dtype
        np.testing.assert_allclose(p.asnumpy().astype(np.float64), ref, rtol=tol, atol=tol)


def test_fp16_master_weights_are_fp32_accurate():
    init, params = _params(np.float16)
    opt = FusedAdamW(params, learning_rate=1e-3, weight_decay=0.01)
    grads = _grads(np.float16, 5)
    for g in grads:
        opt(tuple(Tensor(x) for x in g))
    assert len(opt.masters) == 1 and opt.masters[0].dtype == ms.float32
    master = opt.masters[0].asnumpy()
    ref = np.concatenate([reference_adamw(init[i], [g[i] for g in grads], 1e-3, wd=0.01).ravel()
                          for i in range(len(SHAPES))])
    # Updates of ~1e-3 per step are below fp16 resolution near 1; the master keeps them.
    np.testing.assert_allclose(master, ref, rtol=1e-5, atol=1e-6)
    flat_params = np.concatenate([p.asnumpy().ravel() for p in params])
    np.testing.assert_array_equal(flat_params, master.astype(np.float16))


def test_bfloat16_params_if_supported():
    try:
        p = Parameter(Tensor(np.ones((4,), np.float32)).astype(ms.bfloat16), name="w")
        opt = FusedAdamW([p], learning_rate=1e-2)
        opt((Tensor(np.full((4,), 0.5, np.float32)).astype(ms.bfloat16),))
        value = p.astype(ms.float32).asnumpy()
    except (RuntimeError, TypeError) as exc:
        pytest.skip(f"bfloat16 not supported on this device: {str(exc).splitlines()[0]}")
    ref = reference_adamw(np.ones(4), [np.full(4, 0.5)], 1e-2)
    np.testing.assert_allclose(value, ref, rtol=1e-2)


def test_weight_decay_is_decoupled_and_skips_norm_parameters():
    init, params = _params(np.float32, names=["w", "ln.gamma", "ln.beta", "v"])
    opt = FusedAdamW(params, learning_rate=0.1, weight_decay=0.5)
    opt(tuple(Tensor(np.zeros(s, np.float32)) for s in SHAPES))  # zero gradient: only decay acts
    np.testing.assert_allclose(params[0].asnumpy(), init[0] * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(params[1].asnumpy(), init[1])
    np.testing.assert_array_equal(params[2].asnumpy(), init[2])
    np.testing.assert_allclose(params[3].asnumpy(), init[3] * (1 - 0.1 * 0.5), rtol=1e-6)


def test_parameter_groups_take_their_own_lr_and_weight_decay():
    init, params = _params(np.float32)
    groups = [{"params": params[:2], "lr": 0.05, "weight_decay": 0.2},
              {"params": params[2:], "weight_decay": 0.0}]
    opt = FusedAdamW(groups, learning_rate=1e-2)
    assert len(opt.buckets) == 2
    grads = _grads(np.float32, 4)
    for g in grads:
        opt(tuple(Tensor(x) for x in g))
    for i, p in enumerate(params):
        lr, wd = (0.05, 0.2) if i < 2 else (1e-2, 0.0)
        ref = reference_adamw(init[i], [g[i] for g in grads], lr, wd=wd)
        np.testing.assert_allclose(p.asnumpy(), ref, rtol=2e-6, atol=2e-6)


def test_learning_rate_schedule_is_read_per_step():
    """A per-step learning rate (list -> schedule of global_step) is evaluated inside the compiled step."""
    init, params = _params(np.float32)
    lrs = [1e-2, 5e-3, 2e-2, 1e-3]
    opt = FusedAdamW(params, learning_rate=lrs, weight_decay=0.1)
    grads = _grads(np.float32, len(lrs))
    for g in grads:
        opt(tuple(Tensor(x) for x in g))
    assert int(opt.global_step.asnumpy()[0]) == len(lrs)
    for i, p in enumerate(params):
        ref, m, v = init[i].astype(np.float64), 0.0, 0.0
        for t, (lr, g) in enumerate(zip(lrs, grads), 1):
            g64 = g[i].astype(np.float64)
            m = 0.9 * m + 0.1 * g64
            v = 0.999 * v + 0.001 * g64 * g64
            ref = ref - lr * (m / (1 - 0.9 ** t) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-6) + 0.1 * ref)
        np.testing.assert_allclose(p.asnumpy(), ref, rtol=2e-6, atol=2e-6)


def test_mixed_dtypes_get_one_region_each_and_contiguous_parameters():
    rng = np.random.default_rng(0)
    params = [Parameter(Tensor(rng.normal(size=(4, 4)).astype(dt)), name=f"p{i}")
              for i, dt in enumerate([np.float32, np.float16, np.float32, np.float16])]
    opt = FusedAdamW(params, learning_rate=1e-2)
    assert sorted(str(r.dtype) for r in opt.regions) == ["Float16", "Float32"]
    for region in opt.regions:
        ptrs = [params[i].data_ptr() for i in region.param_indices]
        assert ptrs == [ptrs[0] + k * 16 * region.itemsize for k in range(len(ptrs))]
    sizes = opt.region_bytes()
    assert sizes["parameters.float32"] == 128 and sizes["parameters.float16"] == 64
    assert sizes["optimizer"] == 32 * 8 + 32 * 12


def test_no_bias_correction_equals_nn_adamweightdecay():
    """With bias correction off, FusedAdamW is nn.AdamWeightDecay's update (drop-in check)."""
    init, ours = _params(np.float32, names=["a", "b", "c", "d"])
    _, theirs = _params(np.float32, names=["a", "b", "c", "d"])
    fused = FusedAdamW(ours, learning_rate=1e-2, weight_decay=0.1, eps=1e-6, bias_correction=False)
    plain = nn.AdamWeightDecay(theirs, learning_rate=1e-2, weight_decay=0.1, eps=1e-6)
    for g in _grads(np.float32, 5):
        fused(tuple(Tensor(x) for x in g))
        plain(tuple(Tensor(x) for x in g))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)


def test_strided_gradients_are_read_in_logical_order():
    """A transposed-view gradient must not be copied in its raw storage order."""
    rng = np.random.default_rng(2)
    init = rng.normal(size=(3, 5)).astype(np.float32)
    p = Parameter(Tensor(init), name="w")
    grads = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3)]
    opt = FusedAdamW([p], learning_rate=1e-2)
    for g in grads:
        strided = Tensor(g).T
        assert not strided.is_contiguous()
        opt((strided,))
    ref = reference_adamw(init, [g.T for g in grads], 1e-2)
    np.testing.assert_allclose(p.asnumpy(), ref, rtol=2e-6, atol=2e-6)


TINY = GPTConfig(num_layers=2, hidden_size=16, num_heads=2, seq_length=8, vocab_size=32, seed=3)


def _train(net, opt, batches):
    step = nn.TrainOneStepCell(net, opt)
    return [float(step(Tensor(x), Tensor(y)).asnumpy()) for x, y in batches]


def test_model_train_equals_functional_loop():
    batches = list(synthetic_batches(TINY, 4, 3, seed=5))
    net_a = GPTWithLoss(GPT(TINY))
    losses = _train(net_a, FusedAdamW(net_a.trainable_params(), 1e-2, weight_decay=0.01), batches)
    assert losses[-1] < losses[0]

    net_b = GPTWithLoss(GPT(TINY))
    model = ms.train.Model(net_b, optimizer=FusedAdamW(net_b.trainable_params(), 1e-2, weight_decay=0.01))
    model.train(1, synthetic_dataset(TINY, 4, 3, seed=5), dataset_sink_mode=False)
    for a, b in zip(net_a.trainable_params(), net_b.trainable_params()):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6, err_msg=a.name)


def test_gpt_training_without_bias_correction_equals_nn_adamweightdecay():
    batches = list(synthetic_batches(TINY, 4, 3, seed=5))
    nets = [GPTWithLoss(GPT(TINY)) for _ in range(2)]
    plain = _train(nets[0], nn.AdamWeightDecay(nets[0].trainable_params(), 1e-2, weight_decay=0.01), batches)
    fused = _train(nets[1], FusedAdamW(nets[1].trainable_params(), 1e-2, weight_decay=0.01,
                                       bias_correction=False), batches)
    np.testing.assert_allclose(fused, plain, rtol=1e-5)
    for a, b in zip(nets[0].trainable_params(), nets[1].trainable_params()):
        np.testing.assert_allclose(b.asnumpy(), a.asnumpy(), rtol=1e-4, atol=1e-5, err_msg=a.name)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_checkpoint_resume_is_identical(tmp_path, dtype):
    cfg = GPTConfig(**{**TINY.to_dict(), "dtype": dtype})
    batches = list(synthetic_batches(cfg, 4, 4, seed=7))
    net = GPTWithLoss(GPT(cfg))
    opt = FusedAdamW(net.trainable_params(), 1e-2, weight_decay=0.01)
    _train(net, opt, batches[:2])
    path = str(tmp_path / "opt.ckpt")
    ms.save_checkpoint(opt, path)
    continued = _train(net, opt, batches[2:])
    expected = {p.name: p.asnumpy() for p in net.trainable_params()}

    other_cfg = GPTConfig(**{**cfg.to_dict(), "seed": 99})  # different start: the load must win
    net2 = GPTWithLoss(GPT(other_cfg))
    opt2 = FusedAdamW(net2.trainable_params(), 1e-2, weight_decay=0.01)
    not_loaded = ms.load_param_into_net(opt2, ms.load_checkpoint(path))
    assert not any(not_loaded) if isinstance(not_loaded, tuple) else not not_loaded
    resumed = _train(net2, opt2, batches[2:])
    assert resumed == continued
    for p in net2.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), expected[p.name], err_msg=p.name)
    assert int(opt2.global_step.asnumpy()[0]) == 4


def test_checkpoint_holds_state_parameters(tmp_path):
    net = GPTWithLoss(GPT(TINY))
    opt = FusedAdamW(net.trainable_params(), 1e-3)
    path = str(tmp_path / "o.ckpt")
    ms.save_checkpoint(opt, path)
    names = set(ms.load_checkpoint(path))
    assert {"global_step", "fused_adamw.m.0", "fused_adamw.v.0"} <= names
    assert {p.name for p in net.trainable_params()} <= names


def test_rejects_bad_hyperparameters():
    _, params = _params(np.float32)
    with pytest.raises(ValueError):
        FusedAdamW(params, beta1=1.0)
    with pytest.raises(ValueError):
        FusedAdamW(params, eps=0.0)


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16])
def test_compiled_cpu_step_agrees_with_the_compiled_graph(monkeypatch, np_dtype):
    """On CPU (float32, library built) the step is one compiled AdamW pass on host memory
    (``ms_memopt.native.adamw``); the graph path (decay + ``ops.Adam`` in one ``ms.jit``
    graph) computes the same update. 40 steps back to back, weight decay on and off, two
    learning-rate groups: moments (and fp16 masters) agree to float32 rounding, fp16 parameters
    to one fp16 rounding step."""
    import ms_memopt.mindspore.fused_adamw as fused
    from ms_memopt import native

    if not native.available():
        pytest.skip("ms_memopt.native is not built")
    steps = 40
    grads = [tuple(Tensor(x) for x in g) for g in _grads(np_dtype, steps)]
    results = {}
    for compiled in (True, False):
        monkeypatch.setattr(fused, "_native_kernel", lambda compiled=compiled: compiled)
        _, params = _params(np_dtype, names=["w0", "w1.gamma", "w2", "w3"])
        groups = [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
        opt = FusedAdamW(groups, learning_rate=1e-2, weight_decay=0.1)
        assert opt._native == compiled
        for g in grads:
            opt(g)
        results[compiled] = ([m.asnumpy() for m in opt.moments1] + [v.asnumpy() for v in opt.moments2]
                             + [m.asnumpy() for m in opt.masters] + [opt.global_step.asnumpy()],
                             [p.asnumpy().astype(np.float32) for p in params])
    for a, b in zip(results[True][0], results[False][0]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    tol = 1e-6 if np_dtype == np.float32 else 1e-3
    for a, b in zip(results[True][1], results[False][1]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * 0.1)


@pytest.fixture
def graph_mode():
    """Graph mode (mode 0) for one test: a training cell compiles the optimizer into its graph."""
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=mode)


def _grouped(np_dtype):
    _, params = _params(np_dtype, names=["w0", "w1.gamma", "w2", "w3"])
    groups = [{"params": params[:2], "lr": 1e-2}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]
    return params, groups


@pytest.mark.parametrize("np_dtype", [np.float32, np.float16])
def test_graph_step_agrees_with_the_pynative_step(np_dtype):
    """In graph mode the step is MindSpore ops (per parameter: decay, ``ops.Adam``, the fp16
    write), compiled as the optimizer's graph; it computes the PyNative step's update. 40 steps,
    weight decay on and off (and the gamma rule), two learning-rate groups: weights agree to
    float32 rounding (fp16 parameters to one fp16 rounding step), the step count exactly."""
    steps = 40
    grads = [tuple(Tensor(x) for x in g) for g in _grads(np_dtype, steps)]
    results = {}
    for mode in (ms.PYNATIVE_MODE, ms.GRAPH_MODE):
        previous = ms.get_context("mode")
        ms.set_context(mode=mode)
        try:
            params, groups = _grouped(np_dtype)
            opt = FusedAdamW(groups, learning_rate=1e-2, weight_decay=0.1)
            assert opt._graph == (mode == ms.GRAPH_MODE) == isinstance(opt, FusedAdamWGraph)
            for g in grads:
                opt(g)
            results[mode] = ([p.asnumpy().astype(np.float32) for p in params], int(opt.global_step.asnumpy()[0]))
        finally:
            ms.set_context(mode=previous)
    assert results[ms.GRAPH_MODE][1] == results[ms.PYNATIVE_MODE][1] == steps
    tol = 2e-6 if np_dtype == np.float32 else 1e-3
    for a, b in zip(results[ms.GRAPH_MODE][0], results[ms.PYNATIVE_MODE][0]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * 0.1)


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("np_dtype,tol", [(np.float32, 2e-6), (np.float16, 2e-3)])
def test_graph_step_matches_float64_reference(graph_mode, np_dtype, tol, bias_correction):
    init, params = _params(np_dtype)
    opt = FusedAdamW(params, learning_rate=1e-2, weight_decay=0.1, bias_correction=bias_correction)
    grads = _grads(np_dtype, 6)
    for g in grads:
        opt(tuple(Tensor(x) for x in g))
    for i, p in enumerate(params):
        ref = reference_adamw(init[i], [g[i] for g in grads], 1e-2, wd=0.1, bias_correction=bias_correction)
        assert p.dtype == Tensor(init[i]).dtype
        np.testing.assert_allclose(p.asnumpy().astype(np.float64), ref, rtol=tol, atol=tol)


def test_graph_flag_overrides_the_context():
    """``graph=`` picks the step whatever the context mode: a graph step built in PyNative runs
    eagerly (op by op) and trains the same."""
    _, params = _params(np.float32)
    assert type(FusedAdamW(params, graph=True)) is FusedAdamWGraph
    assert type(FusedAdamW(params, graph=False)) is FusedAdamW
    init, params = _params(np.float32)
    opt = FusedAdamW(params, learning_rate=1e-2, weight_decay=0.1, graph=True)
    grads = _grads(np.float32, 3)
    for g in grads:
        opt(tuple(Tensor(x) for x in g))
    for i, p in enumerate(params):
        ref = reference_adamw(init[i], [g[i] for g in grads], 1e-2, wd=0.1)
        np.testing.assert_allclose(p.asnumpy().astype(np.float64), ref, rtol=2e-6, atol=2e-6)


def _contiguous(tensors) -> bool:
    ptrs = [t.data_ptr() for t in tensors]
    return all(b == a + t.nbytes for a, b, t in zip(ptrs, ptrs[1:], tensors))


def _state_in_region(opt) -> bool:
    """Every state Parameter is a view of the one optimizer-region buffer, which holds its values."""
    whole = np.concatenate([p.asnumpy().reshape(-1) for p in opt._state_order])
    return (_contiguous(opt._state_order) and opt._state_order[0].data_ptr() == opt._state_handle[0:1].data_ptr()
            and np.array_equal(opt._state_handle[0:whole.size].asnumpy(), whole))


class _Losses(ms.train.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_step_end(self, run_context):
        self.losses.append(float(run_context.original_args().net_outputs.asnumpy()))


def _model_train(make_optimizer, *callbacks, cfg=TINY, steps=6):
    net = GPTWithLoss(GPT(cfg))
    opt = make_optimizer(net.trainable_params())
    losses = _Losses()
    ms.train.Model(net, optimizer=opt).train(1, synthetic_dataset(cfg, 4, steps, seed=5), callbacks=[losses, *callbacks],
                                             dataset_sink_mode=False)
    return losses.losses, net, opt


def test_model_train_in_graph_mode_equals_nn_adamweightdecay(graph_mode):
    """``Model.train`` in graph mode compiles FusedAdamW's step into the training graph. Without
    bias correction its update is ``nn.AdamWeightDecay``'s; the losses agree to float32
    rounding (``ops.Adam`` vs ``AdamWeightDecay``'s kernel: the same rule, operations in another
    order). Weights and state stay in their contiguous regions."""
    plain, _, _ = _model_train(lambda p: nn.AdamWeightDecay(p, 1e-2, weight_decay=0.01))
    fused, net, opt = _model_train(lambda p: FusedAdamW(p, 1e-2, weight_decay=0.01, bias_correction=False))
    assert opt._graph and len(fused) == 6 and fused[-1] < fused[0]
    np.testing.assert_allclose(fused, plain, rtol=1e-5)
    assert _state_in_region(opt)
    params = [net.trainable_params()[i] for i in opt.regions[0].param_indices]
    assert _contiguous(params)
    assert int(opt.global_step.asnumpy()[0]) == 6


def test_graph_mode_compaction_leaves_the_regions_alone_bit_identically(graph_mode, tmp_path):
    """A live compaction relocates nothing that lives in FusedAdamW's regions (parameters and
    graph-mode state share the region's storage, formed once): losses and weights are
    bit-identical to the run without compaction, every region member is counted as skipped,
    and the regions are still contiguous where they were."""
    from ms_memopt.mindspore.compaction import CompactionCallback

    make = lambda p: FusedAdamW(p, 1e-2, weight_decay=0.01)
    ref_losses, ref_net, _ = _model_train(make)
    callback = CompactionCallback(every=2, log_dir=tmp_path, barrier=None)
    losses, net, opt = _model_train(make, callback)
    assert losses == ref_losses
    for a, b in zip(net.trainable_params(), ref_net.trainable_params()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy(), err_msg=a.name)
    members = len(net.trainable_params()) + len(opt._state_order)
    assert [r["live"]["skipped_in_regions"] for r in callback.records] == [members] * 3
    assert [r["regions_restored"] for r in callback.records] == [False] * 3
    assert _state_in_region(opt)
    assert _contiguous([net.trainable_params()[i] for i in opt.regions[0].param_indices])


def test_graph_mode_checkpoint_resume_is_identical(graph_mode, tmp_path):
    """Graph-mode state (one m, v per parameter, named ``fused_adamw.m.<name>``) round-trips
    through a checkpoint; ``restore_regions()`` after the load puts it back in one region."""
    batches = list(synthetic_batches(TINY, 4, 4, seed=7))
    net = GPTWithLoss(GPT(TINY))
    opt = FusedAdamW(net.trainable_params(), 1e-2, weight_decay=0.01)
    _train(net, opt, batches[:2])
    path = str(tmp_path / "opt.ckpt")
    ms.save_checkpoint(opt, path)
    assert {"global_step", f"fused_adamw.m.{net.trainable_params()[0].name}"} <= set(ms.load_checkpoint(path))
    continued = _train(net, opt, batches[2:])

    net2 = GPTWithLoss(GPT(GPTConfig(**{**TINY.to_dict(), "seed": 99})))
    opt2 = FusedAdamW(net2.trainable_params(), 1e-2, weight_decay=0.01)
    ms.load_param_into_net(opt2, ms.load_checkpoint(path))
    assert opt2.restore_regions() and _state_in_region(opt2)
    assert _train(net2, opt2, batches[2:]) == continued
    assert int(opt2.global_step.asnumpy()[0]) == 4


def test_data_ptr_of_any_tensor_waits_for_queued_kernels():
    """The compiled CPU step rewrites weights through cached addresses right after reading the
    gradients' ``data_ptr()``. That is safe only because ``data_ptr()`` of any tensor waits for
    every queued kernel, including ones still reading those weights. (Without that call, the
    same rewrite corrupted the queued matmuls' results in 10 of 10 tries here.)"""
    import ctypes

    from mindspore import ops

    rng = np.random.default_rng(0)
    for _ in range(3):
        w = Tensor(rng.standard_normal((512, 512)).astype(np.float32))
        x = Tensor(rng.standard_normal((512, 128)).astype(np.float32))
        w_np, ref = w.asnumpy().copy(), x.asnumpy()
        w_ptr = w.data_ptr()
        y = x
        for _ in range(8):
            y = ops.matmul(w, y) * 0.03           # queued kernels reading w
        (Tensor(np.ones(4, np.float32)) + 1).data_ptr()   # an unrelated tensor, as a gradient
        ctypes.memset(w_ptr, 0, w_np.nbytes)     # the host step's in-place rewrite
        for _ in range(8):
            ref = (w_np @ ref) * np.float32(0.03)
        np.testing.assert_allclose(y.asnumpy(), ref, rtol=1e-3, atol=1e-3)
