"""The slow tier of a :class:`~dynemb.table.tiered.TieredTable`: rows that left the fast tier, with every column.

A :class:`SlowStore` is a row store of its own (an index and row-aligned columns, as a table has) whose columns
live either in host memory (pinned when the fast tier is on CUDA, so copies to the device can overlap) or in
memory-mapped row files, one file per column, in a private directory under a path. The index stays in RAM: about
26-52 bytes per row for int64 keys, against the row itself (a ``dim=64`` float32 row with one Adagrad slot is 536
bytes).

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
        self.backend = table.backend
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
        self._init_storage(init_capacity)
        self._cols = {name: self._placed(name, col) for name, col in self._cols.items()}
        for name in table.slot_names:  # placed as they are added
            self.add_slot(name, table.slot(name).shape[1], table._slot_init[name], table.slot(name).dtype)

    # ------------------------------------------------------------------ placement of columns
    def _placed(self, name: str, col: torch.Tensor) -> torch.Tensor:
        """``col`` moved to where this store keeps columns (a new file, or pinned memory)."""
        fresh = self._new_column(name, col, col.shape[0])
        fresh.copy_(col)
        return fresh

    _PAIRED_STAMPS = False  # every column is placed (a file, pinned memory) on its own

    def _new_column(self, name: str, col: torch.Tensor, capacity: int) -> torch.Tensor:
        shape = (capacity,) + tuple(col.shape[1:])
        if self.directory is None:
            return torch.empty(shape, dtype=col.dtype, pin_memory=self.pin)
        # A new file per allocation: the old mapping stays valid while rows are copied over, then is unlinked.
        self._files += 1
        path = os.path.join(self.directory, f"{self._files:06d}.{name.replace(':', '_')}.rows")
        fresh = torch.from_file(path, shared=True, size=math.prod(shape), dtype=col.dtype).view(shape)
        old = getattr(col, "_dynemb_path", None)
        if old is not None:
            os.unlink(old)  # Linux keeps the pages mapped until the old tensor goes
        fresh._dynemb_path = path
        return fresh

    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().add_slot(name, dim, init, dtype)
        key = f"slot:{name}"
        self._cols[key] = self._placed(key, self._cols[key])

    def cast(self, dtype: torch.dtype) -> None:
        before = self._cols["value"]
        super().cast(dtype)  # checks dtype; a converted copy in RAM, placed again below
        if self._cols["value"] is not before:
            self._cols["value"] = self._placed("value", self._cols["value"])
            if getattr(before, "_dynemb_path", None) is not None:
                os.unlink(before._dynemb_path)

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
