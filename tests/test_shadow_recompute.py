"""The shadow source (ShadowModelSource) with recompute groups: what it keeps, what it re-allocates."""
from __future__ import annotations

import functools
import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

HAS_MINDSPORE = importlib.util.find_spec("mindspore") is not None
pytestmark = [pytest.mark.mindspore, pytest.mark.skipif(not HAS_MINDSPORE, reason="MindSpore is not installed")]

# 4 blocks, hidden 32, 4 heads, seq 16; batch 4 (float32)
TINY = dict(num_layers=4, hidden_size=32, num_heads=4, seq_length=16, vocab_size=64, seed=0)
BATCH = 4


@functools.lru_cache(maxsize=None)
def _step(k: int, *, train_cell: bool = False):
    """One forward + backward of the tiny GPT (pool mode with checkpoint_every=k when k > 0)
    under a fresh shadow source; returns (source, reading, plan or None), cached (read only)."""
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_memopt.mindspore.model import GPT, GPTConfig, GPTWithLoss, synthetic_batches
    from ms_memopt.mindspore.pool_mode import enable_pool_mode
    from ms_memopt.mindspore.sources import ShadowModelSource

    cfg = GPTConfig(**TINY)
    net = GPTWithLoss(GPT(cfg))
    plan = enable_pool_mode(net, checkpoint_every=k, batch_size=BATCH, combine_parameters=False) if k else None
    x, y = (Tensor(a) for a in next(synthetic_batches(cfg, BATCH, 1, seed=9)))
    if train_cell:
        opt = nn.SGD(net.trainable_params(), 0.01)
        train = nn.TrainOneStepCell(net, opt)
        source = ShadowModelSource(train, opt)
        float(train(x, y).asnumpy())
    else:
        source = ShadowModelSource(net)
        loss, _ = ms.value_and_grad(net, None, net.trainable_params())(x, y)
        float(loss.asnumpy())
    try:
        return source, source.read(), plan
    finally:
        source.close()


def test_without_recompute_the_figures_are_those_of_before():
    source, reading, _ = _step(0)
    extra = reading.extra
    b, s, h, layers = BATCH, TINY["seq_length"], TINY["hidden_size"], TINY["num_layers"]
    # leaf outputs per block: ln1 h, qkv 3h, proj h, ln2 h, fc1 4h, fc2 h; then ln_f h; float32
    assert extra["activation_bytes"] == 4 * b * s * h * (11 * layers + 1) == 368640
    assert extra["activations_observed"] == 6 * layers + 1
    assert extra["activation_peak_bytes"] == extra["activation_kept_bytes"] == extra["activation_bytes"]
    assert extra["activations_recomputed"] == extra["recompute_groups"] == 0
    # pinned from the source before it knew recompute (commit f4aaabe), same model and batch
    assert extra["step_peak_allocated"] == 627712
    assert (reading.reserved, reading.allocated, reading.largest_free) == (2147483648, 232448, 1073741824)
    assert extra["gradient_bytes"] == 221952
    assert {e.kind for e in source.observed()} == {"output"}


@pytest.mark.parametrize("k", [1, 2])
def test_peak_with_recompute_follows_the_estimator_ratio(k):
    _, plain, _ = _step(0)
    source, grouped, plan = _step(k)
    shadow_ratio = grouped.extra["activation_peak_bytes"] / plain.extra["activation_peak_bytes"]
    estimator_ratio = plan.notes["activation_with_recompute"] / plan.notes["activation_without_recompute"]
    # The source sees only Cell outputs (not the attention scores), so its per-block bytes are
    # smaller than the estimator's and the boundary weighs a little more: 0.533 vs 0.528 for
    # k=2, 0.333 vs 0.306 for k=1.
    assert shadow_ratio == pytest.approx(estimator_ratio, abs=0.05)
    assert shadow_ratio < 0.6
    assert grouped.extra["step_peak_allocated"] < plain.extra["step_peak_allocated"]
    # the same composition as the estimator: every group's boundary + one group's outputs
    events = source.observed()
    boundaries = [e.nbytes for e in events if e.kind == "group_enter"]
    per_group: dict[str, int] = {}
    for e in events:
        if e.kind == "group_output":
            per_group[e.group] = per_group.get(e.group, 0) + e.nbytes
    assert len(boundaries) == TINY["num_layers"] // k == grouped.extra["recompute_groups"]
    assert all(size == BATCH * TINY["seq_length"] * TINY["hidden_size"] * 4 for size in boundaries)
    assert grouped.extra["activation_peak_bytes"] == sum(boundaries) + max(per_group.values())


