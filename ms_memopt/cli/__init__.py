"""The ``ms-memopt`` command: one subcommand per module in this package.

Each subcommand module defines ``add_parser(subparsers)`` and ``run(args) -> int``. Modules are
imported only when their command is used, so ``ms-memopt replay`` never imports MindSpore.
Bad input (:class:`~ms_memopt.core.errors.InputError`) prints one line to stderr and exits 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from ms_memopt import __version__
from ms_memopt.core.errors import InputError

__all__ = ["main"]

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "replay": ("ms_memopt.cli.replay_cmd", "replay a recorded trace through an allocator model"),
    "plan": ("ms_memopt.cli.plan_cmd", "per-card memory by region for a recipe"),
    "simulate": ("ms_memopt.cli.simulate_cmd", "many-step simulation of a recipe under policies"),
    "sweep": ("ms_memopt.cli.sweep_cmd", "the job simulation over a grid of recipe settings"),
    "pack": ("ms_memopt.cli.pack_cmd", "static placement of buffers with known lifetimes"),
    "run": ("ms_memopt.cli.run_cmd", "standalone training on one device with all callbacks"),
    "report": ("ms_memopt.cli.report_cmd", "plots and a summary from a run's or simulation's logs"),
    "record": ("ms_memopt.cli.record_cmd", "run a MindSpore command and record its real memory pool as events"),
    "doctor": ("ms_memopt.cli.doctor_cmd", "verdict, blockers and measured remedies from one recording"),
    "learn": ("ms_memopt.cli.learn_cmd", "a step template of your model from recordings with mark_step dims"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep its message short
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, dict]:
    parser = _Parser(prog="ms-memopt", description="Fragmentation sight, first aid and prevention for MindSpore.")
    parser.add_argument("--version", action="version", version=f"ms-memopt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    wanted = next((a for a in argv if not a.startswith("-")), None)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        if name == wanted:
            modules[name] = importlib.import_module(module_name)
            modules[name].add_parser(sub.add_parser(name, help=help_text, description=help_text))
        else:
            sub.add_parser(name, help=help_text)
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ms-memopt`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, modules = _build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except InputError as exc:
        print(f"ms-memopt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head`: not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
