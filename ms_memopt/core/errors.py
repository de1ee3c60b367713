"""The one error type bad input turns into.

Every reader, the recipe loader and the command line raise :class:`InputError` for input
they cannot use; the CLI prints its message and exits with code 2. The message always says
*where* (file, line, YAML key path) and *what was expected*.
"""
from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """Bad input from a file, a recipe or the command line.

    Args:
        message: what is wrong and what was expected.
        source: the file (or other origin, e.g. ``"--capacity"``) the input came from.
        line: 1-based line number in ``source``, when it is a text file.
        key: dotted YAML key path (``"memopt.device.hbm"``), when it is a recipe.

    Example:
        >>> str(InputError("expected 6 columns, got 4", source="trace.csv", line=12))
        'trace.csv:12: expected 6 columns, got 4'
    """

    def __init__(self, message: str, *, source: str | None = None, line: int | None = None,
                 key: str | None = None) -> None:
        self.message = message
        self.source = None if source is None else str(source)
        self.line = line
        self.key = key
        super().__init__(self._format())

    def _format(self) -> str:
        where = self.source or ""
        if self.line is not None:
            where = f"{where}:{self.line}" if where else f"line {self.line}"
        if self.key:
            where = f"{where}: {self.key}" if where else self.key
        return f"{where}: {self.message}" if where else self.message
