"""The slow tier of a :class:`~dynemb.table.tiered.TieredTable`: rows that left the fast tier, with every column.

A :class:`SlowStore` is a row store of its own (an index and row-aligned columns, as a table has) whose columns
are views of one row-interleaved buffer, either in host memory (pinned when the fast tier is on CUDA, so copies to
the device can overlap) or in a memory-mapped row file in a private directory under a path. Inside a tiered table
its index is a view of the table's one index of both tiers (:class:`~dynemb.table.tier_moves.SlowIndex`), kept
with the fast tier: about 26-52 bytes per key for int64 keys, against the row itself (a ``dim=64`` float32 row
with one Adagrad slot is 536 bytes).

Memory-mapped files were measured against RocksDB (``rocksdict``) and LMDB for row-sized values
(``benchmarks/slow_stores.py``): moving a batch of rows is one gather or scatter over the mapped columns, with no
per-key encoding, and ran 3-12x faster. The files are a cache, not a checkpoint: a store starts
empty, and its directory is removed when it is closed or collected; a process that dies leaves its directory, which
no later run reads and the next store opened under the same path (on the same host) removes. Durability comes from
checkpoints, which see the table as one (see ``TieredTable.export``).
"""

from __future__ import annotations

import math
import os
import re
import socket
import shutil
import tempfile
import weakref

import torch

from ..checks import check_keys
from .hashing import unique_by_hash
from .rows import Rows, RowStore

__all__ = ["SlowStore", "swap_rows"]

_VERSION = "version"
_PREFIX = "dynemb-slow-"
_HOST = socket.gethostname().replace("-", "_")


