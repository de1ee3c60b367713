"""Reading input files line by line in bounded memory: the one reader every text format uses.

A hostile or simply huge input must cost memory bounded by what the reader keeps, never by
the file. Three things break that with plain ``open(...).read()`` or ``for line in handle``:

* **a line with no end** (``/dev/zero``, a binary file, a 2 GB log of one line) is read whole
  before anything can refuse it. :func:`iter_lines` and :func:`open_text` read at most
  :data:`MAX_LINE_BYTES` (1 MiB) per line; a longer line is an
  :class:`~ms_memopt.core.errors.InputError` naming the file and the line, and the rest of it
  is never read;
* **a pipe read twice** (``/dev/stdin``, ``<(zcat x.log.gz)``): format detection reads the head,
  and the reader then opened the path again and lost it. A path that is not a regular file is
  opened once; its first :data:`SPOOL_BYTES` are kept, so :func:`read_head` and any later open of
  the same path start again at its first byte;
* **a FIFO with no writer** blocks ``open`` forever. A FIFO or socket is opened non-blocking
  and must deliver its first byte (or its end) within :data:`PIPE_WAIT_SECONDS` (environment
  variable ``MS_MEMOPT_PIPE_WAIT``), else it is an :class:`InputError`.

Gzip (by its magic bytes, not the name) is decompressed as a stream; ``\\r\\n`` line ends read
as ``\\n``. Every :class:`OSError` while opening or reading, and corrupt gzip data, becomes an
:class:`InputError` naming the file.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "log.txt")
    >>> _ = open(path, "wb").write(b"first\\r\\nsecond\\n")
    >>> list(iter_lines(path, expected="a log"))
    [(1, 'first'), (2, 'second')]
    >>> with open_text(path, expected="a log") as handle:   # a text file object for csv & co.
    ...     handle.readline()
    'first\\n'
"""
from __future__ import annotations

import errno
import fcntl
import gzip
import io
import os
import select
import stat
import zlib
from contextlib import contextmanager
from typing import IO, BinaryIO, Iterator

from ms_memopt.core.errors import InputError

__all__ = ["open_input", "MAX_LINE_BYTES", "SPOOL_BYTES", "PIPE_WAIT_SECONDS", "iter_lines", "open_text", "open_binary",
           "read_head", "bounded_lines", "BoundedText", "is_regular_file"]

#: longest line accepted, in bytes (the longest real line seen, a pool log's Ascend return line
#: with a long owner name, is under 2 KiB)
MAX_LINE_BYTES = 1 << 20
#: bytes of a pipe kept so that detection and the reader both see its head
SPOOL_BYTES = 4 << 20
#: seconds a FIFO or socket may take to deliver its first byte (or its end)
PIPE_WAIT_SECONDS = float(os.environ.get("MS_MEMOPT_PIPE_WAIT", "10") or 10)
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 16


class _Spool(io.RawIOBase):
    """A non-seekable input read once: keeps its first ``limit`` bytes so it can start again."""

    def __init__(self, fd: int, source: str, limit: int = SPOOL_BYTES) -> None:
        self._fd = fd
        self._source = source
        self._limit = limit
        self._kept = bytearray()
        self._pos = 0
        self._keeping = True

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        if self._pos < len(self._kept):
            n = min(len(view), len(self._kept) - self._pos)
            view[:n] = self._kept[self._pos:self._pos + n]
            self._pos += n
            return n
        data = os.read(self._fd, len(view))
        n = len(data)
        view[:n] = data
        if self._keeping:
            if len(self._kept) + n <= self._limit:
                self._kept += data
                self._pos += n
            else:   # past what is kept: no second start any more, and the head is dropped
                self._keeping = False
                self._kept = bytearray()
                self._pos = 0
        return n

    def rewind(self) -> None:
        """Start again at the first byte (an :class:`InputError` once more than the kept head was read)."""
        if not self._keeping:
            raise InputError(f"a pipe or device is read once: it was read past its first {self._limit} bytes "
                             "already; give a regular file", source=self._source)
        self._pos = 0

    def close(self) -> None:        # shared by every open of the path; the descriptor lives on
        pass


_SPOOLS: dict[tuple[int, int], _Spool] = {}


def is_regular_file(path: str | os.PathLike) -> bool:
    """True when ``path`` is a regular file (symlinks followed); False for pipes, devices, missing paths."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _wait_for_writer(fd: int, source: str) -> None:
    """A FIFO or socket opened non-blocking: wait for its first byte or its end, then block normally."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR)
    if not poller.poll(int(PIPE_WAIT_SECONDS * 1000)):
        os.close(fd)
        raise InputError(f"nothing to read within {PIPE_WAIT_SECONDS:g} s (a FIFO with no writer?); start the "
                         "writer first, or set MS_MEMOPT_PIPE_WAIT to the seconds to wait", source=source)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)


