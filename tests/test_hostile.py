"""Hostile and huge input, every subcommand in a child process: exit 0, 1 or 2 with a message, never a
traceback, a signal, a hang, or memory that grows with the file.

Complements tests/test_reliability.py (which fuzzes the readers and commands in-process against
damaged seeds) and tests/test_input_bounds.py (the bounds' messages): here each case is a bomb of
its kind, generated small on disk (a gzip of 200 MB of filler is 200 KB; a pickle nesting a tuple a
million deep is 1 MB), and run as the user runs it: ``python -m ms_memopt ...`` in a child with an
address-space limit (``RLIMIT_AS``), a wall-clock bound, and its own peak RSS (``os.wait4`` in a launcher) checked
against :data:`_RSS_BOUND_MIB`. The properties at the end (hypothesis) hold the bounded structures
(sorted keys, the trace checker, the nesting scans) to plain references.
"""
from __future__ import annotations

import gzip
import json
import os
import pickle
import sqlite3
import subprocess
import tempfile
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ms_memopt.core.consistency import TraceChecker
from ms_memopt.core.errors import InputError
from ms_memopt.core.events import Event
from ms_memopt.core.jsontext import MAX_DEPTH as JSON_DEPTH, parse_json
from ms_memopt.core.sortedkeys import SortedKeys
from ms_memopt.io.traces.torch_snapshot import MAX_NESTING, pickle_nesting
from ms_memopt.io.yamltext import parse_yaml

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
RECIPE = ROOT / "recipes" / "demo_cpu.yaml"
POOL_LOG = DATA / "pool_log" / "mlp_jit.log.gz"
#: wall-clock bound of one child (each needs a few seconds on a loaded 2-core machine)
_SECONDS = 60.0
#: address space of a child: python, numpy and the command's state, not the file
_ADDRESS_SPACE = 3 << 30
#: peak RSS of a child (an idle `python -m ms_memopt replay` is about 60 MiB here)
_RSS_BOUND_MIB = 500


#: the child's launcher: a fresh small process that forks the command and reports the command's own rusage.
#: A child forked straight from pytest starts with pytest's resident pages counted in its peak RSS (Linux
#: sets a fork's high-water mark to the parent's RSS at the fork, and exec keeps it): late in the whole
#: suite, with MindSpore loaded, every command then "peaked" at pytest's size.
_LAUNCHER = """
import json, os, resource, sys
report, limit = sys.argv[1], int(sys.argv[2])
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execv(sys.executable, [sys.executable, "-m", "ms_memopt", *sys.argv[3:]])
_, status, usage = os.wait4(pid, 0)
with open(report, "w") as out:
    json.dump({"code": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss}, out)
"""


def _run(args: list[str], *, cwd: Path | None = None, env: dict | None = None,
         stdin: bytes | None = None) -> tuple[int, str, str, float]:
    """``python -m ms_memopt ARGS`` in a child with RLIMIT_AS and a wall-clock bound; (exit code,
    stdout, stderr, peak RSS in MiB). Fails on a signal, a traceback, a hang or memory over the bound."""
    with tempfile.TemporaryDirectory() as tmp:
        out_path, err_path, report = Path(tmp, "out"), Path(tmp, "err"), Path(tmp, "rusage.json")
        full_env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MS_MEMOPT_PIPE_WAIT="1",
                        TQDM_DISABLE="1", PYTHONPATH=str(ROOT))
        full_env.update(env or {})
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            child = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(report), str(_ADDRESS_SPACE), *args],
                                     cwd=cwd or ROOT, env=full_env, start_new_session=True,
                                     stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                     stdout=out, stderr=err)
            if stdin is not None:
                try:
                    child.stdin.write(stdin)
                except BrokenPipeError:
                    pass
                child.stdin.close()
            try:
                child.wait(timeout=_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, 9)         # the launcher and the command
                child.wait()
                pytest.fail(f"ms-memopt {' '.join(args)}: still running after {_SECONDS:g} s")
        stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
        assert report.exists(), f"ms-memopt {' '.join(args)}: the launcher failed\n{stderr[-2000:]}"
        rusage = json.loads(report.read_text())
    code, rss = rusage["code"], rusage["maxrss_kib"] / 1024
    assert code >= 0, f"ms-memopt {' '.join(args)}: killed by signal {-code}\n{stderr[-2000:]}"
    assert "Traceback" not in stderr, f"ms-memopt {' '.join(args)}: a traceback\n{stderr[-3000:]}"
    assert code in (0, 1, 2), (code, stderr[-2000:])
    if code == 2:
        assert "error:" in stderr, stderr[-2000:]
    assert rss < _RSS_BOUND_MIB, f"ms-memopt {' '.join(args)}: peak RSS {rss:.0f} MiB"
    return code, stdout, stderr, rss


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


# --- bombs, one per reader ----------------------------------------------------------------------

