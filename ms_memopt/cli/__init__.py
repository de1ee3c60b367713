"""The ``ms-memopt`` command: one subcommand per module in this package.

Each subcommand module defines ``add_parser(subparsers)`` and ``run(args) -> int``. Modules are
imported only when their command is used, so ``ms-memopt replay`` never imports MindSpore.
Bad input (:class:`~ms_memopt.core.errors.InputError`) prints one line to stderr and exits 2.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
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


#: errors of a path itself (missing, a directory, no permission, a full or read-only disk, a name
#: too long): the user's to fix, so exit 2 with the path, not a traceback
_PATH_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EEXIST,
                          errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.ELOOP, errno.ENAMETOOLONG,
                          errno.ENXIO, errno.ENODEV, errno.EINVAL, errno.EIO, errno.ETXTBSY, errno.EBUSY})


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:      # bytes that were not UTF-8, kept as lone surrogates by Python
        return False
    return True


def _user_paths(args: argparse.Namespace) -> list[str]:
    """Every string the user gave (options and positionals): the paths among them."""
    out: list[str] = []
    for value in vars(args).values():
        values = value if isinstance(value, (list, tuple)) else [value]
        out += [str(v) for v in values if isinstance(v, (str, os.PathLike))]
    return [p for p in out if p]


def _about_user_path(exc: OSError, args: argparse.Namespace) -> bool:
    """True when ``exc`` is a path error on a path the user gave, or inside a folder the user gave;
    a write error without a file name (a full disk: ``/dev/full``) counts too."""
    if exc.errno not in _PATH_ERRNOS:
        return False
    if exc.filename is None:
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EINVAL)
    names = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    for given in _user_paths(args):
        for name in names:      # the path, a file inside it, or a folder on the way to it
            if (name == given or name.startswith(given.rstrip("/") + "/") or given.startswith(name.rstrip("/") + "/")
                    or _same_file(name, given) or _beside(name, given)):
                return True
    return False


def _outputs(args: argparse.Namespace) -> str:
    """The output paths the user gave (``--out``, ``--export-*``, ``--raw``), for a write error that
    names no file (a full disk)."""
    given = [str(v) for k, v in vars(args).items() if v and isinstance(v, (str, os.PathLike))
             and (k in ("out", "raw") or k.startswith("export_"))]
    return " or ".join(given)


def _beside(name: str, given: str) -> bool:
    """``name`` is in the folder of the file ``given``: a file looked for beside it (a crash log's
    ``MemoryDebugInfo<N>.txt``, a snapshot's per-policy siblings)."""
    try:
        return os.path.dirname(os.path.abspath(name)) == os.path.dirname(os.path.abspath(given))
    except (OSError, ValueError):
        return False


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.realpath(a) == os.path.realpath(b)
    except (OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ms-memopt`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, modules = _build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    def fail(message: str, code: int = 2) -> int:
        print(f"ms-memopt {args.command}: error: {message}", file=sys.stderr)
        return code

    bad_name = next((a for a in argv if not _utf8(a)), None)
    if bad_name is not None:    # written later into JSON, plots and logs, where it cannot be encoded
        return fail(f"{bad_name.encode('utf-8', 'surrogateescape')!r}: not a UTF-8 name; expected file and "
                    "folder names in UTF-8 (rename it)")
    try:
        return int(modules[args.command].run(args) or 0)
    except InputError as exc:
        return fail(str(exc))
    except BrokenPipeError:  # output piped into `head`: not an error of ours
        sys.stderr.close()
        return 0
    except OSError as exc:
        if not _about_user_path(exc, args):
            raise
        where = exc.filename if exc.filename is not None else _outputs(args) or "an output file"
        return fail(f"{where}: cannot {'write' if exc.filename is None else 'use'} it: "
                    f"{exc.strerror or exc}")
    except RecursionError:
        return fail("the input is nested too deeply to read")
    except MemoryError:
        return fail("out of memory (the input or the work asked for is larger than this machine holds; "
                    "see the command's limits in docs/reliability.md)", 1)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