def _open_raw(path: str | os.PathLike, source: str, expected: str) -> BinaryIO:
    """A buffered binary stream from the first byte of ``path`` (raw: no gunzip)."""
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise InputError(f"is a directory; expected {expected}", source=source)
        if stat.S_ISREG(info.st_mode):
            return open(path, "rb")
        key = (info.st_dev, info.st_ino)
        spool = _SPOOLS.get(key)
        if spool is None:
            waits = stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode)
            fd = os.open(path, os.O_RDONLY | (os.O_NONBLOCK if waits else 0))
            if waits:
                _wait_for_writer(fd, source)
            spool = _SPOOLS[key] = _Spool(fd, source)
        else:
            spool.rewind()
        return io.BufferedReader(spool, _CHUNK)
    except OSError as exc:
        raise _os_error(exc, source, expected) from None


def _os_error(exc: OSError, source: str, expected: str) -> InputError:
    if isinstance(exc, IsADirectoryError):
        return InputError(f"is a directory; expected {expected}", source=source)
    if isinstance(exc, gzip.BadGzipFile):
        return InputError(f"corrupt gzip data ({exc})", source=source)
    if exc.errno == errno.ENXIO:
        return InputError(f"cannot read: a socket or a device with nothing behind it; expected {expected}",
                          source=source)
    return InputError(f"cannot read: {exc.strerror or exc}", source=source)


@contextmanager
def open_binary(path: str | os.PathLike, *, expected: str, gunzip: bool = True) -> Iterator[BinaryIO]:
    """Open ``path`` for reading bytes: gzip decompressed as a stream (``gunzip``), pipes re-readable
    from their first byte, FIFOs without a writer refused in :data:`PIPE_WAIT_SECONDS`.

    Any :class:`OSError`, and corrupt or truncated gzip data, inside the ``with`` block too, is an
    :class:`InputError` naming the file (``expected`` says what the file should be).

    Example:
        >>> with open_binary("tests/data/pool_log_cpu.log.gz", expected="a pool log") as f:  # doctest: +SKIP
        ...     f.readline(100)
        b'[V12906] PRE_ACT(...'
    """
    source = str(path)
    stream = _open_raw(path, source, expected)
    try:
        if gunzip and stream.peek(2)[:2] == _GZIP_MAGIC:
            stream = gzip.GzipFile(fileobj=stream, mode="rb")
        yield stream
    except OSError as exc:
        raise _os_error(exc, source, expected) from None
    except (EOFError, zlib.error) as exc:
        raise InputError(f"truncated or corrupt gzip data ({exc})", source=source) from None
    finally:
        stream.close()


def read_head(path: str | os.PathLike, size: int, *, expected: str = "an input file", gunzip: bool = False) -> bytes:
    """The first ``size`` bytes of ``path`` (decompressed with ``gunzip``), for format detection.

    A pipe's head is kept: the reader that opens it next still starts at its first byte.
    Truncated gzip data gives what could be decompressed (detection judges a head, not the file).
    """
    with open_binary(path, expected=expected, gunzip=False) as raw:
        if not (gunzip and raw.peek(2)[:2] == _GZIP_MAGIC):
            return _read_up_to(raw, size)
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                return _read_up_to(unzipped, size)
        except (OSError, EOFError, zlib.error):
            return b""