def test_deep_tuple_pickle_is_refused_not_a_segfault(tmp_path):
    """A tuple nested a million deep (one TUPLE1 opcode a level) as a dict key: hashing it recursed
    in C and killed replay with SIGSEGV."""
    path = tmp_path / "deep.pickle"
    path.write_bytes(b"\x80\x04}(" + b"K\x01" + b"\x85" * 1_000_000 + b"K\x01s.")
    code, _, err, _ = _run(["replay", str(path)])
    assert code == 2 and "nests containers more than" in err


def test_frame_list_shared_through_the_memo_is_read_once(tmp_path):
    """20k allocations sharing one 20k-frame list: the reader walked the list per allocation."""
    frames = [{"filename": f"/m/f{i}.py", "name": "f", "line": i} for i in range(20_000)]
    trace = [{"action": "alloc", "addr": i * 512, "size": 512, "stream": 0, "frames": frames} for i in range(20_000)]
    path = tmp_path / "shared.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4))
    code, out, _, _ = _run(["replay", str(path), "--allocator", "torch", "--json"])
    assert code == 0 and json.loads(out)["allocs"] == 20_000


@pytest.mark.parametrize("fmt", ["jsonl", "mindspore-pool-log", "instances", "msmemscope"])
def test_a_line_without_end_is_refused_not_read_whole(fmt):
    """/dev/zero: one endless line; it reached 12 GB before a MemoryError."""
    code, _, err, _ = _run(["replay", "--format", fmt, "/dev/zero"])
    assert code == 2 and ("longer than" in err or "binary" in err), err


def test_gzip_of_filler_is_read_as_a_stream(tmp_path):
    """A real pool log inside 200 MB of filler lines, gzipped to a few hundred KB: 5.9 GB resident before."""
    real = gzip.open(POOL_LOG, "rb").read()
    path = tmp_path / "filler.log.gz"
    filler = b"INFO some other output of the job, not a pool line\n" * 40_000     # 2 MB
    with gzip.open(path, "wb", compresslevel=9) as out:
        out.write(real)
        for _ in range(100):
            out.write(filler)
    assert path.stat().st_size < 2_000_000
    code, out, _, rss = _run(["replay", str(path), "--json"])
    assert code == 0 and json.loads(out)["events"] == 640, out


def test_a_pipe_loses_nothing_to_format_detection():
    """`replay /dev/stdin` gave 490 of 640 events: detection had read the first 64 KiB."""
    code, out, _, _ = _run(["replay", "/dev/stdin", "--json"], stdin=gzip.open(POOL_LOG, "rb").read())
    assert code == 0 and json.loads(out)["events"] == 640


@pytest.mark.parametrize("command", [["replay"], ["pack"]])
def test_a_fifo_with_no_writer_is_refused_in_time(tmp_path, command):
    code, _, err, _ = _run([*command, str(_fifo(tmp_path))])
    assert code == 2 and "FIFO" in err


def test_an_inconsistent_trace_is_reported_and_strict_refuses_it(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = ['{"format": "ms-memopt-events", "version": 1}', '{"action":"alloc","id":1,"size":512,"addr":0}',
             '{"action":"alloc","id":2,"size":512,"addr":256}', '{"action":"free","id":1}',
             '{"action":"free","id":1}', '{"action":"free","id":7}']
    path.write_text("\n".join(lines) + "\n")
    code, out, err, _ = _run(["replay", str(path), "--json"])
    found = json.loads(out)["inconsistencies"]
    assert code == 0 and found == {"unknown_free": {"count": 1, "first_line": 6},
                                   "double_free": {"count": 1, "first_line": 5},
                                   "overlapping_addresses": {"count": 1, "first_line": 3}}
    code, _, err, _ = _run(["replay", str(path), "--strict"])
    assert code == 2 and "--strict" in err


# --- recipes, configs, templates ----------------------------------------------------------------

def _alias_bomb(levels: int = 9) -> str:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("tail, words", [
    ("model:\n  model_config:\n    num_layers: *a8\n", "alias bomb"),
    ("recompute_config:\n  recompute: [[[1]]]\n", "recompute_config.recompute[0][0]"),
])
def test_recipe_bombs_exit_2_naming_the_key(tmp_path, tail, words):
    path = tmp_path / "r.yaml"
    text = RECIPE.read_text()
    path.write_text((_alias_bomb() if "*a8" in tail else "") + text + tail)
    code, _, err, _ = _run(["plan", str(path)])
    assert code == 2 and words in err, err


def test_deep_config_json_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"a":' * 5000 + "1" + "}" * 5000)
    (tmp_path / "r.yaml").write_text("pretrained_model_dir: m\nmodel:\n  model_config:\n    type: LlamaConfig\n")
    code, _, err, _ = _run(["plan", str(tmp_path / "r.yaml")])
    assert code == 2 and "config.json" in err and "nested too deeply" in err


# --- limits ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, words", [
    (["--steps", str(10**12)], "--max-work"),
    (["--seeds", str(10**6)], "--max-work"),
    (["--seed", "-1"], "--seed"),
    (["--executor", "dask", "--address", "127.0.0.1"], "--address"),
    (["--steps", "2", "--allocator-option", "pregrow=true"], None),
])
def test_simulate_refuses_impossible_work_and_options(extra, words):
    if "dask" in extra:
        pytest.importorskip("distributed")
    code, _, err, _ = _run(["simulate", str(RECIPE), *extra])
    if words is None:       # a recipe's own capacity: a valid combination
        assert code in (0, 1), err
    else:
        assert code == 2 and words in err, err


