"""Write-backs: rows that lookups found below the cache, waiting per table, and the thread that inserts them.

Above a model's ``hit_rate_threshold`` a lookup does not insert the rows it fetched into the cache itself: it adds
them to the table's :class:`PendingRows`, and a full batch goes to the background thread of :class:`WriteBack`.
"""

from __future__ import annotations

import queue
import random
import threading
from typing import TYPE_CHECKING, Iterable, Optional

import torch

if TYPE_CHECKING:
    from .cache import TableState

__all__ = ["PendingRows", "WriteBack", "batch_rows"]

_FLUSH = object()
_WRITEBACK_ROWS = 4096  # most rows per background write-back: a larger one keeps lookups off the cache longer


def batch_rows(capacity: int) -> int:
    """Rows per background write-back into a cache of ``capacity`` rows."""
    # A batch of 1/16 of the cache keeps rows fetched in one batch from evicting each other.
    return max(1, min(_WRITEBACK_ROWS, capacity // 16))


class PendingRows:
    """Rows of one table waiting for a background write-back. Guarded by the table's ``stats_lock``."""

    def __init__(self, batch_rows: int, jitter: random.Random) -> None:
        self.batch_rows, self._jitter = batch_rows, jitter
        self.clear()

    def clear(self) -> None:
        """Drop the waiting rows and draw the size of the next batch."""
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (keys, rows) as the lookups found them
        self.rows = 0
        # Each write-back takes a random 50-100% of a table's batch size. With one size, tables that miss at the
        # same rate (the features of one request) would all fill their batches in the same request, and the inserts
        # would come in bursts that slow a run of requests down together.
        self.flush_at = max(1, round(self.batch_rows * self._jitter.uniform(0.5, 1.0)))

    def add(self, keys: torch.Tensor, rows: torch.Tensor) -> bool:
        """Add rows; returns whether the waiting rows make a batch now."""
        self.chunks.append((keys, rows))
        self.rows += keys.numel()
        return self.rows >= self.flush_at

    def take(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The waiting rows as one ``(keys, rows)`` (and a new batch begins), or None when there are none."""
        if not self.chunks:
            return None
        keys, rows = zip(*self.chunks)
        self.clear()
        return torch.cat(keys), torch.cat(rows)


class WriteBack:
    """The background thread that inserts batches of pending rows into the caches, and its queue."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=64)
        self.errors = 0  # write-backs that failed (each only costs later cache misses)
        self._worker = threading.Thread(target=self._drain, name="dynemb-ps-writeback", daemon=True)
        self._worker.start()

    def defer(self, t: TableState, keys: torch.Tensor, rows: torch.Tensor, epoch: int) -> None:
        """Add rows read at ``epoch`` to ``t``'s pending rows (none if an update came since); queue a full batch."""
        with t.stats_lock:
            if epoch != t.epoch:
                return
            job = self._take(t) if t.pending.add(keys, rows) else None
        if job is not None:
            try:
                self._queue.put_nowait(job)
            except queue.Full:  # the cache is warm; dropping a write-back only costs later misses
                pass

    def flush(self, tables: Iterable[TableState]) -> None:
        """Queue the pending rows of ``tables`` and wait until every queued write-back is done."""
        for t in tables:
            with t.stats_lock:
                job = self._take(t)
            if job is not None:
                self._queue.put(job)
        done = threading.Event()
        self._queue.put((_FLUSH, done))
        done.wait(timeout=30)

    def close(self) -> None:
        self._queue.put(None)
        self._worker.join(timeout=5)

    @staticmethod
    def _take(t: TableState) -> Optional[tuple]:
        """``t``'s pending rows as one job (call under ``t.stats_lock``), or None."""
        taken = t.pending.take()
        return None if taken is None else (t, *taken, t.epoch)

    @staticmethod
    def _fill(t: TableState, keys: torch.Tensor, rows: torch.Tensor, epoch: int) -> None:
        # Raised before taking the lock, so that readers go around the cache instead of queueing behind the insert.
        t.filling = True
        try:
            t.insert_if_current(keys, rows, epoch)
        finally:
            t.filling = False

    def _drain(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job[0] is _FLUSH:
                job[1].set()
                continue
            try:
                self._fill(*job)
            except Exception:  # a failed write-back only costs a later cache miss; keep the worker alive
                self.errors += 1
