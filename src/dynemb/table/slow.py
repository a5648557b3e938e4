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

import errno
import math
import os
import re
import socket
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from ..checks import check_keys
from .hashing import unique_by_hash
from .rows import Rows, RowStore

__all__ = ["LogStore", "SlowStore", "swap_rows"]

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
            try:
                os.makedirs(path, exist_ok=True)
                _remove_orphans(os.fspath(where))
                self.directory = tempfile.mkdtemp(prefix=f"{_PREFIX}{_HOST}-{os.getpid()}-", dir=os.fspath(where))
            except OSError as e:  # read-only, not ours, a file on the path: name the argument, not our temp name
                raise type(e)(e.errno, f"Tiers.slow={os.fspath(where)!r} must be a directory this process can "
                                       f"write row files into: {e.strerror}", e.filename) from e
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
            # The store moves to it only once it is made (a full disk leaves it on its old file, named as before).
            path = os.path.join(self.directory, f"{self._files + 1:06d}.rows")
            buf = _row_file(path, capacity, width)
            self._files, self._path = self._files + 1, path
        self._buf, self._file_layout = buf, (layout, width)  # the raw rows ``[capacity, width]`` uint8
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
        """Copies of every row (in row order: :meth:`stored_rows`) and their version stamps."""
        return self.rows(self.stored_rows())

    def stored_rows(self) -> torch.Tensor:
        """The rows ``[size]`` that hold keys, ascending: ``0 .. size-1`` here (:class:`LogStore`: wherever)."""
        return torch.arange(self._size)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, rows)`` ``[size]`` of the rows that hold keys (what an index rebuild inserts)."""
        rows = self.stored_rows()
        return self.row_keys.index_select(0, rows), rows

    def pack(self) -> None:
        """Make rows ``0 .. size-1`` the ones that hold keys (already so here; see :class:`LogStore`)."""

    def clear(self) -> None:
        self._size = 0
        self.index.clear()


class LogStore(SlowStore):
    """A :class:`SlowStore` of row files written as a log: rows going down are appended with a few large
    sequential ``pwrite`` calls, and the mapping is only read.

    Why: a row written through a shared mapping dirties its page, and once the kernel has written the page back
    (every ~30 s) the next store to it takes a page fault (``page_mkwrite``), which may also wait for that write
    to finish: after each write-back, steps ran 2-4x slower for about 50 steps while thousands of pages faulted
    again. Pages changed by ``pwrite`` are never written through the mapping, so no store faults.

    Layout: the file is a ring of ``capacity`` rows. Rows are appended at the head; a row that goes up, is erased or
    taken leaves a hole (``_holds`` says which rows hold keys), and the index stores each key's row in the ring. When
    an append would reach the tail, the oldest rows are cleaned: those still live are appended again and the tail
    moves past them. The ring is kept at least twice the live rows (plus what a call appends), so cleaning a step
    copies about as many rows as the step appends (cold rows come round once a turn of the ring). A change of layout
    (a slot added, a cast) calls :meth:`pack` first: one sequential rewrite into a new file. Streamed checkpoints
    and exports read the rows ``_holds`` marks where they stand (``checkpoint.tiered_stream``): no rewrite, so no
    free space needed here.

    Args: as :class:`SlowStore`; ``where`` must be a directory.
    """

    _CHUNK = 4096  # rows a rewrite copies at a time (a streamed save's memory bound counts them)
    _CLEAN_MIN = 4096  # rows of the tail a cleaning pass looks at, at least

    def __init__(self, table, where: str | os.PathLike, *, init_capacity: int = 1024) -> None:
        if where == "host":
            raise ValueError("a LogStore keeps row files: where must be a directory, got 'host'")
        self._holds = None
        self._head = self._tail = 0
        self._fd = self._fd_closer = None
        self._writes = []  # appends handed to the writer thread, not yet seen complete
        self._failed = None  # the error of an append that failed: every later use raises (its rows were never written)
        self.rewrites = 0  # counts rewrites (pack, growth): rows found before one have moved
        super().__init__(table, where, init_capacity=init_capacity)

    # ---------------------------------------------------------------- appends in the background
    #: appends written by a background thread (:func:`_writer`), off the step's critical path; False: at once
    WRITE_BEHIND = True

    def _sync(self) -> None:
        """Wait for the appends in flight: every read of the mapping (the columns, the raw rows) comes after
        them, so it sees each row appended (an error writing one is raised here, and at every later call: keys in
        the index point at rows that were never written)."""
        while self._writes:
            try:
                self._writes[0].result()
            except Exception as error:  # noqa: BLE001 - the writer's error, kept (an interrupted wait is not one)
                if self._failed is None:
                    self._failed = error
                    self._writes.pop(0)
                    raise
            self._writes.pop(0)
        if self._failed is not None:
            raise RuntimeError(f"LogStore at {self.directory}: an append of rows failed ({self._failed}); the keys it "
                               "held have rows that were never written") from self._failed

    @property
    def _cols(self) -> dict:
        self._sync()
        return RowStore._cols.fget(self)

    @_cols.setter
    def _cols(self, columns: dict) -> None:
        RowStore._cols.fset(self, columns)

    def _column(self, name: str) -> torch.Tensor:
        self._sync()
        return self._columns[name]

    @property
    def row_keys(self) -> torch.Tensor:
        self._sync()
        return self._columns["key"]

    @property
    def _buf(self) -> torch.Tensor:
        """The raw rows ``[capacity, width]`` (uint8) of the mapping, appends in flight written first."""
        self._sync()
        return self._raw

    @_buf.setter
    def _buf(self, raw: torch.Tensor) -> None:
        self._raw = raw

    # ---------------------------------------------------------------- file and ring
    def _resize_columns(self, capacity: int, live: int) -> None:
        """As :meth:`SlowStore._resize_columns` (a layout change: a slot added, a cast) on packed rows."""
        if self._holds is not None and not self._packed():
            raise RuntimeError("LogStore: pack() before the columns are placed again")
        super()._resize_columns(capacity, live)
        self._opened(live)

    def _opened(self, live: int) -> None:
        """After a new file: its descriptor, the ring holding rows ``0 .. live-1``."""
        self._sync()
        if self._fd_closer is not None:
            self._fd_closer()
        self._fd = os.open(self._path, os.O_RDWR)
        self._fd_closer = weakref.finalize(self, os.close, self._fd)
        self._holds = torch.zeros(self.capacity, dtype=torch.bool)
        self._holds[:live] = True
        self._tail, self._head = 0, live
        self.rewrites += 1

    def _packed(self) -> bool:
        return self._tail == 0 and self._head == self._size

    def _write(self, raw: torch.Tensor) -> torch.Tensor:
        """Append the raw rows ``raw [n, width]`` (uint8; the caller no longer touches them) at the head (room
        there checked); returns their rows. The ``pwrite`` runs on the writer thread (:attr:`WRITE_BEHIND`): it
        releases the GIL, so the step goes on while the kernel copies the rows into the page cache."""
        n, cap, width = raw.shape[0], self.capacity, self._file_layout[1]
        start = self._head % cap
        first = min(n, cap - start)
        parts = [(_bytes(raw[:first]), start * width)] + ([(_bytes(raw[first:]), 0)] if n > first else [])
        if self.WRITE_BEHIND:
            # at most one append in flight a store (the step's last is long done by its next): a stream of puts
            # (a checkpoint loading) holds one chunk's bytes, not all of them
            self._sync()
            self._writes.append(_writer().submit(self._write_parts, parts))
        else:
            self._write_parts(parts)
        self._head += n
        self._holds[start:start + first] = True  # one range, or two where it wrapped round
        self._holds[:n - first] = True
        if n == first:
            return torch.arange(start, start + n)
        return torch.cat([torch.arange(start, cap), torch.arange(n - first)])

    def _write_parts(self, parts: list) -> None:
        for data, offset in parts:
            _pwrite_bytes(self._fd, data, offset)

    def _make_room(self, n: int) -> bool:
        """Clean the tail until ``n`` rows fit before it; returns whether live rows moved (to the head)."""
        cap, moved = self.capacity, False
        while self._head - self._tail + n > cap:
            c = min(max(n, self._CLEAN_MIN), self._head - self._tail)
            if c == 0:  # _reserve sizes the ring for what a call appends: never reached
                raise RuntimeError(f"LogStore: {n} rows do not fit a ring of {cap}")
            rows = (torch.arange(self._tail, self._tail + c)) % cap
            alive = rows[self._holds.index_select(0, rows)]
            self._tail += c
            self._holds[rows] = False
            if alive.numel():  # still holding keys: appended again, the index told where
                keys = self._cols["key"].index_select(0, alive)
                again = self._write(self._buf.index_select(0, alive))
                self.index.set_rows(self.index.find_slots(keys), again)
                self.row_moves += 1
                moved = True
        return moved

    def _append(self, raw: torch.Tensor) -> torch.Tensor:
        """Append ``raw [n, width]`` (keys absent), cleaning the tail first where the ring has no room; returns the
        rows the keys now have (the caller sets them in the index and counts them in ``_size``)."""
        self._make_room(raw.shape[0])
        return self._write(raw)

    def claim(self, n: int) -> tuple[torch.Tensor, bool]:
        """``n`` rows at the head for the caller to write through the mapping (a CUDA fast tier's staged link
        writes rows in place), and whether cleaning moved live rows (rows found before are then stale)."""
        moved = self._make_room(n)
        rows = torch.arange(self._head, self._head + n) % self.capacity
        self._head += n
        self._holds[rows] = True
        return rows, moved

    def _rewrite(self, capacity: int) -> None:
        """The live rows copied, packed, into a new file of ``capacity`` rows (sequential writes); the index told."""
        rows = self.stored_rows()
        n = rows.numel()
        layout, width = self._file_layout
        old_path, old_buf = self._path, self._buf
        path = os.path.join(self.directory, f"{self._files + 1:06d}.rows")
        buf = _row_file(path, capacity, width)  # its blocks reserved: raises here, on a full disk, not mid-append
        fd = os.open(path, os.O_RDWR)
        try:
            for i in range(0, n, self._CHUNK):
                _pwrite_all(fd, old_buf.index_select(0, rows[i:i + self._CHUNK]), i * width)
        except BaseException:  # a full disk: the store stays on its file as it was, the new one goes
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._files, self._path = self._files + 1, path
        self._buf = buf
        fresh = {}
        for name, col in self._cols.items():
            start, nbytes, shape = layout[name]
            view = buf[:, start:start + nbytes].view(col.dtype)
            fresh[name] = view[:, 0] if not shape else view.view(capacity, *shape)
        self._cols = fresh
        self._marks = None
        if n:
            self.index.set_rows(self.index.find_slots(self._cols["key"][:n]), torch.arange(n))
        self.row_moves += 1
        self._opened(n)
        os.unlink(old_path)

    def pack(self) -> None:
        """Make rows ``0 .. size-1`` the ones that hold keys (a rewrite, where the ring has holes or wrapped)."""
        if not self._packed():
            self._rewrite(self.capacity)

    def _row_limit(self) -> int:
        """Row ids this level may use: its range in a tiered table's index (int32 row ids on their own)."""
        return getattr(self.index, "end", 1 << 31) - getattr(self.index, "base", 0)

    def ring_rows(self, n: int) -> int:
        """Rows the ring needs for ``n`` live rows: twice as many (cleaning then copies about one row per row
        appended), within the level's row ids."""
        return min(2 * n + self._CLEAN_MIN, self._row_limit())

    def _reserve(self, n: int) -> None:
        """Room for ``n`` live rows with the ring's slack (a rewrite into a larger file), and the index sized."""
        limit = self._row_limit()
        if n > limit:
            self.index.needs_rehash(n)  # a tiered table's view raises: too many rows for the level
            raise ValueError(f"a LogStore holds at most {limit} rows, asked for {n}")
        need = self.ring_rows(n)
        if need > self.capacity:
            self._rewrite(min(max(need, int(self.capacity * 1.5)), limit))
        if self.index.needs_rehash(n):
            keys, rows = self.stored()
            self.index.rehash(keys, rows, n)

    def stored_rows(self) -> torch.Tensor:
        """The rows ``[size]`` that hold keys, ascending."""
        if self._packed():
            return torch.arange(self._size)
        return self._holds.nonzero().squeeze(1)

    def nbytes(self) -> int:
        return super().nbytes() + (0 if self._holds is None else self._holds.numel())

    # ---------------------------------------------------------------- rows
    def raw_rows(self, columns: dict, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, width]`` uint8 rows in this store's layout from ``columns`` (name: ``[n, ...]`` tensors, or, with
        ``rows``, a table's columns to read ``rows`` of)."""
        layout, width = self._file_layout
        n = next(iter(columns.values())).shape[0] if rows is None else rows.numel()
        raw = torch.zeros((n, width), dtype=torch.uint8)
        for name, (start, nbytes, shape) in layout.items():
            col = columns[name]
            view = raw[:, start:start + nbytes].view(col.dtype)
            view = view[:, 0] if not shape else view.view(n, *shape)
            view.copy_(col if rows is None else col.index_select(0, rows))
        return raw

    def put(self, rows: Rows, versions: torch.Tensor) -> None:
        n = rows.keys.numel()
        if n == 0:
            return
        self._reserve(self._size + n)
        cols = {"key": rows.keys, "value": rows.values, "score": rows.scores, _VERSION: versions,
                **{f"slot:{name}": rows.slots[name] for name in self._slot_init}}
        at = self._append(self.raw_rows({name: col.to("cpu") for name, col in cols.items()}))
        self.index.insert(rows.keys, at)
        self._size += n

    def _drop(self, at: torch.Tensor) -> None:
        """Rows ``at`` (unique, live) leave: out of the index, holes in the ring."""
        if at.numel():
            self.index.remove(self.index.find_slots(self._cols["key"].index_select(0, at)))
            self._holds[at] = False
            self._size -= at.numel()

    def exchange(self, keys: torch.Tensor, rows: Rows | None, versions: torch.Tensor | None):
        at = self.index.find(keys.to(self.device))
        taken = self.rows(at)
        self._drop(at)
        if rows is not None:
            self.put(rows, versions)
        return taken

    def erase(self, keys: torch.Tensor) -> torch.Tensor:
        flat = check_keys(keys, self.key_dtype, self.device)
        unique = unique_by_hash(flat, self.backend)[0]
        rows = self.index.find(unique)
        hit = rows >= 0
        self._drop(rows[hit])
        return unique[hit]

    def _compact(self, dead: torch.Tensor) -> None:
        """Rows ``dead`` (unique, already out of the index) become holes: nothing moves."""
        self._holds[dead] = False
        self._size -= dead.numel()

    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        if self._holds is not None and f"slot:{name}" not in self._cols:
            self.pack()
        super().add_slot(name, dim, init, dtype)

    def cast(self, dtype: torch.dtype) -> None:
        if self._holds is not None and dtype != self.dtype:
            self.pack()
        super().cast(dtype)

    def clear(self) -> None:
        super().clear()
        self._holds.zero_()
        self._head = self._tail = 0

    def close(self) -> None:
        try:
            if self._failed is None:  # an append's error raised before is not raised again
                self._sync()
        finally:
            if self._fd_closer is not None:
                self._fd_closer()
            super().close()


