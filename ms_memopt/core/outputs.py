"""Output paths: what a command refuses to write to, before it writes.

* **A FIFO or socket** given as an output file: opening it for writing waits until something reads
  it (forever, with no reader). :func:`check_output_file` refuses it.
* **The input itself** (``replay X --export-memory-viz X``): the recording would be overwritten
  by its own export. :func:`check_output_file` refuses any path that is the same file as an input.
* **A symlink planted in an output folder** (``doctor --out D`` with ``D/report.md`` linked to
  another file): the file we name inside a folder is ours, so :func:`check_output_folder` refuses
  a symlink, FIFO, socket or folder at any of those names, and :func:`write_text_in` writes with
  ``O_NOFOLLOW`` (a link made between the check and the write is refused too).

Each refusal is an :class:`~ms_memopt.core.errors.InputError` naming the path and the option.

Example:
    >>> import tempfile, os
    >>> folder = tempfile.mkdtemp()
    >>> write_text_in(folder, "report.md", "# hello\\n").name
    'report.md'
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Iterable

from ms_memopt.core.errors import InputError

__all__ = ["check_output_file", "check_output_folder", "write_text_in"]


def _stat(path: str | os.PathLike, *, follow: bool = True) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=follow)
    except (OSError, ValueError):
        return None


def check_output_file(path: str | os.PathLike, *, key: str, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Refuse an output file that is a FIFO or socket, or the same file as one of ``inputs`` (or a
    file inside an input folder that is already there: a profiler folder's own files).

    Raises:
        InputError: naming ``key`` (the option) and the path.
    """
    info = _stat(path)
    if info is None:
        return                  # a new file (a bad folder on the way is the writer's error to name)
    if stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode):
        raise InputError(f"{path}: is a FIFO or socket; expected a file to write (opening it waits for a reader)",
                         key=key)
    for given in inputs:
        other = _stat(given)
        if other is None:
            continue
        if (info.st_dev, info.st_ino) == (other.st_dev, other.st_ino):
            raise InputError(f"{path}: is the input itself; write the output to another file", key=key)
        if stat.S_ISDIR(other.st_mode):
            real, folder = os.path.realpath(path), os.path.realpath(given)
            if real.startswith(folder.rstrip(os.sep) + os.sep):
                raise InputError(f"{path}: is a file of the input folder {given}; write the output elsewhere",
                                 key=key)


def check_output_folder(folder: str | os.PathLike, names: Iterable[str], *, key: str = "--out") -> None:
    """Refuse to write ``names`` into ``folder`` when one of them is there as a symlink, FIFO, socket
    or folder (a link planted there would redirect our write to its target).

    Raises:
        InputError: naming ``key`` and the path.
    """
    for name in names:
        path = Path(folder) / name
        info = _stat(path, follow=False)
        if info is None or stat.S_ISREG(info.st_mode):
            continue
        what = ("a symbolic link" if stat.S_ISLNK(info.st_mode) else "a folder" if stat.S_ISDIR(info.st_mode)
                else "a FIFO, socket or device")
        raise InputError(f"{path}: is {what}; this command writes a file of its own there and does not write "
                         "through it (remove it, or give another folder)", key=key)


def write_text_in(folder: str | os.PathLike, name: str, text: str) -> Path:
    """Write ``text`` (UTF-8; a file name that is not UTF-8 as its bytes) to ``folder/name``, never
    through a symlink (``O_NOFOLLOW``) nor into a FIFO.

    Raises:
        InputError: ``folder/name`` is a symlink, FIFO or socket.
        OSError: any other error of the write (the CLI names the path).
    """
    path = Path(folder) / name
    check_output_folder(folder, [name])
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):        # ELOOP: a link made since the check; ENXIO: a FIFO with no reader
            raise InputError(f"{path}: a symbolic link or FIFO appeared; not written through it", key="--out") from None
        raise
    # a name found inside a folder the user gave may not be UTF-8 (kept as lone surrogates by
    # Python): written as its own bytes, not a UnicodeEncodeError
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as handle:
        handle.write(text)
    return path