def test_backward_firings_are_recompute_not_new_activations():
    _, plain, _ = _step(0)
    source, grouped, _ = _step(2)
    events = source.observed()
    forward_cells = [e.cell for e in events if e.kind == "group_output"]
    recomputed = [e for e in events if e.kind == "recompute"]
    # every block leaf fired twice, but the forward figures are those of no recompute
    assert grouped.extra["activations_observed"] == plain.extra["activations_observed"]
    assert grouped.extra["activation_bytes"] == plain.extra["activation_bytes"]
    assert grouped.extra["activations_recomputed"] == len(recomputed) == len(forward_cells) == 24
    assert sorted(e.cell for e in recomputed) == sorted(forward_cells)
    # recompute runs in backward, after the whole forward, last group first
    last_forward = max(i for i, e in enumerate(events) if e.kind != "recompute")
    assert all(i > last_forward for i, e in enumerate(events) if e.kind == "recompute")
    assert [e.group for e in recomputed][0] == "network.blocks.2" and recomputed[-1].group == "network.blocks.0"
    # the group's own hooks fire once (forward only): MindSpore 2.10 recomputes via construct
    assert [e.cell for e in events if e.kind == "group_enter"] == ["network.blocks.0", "network.blocks.2"]
    # MindSpore's recompute wrapper Cells and the Passthrough slots (which return their input) are not seen
    assert not any("_recompute_cell" in e.cell or e.cell in ("network.blocks.1", "network.blocks.3")
                   for e in events)


def test_train_one_step_cell_gives_the_same_activation_figures():
    _, direct, _ = _step(2)
    source, wrapped, _ = _step(2, train_cell=True)
    for key in ("activations_observed", "activation_bytes", "activation_peak_bytes", "activations_recomputed",
                "recompute_groups"):
        assert wrapped.extra[key] == direct.extra[key], key
    # the grad reducer (an Identity in one process) hands the gradients on: no new tensors
    assert not any("grad_reducer" in e.cell for e in source.observed())


def test_a_group_entered_twice_in_one_forward_counts_as_recompute():
    """The guard for a MindSpore that would call the group Cell again during backward."""
    import numpy as np
    from mindspore import Tensor

    from ms_memopt.mindspore.sources import ShadowModelSource

    source = ShadowModelSource(None)
    x = Tensor(np.zeros((2, 8), np.float32))
    enter, leave = source._group_enter_hook("g"), source._group_exit_hook("g")
    leaf = source._leaf_hook("g.fc", "g")
    for _ in range(2):  # forward, then the same group again without a new forward
        enter(None, (x,))
        leaf(None, (x,), Tensor(np.zeros((2, 16), np.float32)))
        leave(None, (x,), x)
    assert [e.kind for e in source.observed()] == ["group_enter", "group_output", "group_exit", "recompute"]
    source._forward_begins(None, (x,))
    enter(None, (x,))
    assert source.observed()[-1].kind == "group_enter"


# -- the replay alone (synthetic events) ---------------------------------------------------------

def _events(head, groups, tail):
    from ms_memopt.mindspore.sources import ObservedEvent as E

    events = [E("output", f"head{i}", None, size) for i, size in enumerate(head)]
    for g, (boundary, outputs) in enumerate(groups):
        events.append(E("group_enter", f"g{g}", f"g{g}", boundary))
        events += [E("group_output", f"g{g}.{i}", f"g{g}", size) for i, size in enumerate(outputs)]
        events.append(E("group_exit", f"g{g}", f"g{g}", 0))
    events += [E("output", f"tail{i}", None, size) for i, size in enumerate(tail)]
    for g, (_, outputs) in reversed(list(enumerate(groups))):
        events += [E("recompute", f"g{g}.{i}", f"g{g}", size) for i, size in enumerate(outputs)]
    return events


sizes = st.lists(st.integers(0, 10**6), max_size=4)


@settings(max_examples=80, deadline=None)
@given(sizes, st.lists(st.tuples(st.integers(0, 10**5), st.lists(st.integers(0, 10**6), min_size=1, max_size=5)),
                       min_size=1, max_size=5), sizes, st.integers(0, 40))
def test_replay_peak_is_kept_boundaries_plus_one_group(head, groups, tail, n_grads):
    from ms_memopt.allocators import create
    from ms_memopt.mindspore.sources import _ActivationReplay

    model = create("mindspore", capacity=None)
    replay = _ActivationReplay(model)
    kept = replay.forward(_events(head, groups, tail))
    assert replay.live == sum(head) + sum(b for b, _ in groups) + sum(tail)
    grads = replay.backward(kept, [4096] * n_grads)
    assert replay.live == 0 and len(grads) == n_grads
    for addr in grads:
        model.free(addr)
    assert model.allocated == 0
    prefix, group_peak = 0, 0
    for boundary, outputs in groups:
        prefix += boundary
        group_peak = max(group_peak, prefix + sum(outputs))
    assert replay.peak == sum(head) + max(group_peak, prefix + sum(tail))