def test_sweep_grid_is_bounded(tmp_path):
    values = ",".join(str(i) for i in range(1, 1001))
    code, _, err, _ = _run(["sweep", str(RECIPE), "--set", f"memopt.workload.seed={values}",
                            "--set", f"memopt.workload.steps={values}", "--out", str(tmp_path)])
    assert code == 2 and "10,000 points" in err


def test_pack_time_limit_covers_the_whole_run(tmp_path):
    path = tmp_path / "overlap.csv"
    path.write_text("id,lower,upper,size\n" + "".join(f"{i},{i},{i + 30000},512\n" for i in range(30000)))
    started = time.monotonic()
    code, out, err, _ = _run(["pack", str(path), "--time-limit", "2", "--json"])
    assert code in (0, 2), err          # 2: the limit ran out while reading (a very loaded machine)
    if code == 0:
        assert json.loads(out)["valid"]
    assert time.monotonic() - started < _SECONDS
    code, _, err, _ = _run(["pack", str(path), "--gap", "inf"])
    assert code == 2 and "--gap" in err


# --- output paths and names -----------------------------------------------------------------------

@pytest.mark.parametrize("target", ["DIR", "/dev/full", "/proc/nope/x", "/proc/version"])
def test_every_bad_output_path_exits_2(tmp_path, target):
    target = str(tmp_path) if target == "DIR" else target
    code, _, err, _ = _run(["replay", str(DATA / "events.jsonl"), "--export-memory-viz", target])
    assert code == 2 and "error:" in err


def test_simulate_out_bad_paths_and_names_exit_2(tmp_path):
    code, _, err, _ = _run(["simulate", str(RECIPE), "--steps", "2", "--out", "/dev/full"])
    assert code == 2 and "/dev/full" in err
    name = os.fsdecode(bytes(tmp_path) + b"/x\xff")
    code, _, err, _ = _run(["simulate", str(RECIPE), "--steps", "2", "--out", name])
    assert code == 2 and "UTF-8" in err


def test_record_drains_the_job_whatever_happens_to_its_files(tmp_path):
    """--out a directory: the job writes 300 KB of stderr and must still end (it hung at 64 KB)."""
    job = tmp_path / "job.py"
    job.write_text("import gzip, sys\n"
                   f"sys.stderr.write(gzip.open({str(POOL_LOG)!r}, 'rt').read())\n"
                   "sys.stderr.write(('n' * 99 + '\\n') * 3000)\n")
    code, _, err, _ = _run(["record", "--no-progress", "--out", str(tmp_path), "--", sys.executable, str(job)])
    assert code == 2 and "cannot write it" in err


# --- bounded structures against plain references (hypothesis) -------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "before", "after"]), st.integers(0, 300)),
                max_size=3000))
def test_sorted_keys_match_a_sorted_list(ops):
    import bisect

    keys, ref = SortedKeys(), []
    SortedKeys._BLOCK = 4       # small blocks: splits and empty blocks happen in small examples
    try:
        for op, key in ops:
            if op == "add":
                keys.add(key)
                if key not in ref:
                    bisect.insort(ref, key)
            elif op == "remove":
                keys.remove(key)
                if key in ref:
                    ref.remove(key)
            elif op == "before":
                i = bisect.bisect_left(ref, key)
                assert keys.before(key) == (ref[i - 1] if i else None)
            else:
                i = bisect.bisect_left(ref, key)
                assert keys.at_or_after(key) == (ref[i] if i < len(ref) else None)
        assert len(keys) == len(ref)
    finally:
        SortedKeys._BLOCK = 512


_EVENTS = st.lists(st.one_of(
    st.builds(lambda i, a, s: Event("alloc", id=i, size=s, addr=a), st.integers(0, 20), st.integers(0, 40) | st.none(),
              st.integers(0, 12)),
    st.builds(lambda i: Event("free", id=i), st.integers(0, 20)),
    st.builds(lambda a: Event("segment_alloc", addr=a, size=8), st.integers(0, 5)),
    st.builds(lambda a: Event("segment_free", addr=a, size=8), st.integers(0, 5))), max_size=200)