def _read_up_to(stream: BinaryIO, size: int) -> bytes:
    parts, got = [], 0
    while got < size:
        part = stream.read(size - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _too_long(source: str, number: int, max_line: int, expected: str) -> InputError:
    return InputError(f"line longer than {max_line} bytes; expected {expected} (lines of text, not binary data)",
                      source=source, line=number)


def bounded_lines(stream: BinaryIO, *, source: str, expected: str = "text lines", max_line: int = MAX_LINE_BYTES,
                  strict_utf8: bool = False, first_line: int = 1,
                  keep_torn: bool = True) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` for each line of a binary ``stream``, line ends (``\\n``, ``\\r\\n``) removed.

    Args:
        stream: anything with ``readline(limit)`` (a file opened ``"rb"``, a ``GzipFile``).
        source: the file named in errors.
        max_line: the longest line accepted, in bytes; a longer one is an :class:`InputError`
            naming ``source`` and its line, and is not read further.
        strict_utf8: bytes that are not UTF-8 are an :class:`InputError` naming the line
            (otherwise they read as U+FFFD).
        first_line: the number of the stream's first line (after a header read elsewhere).
        keep_torn: also yield a last line that has no line end (a writer killed mid-line).
    """
    number = first_line - 1
    readline = stream.readline
    errors = "strict" if strict_utf8 else "replace"
    while True:
        data = readline(max_line + 1)
        if not data:
            return
        number += 1
        if data[-1:] == b"\n":
            data = data[:-2] if data[-2:-1] == b"\r" else data[:-1]
        elif len(data) > max_line:
            raise _too_long(source, number, max_line, expected)
        elif not keep_torn:
            return
        try:
            text = data.decode("utf-8", errors)
        except UnicodeDecodeError:
            raise InputError(f"not UTF-8 text; expected {expected}", source=source, line=number) from None
        yield number, text


def iter_lines(path: str | os.PathLike, *, expected: str, max_line: int = MAX_LINE_BYTES, strict_utf8: bool = False,
               keep_torn: bool = True, gunzip: bool = True) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` for each line of the file at ``path``, in memory bounded by ``max_line``.

    The file may be gzip (decompressed as a stream), a pipe or ``/dev/stdin`` (its head, if
    format detection read it, is read again). Line ends are removed; see :func:`bounded_lines`
    for the arguments.

    Raises:
        InputError: unreadable, a FIFO with no writer, corrupt gzip data, a line longer than
            ``max_line`` bytes, or (``strict_utf8``) bytes that are not UTF-8; it names the
            file and, where there is one, the line.

    Example:
        >>> for number, text in iter_lines("pool.log", expected="a pool log"):   # doctest: +SKIP
        ...     parser.feed(text)
    """
    source = str(path)
    with open_binary(path, expected=expected, gunzip=gunzip) as stream:
        yield from bounded_lines(stream, source=source, expected=expected, max_line=max_line,
                                 strict_utf8=strict_utf8, keep_torn=keep_torn)


class BoundedText(io.TextIOBase):
    """A read-only text file over a binary stream whose every line is bounded (for ``csv.reader``
    and code written against a file object). Lines keep their end, ``\\r\\n`` read as ``\\n``;
    ``line`` is the number of the last line read."""

    def __init__(self, stream: BinaryIO, *, source: str, expected: str, max_line: int = MAX_LINE_BYTES,
                 strict_utf8: bool = True, max_read: int = 64 << 20) -> None:
        super().__init__()
        self._stream = stream
        self._source = source
        self._expected = expected
        self._max_line = max_line
        self._errors = "strict" if strict_utf8 else "replace"
        self._max_read = max_read
        self.line = 0

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:
        data = self._stream.readline(self._max_line + 1)
        if not data:
            return ""
        self.line += 1
        if data[-1:] == b"\n":
            if data[-2:-1] == b"\r":
                data = data[:-2] + b"\n"
        elif len(data) > self._max_line:
            raise _too_long(self._source, self.line, self._max_line, self._expected)
        try:
            return data.decode("utf-8", self._errors)
        except UnicodeDecodeError:
            raise InputError(f"not UTF-8 text; expected {self._expected}", source=self._source,
                             line=self.line) from None

    def __next__(self) -> str:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def __iter__(self) -> "BoundedText":
        return self

    def read(self, size: int | None = -1) -> str:
        """The rest, line by line; refused past ``max_read`` bytes (a whole-file reader's bound)."""
        parts, total = [], 0
        while size is None or size < 0 or total < size:
            line = self.readline()
            if not line:
                break
            total += len(line)
            if total > self._max_read:
                raise InputError(f"larger than {self._max_read} bytes; expected {self._expected}",
                                 source=self._source)
            parts.append(line)
        return "".join(parts)


@contextmanager
def open_text(path: str | os.PathLike, *, expected: str, max_line: int = MAX_LINE_BYTES, strict_utf8: bool = True,
              gunzip: bool = True) -> Iterator[IO[str]]:
    """Open ``path`` as bounded UTF-8 text (:class:`BoundedText`): the text twin of :func:`open_binary`.

    Raises:
        InputError: as :func:`iter_lines`, from the ``with`` block too.
    """
    source = str(path)
    with open_binary(path, expected=expected, gunzip=gunzip) as stream:
        yield BoundedText(stream, source=source, expected=expected, max_line=max_line, strict_utf8=strict_utf8)


def open_input(path: str | os.PathLike, *, expected: str):
    """Open a UTF-8 text input (:func:`open_text`): failing to open or decode it, inside the ``with``
    block too, is an :class:`InputError` naming the file (and line); ``expected`` says what it should be.

    Example:
        >>> with open_input("/no/such.csv", expected="an instance CSV") as f:   # doctest: +SKIP
        ...     f.read()
        InputError: /no/such.csv: cannot read: No such file or directory
    """
    return open_text(path, expected=expected)
