"""Change tracking: per-row version stamps and a log of deleted keys.

Every row carries the table clock of its last write in the ``version`` column; a table may also log the keys it
deletes. Incremental checkpoints and serving deltas are built from :meth:`ChangeLog.changes_since`, so the layers
above need no hooks into optimizers or lookups.
"""

from __future__ import annotations

import torch

from .ops import fill_rows

__all__ = ["ChangeLog"]


class ChangeLog:
    """Version stamps and the deletion log of a table whose columns live in ``self._cols`` (live rows
    ``0 .. _size-1``), with a ``clock`` that ticks once per call that changes rows."""

    _cols: dict
    _columns: dict  # the same columns, read without settling deferred stamps (RowStore)
    _size: int
    clock: int
    key_dtype: torch.dtype
    device: torch.device
    _deleted: list[tuple[int, torch.Tensor]] | None

    def mark_updated(self, rows: torch.Tensor) -> None:
        """Stamp rows as written now (optimizers call this after updating values or slots in place).

        Stamps a lookup deferred stay deferred (``RowStore._defer_stamps``): the version written now is at least
        any deferred one, and a settle keeps the larger. An unfused optimizer marks every step."""
        fill_rows(self._columns["version"], rows, self.clock, getattr(self, "backend", None))

    def track_deletions(self, enabled: bool = True) -> None:
        """Keep a log of deleted keys (erase, evict, restrict, clear) for :meth:`changes_since`."""
        self._deleted = [] if enabled else None

    def changes_since(self, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [R] int64 written after clock ``version``, keys [K] deleted after it)``.

        Applying the deletions first and then the rows reproduces the table. Deleted keys need
        :meth:`track_deletions`; without it the second tensor is empty.
        """
        rows = (self._cols["version"][: self._size] > version).nonzero().squeeze(1)
        deleted = [keys for stamp, keys in (self._deleted or []) if stamp > version]
        keys = torch.cat(deleted) if deleted else torch.empty(0, dtype=self.key_dtype, device=self.device)
        return rows, keys

    def forget_deletions(self, version: int) -> None:
        """Drop logged deletions at or before clock ``version`` (after a save consumed them)."""
        if self._deleted is not None:
            self._deleted = [(stamp, keys) for stamp, keys in self._deleted if stamp > version]

    def _log_deleted(self, keys: torch.Tensor) -> None:
        if self._deleted is not None and keys.numel():
            self._deleted.append((self.clock, keys))
