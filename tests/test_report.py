"""Reports: layouts.jsonl round trip, figures and summary from runs, simulations and plans,
rank merging through ``ms-memopt report``, bad input. Framework-free (no MindSpore)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from ms_memopt.cli import main
from ms_memopt.core.errors import InputError
from ms_memopt.core.layout import Block, Layout, Segment
from ms_memopt.io.layouts import LayoutSnapshot, layout_from_dict, layout_to_dict, read_layouts, write_layouts
from ms_memopt.report.build import build_report
from ms_memopt.report.memory_map import plot_memory_map
from ms_memopt.report.plots import plot_region_budget, purpose_color

MiB = 2**20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _layout(sizes_live: list[tuple[int, bool]], base: int = 1 << 32, tag: str = "activation") -> Layout:
    blocks, addr = [], base
    for size, live in sizes_live:
        blocks.append(Block(addr, size, live, tag=tag if live else None))
        addr += size
    return Layout([Segment(base, addr - base, blocks, pool="common")], capacity=64 * MiB)


@st.composite
def layouts(draw):
    segments, addr = [], 0
    for _ in range(draw(st.integers(1, 4))):
        addr += draw(st.integers(0, 8)) * 512
        blocks, start = [], addr
        for _ in range(draw(st.integers(1, 6))):
            size = draw(st.integers(1, 64)) * 512
            blocks.append(Block(addr, size, draw(st.booleans()), tag=draw(st.sampled_from([None, "parameter", "x"]))))
            addr += size
        segments.append(Segment(start, addr - start, blocks, stream=draw(st.integers(0, 2)),
                                pool=draw(st.sampled_from(["common", "persistent", "activations"]))))
    return Layout(segments, capacity=draw(st.one_of(st.none(), st.just(addr + 4096))))


@settings(max_examples=60, deadline=None)
@given(layouts(), st.integers(0, 10**6))
def test_layout_records_round_trip(layout, step):
    snap = layout_from_dict(json.loads(json.dumps(layout_to_dict(layout, step=step, label="x"))))
    assert snap.step == step and snap.label == "x"
    assert snap.layout == layout


def test_read_layouts_ignores_a_torn_last_line_and_names_bad_lines(tmp_path):
    path = write_layouts(tmp_path / "layouts.jsonl", [LayoutSnapshot(3, "a", _layout([(MiB, True), (MiB, False)]))])
    with open(path, "a") as f:
        f.write('{"step": 4, "segm')                          # a writer killed mid-line
    assert [s.step for s in read_layouts(tmp_path)] == [3]
    path.write_text('{"step": 1}\n')
    with pytest.raises(InputError, match=r"layouts.jsonl:1: not a layout record"):
        read_layouts(tmp_path)


def _scan(rank: int, step: int, free: int, largest: int, *, fits: bool = True) -> dict:
    return {"kind": "scan", "step": step, "rank": rank, "time": 0.0, "source": "model", "reserved": 8 * MiB,
            "allocated": 8 * MiB - free, "free_total": free, "largest_free": largest,
            "frag_ratio": free / largest - 1, "device_free": 0, "hole_histogram": None,
            "watch": {"bucket": {"size": 2 * MiB, "fits": fits, "in_hole": fits}}, "warnings": [], "extra": {}}


def _two_rank_run(root: Path) -> None:
    for rank, shrink in ((0, 1), (1, 2)):
        lines = [_scan(rank, s, 4 * MiB, 4 * MiB // (shrink if s > 1 else 1), fits=not (rank == 1 and s == 20))
                 for s in (1, 10, 20)]
        lines.insert(2, {"kind": "compaction", "step": 10, "rank": rank, "bytes_moved": MiB, "seconds": 0.01,
                         "largest_free_after": 4 * MiB, "frag_ratio_after": 0.0})
        (root / f"rank_{rank}").mkdir(parents=True)
        (root / f"rank_{rank}" / "scan.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    (root / "train.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "step_seconds": 0.2})
                                              + "\n" for s in range(1, 21)))
    write_layouts(root / "layouts.jsonl",
                  [LayoutSnapshot(1, "step 1", _layout([(MiB, True), (2 * MiB, False), (MiB, True)])),
                   LayoutSnapshot(20, "step 20", _layout([(MiB, True), (MiB, False), (MiB, True), (MiB, False)]))])
    (root / "plan.json").write_text(json.dumps({"regions": {"parameters": 10 * MiB, "activations": 30 * MiB},
                                                "total": 40 * MiB, "capacity": 64 * MiB, "fits": True,
                                                "checkpoint_every": 1}))


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_report_of_a_two_rank_run_has_every_figure_and_the_merged_table(tmp_path):
    _two_rank_run(tmp_path)
    report = build_report(tmp_path, title="t")
    text = report.read_text()
    for figure in ("loss.png", "scan_fragmentation.png", "memory_map.png", "region_budget.png"):
        assert f"]({figure})" in text
        assert _is_png(tmp_path / figure), figure
    assert "Ranks [0, 1]; 3 scanned steps" in text
    # step 10: rank 1's largest block is half of rank 0's -> frag 1.0 vs 0.0, worst rank 1
    assert "| 10 | 2 | 1.00 | 0.50 | 1 | 2.00 MiB | 4.00 MiB | 0 |" in text
    assert "| 20 | 2 | 1.00 | 0.50 | 1 | 2.00 MiB | 4.00 MiB | 1 |" in text
    assert "Compactions: 2" in text
    assert "loss 4.9000 (step 1) -> 3.0000 (step 20)" in text


def test_report_of_a_simulation_summarises_ooms_per_policy(tmp_path):
    rows = [{"policy": p, "seed": 0, "step": s, "kind": "scan", "free_total": 8 * 2**30,
             "largest_free": 2**30 * (4 if p == "pool" else 1), "frag_ratio": 1.0 if p == "pool" else 7.0}
            for p in ("baseline", "pool") for s in (100, 200)]
    rows.append({"policy": "baseline", "seed": 0, "step": 237, "kind": "oom", "free_total": 8 * 2**30,
                 "largest_free": 2**30, "frag_ratio": 7.0, "tag": "allreduce", "size": 4_200_000_000,
                 "oom_kind": "fragmentation"})
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = build_report(tmp_path).read_text()
    assert "| baseline | 1 | seed 0: step 237 (fragmentation, allreduce 3.91 GiB) | 7.00 | 1.00 GiB | 0 |" in text
    assert "| pool | 1 | none | 1.00 | 4.00 GiB | 0 |" in text
    assert _is_png(tmp_path / "fragmentation.png")


def test_memory_map_shows_holes_between_live_blocks(tmp_path):
    import matplotlib.image as mpimg

    snap = LayoutSnapshot(1, "one hole", _layout([(4 * MiB, True), (4 * MiB, False), (4 * MiB, True)]))
    path = plot_memory_map([snap], tmp_path / "m.png")
    pixels = mpimg.imread(path)[..., :3]
    row = pixels[pixels.shape[0] // 2 - 20]          # a line through the bar (bars are centred)
    greens = ((row[:, 1] > 0.5) & (row[:, 0] < 0.3)).sum()
    greys = ((abs(row[:, 0] - 0.95) < 0.02) & (abs(row[:, 1] - 0.95) < 0.02)).sum()
    assert greens > 100 and greys > 100              # activations (green) and the hole (light grey)
    with pytest.raises(InputError, match="no layouts"):
        plot_memory_map([], tmp_path / "none.png")


def test_region_budget_needs_regions(tmp_path):
    with pytest.raises(InputError, match="regions"):
        plot_region_budget({"total": 1}, tmp_path / "b.png")


def test_report_command_merges_ranks_and_writes_the_report(tmp_path, capsys):
    _two_rank_run(tmp_path)
    assert main(["report", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ranks"] == [0, 1] and out["records_per_rank"] == {"0": 3, "1": 3}
    assert [s["worst_rank"] for s in out["steps"]] == [0, 1, 1]
    assert {"memory_map.png", "region_budget.png"} <= set(out["figures"])
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    assert "ranks [0, 1], 3 scanned steps" in capsys.readouterr().out


def test_report_command_draws_a_plan_from_a_recipe(tmp_path, capsys):
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "demo_cpu.yaml"
    (tmp_path / "train.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "step_seconds": 0.1}) + "\n")
    assert main(["report", str(tmp_path), "--plan", str(recipe)]) == 0
    assert _is_png(tmp_path / "region_budget.png")
    assert "## Memory plan (per card)" in (tmp_path / "report.md").read_text()


def test_report_rejects_a_plan_without_plots(tmp_path, capsys):
    """``--plan`` only feeds a figure: with ``--no-plots`` it is refused, not silently dropped."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "demo_cpu.yaml"
    (tmp_path / "train.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "step_seconds": 0.1}) + "\n")
    assert main(["report", str(tmp_path), "--no-plots", "--plan", str(recipe)]) == 2
    assert "--plan" in capsys.readouterr().err and not (tmp_path / "region_budget.png").exists()


def test_scan_record_of_the_wrong_type_names_file_and_line(tmp_path, capsys):
    (tmp_path / "rank_0").mkdir()
    log = tmp_path / "rank_0" / "scan.jsonl"
    log.write_text(json.dumps({"kind": "scan", "step": 1, "frag_ratio": 0.5}) + "\n"
                   + json.dumps({"kind": "scan", "step": 2, "frag_ratio": "high"}) + "\n")
    assert main(["report", str(tmp_path), "--no-plots"]) == 2
    assert f"{log}:2:" in capsys.readouterr().err


def test_a_byte_count_beyond_int64_in_a_scan_record_is_bad_input(tmp_path, capsys):
    """A reserved of 10**400 bytes (a fuzz case) raised OverflowError inside math.isfinite."""
    (tmp_path / "rank_0").mkdir()
    log = tmp_path / "rank_0" / "scan.jsonl"
    log.write_text(json.dumps({"kind": "scan", "step": 1, "reserved": 4096}) + "\n"
                   + '{"kind": "scan", "step": 2, "reserved": 1' + "0" * 400 + '}\n')
    assert main(["report", str(tmp_path), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"{log}:2:" in err and "'reserved'" in err and "2**63 - 1" in err


def test_report_bad_input_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "nothing to report" in capsys.readouterr().err
    (tmp_path / "rank_0").mkdir()
    (tmp_path / "rank_0" / "scan.jsonl").write_text('{"kind": "scan", "step": 1}\nnot json\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "scan.jsonl:2" in capsys.readouterr().err


def test_demo_memory_map_layouts_come_from_the_simulated_workload():
    from ms_memopt.simulation.snapshots import simulated_layouts
    from ms_memopt.simulation.spec import job_from_recipe
    from ms_memopt.core.metrics import measure
    from ms_memopt.config.recipe import load_recipe

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    snaps = simulated_layouts(job_from_recipe(load_recipe(recipes / "demo_cpu.yaml")), [1, 5], policies=("baseline",))
    snaps += simulated_layouts(job_from_recipe(load_recipe(recipes / "dense_100b_1024x910c.yaml")), [1],
                               policies=("pool",))
    assert [s.label for s in snaps] == ["baseline step 1", "baseline step 5", "pool step 1"]
    for snap in snaps:
        snap.layout.check()
        m = measure(snap.layout)
        assert m.allocated > 0 and m.free_total > 0
        tags = {b.tag for b in snap.layout.live_blocks()}
        assert None not in tags                               # every live block knows its purpose
        assert "parameter" in {purpose_color(t)[0] for t in tags}
    assert {s.pool for s in snaps[-1].layout.segments} >= {"parameters", "activations"}   # one segment per region


def test_a_run_whose_scans_never_change_says_plainly_that_nothing_fragmented(tmp_path):
    (tmp_path / "rank_0").mkdir()
    flat = [_scan(0, s, 2 * MiB, MiB) for s in (1, 5, 10)]
    (tmp_path / "rank_0" / "scan.jsonl").write_text("".join(json.dumps(l) + "\n" for l in flat))
    text = build_report(tmp_path).read_text()
    assert "Nothing fragmented in this run:** all 3 scans saw the same pool (2.00 MiB free, largest hole 1.00 MiB)" in text
    _two_rank_run(tmp_path / "moving")
    assert "Nothing fragmented" not in build_report(tmp_path / "moving").read_text()


def test_the_report_reads_the_pool_log_summary_the_run_wrote_and_never_replays(tmp_path, monkeypatch):
    import gzip

    from ms_memopt.replay import pool_log_check, replay

    (tmp_path / "rank_0").mkdir()
    (tmp_path / "rank_0" / "scan.jsonl").write_text("".join(json.dumps(_scan(0, s, 2 * MiB, MiB)) + "\n"
                                                            for s in (1, 5)))
    data = Path(__file__).parent / "data" / "pool_log" / "mlp_jit.log.gz"
    (tmp_path / "pool.log").write_bytes(gzip.decompress(data.read_bytes()))
    # no summary yet: the report says how to get one
    text = build_report(tmp_path).read_text()
    assert "has no replay summary (`pool_log_replay.json`" in text and "`ms-memopt replay pool.log`" in text
    summary = pool_log_check.write_summary(tmp_path)      # what the run does when it finishes
    assert summary["address_match"] == 1.0 and summary["final_layout_match"] is True
    monkeypatch.setattr(replay, "replay", None)            # the report must not replay
    text = build_report(tmp_path).read_text()
    assert (f"The run's pool log (`pool.log`: {summary['events']:,} pool events, {summary['allocs']:,} allocations) "
            f"replays through the `mindspore-bestfit` model at 100.00% address match, final layout identical") in text
