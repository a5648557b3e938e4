"""Row storage under :class:`~dynemb.table.kv.KeyValueTable`: growth, placement of new rows, eviction, compaction.

Rows are kept compact: live rows are ``0 .. size-1`` of every column, so export is a slice and memory tracks the
number of keys. Evicted rows are reused in place by the keys that displaced them; ``erase`` and ``restrict`` fill
the holes they leave with rows from the end. Every row-aligned tensor (keys, values, scores, version stamps, each
optimizer slot) is a *column* in one dict, so growth, compaction, eviction and export move them together by
construction.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from ..kernels.dispatch import kernels_for
from .changes import ChangeLog
from ..checks import check_int, resolve_device
from .columns import RowColumns
from .hashing import key_hash, mix64
from .index import HashIndex
from .initializers import CallableInitializer, computed_by_kernel, initial_rows
from .huge_pages import empty_storage, to_storage
from .ops import copy_rows, gather_rows, lowest_rows, scatter_rows, stamp_kernels

__all__ = ["Rows", "EvictHook", "RowStore"]

_MAX_DEFERRED = 255  # distinct deferred stamp pairs: a uint8 tag each (0: none)


class Rows(NamedTuple):
    """A set of rows taken out of a table (evicted or exported). ``slots`` maps slot name to ``[E, d]``."""

    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    slots: dict


EvictHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class RowStore(ChangeLog, RowColumns):
    """The storage half of a :class:`~dynemb.table.kv.KeyValueTable`: an index, the columns and their upkeep.

    The table's constructor sets the configuration read here (``dim``, ``dtype``, ``key_dtype``, ``device``,
    ``backend``, ``max_capacity``, ``initializer``, ``seed``, ``on_evict``) and the counters (``clock``,
    ``inserted``, ``removed``, ``evicted``), then calls :meth:`_init_storage`. Methods here keep the columns, the
    index and ``size`` consistent; the public operations decide what to store.
    """

    #: whether ``score`` and ``version`` share one ``[capacity, 2]`` tensor (see :meth:`_stamp_columns`); a store
    #: that places each column itself (the slow tier's files) keeps them apart
    _PAIRED_STAMPS = True
    #: whether lookups may defer their stamps (:meth:`_defer_stamps`); a store whose every lookup moves rows between
    #: tiers keeps them written
    _DEFERS_STAMPS = True
    _pending: tuple | list = ()  # deferred stamp pairs (score, version); a row marked t takes pair t - 1
    _marks: torch.Tensor | None = None  # [capacity] uint8 tags of the rows with deferred stamps (0: none)
    _clock = 0
    _clock_high = 0  # the highest clock since the last load: no version written since is above it
    #: the :class:`~dynemb.table.group.TableGroup` whose device counter holds this table's size while its grouped
    #: lookups run (``size`` and ``inserted`` are read back from it, once for the group, when asked); or None
    _ledger = None
    _live = 0
    _inserted = 0
    #: advances whenever a column or the index is reallocated (a group's kernels hold the tensors' addresses)
    storage_generation = 0

    @property
    def _size(self) -> int:
        """Live rows (``size()``); read back from the device once for a whole group after grouped lookups."""
        ledger = self._ledger
        if ledger is not None and ledger.pending:
            ledger.settle()
        return self._live

    @_size.setter
    def _size(self, value: int) -> None:
        ledger = self._ledger
        if ledger is not None:
            if ledger.pending:
                ledger.settle()
            ledger.stale = True  # the host's count is the truth now: the group uploads it before its next call
        self._live = value

    @property
    def inserted(self) -> int:
        """Keys inserted (a counter of ``size == inserted - removed - evicted``); settled as ``size`` is."""
        ledger = self._ledger
        if ledger is not None and ledger.pending:
            ledger.settle()
        return self._inserted

    @inserted.setter
    def inserted(self, value: int) -> None:
        ledger = self._ledger
        if ledger is not None and ledger.pending:
            ledger.settle()
        self._inserted = value

    @property
    def clock(self) -> int:
        """Advances once per call that changes rows; rows written are stamped with it."""
        return self._clock

    @clock.setter
    def clock(self, value: int) -> None:
        # A clock set back (a rolled-back call, a restored state dict) leaves versions above it; deferred stamps
        # settle as the larger version, so they wait until the clock is back at its high (see _defer_stamps).
        self._clock = value
        if value > self._clock_high:
            self._clock_high = value

    def _init_storage(self, capacity: int) -> None:
        self.index = HashIndex(self.key_dtype, self.device, capacity, backend=self.backend)
        self._slot_init: dict[str, float] = {}
        self._pending, self._marks = [], None
        self._cols: dict[str, torch.Tensor] = {
            "key": empty_storage((capacity,), self.key_dtype, self.device),
            "value": empty_storage((capacity, self.dim), self.dtype, self.device),
        }
        self._cols["score"], self._cols["version"] = self._stamp_columns(capacity)
        self._size = 0
        self._init_calls = 0
        # Calls that moved a stored key to another row or dropped rows (compaction, reuse of evicted rows, load,
        # clear): rows read while it is unchanged still hold their keys, so a backward can skip re-checking them.
        self.row_moves = 0

    def rows_unmoved_since(self, moves: int) -> bool:
        """Whether every row read when ``row_moves`` was ``moves`` still holds the key it held then."""
        return self.row_moves == moves

    # ------------------------------------------------------------------ columns
    @property
    def _cols(self) -> dict:
        """Every column by name, deferred stamps written first (:meth:`_defer_stamps`): whatever reads, writes or
        moves columns through this dict sees every stamp. The hot accessors (``values``, ``row_keys``, ``slot``)
        read ``_columns`` as it is (:meth:`_column`)."""
        if self._pending:
            self._settle_stamps()
        return self._columns

    @_cols.setter
    def _cols(self, columns: dict) -> None:
        self._columns = columns
        self.storage_generation += 1

    def _column(self, name: str) -> torch.Tensor:
        return self._columns[name]  # keys, values and slots: deferred stamps never touch them

    @property
    def row_keys(self) -> torch.Tensor:
        """Key of each row ``[capacity]``."""
        return self._columns["key"]

    def _defer_stamps(self, rows: torch.Tensor, score: int, version: int) -> bool:
        """Stamp ``rows [N]`` (int64, in range; duplicates allowed) with ``score`` and ``version`` later: the first
        access to the columns through :attr:`_cols` writes them (every reader of stamps, and every call that moves
        rows, goes through it). False where this store cannot defer: the caller writes them now.

        Why: a lookup stamps all its rows with one pair of values, but each row's pair sits on its own cache line
        of the ``[capacity, 2]`` stamps, read and written back once a row (78.6k rows of 1M: one more line
        transfer each way per key, on top of the index's two). Deferred, the store keeps up to 255 distinct pairs
        and writes each row's pair tag, one byte, into a ``[capacity]`` array small enough to stay in cache; the
        pairs land in the stamp columns in row order, at most every 255 distinct pairs, or when something reads
        them. That saves about 3.5% of an SGD train step of 4 tables of 1M rows on uniform ids (0-5% on zipf ids;
        both ways in one process, paired). Every read returns what stamping at once would have written: later
        writes settle first.
        """
        # A full bounded table reads its scores to evict on most calls, and a settle costs about four eager stamps
        # of the same rows (a sweep over the stamp pairs): it stamps at once. A table under a byte budget holds no
        # tags at all (the budget counts every byte, and checkpoints of full ones must still fit).
        # Below its high the clock was set back, and some version may be above this one: a settle keeps the larger
        # version (mark_updated), so only stamping at once gives this one.
        if not self._DEFERS_STAMPS or self.device.type != "cpu" or rows.dtype != torch.int64 \
                or getattr(self, "max_bytes", None) is not None \
                or (self.max_capacity is not None and self._size >= self.max_capacity) or version < self._clock_high:
            return False
        kernels = stamp_kernels(self.device, self.backend)
        if kernels is None:
            return False
        # what settles these tags, whatever the default backend is by then (a function: tables deep-copy and pickle)
        self._settle_marks = kernels.settle_marks
        if self._marks is None:  # dropped on every change of capacity, which settles them first
            self._marks = torch.zeros(self.capacity, dtype=torch.uint8)
        pair = (score, version)
        if not self._pending or self._pending[-1] != pair:
            if len(self._pending) == _MAX_DEFERRED:
                self._settle_stamps()
            self._pending = [*self._pending, pair]
        return kernels.mark_rows(self._marks, rows.contiguous(), len(self._pending))

    def _settle_stamps(self) -> None:
        """Write the deferred stamps (:meth:`_defer_stamps`) into the score and version columns."""
        pending = self._pending
        scores = torch.tensor([p[0] for p in pending], dtype=torch.int64)
        versions = torch.tensor([p[1] for p in pending], dtype=torch.int64)
        self._settle_marks(self._marks, self._columns["score"], self._columns["version"], scores, versions)
        self._pending = []

    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        """Add an optimizer-state column of width ``dim``; existing and future rows start at ``init``.

        Adding a slot that already exists with the same width keeps its contents.
        """
        check_int(dim, "dim", minimum=1)
        key = f"slot:{name}"
        if key in self._cols:
            if self._cols[key].shape[1] != dim or self._cols[key].dtype != dtype:
                raise ValueError(f"slot {name!r} already exists with shape {tuple(self._cols[key].shape[1:])}")
            return
        self._cols[key] = empty_storage((self.capacity, dim), dtype, self.device).fill_(init)
        self._slot_init[name] = init
        self.storage_generation += 1

    @property
    def capacity(self) -> int:
        """Rows allocated now (grows on demand)."""
        return self._columns["key"].shape[0]

    def size(self) -> int:
        """Number of keys stored."""
        return self._size

    def __len__(self) -> int:
        return self._size

    def live_rows(self) -> int:
        """Rows ``0 .. live_rows()-1`` of the columns hold keys: ``size()``, unless some rows live elsewhere (a
        tiered table's slow tier)."""
        return self._size

    def nbytes(self) -> int:
        """Bytes held by the index and every column (allocated capacity, not just live rows)."""
        marks = 0 if self._marks is None else self._marks.numel()
        return self.index.nbytes() + marks + sum(t.numel() * t.element_size() for t in self._columns.values())

    def stats(self) -> dict:
        """Counters and sizes, for logs and dashboards."""
        return {
            "size": self._size,
            "capacity": self.capacity,
            "max_capacity": self.max_capacity,
            "inserted": self.inserted,
            "removed": self.removed,
            "evicted": self.evicted,
            "index_load": self._size / self.index.slots,
            "bytes": self.nbytes(),
        }

    def to(self, device: torch.device | str) -> "RowStore":
        """Move storage and index to ``device`` in place; returns self."""
        device = resolve_device(device)
        if device == self.device:
            return self
        index = HashIndex(self.key_dtype, device, self.capacity, backend=self.backend)  # fails before anything moves
        paired = ("score", "version") if self._PAIRED_STAMPS else ()
        moved = {k: to_storage(v, device) for k, v in self._cols.items() if k not in paired}
        if paired:  # the stamps move as one interleaved tensor
            pair = to_storage(torch.stack([self._cols["score"], self._cols["version"]], 1), device)
            moved["score"], moved["version"] = pair[:, 0], pair[:, 1]
        self._cols = {k: moved[k] for k in self._cols}
        self.device, self._marks = device, None
        self.index = index
        self.index.insert(self.row_keys[: self._size], torch.arange(self._size, device=device))
        return self

    def initial_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """The initializer's rows ``[N, D]`` for ``keys [N]`` (what a missing key reads and a new key starts at)."""
        seed = self._count_draw()
        if seed is not None:
            return self.initializer(keys, self.dim, self.dtype, seed)
        return initial_rows(self.initializer, keys, self.dim, self.dtype, self.seed, self.backend)

    def _count_draw(self) -> int | None:
        """Count one call of a callable initializer and return the seed of its draw (None for the built-in
        initializers, pure functions of the key that count nothing). A call whose rows nobody reads counts too, so
        later draws do not depend on it."""
        if not isinstance(self.initializer, CallableInitializer):
            return None
        self._init_calls += 1
        return self.seed * 1_000_003 + self._init_calls

    # ------------------------------------------------------------------ growth
    def _reserve(self, n: int) -> None:
        """Make room for ``n`` live rows (columns and index) before anything is mutated."""
        capacity = self.capacity
        if n > capacity:
            grown = int(capacity * (2.0 if capacity < 65536 else 1.25))
            new_cap = max(n, grown)
            if self.max_capacity is not None:
                new_cap = min(new_cap, self.max_capacity)
            self._resize_columns(new_cap, self._size)
        if self.index.needs_rehash(n):
            # Sized for n: bucket counts are powers of two, so this at least doubles the index (load just over
            # MAX_LOAD / 2 after a rehash for growth) without over-allocating it.
            self.index.rehash(self.row_keys[: self._size], torch.arange(self._size, device=self.device), n)

    def _resize_columns(self, capacity: int, live: int) -> None:
        """Every column reallocated to ``capacity`` rows, its first ``live`` rows copied (growth, and the shrink to a
        byte budget). All columns are allocated before any is replaced, and the stamps stay interleaved."""
        paired = ("score", "version") if self._PAIRED_STAMPS else ()
        fresh = {name: self._new_column(name, col, capacity) for name, col in self._cols.items() if name not in paired}
        if paired:
            fresh["score"], fresh["version"] = self._stamp_columns(capacity)
        for name, col in fresh.items():
            col[:live] = self._cols[name][:live]
        self._cols = {name: fresh[name] for name in self._cols}
        self._marks = None  # settled above; the next deferring lookup sizes them anew (nbytes counts them)

    def _stamp_columns(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed ``(score, version)`` columns of ``capacity`` rows, interleaved in one ``[capacity, 2]`` int64 tensor
        (two strided 1-D columns): a training lookup stamps both for every row it reads, and in one cache line that
        is one miss a row, not two (0.78 against 1.48 ms for 78.6k random rows of 1M, Zen 3 guest). Only the layout
        changes: every reader sees two int64 columns."""
        pair = empty_storage((capacity, 2), torch.int64, self.device).zero_()
        return pair[:, 0], pair[:, 1]

    def _new_column(self, name: str, col: torch.Tensor, capacity: int) -> torch.Tensor:
        """Storage for column ``name`` grown to ``capacity`` rows (a slow tier places it in pinned memory or a
        file)."""
        return empty_storage((capacity,) + tuple(col.shape[1:]), col.dtype, col.device)

    def _load(self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None, slots: dict) -> None:
        """Hold exactly ``keys [N]`` (unique, checked) with their columns, in that row order."""
        n = keys.numel()
        self.row_moves += 1
        self.index.clear()
        self._size = 0
        self._reserve(n)
        self.index.insert(keys, torch.arange(n, device=self.device))
        self._cols["key"][:n] = keys
        self._cols["value"][:n] = values
        self._cols["score"][:n] = scores if scores is not None else 0
        self._cols["version"][:n] = self.clock
        for name, init in self._slot_init.items():
            self.slot(name)[:n] = slots.get(name, init)
        self._size = n
        self._clock_high = self.clock  # every live row's version is the clock now

    # ------------------------------------------------------------------ placement
    def _insert_missing(
        self,
        keys: torch.Tensor,
        pinned: torch.Tensor,
        values: torch.Tensor | None = None,
        hashes: torch.Tensor | None = None,
    ):
        """Give rows to absent unique ``keys`` ``[M]``; rows in ``pinned`` are never evicted for them.

        ``values``: ``[M, D]`` rows, ``(source, index)`` to copy ``source[index]`` without an ``[M, D]`` temporary,
        or None for initializer rows. ``hashes``: ``key_hash(keys)`` if the caller has it (keys in hash order then
        skip the index's sort).
        Returns rows ``[M]`` int64; -1 for keys that could not be stored (reported as evicted).
        """
        m = keys.numel()
        victims = torch.empty(0, dtype=torch.int64, device=self.device)
        stored = m
        if self.max_capacity is not None and self._size + m > self.max_capacity:
            need = self._size + m - self.max_capacity
            victims = self._pick_victims(need, pinned)
            stored = m - (need - victims.numel())
        order = None
        if stored < m:  # the keys kept come first (rows are returned in the caller's order)
            keys, values, hashes, order = _kept_first(keys, values, hashes, stored)
        n_append = stored - victims.numel()
        keep, dropped = keys[:stored], keys[stored:]
        # Rows that all follow size and start at a kernel initializer's values get them written in place, after the
        # reserve: no [M, D] temporary and no copy of it (find_or_insert of 65,536 new keys of dim 64: 16 MB less
        # written and read again).
        in_place = (values is None and n_append == m and type(self).initial_rows is RowStore.initial_rows
                    and computed_by_kernel(self.initializer, self.dtype, self.backend, self.device))
        # User code runs before anything changes (the initializer, then on_evict): if it raises, the table is as
        # it was.
        init = _head(values, stored) if values is not None else None if in_place else self.initial_rows(keep)
        if self.on_evict is None:  # nobody reads the evicted rows: their keys are all the call needs
            taken = Rows(gather_rows(self.row_keys, victims), None, None, {})
            evicted = Rows(torch.cat([taken.keys, dropped]), None, None, {})
            if stored < m and values is None:
                self._count_draw()  # the dropped keys' rows, drawn for a listener, are not drawn here
        else:
            taken = evicted = self._take(victims)
            if stored < m:
                dropped_values = _tail(values, stored) if values is not None else self.initial_rows(dropped)
                evicted = _concat_rows(taken, self._fresh_rows(dropped, dropped_values))
        self._notify_evicted(evicted)
        self._reserve(self._size + n_append)
        if victims.numel():
            self.index.remove(self.index.find_slots(taken.keys))
        rows = torch.cat([victims, torch.arange(self._size, self._size + n_append, device=self.device)])
        self.index.insert(keep, rows, None if hashes is None else hashes[:stored])
        if in_place:  # after the index, whose buckets the lookup's probe left in cache: 16 MB of rows evict them
            try:
                initial_rows(self.initializer, keep, self.dim, self.dtype, self.seed, self.backend,
                             out=self._column("value")[self._size: self._size + n_append])
            except BaseException:  # a kernel's first compile or launch, or an interrupt: the keys leave again
                self.index.remove(self.index.find_slots(keep))
                raise
        slots = {f"slot:{name}": value for name, value in self._slot_init.items()}
        columns = {"key": keep, "score": 0, "version": self.clock, **slots}
        if not in_place:
            columns["value"] = init
        self._write_rows(rows, victims.numel(), columns)
        self._size += n_append
        self.inserted += m
        self._count_evicted(evicted)
        rows = torch.cat([rows, torch.full((m - stored,), -1, dtype=torch.int64, device=self.device)])
        return rows if order is None else torch.empty_like(rows).index_copy_(0, order, rows)

    def _read_rows(self, source: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``source[rows]`` of ``[R, ...]`` rows (row 0 where ``rows`` is -1), written into ``out`` when given: for
        float32 ``[R, D]`` rows by the pool family's ``gather`` kernel where one serves this table (it prefetches rows
        ahead: 0.8-0.85x the time of ``index_select`` for random rows of a large tensor), else by ``index_select``."""
        gather = kernels_for(self.backend, self.device).for_rows(self.dtype).pool.gather  # optional in the family
        if (gather is None or source.dtype != torch.float32 or source.dim() != 2 or not source.is_contiguous()
                or (out is not None and not out.is_contiguous())):
            return gather_rows(source, rows.clamp(min=0), out=out)
        return gather(source, rows, out if out is not None else source.new_empty(rows.numel(), source.shape[1]))

    def _write_rows(self, rows: torch.Tensor, k: int, columns: dict) -> None:
        """Fill new ``rows``: the first ``k`` reuse evicted rows, the rest follow ``size`` (plain slice copies).

        ``columns`` maps a column to a scalar, to ``[len(rows), ...]`` values, or to ``(source, index)`` to copy
        ``source[index]`` without materializing it.
        """
        appended = slice(self._size, self._size + rows.numel() - k)
        if k:
            self.row_moves += 1  # evicted rows now hold other keys
            cols = self._cols
        else:  # rows past size only: deferred stamps stay deferred (a growing table inserts on most lookups)
            cols = self._columns
            if self._marks is not None:
                self._marks[appended] = 0  # a row cleared away may have left its tag
        for name, src in columns.items():
            col = cols[name]
            if isinstance(src, tuple):
                source, index = src
                self._read_rows(source, index[k:], col[appended])
                if k:
                    copy_rows(col, rows[:k], source, index[:k], self.backend)
            elif isinstance(src, torch.Tensor):
                col[appended] = src[k:]
                if k:
                    scatter_rows(col, rows[:k], src[:k], self.backend)
            else:
                col[appended] = src
                if k:
                    col.index_fill_(0, rows[:k], src)

    # ------------------------------------------------------------------ eviction
    def _pick_victims(self, need: int, pinned: torch.Tensor) -> torch.Tensor:
        return lowest_rows(self.scores[: self._size], need, pinned, self.backend)

    def _take(self, rows: torch.Tensor) -> Rows:
        cols = {name: gather_rows(col, rows) for name, col in self._cols.items()}
        slots = {name: cols[f"slot:{name}"] for name in self._slot_init}
        return Rows(cols["key"], cols["value"], cols["score"], slots)

    def _fresh_rows(self, keys: torch.Tensor, values: torch.Tensor) -> Rows:
        n = keys.numel()
        slots = {
            name: torch.full((n, self.slot(name).shape[1]), init, dtype=self.slot(name).dtype, device=self.device)
            for name, init in self._slot_init.items()
        }
        return Rows(keys, values, torch.zeros(n, dtype=torch.int64, device=self.device), slots)

    def _evict_rows(self, rows: torch.Tensor) -> Rows:
        evicted = self._take(rows)
        self._notify_evicted(evicted)
        self.clock += 1
        self.index.remove(self.index.find_slots(evicted.keys))
        self._compact(rows)
        self._count_evicted(evicted)
        return evicted

    def _notify_evicted(self, evicted: Rows) -> None:
        """Hand rows about to be evicted to ``on_evict``, before the table changes: if it raises, the call that
        evicts changes nothing and the exception propagates."""
        if evicted.keys.numel() and self.on_evict is not None:
            self.on_evict(evicted.keys, evicted.values, evicted.scores)

    def _count_evicted(self, evicted: Rows) -> None:
        if evicted.keys.numel():
            self._log_deleted(evicted.keys)
            self.evicted += evicted.keys.numel()

    @contextlib.contextmanager
    def _restored_on_error(self):
        """For the body of a call whose user code (initializer, ``on_evict``) runs before it changes any row or
        the index: if that code raises, the counters the call had advanced (the clock, initializer calls) are put
        back, so that the table is exactly as it was and the same call can be retried."""
        saved = self.clock, self._init_calls
        try:
            yield
        except BaseException:
            self.clock, self._init_calls = saved
            raise

    # ------------------------------------------------------------------ compaction
    def _compact(self, dead: torch.Tensor) -> None:
        """Fill the holes left by ``dead`` rows (unique, already out of the index) with the last live rows."""
        size, k = self._size, dead.numel()
        new_size = size - k
        self.row_moves += 1
        tail_alive = torch.ones(k, dtype=torch.bool, device=self.device)
        tail_alive[dead[dead >= new_size] - new_size] = False
        movers = torch.arange(new_size, size, device=self.device)[tail_alive]
        holes = dead[dead < new_size]
        if holes.numel():
            for col in self._cols.values():
                copy_rows(col, holes, col, movers, self.backend)
            moved_keys = self.row_keys.index_select(0, holes)
            self.index.set_rows(self.index.find_slots(moved_keys), holes)
        self._size = new_size


def _kept_first(keys: torch.Tensor, values, hashes: torch.Tensor | None, stored: int):
    """``(keys, values, hashes, order)``: ``keys`` (and their ``values`` and ``hashes``) taken in ``order``, so that
    the ``stored`` kept of more new keys than there is room for come first, each part in its old order.

    The kept ones are drawn evenly over the hash range (the lowest of a second hash): the first ``stored`` in hash
    order would fill half the index's buckets twice over, and keys crowded into part of the range overflow buckets
    at any load, which slows every lookup."""
    hashes = key_hash(keys) if hashes is None else hashes
    kept = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
    kept[mix64(hashes).topk(stored, largest=False, sorted=False).indices] = True
    order = torch.cat([kept.nonzero().squeeze(1), (~kept).nonzero().squeeze(1)])
    if isinstance(values, tuple):
        values = (values[0], values[1].index_select(0, order))
    elif values is not None:
        values = values.index_select(0, order)
    return keys.index_select(0, order), values, hashes.index_select(0, order), order


def _head(values, n: int):
    """The first ``n`` of new rows given as a tensor or as ``(source, index)``."""
    return (values[0], values[1][:n]) if isinstance(values, tuple) else values[:n]


def _tail(values, n: int) -> torch.Tensor:
    """The rows after the first ``n`` of new rows given as a tensor or as ``(source, index)``, as a tensor."""
    return gather_rows(values[0], values[1][n:]) if isinstance(values, tuple) else values[n:]


def _concat_rows(a: Rows, b: Rows) -> Rows:
    return Rows(
        torch.cat([a.keys, b.keys]),
        torch.cat([a.values, b.values]),
        torch.cat([a.scores, b.scores]),
        {name: torch.cat([a.slots[name], b.slots[name]]) for name in a.slots},
    )
