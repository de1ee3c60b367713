"""The README's tour, run as a new user runs it: every command of its ``bash`` blocks in order, then
its Python script, in an empty directory holding only copies of the repository's ``recipes/`` and
``bench/`` (what a clone has), so a step that needs a file from elsewhere fails here.

Each command runs as written (through ``ms_memopt.cli.main`` in this process, ``run`` in a process of
its own, as its pool log must be switched on before MindSpore is imported), except those whose
README comment gives a time in minutes (``# ~3 min``, ``# 6 to 8 min``): they are shortened to ``--steps 20`` and one
rank stream (``run``: 3 steps), as the README says. A command fails the test
when it exits non-zero, prints a traceback, or prints a warning of ours: a Python warning raised
in ``ms_memopt`` (a figure that :func:`ms_memopt.report.figure_check.figure_problems` finds
defective is a ``FigureWarning``), or a ``warning:`` line of our CLI. The script runs as the README
prints it (it is small already).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: steps of a command the README marks as taking minutes
SHORT_STEPS = 20
#: what a warning of ours looks like on stderr: Python's "path/ms_memopt/x.py:12: SomeWarning: ..."
#: or our CLI's own "warning: ..." lines
_OUR_WARNING = re.compile(r"(^|/)ms_memopt/[\w/]+\.py:\d+: \w*Warning:|^(ms-memopt \w+: )?warning:", re.M)
_MINUTES = re.compile(r"#\s*~?\d+(\.\d+)?(\s*to\s*\d+)?\s*min\b")


def tour_commands(text: str) -> list[tuple[list[str], bool]]:
    """``(argv without "ms-memopt", shortened?)`` of every ``ms-memopt`` line of the ``bash`` blocks,
    in order; shortened when its comment gives a time in minutes."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            code, _, comment = line.partition(" #")
            code = code.strip()
            if code.startswith("ms-memopt "):
                commands.append((shlex.split(code)[1:], bool(_MINUTES.search("#" + comment))))
    return commands


def tour_script(text: str) -> str:
    """The README's one ``python`` block: the complete script of the tour's last step."""
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1, f"expected one python block in README.md, found {len(blocks)}"
    return blocks[0]


def shortened(argv: list[str]) -> list[str]:
    """``argv`` with ``--steps`` capped at :data:`SHORT_STEPS` (3 for ``run``) and, for a job
    simulation, one rank stream (``--ranks 1``)."""
    cap = 3 if argv[0] == "run" else SHORT_STEPS
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg in ("--steps", "--ranks"):
            skip = True
            if arg == "--steps":
                out += ["--steps", str(min(int(argv[i + 1]), cap))]
        else:
            out.append(arg)
    if argv[0] in ("simulate", "sweep") and not argv[1].endswith(".template.json"):
        out += ["--ranks", "1"]
    return out


def problems_of(stderr: str) -> list[str]:
    """Tracebacks and warnings of ours in a command's stderr."""
    found = []
    if "Traceback (most recent call last)" in stderr:
        found.append("a traceback")
    found += [line.strip() for line in stderr.splitlines() if _OUR_WARNING.search(line)]
    return found


def test_the_readme_has_a_tour_and_a_script():
    text = README.read_text(encoding="utf-8")
    names = [argv[0] for argv, _ in tour_commands(text)]
    assert {"plan", "simulate", "report", "sweep", "replay", "doctor", "record", "learn", "pack", "run"} <= set(names)
    # every long command says how long it takes, and the shortening keeps a command runnable
    marked = [argv[:2] for argv, short in tour_commands(text) if short]
    assert ["simulate", "recipes/dense_100b_1024x910c.yaml"] in marked and ["sweep", "recipes/dense_100b_1024x910c.yaml"] in marked
    assert ["run", "recipes/demo_cpu.yaml"] in marked
    script = tour_script(text)
    for name in ("GPT", "GPTConfig", "GPTWithLoss", "synthetic_dataset", "enable_pool_mode", "poolcapture"):
        assert name in script
    assert script.index("poolcapture.start") < script.index("import mindspore")
    assert script.index("FusedAdamW(") < script.index("enable_pool_mode(")


def test_problems_of_finds_our_warnings_and_tracebacks_only():
    assert problems_of("simulate: 10%|#  | 2/20\n[WARNING] ME(1:2,MainProcess): deprecated\n") == []
    assert problems_of("/x/ms_memopt/report/plots.py:87: FigureWarning: out/a.png: text 'a' overlaps 'b'\n")
    assert problems_of("warning: first steps were recorded at seq=8 only\n")
    assert problems_of("Traceback (most recent call last):\n  File ...\n") == ["a traceback"]


def _in_process(argv: list[str], capsys) -> tuple[int, str]:
    """``ms-memopt ARGV`` through :func:`ms_memopt.cli.main` in this process (no interpreter start per
    command): its exit code, and its stderr with the Python warnings it raised written as Python
    writes them (``path:line: Category: message``)."""
    from ms_memopt.cli import main

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(argv)
    err = capsys.readouterr().err
    return code, err + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, "")
                               for w in caught)


@pytest.mark.mindspore
@pytest.mark.slow
def test_every_tour_command_and_the_script_work_from_a_clean_clone(tmp_path, monkeypatch, capsys):
    text = README.read_text(encoding="utf-8")
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    shutil.copytree(ROOT / "bench", tmp_path / "bench")
    monkeypatch.chdir(tmp_path)
    # `record -- python ...` runs the PATH's python: this interpreter's, as in the virtualenv
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    for argv, short in tour_commands(text):
        if short:
            argv = shortened(argv)
        if argv[0] == "run":     # in a process of its own: its pool log must be on before MindSpore is imported
            done = subprocess.run([sys.executable, "-m", "ms_memopt", *argv], capture_output=True, text=True,
                                  timeout=600)
            code, err = done.returncode, done.stderr
        else:
            code, err = _in_process(argv, capsys)
        command = "ms-memopt " + shlex.join(argv)
        assert code == 0, f"{command} exited {code}:\n{err[-3000:]}"
        assert not problems_of(err), f"{command}:\n" + "\n".join(problems_of(err))
    (tmp_path / "train.py").write_text(tour_script(text), encoding="utf-8")
    done = subprocess.run([sys.executable, "train.py"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"the README's script exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert not problems_of(done.stderr), "the README's script:\n" + "\n".join(problems_of(done.stderr))
    # what the tour promises to leave behind
    figures = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("out/**/*.png"))
    for name in ("out/sim/fragmentation.png", "out/sim/memory_map.png", "out/sweep/sweep.png",
                 "out/mine/fragmentation.png", "out/mine/memory_map.png", "out/doctor/memory_map.png"):
        assert name in figures, f"{name} not written; figures: {figures}"
    assert not (tmp_path / "out" / "sweep" / "sweep.partial.jsonl").exists()     # cleaned up once complete
    records = [line for line in (tmp_path / "memlog" / "rank_0" / "scan.jsonl").read_text().splitlines()
               if '"kind":"compaction"' in line.replace(" ", "")]
    assert records and all('"frag_ratio_before":null' not in r.replace(" ", "") for r in records)
