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