@settings(max_examples=150, deadline=None)
@given(_EVENTS)
def test_trace_checker_matches_a_plain_reference(events):
    """The checker's counts equal those of a quadratic reference walking every live allocation."""
    checker = TraceChecker()
    live: dict[int, tuple[int, int] | None] = {}
    freed: set[int] = set()
    segments: set[int] = set()
    expected: dict[str, int] = {}

    def note(kind):
        expected[kind] = expected.get(kind, 0) + 1

    for line, event in enumerate(events):
        checker.feed(event, line)
        if event.action == "alloc":
            if event.id in live:
                note("duplicate_live_id")
                live.pop(event.id)
            span = None
            if event.addr is not None and event.size > 0:
                a, b = event.addr, event.addr + event.size
                if any(s is not None and s[0] < b and a < s[1] for s in live.values()):
                    note("overlapping_addresses")
                elif all(s is None or s[0] != a for s in live.values()):
                    span = (a, b)
            live[event.id] = span
            freed.discard(event.id)
        elif event.action == "free":
            if event.id in live:
                live.pop(event.id)
                freed.add(event.id)
            else:
                note("double_free" if event.id in freed else "unknown_free")
        elif event.action == "segment_alloc":
            segments.add(event.addr)
        elif event.action == "segment_free":
            if event.addr in segments:
                segments.discard(event.addr)
            else:
                note("unknown_segment_free")
    assert checker.found.counts == expected


def _nested(depth: int, kinds: list[str]) -> object:
    value: object = 1
    for level in range(depth):
        kind = kinds[level % len(kinds)]
        value = [value] if kind == "list" else (value,) if kind == "tuple" else {"k": value}
    return value


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3 * MAX_NESTING), st.lists(st.sampled_from(["list", "tuple", "dict"]), min_size=1, max_size=3),
       st.integers(0, 5))
def test_pickle_nesting_is_the_real_depth(depth, kinds, protocol):
    data = pickle.dumps(_nested(depth, kinds), protocol=protocol)
    assert pickle_nesting(data, limit=10**6) == depth


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 3 * JSON_DEPTH), st.sampled_from(["[", '{"a":']))
def test_deep_json_is_an_input_error_or_parsed(depth, opener):
    closer = "]" if opener == "[" else "}"
    text = opener * depth + "1" + closer * depth
    if depth > JSON_DEPTH:
        with pytest.raises(InputError, match="nested too deeply"):
            parse_json(text, source="t.json", line=1)
    else:
        parse_json(text, source="t.json", line=1)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 12), st.integers(2, 12))