class SlowStore(RowStore):
    """Rows keyed like ``table``'s (same dim, dtypes and slots), on the host or in files under ``path``.

    Args:
        table: the fast tier whose row layout this store mirrors (slots added to it later are added with
            :meth:`add_slot`).
        where: ``"host"`` for host memory, or a directory under which a private subdirectory of row files is made.
        pin: place host columns in pinned memory (for a CUDA fast tier).
        init_capacity: rows allocated up front.

    Example:
        >>> from dynemb.table import KeyValueTable
        >>> t = KeyValueTable(2, initializer="zeros")
        >>> s = SlowStore(t, "host")
        >>> s.put(Rows(torch.tensor([5, -1]), torch.ones(2, 2), torch.tensor([3, 4]), {}), torch.tensor([1, 1]))
        >>> s.find(torch.tensor([-1, 7])).tolist()
        [1, -1]
        >>> s.take(torch.tensor([-1]))[0].scores.tolist(), s.size()
        ([4], 1)
    """

    def __init__(self, table, where: str | os.PathLike = "host", *, pin: bool = False,
                 init_capacity: int = 1024) -> None:
        self.dim, self.dtype, self.key_dtype = table.dim, table.dtype, table.key_dtype
        self.device = torch.device("cpu")
        # its rows are host memory: a CUDA table's backend (triton, say) is not the one for them
        self.backend = table.backend if table.device.type == "cpu" else None
        self.max_capacity = None
        self.initializer, self.seed, self.on_evict = None, 0, None
        self.clock = 0
        self._deleted = None
        self.pin = bool(pin)
        self.directory = None
        if where != "host":
            path = os.path.abspath(os.fspath(where))
            if os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(f"Tiers.slow must be 'host' or a directory, got {os.fspath(where)!r}: a file is there")
            os.makedirs(path, exist_ok=True)
            _remove_orphans(os.fspath(where))
            self.directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{_HOST}-{os.getpid()}-", dir=os.fspath(where))
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.directory, True)
        self._files = 0
        self._path = None  # the row file of the columns now (disk tier)
        self._init_storage(init_capacity)
        self._resize_columns(self.capacity, 0)  # the columns, placed
        for name in table.slot_names:  # placed as they are added
            self.add_slot(name, table.slot(name).shape[1], table._slot_init[name], table.slot(name).dtype)

    # ------------------------------------------------------------------ placement of columns
    _PAIRED_STAMPS = False  # every column is a view of one row-interleaved buffer (see _resize_columns)

    def _resize_columns(self, capacity: int, live: int) -> None:
        """Every column reallocated to ``capacity`` rows, its first ``live`` rows copied, all of them views of one
        buffer whose rows hold a row of every column side by side (key, value, score, version, slots): in a file
        on disk, in pinned memory for a CUDA fast tier, else in RAM.

        Why interleaved: rows move between the tiers at random positions, and on disk each page a call dirties is
        written back by the kernel, after which the next store to it takes a page fault. One buffer dirties one
        page a row moved; a file per column dirtied one per column (5 with one optimizer slot: 17,000 faults a
        step of 4 tables of 1M rows at a 10% fast tier, 44 ms of system time).
        """
        layout, width = _layout({name: (tuple(col.shape[1:]), col.dtype) for name, col in self._cols.items()})
        old_path = self._path
        if self.directory is None:
            buf = torch.empty((capacity, width), dtype=torch.uint8, pin_memory=self.pin)
            self._path = None
        else:
            # A new file per allocation: the old mapping stays valid while rows are copied over, then is unlinked.
            self._files += 1
            self._path = os.path.join(self.directory, f"{self._files:06d}.rows")
            buf = torch.from_file(self._path, shared=True, size=capacity * width, dtype=torch.uint8)
            buf = buf.view(capacity, width)
        fresh = {}
        for name, col in self._cols.items():
            start, nbytes, shape = layout[name]
            view = buf[:, start:start + nbytes].view(col.dtype)
            fresh[name] = view[:, 0] if not shape else view.view(capacity, *shape)
            fresh[name][:live] = col[:live]
        self._cols = fresh
        self._marks = None
        if old_path is not None:
            os.unlink(old_path)  # Linux keeps the pages mapped until the old tensors go

    def row_nbytes(self) -> int:
        """Bytes a row takes here: every column, interleaved (see :meth:`_resize_columns`)."""
        return _layout({name: (tuple(col.shape[1:]), col.dtype) for name, col in self._cols.items()})[1]

    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        had = f"slot:{name}" in self._cols
        super().add_slot(name, dim, init, dtype)
        if not had:
            self._resize_columns(self.capacity, self._size)

    def cast(self, dtype: torch.dtype) -> None:
        before = self._cols["value"]
        super().cast(dtype)  # checks dtype; a converted copy in RAM, placed again below
        if self._cols["value"] is not before:
            self._resize_columns(self.capacity, self._size)

    def close(self) -> None:
        """Drop every row and remove the store's files."""
        self._cols = {}
        if self.directory is not None:
            self._finalizer()

    # ------------------------------------------------------------------ rows
    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Row of each key ``[N]`` in this store, ``-1`` where absent."""
        return self.index.find(keys.to(self.device))

    def put(self, rows: Rows, versions: torch.Tensor) -> None:
        """Store ``rows`` (keys unique and absent here) with their version stamps ``[N]``."""
        self.exchange(rows.keys[:0], rows, versions)

    def take(self, keys: torch.Tensor) -> tuple[Rows, torch.Tensor]:
        """Remove ``keys`` (unique, all present) and return their rows and version stamps."""
        return self.exchange(keys, None, None)

    def exchange(self, keys: torch.Tensor, rows: Rows | None, versions: torch.Tensor | None):
        """Take ``keys`` (unique, all present) out and put ``rows`` (keys unique, absent) in, the incoming rows
        filling the rows the outgoing ones free. Returns the rows taken and their version stamps."""
        at = self.index.find(keys.to(self.device))
        taken = self.rows(at)
        swap_rows(self, at, rows, versions)
        return taken

    def rows(self, rows: torch.Tensor) -> tuple[Rows, torch.Tensor]:
        """Copies of ``rows`` ``[N]`` and their version stamps."""
        return self._take(rows), self._cols[_VERSION].index_select(0, rows)

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        """Remove the ``keys`` found here; returns those keys (unique)."""
        flat = check_keys(keys, self.key_dtype, self.device)
        unique = unique_by_hash(flat, self.backend)[0]
        rows = self.index.find(unique)
        hit = rows >= 0
        swap_rows(self, rows[hit], None, None)
        return unique[hit]

    def export(self) -> tuple[Rows, torch.Tensor]:
        """Copies of every row (in row order) and their version stamps."""
        return self.rows(torch.arange(self._size))

    def clear(self) -> None:
        self._size = 0
        self.index.clear()


def _layout(columns: dict) -> tuple[dict, int]:
    """``({name: (byte offset, bytes, row shape)}, row bytes)`` of ``columns`` (``name: (row shape, dtype)``) side by
    side in one row, each aligned to its element size, the row padded to 8 bytes."""
    layout, at = {}, 0
    for name, (shape, dtype) in columns.items():
        size = dtype.itemsize
        at = -(-at // size) * size
        layout[name] = (at, math.prod(shape) * size, shape)
        at += math.prod(shape) * size
    return layout, max(8, -(-at // 8) * 8)


def swap_rows(store: RowStore, freed: torch.Tensor, incoming: Rows | None, versions: torch.Tensor | None) -> None:
    """Free the unique rows ``freed`` of ``store`` (their keys leave the index) and place ``incoming`` (keys
    absent) with their ``versions``: first in the freed rows, then after the last live row. Freed rows left over
    are filled from the end (``_compact``), so live rows stay ``0 .. size-1``. Both tiers move rows this way."""
    n = 0 if incoming is None else incoming.keys.numel()
    k = min(freed.numel(), n)
    store._reserve(store._size + n - k)  # before the index forgets the freed keys: a rehash re-reads rows 0..size
    if freed.numel():
        store.index.remove(store.index.find_slots(store.row_keys.index_select(0, freed)))
    if n:
        dest = torch.cat([freed[:k], torch.arange(store._size, store._size + n - k, device=store.device)])
        store.index.insert(incoming.keys.to(store.device), dest)
        cols = {"key": incoming.keys, "value": incoming.values, "score": incoming.scores, _VERSION: versions,
                **{f"slot:{name}": incoming.slots[name] for name in store._slot_init}}
        store._write_rows(dest, k, {name: col.to(store.device) for name, col in cols.items()})
        store._size += n - k
    if freed.numel() > k:
        store._compact(freed[k:])


def _remove_orphans(where: str) -> None:
    """Remove the row-file directories under ``where`` left by processes of this host that died (killed, say)
    without removing theirs. Directories of live processes and of other hosts are left alone."""
    pattern = re.compile(re.escape(_PREFIX + _HOST) + r"-(\d+)-")
    for name in os.listdir(where):
        match = pattern.match(name)
        if match is None or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(where, name), ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass
