"""The measurement rules of bench/workload_vs_template.py (docs/simulation.md, "The hand-made
workload against reality"): on small synthetic streams whose answer is known, and on the
hand-made StepWorkload whose constants are known. No MindSpore, no recording."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ms_memopt.core.events import Event
from ms_memopt.templates.template import dims_tag

_BENCH = Path(__file__).resolve().parents[1] / "bench" / "workload_vs_template.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_workload_vs_template", _BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def _model_step(first_id: int, layers: int, seq: int, new_shape: bool) -> list[Event]:
    """A recorded-like step: per layer a forward workspace (8 s B) and two saved tensors
    (10 s and 6 s B), a head whose loss gradient (100 s B) is the step's peak, then per layer in
    reverse a backward workspace (12 s B) and the saved tensors freed; a new shape keeps 16 B."""
    ev: list[Event] = []
    ids = iter(range(first_id, first_id + 1000))
    saved = []
    for _ in range(layers):
        ws = next(ids)
        ev.append(Event("alloc", id=ws, size=8 * seq))
        pair = [next(ids), next(ids)]
        ev += [Event("alloc", id=pair[0], size=10 * seq), Event("alloc", id=pair[1], size=6 * seq),
               Event("free", id=ws)]
        saved.append(pair)
    head = next(ids)
    ev += [Event("alloc", id=head, size=100 * seq), Event("free", id=head)]
    if new_shape:
        ev.append(Event("alloc", id=next(ids), size=16))
    for pair in reversed(saved):
        ws = next(ids)
        ev += [Event("alloc", id=ws, size=12 * seq), Event("free", id=ws),
               Event("free", id=pair[1]), Event("free", id=pair[0])]
    return ev


def _recording(layers: int, lengths: list[int]) -> list[Event]:
    ev = [Event("alloc", id=1, size=4096), Event("step", step=0)]        # the prologue, the setup mark
    seen: set[int] = set()
    for number, seq in enumerate(lengths, 1):
        ev += _model_step(number * 1000, layers, seq, seq not in seen)
        seen.add(seq)
        ev.append(Event("step", step=number, tag=dims_tag({"seq": seq, "batch": 4})))
    ev.append(Event("free", id=1))                                      # the exit: dropped
    return ev


def test_split_marked_finds_prologue_and_steps(bench):
    prologue, steps = bench.split_marked(_recording(2, [16, 24, 24]))
    assert [e.id for e in prologue] == [1]
    assert [s for s, _ in steps] == [16, 24, 24]
    assert bench.prologue_bytes(prologue) == 4096
    # a generated stream has no setup mark: its prologue is counted in events
    _, steps2 = bench.split_marked(_recording(2, [16])[2:], prologue_events=0)
    assert len(steps2) == 1


def test_step_figures_identify_saved_transient_and_kept(bench):
    for layers in (2, 4):
        prologue, steps = bench.split_marked(_recording(layers, [16, 24, 24, 32]))
        figs = bench.step_figures(prologue, steps)
        assert [f.kind for f in figs] == ["first", "new_shape", "repeat", "new_shape"]
        f = figs[2]                                          # repeat at 24
        # the saved tensors, and the head's gradient: it is the peak, so it spans it too
        assert f.saved_bytes == layers * 16 * 24 + 100 * 24
        assert f.saved_allocs == 2 * layers + 1
        assert f.forward_bytes == layers * 8 * 24            # workspaces freed before the peak
        assert f.backward_bytes == layers * 12 * 24
        assert f.peak_in_step == layers * 16 * 24 + 100 * 24  # the head's gradient on top of the saved set
        assert f.peak_total == f.peak_in_step + 4096 + 2 * 16          # the prologue, two shapes kept
        assert (figs[1].kept_bytes, figs[1].kept_allocs) == (16, 1)   # a new shape keeps its tensor
        assert (f.kept_bytes, f.kept_allocs) == (0, 0)


def test_per_layer_differences_cancel_what_layers_do_not_scale(bench):
    figs = {}
    for layers in (2, 4):
        prologue, steps = bench.split_marked(_recording(layers, [16, 32, 32]))
        figs[layers] = bench.pick(bench.step_figures(prologue, steps), "repeat", 32)
    assert bench.per_layer(figs[2].saved_bytes, figs[4].saved_bytes, 2, 4) == 16 * 32   # the head cancels
    assert bench.per_layer(figs[2].forward_bytes, figs[4].forward_bytes, 2, 4) == 8 * 32
    assert bench.layer_sizes(figs[2].saved_sizes, figs[4].saved_sizes, 2, 4) == [10 * 32, 6 * 32]
    assert bench.shares([10 * 32, 6 * 32]) == [0.62, 0.38]
    with pytest.raises(ValueError):
        bench.per_layer(1, 2, 3, 3)


def test_the_rules_read_stepworkload_constants_back(bench):
    """On the hand-made workload the rules give back its own constants: per layer, the saved
    set (4 tensors, 35/30/20/15 %) is ``activation_bytes`` scaled by the length."""
    from ms_memopt.simulation.spec import spec_from_recipe
    figs = {}
    for layers in (2, 4):
        recipe = bench.model_recipe(layers, 64)
        prologue, steps = bench.synthetic_run(recipe, [16, 32, 32, 32])
        figs[layers] = bench.pick(bench.step_figures(prologue, steps), "repeat", 32)
    spec = spec_from_recipe(bench.model_recipe(2, 64))
    sizes = bench.layer_sizes(figs[2].saved_sizes, figs[4].saved_sizes, 2, 4)
    assert abs(sum(sizes) - spec.activation_bytes) <= 4 * 512          # the 512-byte granule per tensor
    # the plain difference also counts the weight gradient live at the peak (param_bytes / layers)
    spec4 = spec_from_recipe(bench.model_recipe(4, 64))
    per = bench.per_layer(figs[2].saved_bytes, figs[4].saved_bytes, 2, 4)
    wgrad = (spec4.param_bytes / 4 - spec.param_bytes / 2) / 2
    assert abs(per - spec.activation_bytes - wgrad) <= 8 * 512
    assert bench.shares(sizes) == list(spec.activation_split)
    assert figs[2].kept_bytes == 0
    prologue, steps = bench.synthetic_run(bench.model_recipe(2, 64), [16, 24, 24])
    new = bench.step_figures(prologue, steps)[1]
    assert new.kind == "new_shape" and new.kept_allocs == spec.cache_tensors
    assert new.kept_bytes == pytest.approx(spec.cache_bytes_per_shape * 24 / spec.seq_length, abs=4 * 512)


def test_classify_and_calibration_runs(bench):
    assert bench.classify([8, 8, 16, 8, 16, 24]) == ["first", "repeat", "new_shape", "repeat", "repeat", "new_shape"]
    assert bench.calibration_runs() == [[16, 24, 24, 32, 32, 32], [24, 32, 32, 16, 16, 16], [32, 16, 24, 24, 24, 32]]


def test_stepworkload_scales_saved_bytes_as_the_formula_does(bench):
    """Without flash attention a layer keeps ``a s + b s^2`` bytes (the attention probabilities;
    recorded: bench/workload_vs_template.py); StepWorkload follows the formula at every length,
    not only at ``seq_length``."""
    from ms_memopt.analysis import estimate as est
    from ms_memopt.config.recipe import load_recipe
    from ms_memopt.workload.step import StepWorkload
    from ms_memopt.simulation.spec import spec_from_recipe
    recipe = bench.model_recipe(2, 64)
    spec = spec_from_recipe(recipe)
    assert 0 < spec.activation_quadratic_share < 1
    for n in (8, 16, 24, 32):
        saved = sum(StepWorkload(spec)._saved_sizes(n)[0])
        want = est.layer_activation_bytes(recipe.model, seq=n, micro_batch=recipe.train.batch_size)
        assert abs(saved - want) <= 4 * 512, n                 # the 512-byte granule per tensor
    big = spec_from_recipe(load_recipe(_BENCH.parents[1] / "recipes" / "dense_100b_1024x910c.yaml"))
    assert big.activation_quadratic_share == 0.0               # flash attention: linear, as before