_WRITER: list = [None, None]  # (pid, executor): one writer thread a process, made on first use


def _writer() -> ThreadPoolExecutor:
    """The process's writer thread of :class:`LogStore` appends (one: a store's appends land in order, and the
    step loses at most one core's share to it). A forked child makes its own."""
    with _WRITER_LOCK:
        if _WRITER[0] != os.getpid():
            _WRITER[:] = [os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="dynemb-row-log")]
        return _WRITER[1]


_WRITER_LOCK = threading.Lock()


def _row_file(path: str, capacity: int, width: int) -> torch.Tensor:
    """A new row file of ``capacity`` rows of ``width`` bytes at ``path``, mapped as ``[capacity, width]`` uint8, its
    disk blocks reserved up front (``posix_fallocate``).

    Why reserve: the file is sparse otherwise, and a full disk would then fail a later write into it: an append on
    the writer thread (its rows lost, the table unusable even once there is room again), or a store through the
    mapping (SIGBUS). Reserved here, the one failure is this call's, before any row moves: an ``OSError`` naming
    the ``Tiers.slow`` directory, the store left on its old file."""
    nbytes = capacity * width
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            if nbytes and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            os.ftruncate(fd, nbytes)  # a file system that cannot reserve: sparse, as before
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        where = os.path.dirname(os.path.dirname(path))
        raise type(e)(e.errno, f"Tiers.slow={where!r}: no room for a row file of {nbytes:,} bytes ({capacity:,} rows): "
                               f"{e.strerror}; no row moved (free space there, or give Tiers.slow another "
                               "directory)", path) from e
    os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8).view(capacity, width)


def _bytes(raw: torch.Tensor) -> memoryview:
    """The bytes of the rows ``raw`` (a view where they are contiguous)."""
    return memoryview(raw.contiguous().numpy()).cast("B")


def _pwrite_all(fd: int, raw: torch.Tensor, offset: int) -> None:
    """Write the rows ``raw`` at byte ``offset`` of ``fd``."""
    _pwrite_bytes(fd, _bytes(raw), offset)


def _pwrite_bytes(fd: int, data: memoryview, offset: int) -> None:
    """Write ``data`` at byte ``offset`` of ``fd`` (a regular file writes all at once; loop for the rare short
    write)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


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
