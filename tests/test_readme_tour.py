"""Every `ms-memopt` command of the README's tour works from a clean clone with nothing beside it.

The commands are read from README.md itself and run in order in an empty directory holding only
copies of the repository's ``recipes/`` and ``bench/`` (what a clone has), so a tour step that needs a file
from elsewhere (``../shared/data``) fails here. Long runs are shortened (``--steps`` capped,
one seed, one rank stream of a job, training 3 steps, packing 2 s) so that the tour takes seconds; everything else is
run as written.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from ms_memopt.cli import main

ROOT = Path(__file__).resolve().parents[1]
_MAX_STEPS = 40


def _tour_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("ms-memopt "):
                commands.append(shlex.split(line)[1:])
    return commands


def _shortened(argv: list[str], max_steps: int = _MAX_STEPS) -> list[str]:
    out = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg == "--steps" and int(argv[i + 1]) > max_steps:
            out += ["--steps", str(max_steps)]
            skip = True
        elif arg in ("--seeds", "--ranks"):
            skip = True
        else:
            out.append(arg)
    if out and out[0] in ("simulate", "sweep") and not out[1].endswith(".template.json"):
        out += ["--ranks", "1"]     # one rank stream of the job (tests/test_job.py covers many); a template is one card
    return out


def test_the_readme_has_a_tour():
    commands = [argv[0] for argv in _tour_commands()]
    assert {"plan", "simulate", "report", "replay", "doctor", "pack", "run"} <= set(commands)


@pytest.mark.mindspore
@pytest.mark.slow
def test_every_tour_command_works_from_a_clean_clone(tmp_path, monkeypatch, capsys):
    shutil.copytree(ROOT / "recipes", tmp_path / "recipes")
    shutil.copytree(ROOT / "bench", tmp_path / "bench")
    monkeypatch.chdir(tmp_path)
    # `record -- python ...` runs the PATH's python: this interpreter's, as in the virtualenv
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    for argv in _tour_commands():
        argv = _shortened(argv)
        if argv[0] == "run":
            argv = _shortened(argv, max_steps=3) + ["--no-progress"]
        elif argv[0] == "pack":
            argv += ["--time-limit", "2"]
        code = main(argv)
        captured = capsys.readouterr()
        assert code == 0, f"ms-memopt {' '.join(argv)} exited {code}:\n{captured.err[-2000:]}"
    assert (tmp_path / "out" / "sim" / "report.md").is_file()
    assert (tmp_path / "out" / "buffers.csv").is_file()
    assert (tmp_path / "out" / "doctor" / "report.md").is_file()