def test_yaml_aliases_within_budget_or_refused_fast(levels, width):
    lines = ["a0: &a0 [" + ", ".join(["1"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    text = "\n".join(lines) + "\n"
    started = time.monotonic()
    try:
        data = parse_yaml(text, source="r.yaml")
    except InputError as exc:
        assert "alias" in str(exc)
    else:
        assert width ** levels <= 10**6 and len(data) == levels
    assert time.monotonic() - started < 10


# --- every output option of every subcommand: a bad path exits 2 naming it (in-process: fast) -------

def _cli(argv: list[str]) -> tuple[int, str]:
    import contextlib
    import io

    from ms_memopt.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:       # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


_FILE_OUTPUTS = [
    ["replay", str(DATA / "events.jsonl"), "--export-memory-viz"],
    ["replay", str(DATA / "events.jsonl"), "--export-instances"],
    ["pack", str(DATA / "instances_small.csv"), "--no-progress", "--out"],
    ["simulate", str(RECIPE), "--steps", "2", "--json", "--export-memory-viz"],
    ["simulate", str(RECIPE), "--steps", "2", "--json", "--export-events"],
]
_DIR_OUTPUTS = [
    ["simulate", str(RECIPE), "--steps", "2", "--json", "--out"],
    ["sweep", str(RECIPE), "--set", "memopt.workload.seed=1", "--steps", "2", "--json", "--out"],
    ["doctor", str(DATA / "events.jsonl"), "--out"],
]


@pytest.mark.parametrize("argv", _FILE_OUTPUTS, ids=lambda a: f"{a[0]} {a[-1]}")
@pytest.mark.parametrize("target", ["a directory", "/dev/full", "/proc/nope/x"])
def test_a_bad_output_file_exits_2_naming_it(tmp_path, argv, target):
    if argv[-1] == "--export-memory-viz" and argv[0] == "simulate" and target != "/proc/nope/x":
        pytest.skip("simulate writes PATH.POLICY.pickle beside PATH: only a missing folder is a bad path")
    path = str(tmp_path) if target == "a directory" else target
    code, err = _cli([*argv, path])
    assert code == 2 and f"ms-memopt {argv[0]}: error:" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", _DIR_OUTPUTS, ids=lambda a: f"{a[0]} {a[-1]}")
@pytest.mark.parametrize("target", ["/dev/full", "/proc/nope"])
def test_a_bad_output_folder_exits_2_naming_it(argv, target):
    code, err = _cli([*argv, target])
    assert code == 2 and f"ms-memopt {argv[0]}: error: {target}" in err, err


def test_a_trace_too_long_to_hold_whole_is_refused_pointing_at_replay(monkeypatch):
    """Commands that hold a trace whole (doctor, learn, pack on a trace) stop at MAX_EVENTS_IN_MEMORY."""
    import ms_memopt.core.events as events
    import ms_memopt.io.traces.ms_pool_log as pool_log
    from ms_memopt.io.traces import load_trace

    monkeypatch.setattr(events, "MAX_EVENTS_IN_MEMORY", 100)
    monkeypatch.setattr(pool_log, "MAX_EVENTS_IN_MEMORY", 100)
    for path in (POOL_LOG, DATA / "events.jsonl"):
        if path.suffix == ".jsonl":
            monkeypatch.setattr(events, "MAX_EVENTS_IN_MEMORY", 3)
        with pytest.raises(InputError, match="as a stream"):
            load_trace(path)
        trace = load_trace(path, stream=True)           # what replay does: no limit
        assert sum(1 for _ in trace.events) > 3


# --- the Ascend profiler's folder and the other readers (issue 44) --------------------------------------------

T0_US = "1736408883694624.810\t"        # torch_npu's time text: ns with the point moved, then a TAB
_OPERATOR_HEADER = ("Name,Size(KB),Allocation Time(us),Release Time(us),Active Release Time(us),Duration(us),"
                    "Active Duration(us),Allocation Total Allocated(MB),Allocation Total Reserved(MB),"
                    "Allocation Total Active(MB),Release Total Allocated(MB),Release Total Reserved(MB),"
                    "Release Total Active(MB),Stream Ptr,Device Type")
_GOOD_ROW = f"a,1.0,{T0_US},,,,,1.0,2.0,1.0,,,,7,NPU:0"


def _profiler(tmp_path: Path, rows: list[str] | None = (_GOOD_ROW,), record: list[str] | None = None,
              modules: list[str] | None = None, name: str = "rank0_ascend_pt") -> Path:
    """A rank's folder as torch_npu's profiler writes it (only the files asked for)."""
    out = tmp_path / name / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    if rows is not None:
        (out / "operator_memory.csv").write_text(_OPERATOR_HEADER + "\n" + "\n".join(rows) + "\n")
    if record is not None:
        (out / "memory_record.csv").write_text("Component,Timestamp(us),Total Allocated(MB),Total Reserved(MB),"
                                               "Device\n" + "\n".join(record) + "\n")
    if modules is not None:
        (out / "npu_module_mem.csv").write_text("Component,Timestamp(us),Total Reserved(MB),Device\n"
                                                + "\n".join(modules) + "\n")
    return tmp_path / name


def _listing(folder: Path) -> dict[str, tuple]:
    """Every path under ``folder`` with its size and mtime: what reading must leave as it was."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("time", ["1" * 5000 + ".810\t", "1" * 5000, "1\u00b23", "1\u00b23.810\t", "1" * 40 + ".810\t"])
def test_profiler_time_field_of_many_or_unicode_digits_is_refused(tmp_path, time):
    """ValueError (int() of 5,000 digits, of '1²3') as a traceback; 40 digits: a time beyond int64 ns."""
    folder = _profiler(tmp_path, [_GOOD_ROW, f"a,1.0,{time},,,,,1.0,2.0,1.0,,,,7,NPU:0"])
    code, _, err, _ = _run(["replay", str(folder)])
    assert code == 2 and "operator_memory.csv:3" in err and "Allocation Time(us)" in err, err


@pytest.mark.parametrize("which", ["record", "modules"])
@pytest.mark.parametrize("time", ["1e300", "9" * 400])
def test_profiler_huge_time_in_the_totals_files_is_refused(tmp_path, which, time):
    """OverflowError (a float of 10**303 ns) in doctor and in the export; replay took it."""
    first = f"PTA,{T0_US.strip()},1.0,2.0,NPU:0"
    if which == "record":
        folder = _profiler(tmp_path, None, record=[first, f"PTA,{time},2.0,2.0,NPU:0"])
        name = "memory_record.csv:3"
    else:
        folder = _profiler(tmp_path, None, record=[first], modules=[f"HCCL,{time},2.0,NPU:0"])
        name = "npu_module_mem.csv:2"
    for command in (["replay", str(folder)], ["doctor", str(folder), "--out", str(tmp_path / "d")]):
        code, _, err, _ = _run(command)
        assert code == 2 and name in err and "Timestamp(us)" in err, err


@pytest.mark.parametrize("sidecar", ["profiler_info_0.json", "profiler_metadata.json"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom", "1 GB", "loop"])
def test_profiler_sidecar_json_is_bounded(tmp_path, sidecar, kind):
    """A FIFO hung until killed; /dev/zero was read whole (10 GB); a 1 GB file too."""
    folder = _profiler(tmp_path)
    path = folder / sidecar
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "1 GB":
        with open(path, "wb") as out:
            out.truncate(1 << 30)         # sparse: a gigabyte of NULs that takes no disk
    elif kind == "loop":
        path.symlink_to(path.name)
    else:
        path.symlink_to(kind)
    code, _, err, _ = _run(["replay", str(folder)])
    assert code == 2 and sidecar in err, err


def test_profiler_db_fifo_and_forced_format_fifo_are_refused_in_time(tmp_path):
    out = tmp_path / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    os.mkfifo(out / "ascend_pytorch_profiler_0.db")
    code, _, err, _ = _run(["replay", str(tmp_path / "rank0_ascend_pt")])
    assert code == 2 and "ascend_pytorch_profiler_0.db" in err, err
    fifo = _fifo(tmp_path)
    code, _, err, _ = _run(["replay", "--format", "ascend-profiler", str(fifo)])
    assert code == 2 and "FIFO" in err, err


def _wal_db(path: Path, rows: list[tuple], *, generated: str | None = None) -> Path:
    """A db of torch_npu's OP_MEMORY schema in WAL mode (as the real one is); ``generated``: the
    ``name`` column is generated by that expression, computed as each row is read."""
    db = sqlite3.connect(path)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE STRING_IDS (id INTEGER PRIMARY KEY, value TEXT)")
    db.executemany("INSERT INTO STRING_IDS VALUES (?, ?)", [(1, "PTA"), (2, "aten::mm")])
    name = f"name BLOB GENERATED ALWAYS AS ({generated}) VIRTUAL" if generated else "name INTEGER"
    db.execute(f"CREATE TABLE OP_MEMORY ({name}, size INTEGER, allocationTime INTEGER, releaseTime INTEGER, "
               "allocationTotalAllocated INTEGER, allocationTotalReserved INTEGER, allocationTotalActive INTEGER, "
               "releaseTotalAllocated INTEGER, releaseTotalReserved INTEGER, releaseTotalActive INTEGER, "
               "streamPtr INTEGER)")
    db.executemany(f"INSERT INTO OP_MEMORY ({'' if generated else 'name, '}size, allocationTime, releaseTime, allocationTotalAllocated, "
                   "allocationTotalReserved, allocationTotalActive, releaseTotalAllocated, releaseTotalReserved, "
                   "releaseTotalActive, streamPtr) VALUES (" + ("" if generated else "2,") + "?,?,?,?,?,?,?,?,?,5)", rows)
    db.commit()
    db.close()
    return path


_T0_NS = 1736408883694624810
_DB_ROWS = [(4096, _T0_NS, _T0_NS + 30, 1 << 20, 20 << 20, 1 << 20, (1 << 20) - 4096, 20 << 20, 0),
            (4096, _T0_NS + 40, None, (1 << 20), 20 << 20, 1 << 20, None, None, None)]


def test_profiler_db_is_read_without_writing_beside_it(tmp_path):
    """mode=ro still made -wal and -shm files beside a WAL db (the shared sample grew both)."""
    out = tmp_path / "rank0_ascend_pt" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    _wal_db(out / "ascend_pytorch_profiler_0.db", _DB_ROWS)
    before = _listing(tmp_path)
    code, out_text, err, _ = _run(["replay", str(tmp_path / "rank0_ascend_pt"), "--json"])
    assert code == 0 and json.loads(out_text)["allocs"] >= 1, err
    assert _listing(tmp_path) == before
    shared = ROOT.parent / "shared" / "data" / "traces" / "ascend_profiler" / "cnn_910b_level1_rank0_db"
    if shared.exists():
        before = _listing(shared)
        code, _, err, _ = _run(["replay", str(shared), "--json"])
        assert code == 0, err
        assert _listing(shared) == before


def test_profiler_db_negative_total_and_huge_generated_column_are_refused(tmp_path):
    """A negative total dropped events with no word (the CSV reader exits 2); a generated 300 MB
    column in an 800 KB file reached 6 GB."""
    bad = [(4096, _T0_NS, _T0_NS + 30, -(1 << 20), 20 << 20, 1 << 20, 0, 20 << 20, 0)] + _DB_ROWS[1:]
    path = _wal_db(tmp_path / "ascend_pytorch_profiler_0.db", bad)
    code, _, err, _ = _run(["replay", str(path)])
    assert code == 2 and "OP_MEMORY row 1" in err and "allocationTotalAllocated" in err, err
    (tmp_path / "g").mkdir()
    path = _wal_db(tmp_path / "g" / "ascend_pytorch_profiler_0.db", _DB_ROWS * 10, generated="zeroblob(300000000)")
    code, _, err, _ = _run(["replay", str(path)])
    assert code == 2 and "ascend_pytorch_profiler_0.db" in err, err


def test_profiler_unreadable_operator_memory_is_not_replaced_by_memory_record(tmp_path):
    folder = _profiler(tmp_path, None, record=[f"PTA,{T0_US.strip()},1.0,2.0,NPU:0"])
    link = folder / "ASCEND_PROFILER_OUTPUT" / "operator_memory.csv"
    link.symlink_to(link.name)        # a symlink loop: ELOOP, even for root
    code, _, err, _ = _run(["replay", str(folder)])
    assert code == 2 and "operator_memory.csv" in err, err


def test_profiler_reader_has_the_event_cap_of_the_others(tmp_path, monkeypatch):
    """10**7 rows reached 4-6 GB: the whole-trace read stops at MAX_EVENTS_IN_MEMORY (replay streams)."""
    import ms_memopt.core.events as events
    import ms_memopt.io.traces.ascend_profiler as profiler
    from ms_memopt.io.traces import load_trace

    rows = [f"a,1.0,{_T0_NS // 1000 + i}.{_T0_NS % 1000:03d}\t,{_T0_NS // 1000 + i}.{_T0_NS % 1000 + 1:03d}\t,,,,"
            f"1.0,2.0,1.0,0.0,2.0,0.0,7,NPU:0" for i in range(50)]
    folder = _profiler(tmp_path, rows)
    monkeypatch.setattr(events, "MAX_EVENTS_IN_MEMORY", 20)
    monkeypatch.setattr(profiler, "MAX_EVENTS_IN_MEMORY", 20, raising=False)
    with pytest.raises(InputError, match="as a stream"):
        load_trace(folder)
    trace = load_trace(folder, stream=True)
    assert sum(1 for e in trace.events if e.action == "alloc") >= 50


def _snapshot(tmp_path: Path, trace: list[dict], segments: list[dict] = (), settings: dict | None = None) -> Path:
    data = {"segments": list(segments), "device_traces": [trace]}
    if settings is not None:
        data["allocator_settings"] = settings
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(data, protocol=4))
    return path


@pytest.mark.parametrize("options", [{"garbage_collection_threshold": "0.5"}, {"max_split_size_mb": "lots"},
                                     {"roundup_power2_divisions": "4"}, {"page_size_1g": "yes"}])
def test_snapshot_allocator_settings_values_are_checked(tmp_path, options):
    """TypeError: '<=' not supported between 'str' and 'int' (the names were checked, the values not)."""
    trace = [{"action": "alloc", "addr": 0, "size": 512, "stream": 0}]
    path = _snapshot(tmp_path, trace, settings={"ms_memopt": {"allocator": "torch-npu", "allocator_options": options}})
    code, _, err, _ = _run(["replay", str(path)])
    assert code == 2 and "snap.pickle" in err and next(iter(options)) in err, err


def test_snapshot_overlapping_live_blocks_are_reported_and_strict_refuses(tmp_path):
    """Every allocation at one address: a peak 10 times the real one, in silence."""
    trace = [{"action": "alloc", "addr": 1 << 30, "size": 1 << 20, "stream": 0} for _ in range(8)]
    path = _snapshot(tmp_path, trace)
    code, out, err, _ = _run(["replay", str(path), "--json"])
    assert code == 0 and json.loads(out)["inconsistencies"]["overlapping_addresses"]["count"] == 7, out
    code, _, err, _ = _run(["replay", str(path), "--strict"])
    assert code == 2 and "--strict" in err


@pytest.mark.parametrize("kind", ["double_free", "unknown_segment_free"])
def test_snapshot_double_frees_and_unknown_segment_frees_fail_strict(tmp_path, kind):
    seg = {"action": "segment_alloc", "addr": 1 << 30, "size": 2 << 20, "stream": 0}
    alloc = {"action": "alloc", "addr": 1 << 30, "size": 512, "stream": 0}
    free = {"action": "free_completed", "addr": 1 << 30, "size": 512, "stream": 0}
    if kind == "double_free":
        trace = [seg, alloc, free, free]
    else:
        trace = [seg, alloc, free, dict(seg, action="segment_free"), dict(seg, action="segment_free")]
    path = _snapshot(tmp_path, trace)
    code, out, err, _ = _run(["replay", str(path), "--json"])
    assert code == 0 and kind in json.loads(out).get("inconsistencies", {}), out
    code, _, err, _ = _run(["replay", str(path), "--strict"])
    assert code == 2 and kind in err, err


def test_replay_refuses_to_export_over_its_input_or_into_a_fifo(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes((DATA / "events.jsonl").read_bytes())
    code, _, err, _ = _run(["replay", str(path), "--export-memory-viz", str(path)])
    assert code == 2 and "--export-memory-viz" in err, err
    assert path.read_bytes() == (DATA / "events.jsonl").read_bytes()
    code, _, err, _ = _run(["replay", str(path), "--export-memory-viz", str(_fifo(tmp_path))])
    assert code == 2 and "FIFO" in err, err


def test_doctor_does_not_follow_a_symlink_planted_in_its_out_folder(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    out = tmp_path / "d"
    out.mkdir()
    (out / "report.md").symlink_to(target)
    code, _, err, _ = _run(["doctor", str(DATA / "events.jsonl"), "--out", str(out)])
    assert target.read_text() == "keep me\n"
    assert code == 2 and "report.md" in err, err


def test_doctor_log_beside_a_symlink_loop_named_like_a_pool_dump(tmp_path):
    """OSError: Too many levels of symbolic links, as a traceback."""
    log = tmp_path / "worker_0.log"
    log.write_bytes((DATA / "crash_logs" / "ms2.10_cpu_fragmentation_glog1.log").read_bytes())
    (tmp_path / "MemoryDebugInfo0.txt").symlink_to("MemoryDebugInfo0.txt")
    code, _, err, _ = _run(["doctor", str(log)])
    assert code == 2 and "MemoryDebugInfo0.txt" in err, err


def test_doctor_report_of_a_log_whose_name_is_not_utf8(tmp_path):
    """UnicodeEncodeError writing report.md: the log's name, found in the folder, is not UTF-8."""
    folder = tmp_path / "logs"
    folder.mkdir()
    Path(os.fsdecode(bytes(folder) + b"/worker_\xff.log")).write_bytes(
        (DATA / "crash_logs" / "ms2.10_cpu_fragmentation_glog1.log").read_bytes())
    code, _, err, _ = _run(["doctor", str(folder), "--out", str(tmp_path / "d")])
    assert code in (0, 1), err
    assert b"worker_\xff.log" in (tmp_path / "d" / "report.md").read_bytes()


def test_mindspore_oom_request_of_many_digits_is_not_cut_to_twenty(tmp_path):
    from ms_memopt.io.oom_logs import parse_message

    text = ("Out of Memory!!! Request memory size: " + "9" * 5000 + "B, Memory Statistic:\n"
            "Device MOC memory size: 62000M\n")
    report = parse_message(text)
    assert report is None or report.request is None or report.request.value != int("9" * 20), report


def test_a_log_where_every_line_holds_the_anchor_reads_fast(tmp_path):
    """Every line with 'emory' (the anchor every OOM message holds) went line by line in Python: 2.2 MB/s."""
    from ms_memopt.io.oom_logs import scan_bytes

    plain = b"INFO step 12 loss 0.25 throughput fine, nothing to see here ........\n" * 150_000
    anchored = b"INFO step 12 memory 0.25 throughput fine, nothing to see here ......\n" * 150_000
    assert len(plain) == len(anchored)

    def took(data: bytes) -> float:
        started = time.perf_counter()
        scan_bytes([data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)], source="x.log")
        return time.perf_counter() - started

    base = min(took(plain) for _ in range(2))
    assert min(took(anchored) for _ in range(2)) < 5 * base + 0.05


# --- outputs that would hang or overwrite an input -----------------------------------------------

def _learned_template(tmp_path: Path) -> tuple[Path, Path]:
    """A template learned from test_template's calibration recordings, and a schedule for it."""
    from test_template import calibration_recordings

    template = tmp_path / "toy.template.json"
    assert _cli(["learn", *calibration_recordings(tmp_path), "--out", str(template)])[0] == 0
    schedule = tmp_path / "s.csv"
    schedule.write_text("seq,batch\n40,3\n12,5\n")
    return template, schedule


def test_export_events_into_a_fifo_or_over_an_input_exits_2(tmp_path):
    """simulate --export-events opened a FIFO and waited for a reader for ever, and wrote over its own
    schedule when given it."""
    template, schedule = _learned_template(tmp_path)
    base = ["simulate", str(template), "--schedule", str(schedule), "--export-events"]
    code, _, err, _ = _run([*base, str(_fifo(tmp_path))])
    assert code == 2 and "--export-events" in err and "FIFO" in err, err
    for target in (schedule, template):
        before = target.read_bytes()
        code, _, err, _ = _run([*base, str(target)])
        assert code == 2 and "--export-events" in err, err
        assert target.read_bytes() == before


def test_pack_out_into_a_fifo_or_over_its_instance_exits_2(tmp_path):
    instance = tmp_path / "instance.csv"
    instance.write_bytes((DATA / "instances_small.csv").read_bytes())
    code, _, err, _ = _run(["pack", str(instance), "--no-progress", "--time-limit", "5", "--out",
                            str(_fifo(tmp_path))])
    assert code == 2 and "--out" in err and "FIFO" in err, err
    code, _, err, _ = _run(["pack", str(instance), "--no-progress", "--time-limit", "5", "--out", str(instance)])
    assert code == 2 and "--out" in err, err
    assert instance.read_bytes() == (DATA / "instances_small.csv").read_bytes()
