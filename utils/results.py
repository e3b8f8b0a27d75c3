"""The writer of ``docs/results.md``'s generated sections: each lives between its own markers, so that every
generator (``bench.report``, ``bench.overhead``, ``utils.isa_report``, ...) replaces its part and keeps the rest."""

from __future__ import annotations

import pathlib

__all__ = ["write_between"]


def write_between(path: pathlib.Path, begin: str, end: str, generated: str) -> None:
    """Put ``generated`` (which starts with ``begin`` and ends with ``end``) in place of the part of
    ``path`` between those markers; append it if the file has none (a new file starts ``# Results``)."""
    old = path.read_text() if path.exists() else "# Results\n\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + generated + old[old.index(end) + len(end) :]
    else:
        new = old.rstrip() + "\n\n" + generated + "\n"
    path.write_text(new)
