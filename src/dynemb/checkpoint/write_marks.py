"""What each live table last had written, so that an incremental write knows its parent and what changed since.

Per table and *stream* (``"checkpoint"`` or ``"serving"``) we remember the directory last written (or loaded) and
the table clock it covers. Every save or export closes the current clock tick (the clock advances by one and the
saved counters include it): an optimizer stamps the rows it updates with the *current* clock
(``mark_updated``), so without the tick an update made after a save but before the next table operation would
carry the save's own stamp and be missed by the next delta. A loaded table gets its rows stamped one below the
saved clock, which makes it look exactly like the table right after that save.

The deletion log is trimmed to what the oldest stream still needs. The marks are kept by each table
(``table.write_marks``), not in a process-wide registry: they live and die with the table, and two models in one
process never see each other's. The directory they name is checked when it is used: an incremental write builds on
it only if its manifest is readable and lists the same tables and configs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import NamedTuple

__all__ = ["parent", "since", "record", "tick"]


class _Mark(NamedTuple):
    root: str
    name: str
    clock: int


@contextlib.contextmanager
def tick(tables: list) -> Iterator[None]:
    """Advance every table's clock by one for a save; undone if the block fails."""
    for table in tables:
        table.clock += 1
        table.save_ticks += 1
    try:
        yield
    except BaseException:
        for table in tables:
            table.clock -= 1
            table.save_ticks -= 1
        raise


def parent(tables: Iterable, stream: str, root: str) -> str | None:
    """The directory all ``tables`` were last written to (or loaded from) under ``root``, or None if they differ."""
    marks = [t.write_marks.get(stream) for t in tables]
    if not marks or any(m is None or m.root != root for m in marks):
        return None
    names = {m.name for m in marks}
    return names.pop() if len(names) == 1 else None


def since(table, stream: str) -> int:
    """Clock to pass to ``changes_since``: what is stamped after it changed since the last write of ``stream``."""
    return table.write_marks[stream].clock


def record(tables: Iterable, stream: str, root: str, name: str, *, reset: bool = False) -> None:
    """Remember that ``tables`` were just written to (``reset=True``: loaded from) ``root/name``.

    Call it after :func:`tick` (or a load): the directory covers every stamp below the current clock.
    """
    for table in tables:
        marks = table.write_marks
        if reset or not marks:
            marks.clear()
            table.track_deletions()  # a fresh log: earlier deletions are in (or before) this directory
        marks[stream] = _Mark(root, name, table.clock - 1)
        table.forget_deletions(min(m.clock for m in marks.values()))
