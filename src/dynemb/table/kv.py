"""KeyValueTable: the storage engine's public operations. Keys map to dense rows of values, optimizer slots and a
score.

Each operation states what happens on a hit, on a miss and when the table is full, and the rule for duplicate
keys. The machinery underneath (growth, placement, eviction, compaction) is in :mod:`dynemb.table.rows`, version
stamps and the deletion log in :mod:`dynemb.table.changes`.

Invariant, after every call: ``size == inserted - removed - evicted``. Keys never vanish silently: automatic
eviction under ``max_capacity`` reports each evicted key to ``on_evict`` and counts it.
"""

from __future__ import annotations

import torch

from ..kernels.dispatch import Backend
from . import budget
from . import fused
from .admission import FrequencyAdmission
from ..checks import (
    KEY_DTYPES,
    VALUE_DTYPES,
    check_dtype,
    check_int,
    check_keys,
    check_rows_like,
    check_scores,
    is_int,
    resolve_device,
)
from .hashing import unique_by_hash
from .initializers import InitializerSpec, resolve_initializer
from .ops import all_nonnegative, copy_rows, fill_pair, lowest_rows
from .policy import DEFAULT_HALF_LIFE, EvictionPolicy, fill_score, touch_scores
from .rows import EvictHook, Rows, RowStore

__all__ = ["KeyValueTable"]

_INT32_MAX = 2**31 - 1  # rows per table: the index stores int32 row ids


class KeyValueTable(RowStore):
    """A growable hash table from int32/int64 keys to rows of ``dim`` values, with optional row-wise slots.

    Args:
        dim: number of values per row (``D``).
        key_dtype: ``torch.int32`` or ``torch.int64``. Every value of the dtype is a valid key.
        dtype: value dtype: float32, float16 or bfloat16.
        device: where rows and the index live (default: CPU).
        init_capacity: rows to allocate up front; the table grows past it.
        max_capacity: bound on the number of rows; past it the lowest-score rows are evicted. ``None``: unbounded.
        max_bytes: bound in bytes instead of rows (not both): values, slots, scores, version stamps and the index
            never take more (see :mod:`dynemb.table.budget`); the row bound it gives is ``max_capacity``, and is
            recomputed when a slot is added or the values are cast.
        eviction: an :class:`EvictionPolicy` (or its name) defining scores; default ``lru``.
        half_life: ``decayed_lfu`` only: clock ticks (about one per batch of lookups) in which an access's weight
            halves; default :data:`~dynemb.table.policy.DEFAULT_HALF_LIFE`.
        initializer: how new rows are filled (see :mod:`dynemb.table.initializers`).
        seed: seed of the initializer.
        on_evict: ``fn(keys, values, scores)`` called with every batch of evicted rows (copies), before the table
            changes: if it raises, the call that evicts leaves the table as it was (rows, scores, slots, counters,
            clock) and the exception propagates. (An admission filter keeps the sightings such a call counted and
            forgets the keys it admitted; admission can then come later, never earlier.)
        admission: a :class:`FrequencyAdmission` (or an int threshold): ``find_or_insert`` stores a new key only
            from its ``threshold``-th sighting; before that it gets row -1 and its initializer row is read.
        backend: the index's implementation, a :class:`~dynemb.kernels.Backend` or its name (see
            :mod:`dynemb.kernels.dispatch`); ``None`` follows the process default at each call. On ``triton``,
            ``find``, ``erase`` and (with room for the batch) ``find_or_insert`` run one-launch kernels
            (:mod:`dynemb.table.fused`), with the torch path's results.

    Example:
        >>> t = KeyValueTable(4, initializer="zeros")
        >>> rows, found = t.find_or_insert(torch.tensor([3, -1, 3]))
        >>> found.tolist(), t.size()
        ([False, False, False], 2)
        >>> t.insert_or_assign(torch.tensor([-1]), torch.ones(1, 4))
        >>> t.find(torch.tensor([-1, 9]))[1].tolist()
        [True, False]
    """

    def __init__(
        self,
        dim: int,
        *,
        key_dtype: torch.dtype = torch.int64,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        init_capacity: int = 8192,
        max_capacity: int | None = None,
        max_bytes: int | None = None,
        eviction: EvictionPolicy | str | None = None,
        half_life: int | None = None,
        initializer: InitializerSpec = "uniform",
        seed: int = 0,
        on_evict: EvictHook | None = None,
        admission: "FrequencyAdmission | int | None" = None,
        backend: Backend | str | None = None,
    ) -> None:
        self.dim = check_int(dim, "dim", minimum=1)
        self.key_dtype = check_dtype(key_dtype, KEY_DTYPES, "key_dtype")
        self.dtype = check_dtype(dtype, VALUE_DTYPES, "dtype")
        self.device = resolve_device(device)
        check_int(init_capacity, "init_capacity", minimum=1)
        self.max_capacity = check_int(max_capacity, "max_capacity", minimum=1, maximum=_INT32_MAX, allow_none=True)
        self.max_bytes = check_int(max_bytes, "max_bytes", minimum=1, allow_none=True)
        if max_bytes is not None:
            if max_capacity is not None:
                raise ValueError(f"give max_capacity or max_bytes, not both (got {max_capacity} and {max_bytes})")
            per_row = budget.row_bytes(self.dim, self.dtype, self.key_dtype, {})
            self.max_capacity = min(budget.rows_for_bytes(max_bytes, per_row, self.key_dtype), _INT32_MAX)
        self.policy = EvictionPolicy.parse(eviction)
        if half_life is not None and self.policy is not EvictionPolicy.DECAYED_LFU:
            raise ValueError(f"half_life applies to eviction='decayed_lfu' only, got half_life={half_life!r} with "
                             f"eviction={self.policy.value!r}")
        self.half_life = check_int(DEFAULT_HALF_LIFE if half_life is None else half_life, "half_life", minimum=1)
        self.initializer = resolve_initializer(initializer)
        check_int(seed, "seed")
        if on_evict is not None and not callable(on_evict):
            raise TypeError(f"on_evict must be a callable (keys, values, scores) or None, got {on_evict!r}")
        self.seed = seed
        self.on_evict = on_evict
        if is_int(admission):
            admission = FrequencyAdmission(admission)
        if admission is not None and not isinstance(admission, FrequencyAdmission):
            raise TypeError(f"admission must be an int threshold, a FrequencyAdmission or None, got {admission!r}")
        self.admission = admission
        self.backend = None if backend is None else Backend.parse(backend)
        capacity = min(init_capacity, self.max_capacity or init_capacity)
        self.clock = 0
        self.save_ticks = 0  # clock ticks made by checkpoint saves: scores never see them
        self.epoch = 0
        self.inserted = 0
        self.removed = 0
        self.evicted = 0
        self._deleted: list[tuple[int, torch.Tensor]] | None = None
        self._init_storage(capacity)
        if admission is not None:
            admission.attach(self._new_counter)

    #: a key is never its own row (see :class:`~dynemb.table.protocol.EmbeddingTable`)
    ids_are_rows = False
    #: ``lookup_rows`` of repeated keys counts each occurrence, as a deduplicated call with counts does
    keys_may_repeat = True

    @property
    def counts_occurrences(self) -> bool:
        """Whether inserts need each key's number of occurrences: lfu scores and admission count them."""
        return self.admission is not None or self.policy.value.endswith("lfu")

    # ------------------------------------------------------------------ queries
    def check_ids(self, ids: torch.Tensor, name: str = "ids") -> torch.Tensor:
        """``ids`` of this table's key dtype and device, flattened to ``[N]`` (see :func:`~.checks.check_keys`)."""
        return check_keys(ids, self.key_dtype, self.device, name)

    def lookup_rows(self, keys: torch.Tensor, *, insert: bool, counts: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, bool]:
        """``(rows [N] int64, every key has a row)`` of checked keys ``[N]``: :meth:`find_or_insert`'s rows with
        ``insert`` (``counts``: each key's occurrences, as it takes them, >= 1 and not checked again), else
        :meth:`find_rows`'. A table that found every key says so without building ``found`` or checking the rows
        again: on a small batch each costs more than the kernel that finds them."""
        if not insert:
            rows = self.find_rows(keys)
            return rows, all_nonnegative(rows)
        rows, found = self._find_or_insert(self.check_ids(keys), None, counts)
        return rows, found is None or all_nonnegative(rows)

    def find_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Row id of each key. Hit: its row; miss: -1. Changes nothing.

        Shape: ``keys`` any shape -> same shape, int64.
        """
        flat = check_keys(keys, self.key_dtype, self.device)
        return self.index.find(flat).view(keys.shape)

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """Bool tensor of ``keys.shape``: whether each key is stored."""
        return self.find_rows(keys) >= 0

    def find(
        self, keys: torch.Tensor, *, out: torch.Tensor | None = None, update_scores: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Read rows. Hit: the stored row. Miss: the initializer's row for that key, nothing inserted.

        Args:
            keys: any shape ``S``, dtype ``key_dtype``.
            out: optional preallocated ``S + (D,)`` output of the table's dtype.
            update_scores: count this read as an access for eviction (e.g. a serving cache).

        Returns:
            ``(values [*S, D], found [*S] bool)``.
        """
        flat = check_keys(keys, self.key_dtype, self.device)
        if out is not None:
            out = check_rows_like(out, flat.numel(), self.dim, self.dtype, self.device, "out", keys.shape)
        ti = fused.kernels(self)
        one_launch = fused.find(self, ti, flat, out) if ti is not None else None
        if one_launch is not None:  # triton: probe, gather and initializer rows in one kernel
            rows, values = one_launch
            return values.view(*keys.shape, self.dim), self._found(keys, rows, update_scores)
        rows, every = self.index.find_all(flat)  # on CPU one kernel pass: int64 rows and the count, no slots
        values = self._read_rows(self.values, rows, out)
        if not every:
            miss = (rows < 0).nonzero().squeeze(1)
            values.index_copy_(0, miss, self.initial_rows(flat.index_select(0, miss)))
        return values.view(*keys.shape, self.dim), self._found(keys, rows, update_scores)

    # ------------------------------------------------------------------ inserts
    def find_or_insert(
        self, keys: torch.Tensor, scores: torch.Tensor | None = None, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for ``keys``, inserting missing keys with initializer rows.

        Hit: the key's row, score updated. Miss: a new row, initialized. Full (``max_capacity``): the
        lowest-score rows not used by this call are evicted (reported to ``on_evict``) and reused. If one call
        brings more new keys than ``max_capacity`` can hold, the excess new keys are reported as evicted at once
        and get row ``-1`` (which are kept is unspecified: some spread over the hash range). Among equal scores
        the lowest row is evicted first.

        Args:
            keys: ``[N]`` (or any shape), dtype ``key_dtype``; duplicates allowed.
            scores: ``custom`` policy only: ``[N]`` int64 scores to set.
            counts: ``[N]`` int64 >= 1, how many occurrences each key stands for (a caller that deduplicated its
                ids passes their counts), so lfu scores and admission count every occurrence. Default: 1 each.

        Returns:
            ``(rows [N] int64, found [N] bool)`` shaped like ``keys``; ``found`` is whether the key was present.
        """
        flat = check_keys(keys, self.key_dtype, self.device)
        custom = self._check_scores(scores, keys)
        if counts is not None:
            if not isinstance(counts, torch.Tensor) or counts.dtype != torch.int64 or counts.shape != keys.shape:
                got = f"{counts.dtype} {tuple(counts.shape)}" if isinstance(counts, torch.Tensor) else type(counts)
                raise TypeError(f"counts must be an int64 tensor of shape {tuple(keys.shape)}, got {got}")
            counts = counts.reshape(-1).to(self.device)
            if counts.numel() and int(counts.min()) < 1:  # a score that falls, or depends on the backend
                raise ValueError(f"counts must be >= 1 (occurrences of each key), got {int(counts.min())}")
        rows, found = self._find_or_insert(flat, custom, counts)
        if found is None:
            found = torch.ones_like(rows, dtype=torch.bool)
        if keys.dim() == 1:  # a view costs microseconds, paid by every table on every step
            return rows, found
        return rows.view(keys.shape), found.view(keys.shape)

    def _find_or_insert(self, flat: torch.Tensor, custom: torch.Tensor | None = None,
                        counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`find_or_insert` of checked keys ``[N]``: ``(rows [N], found [N])``, with ``found`` None when every
        key was present (then every row is >= 0). A training lookup of a plain table calls this directly: on a
        small batch, building the all-True ``found`` and checking the rows again cost more than the kernel."""
        ti = fused.kernels(self)
        one_launch = fused.find_or_insert(self, ti, flat) if ti is not None else None
        if one_launch is not None:  # triton, room for every key: find, insert, number and initialize at once
            rows, found = one_launch
            self._touch(rows, custom, counts)
            return rows, found
        rows, all_found = self.index.find_all(flat)
        if all_found:  # no user code runs (initializer, on_evict): nothing to put back; every row is valid
            self.clock += 1
            self._touch(rows, custom, counts)
            return rows, None
        found = rows >= 0
        with self._restored_on_error():
            self.clock += 1
            # no key stored yet (a batch of new ids): the missed keys are the batch itself, and their rows all of
            # rows, without the positions' nonzero, gather and scatter (0.5 ms of 13 at 65,536 keys)
            miss = None if not found.any() else (~found).nonzero().squeeze(1)
            missed = flat if miss is None else flat.index_select(0, miss)
            new_keys, hashes, _, inverse = unique_by_hash(missed, self.backend)
            pinned = rows[found] if miss is not None else rows[:0]
            if self.admission is None:
                new_rows = self._insert_missing(new_keys, pinned=pinned, hashes=hashes)
            else:
                missed_counts = None if counts is None else counts if miss is None else counts.index_select(0, miss)
                admitted = self.admission.admit(missed, new_keys, missed_counts)
                new_rows = torch.full_like(new_keys, -1, dtype=torch.int64)
                new_rows[admitted] = self._insert_missing(
                    new_keys[admitted], pinned=pinned, hashes=hashes[admitted]
                )
            if miss is None:
                rows = new_rows.index_select(0, inverse)
            else:
                rows.index_copy_(0, miss, new_rows.index_select(0, inverse))
        self._touch_valid(rows, custom, counts)
        return rows, found

    def insert_or_assign(
        self, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Write rows. Hit: value replaced (slots kept). Miss: inserted (slots at their init). Full: as
        :meth:`find_or_insert`. Duplicate keys: the last occurrence wins.

        Shape: ``keys`` ``S``; ``values`` ``S + (D,)``; ``scores`` ``S`` int64 (``custom`` policy).
        """
        flat = check_keys(keys, self.key_dtype, self.device)
        vals = check_rows_like(values, flat.numel(), self.dim, self.dtype, self.device, "values", keys.shape)
        custom = self._check_scores(scores, keys)
        if flat.numel() == 0:
            return
        unique, hashes, last, inverse = unique_by_hash(flat, self.backend)
        rows = self.index.find(unique, hashes)
        found = rows >= 0
        hit = found.nonzero().squeeze(1)
        hit_rows = rows.index_select(0, hit)
        with self._restored_on_error():
            self.clock += 1
            if hit.numel() < unique.numel():  # new keys first: hits are written once on_evict has returned
                new = (~found).nonzero().squeeze(1)
                new_rows = self._insert_missing(
                    unique.index_select(0, new),
                    pinned=hit_rows,
                    values=(vals, last.index_select(0, new)),
                    hashes=hashes.index_select(0, new),
                )
                rows.index_copy_(0, new, new_rows)
        if hit.numel() == flat.numel():  # every key present, once: copy the batch in place, no gather
            self.values.index_copy_(0, rows.index_select(0, inverse), vals)
        elif hit.numel():
            copy_rows(self.values, hit_rows, vals, last.index_select(0, hit), self.backend)
        if hit.numel():
            self.mark_updated(hit_rows)
        self._touch_valid(rows.index_select(0, inverse), custom)

    def accum(
        self, keys: torch.Tensor, old_values: torch.Tensor, new_values: torch.Tensor, exists: torch.Tensor
    ) -> None:
        """Apply updates computed from values read earlier (TFRA ``accum``), safe against concurrent writers.

        ``old_values`` and ``exists`` are what a read (``find``) returned; ``new_values`` are the caller's updated
        rows. Each occurrence is decided by whether its key existed when read and whether it is present now:

        ==================  ===========  ==========================================================
        ``exists`` (read)   present now  result
        ==================  ===========  ==========================================================
        True                True         ``new - old`` is added to the stored row
        True                False        nothing: the key was removed meanwhile and is not revived
        False               True         nothing: the key was inserted meanwhile and that insert wins
        False               False        inserted with ``new`` (TFRA inserts ``new_values`` as they are)
        ==================  ===========  ==========================================================

        Duplicate keys apply in order, each against the table the earlier ones left: after a key's first
        ``exists=False`` occurrence inserts it, its later ``exists=True`` occurrences add their deltas and its
        later ``exists=False`` occurrences change nothing. Rows that change count as accessed (scores). Full: new
        keys are placed as by :meth:`find_or_insert`.

        Shape: ``keys`` ``S``; ``old_values``/``new_values`` ``S + (D,)``; ``exists`` ``S`` bool.

        Example:
            >>> t = KeyValueTable(1, initializer="zeros")
            >>> t.insert_or_assign(torch.tensor([1]), torch.tensor([[5.0]]))
            >>> old, exists = t.find(torch.tensor([1, 2]))
            >>> t.insert_or_assign(torch.tensor([2]), torch.tensor([[7.0]]))  # another writer inserts key 2
            >>> t.accum(torch.tensor([1, 2]), old, old + 1, exists)
            >>> t.find(torch.tensor([1, 2]))[0].view(-1).tolist()  # 1: 5 + 1; 2: the other writer's 7 stays
            [6.0, 7.0]
        """
        flat = check_keys(keys, self.key_dtype, self.device)
        n = flat.numel()
        old = check_rows_like(old_values, n, self.dim, self.dtype, self.device, "old_values", keys.shape)
        new = check_rows_like(new_values, n, self.dim, self.dtype, self.device, "new_values", keys.shape)
        if not isinstance(exists, torch.Tensor) or exists.dtype != torch.bool or exists.shape != keys.shape:
            got = f"{exists.dtype} {tuple(exists.shape)}" if isinstance(exists, torch.Tensor) else type(exists)
            raise TypeError(f"exists must be a bool tensor of shape {tuple(keys.shape)}, got {got}")
        if n == 0:
            return
        exists = exists.reshape(-1).to(self.device)
        rows = self.index.find(flat)
        adds = (rows >= 0) & exists  # occurrences that add their delta
        inserts = torch.zeros_like(adds)  # occurrences that insert their key
        with self._restored_on_error():  # inserts first: deltas are added once on_evict has returned
            self.clock += 1
            if not all_nonnegative(rows):
                self._accum_inserts(flat, new, exists, rows, adds, inserts)
        if bool(adds.any()):
            self.values.index_add_(0, rows[adds], (new - old)[adds])
        self._touch_valid(rows[adds | inserts], None)

    def _accum_inserts(self, flat, new, exists, rows, adds, inserts) -> None:
        """:meth:`accum` for the keys absent now, updating ``rows``, ``adds`` and ``inserts`` (all ``[N]``) in place.

        A key is inserted by its first occurrence read as absent, with that occurrence's ``new`` row; its later
        occurrences read as existing then add their deltas. A key no occurrence read as absent stays out.
        """
        n = flat.numel()
        absent = (rows < 0).nonzero().squeeze(1)
        unique, inverse = torch.unique(flat.index_select(0, absent), return_inverse=True)
        read_absent = ~exists.index_select(0, absent)
        first = torch.full((unique.numel(),), n, dtype=torch.int64, device=self.device)
        first.scatter_reduce_(0, inverse, torch.where(read_absent, absent, n), "amin")
        inserting = (first < n).nonzero().squeeze(1)
        if inserting.numel() == 0:
            return
        firsts = first.index_select(0, inserting)
        new_rows = torch.full((unique.numel(),), -1, dtype=torch.int64, device=self.device)
        new_rows[inserting] = self._insert_missing(unique.index_select(0, inserting), pinned=rows[rows >= 0],
                                                   values=(new, firsts))
        rows.index_copy_(0, absent, new_rows.index_select(0, inverse))
        stored = rows >= 0  # a key that max_capacity could not hold was reported as evicted at once
        inserts[firsts] = True
        inserts &= stored
        adds[absent] = ~read_absent & (absent > first.index_select(0, inverse))
        adds &= stored

    # ------------------------------------------------------------------ removal
    def erase(self, keys: torch.Tensor) -> int:
        """Remove keys. Hit: row removed with its slots. Miss: ignored. Returns the number removed."""
        flat = check_keys(keys, self.key_dtype, self.device)
        if flat.numel() == 0:
            return 0
        unique, hashes, _, _ = unique_by_hash(flat, self.backend)
        ti = fused.kernels(self)  # triton: lookup and removal from the index in one launch
        slots, rows = fused.erase(self, ti, unique) if ti is not None else self.index.lookup(unique, hashes)
        hit = (slots >= 0).nonzero().squeeze(1)
        if hit.numel() == 0:
            return 0
        slots, rows = slots.index_select(0, hit), rows.index_select(0, hit)
        self.clock += 1
        self._log_deleted(unique.index_select(0, hit))
        if ti is None:
            self.index.remove(slots)
        self._compact(rows)
        self.removed += rows.numel()
        return rows.numel()

    def evict(self, n: int) -> Rows:
        """Evict the ``n`` lowest-score rows (all rows if fewer); reports them to ``on_evict`` and returns them."""
        check_int(n, "n", minimum=0)
        n = min(n, self._size)
        if n == 0:
            return self._take(torch.empty(0, dtype=torch.int64, device=self.device))
        victims = lowest_rows(self.scores[: self._size], n, backend=self.backend)
        return self._evict_rows(victims)

    def restrict(self, num_reserved: int, trigger: int | None = None) -> Rows:
        """Keep the ``num_reserved`` highest-score rows when ``size > trigger`` (default ``num_reserved``).

        Removed rows count as evicted and go to ``on_evict``. Returns them.
        """
        check_int(num_reserved, "num_reserved", minimum=0)
        trigger = num_reserved if trigger is None else check_int(trigger, "trigger", minimum=0)
        if trigger < num_reserved:
            raise ValueError(f"trigger must be >= num_reserved ({num_reserved}), got {trigger}")
        excess = self.size() - num_reserved if self.size() > trigger else 0
        return self.evict(excess)

    def clear(self) -> None:
        """Remove every key (counted as removed). Capacity is kept."""
        self.clock += 1
        self._log_deleted(self.row_keys[: self._size].clone())
        self.removed += self._size
        self._size = 0
        self.row_moves += 1
        self.index.clear()

    # ------------------------------------------------------------------ bulk
    def export(self) -> Rows:
        """Copies of all live rows: keys ``[N]``, values ``[N, D]``, scores ``[N]``, slots ``{name: [N, d]}``."""
        return self._take(torch.arange(self._size, device=self.device))

    def replace(self, rows: Rows) -> None:
        """Make the table hold exactly ``rows`` (unique keys), dropping what it held. Counters restart."""
        keys = check_keys(rows.keys, self.key_dtype, self.device, "keys")
        n = keys.numel()
        values = check_rows_like(rows.values, n, self.dim, self.dtype, self.device, "values", keys.shape)
        if self.max_capacity is not None and n > self.max_capacity:
            raise ValueError(f"cannot load {n} rows into a table with max_capacity={self.max_capacity}")
        if n and torch.unique(keys).numel() != n:
            raise ValueError("keys must be unique to load a table")
        unknown = set(rows.slots) - set(self._slot_init)
        if unknown:
            raise ValueError(f"slots {sorted(unknown)} are not defined on this table (has {self.slot_names})")
        scores = None if rows.scores is None else check_scores(rows.scores, (n,)).to(self.device)
        slots = {}
        for name, given in rows.slots.items():
            if given is not None:
                slot = self.slot(name)
                given = given.to(self.device) if isinstance(given, torch.Tensor) else given
                slots[name] = check_rows_like(given, n, slot.shape[1], slot.dtype, self.device, f"slot {name!r}", (n,))
        self._load(keys, values, scores, slots)
        self.inserted, self.removed, self.evicted = n, 0, 0

    # ------------------------------------------------------------------ internals
    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().add_slot(name, dim, init, dtype)
        if self.max_bytes is not None:
            budget.fit(self)

    def cast(self, dtype: torch.dtype) -> None:
        super().cast(dtype)
        if self.max_bytes is not None:
            budget.fit(self)

    def _new_counter(self, max_tracked: int) -> "KeyValueTable":
        """The table an admission filter counts candidates in: lfu scores are the counts, values are unused."""
        return KeyValueTable(1, key_dtype=self.key_dtype, device=self.device, eviction="lfu", initializer="zeros",
                             max_capacity=max_tracked, init_capacity=min(max_tracked, 8192), backend=self.backend)

    def _found(self, keys: torch.Tensor, rows: torch.Tensor, update_scores: bool) -> torch.Tensor:
        """``found`` of a :meth:`find` that read ``rows``, counting the read as an access when asked."""
        found = rows >= 0
        if update_scores:
            self.clock += 1
            self._touch(rows[found])
        return found.view(keys.shape)

    def _check_scores(self, scores, keys: torch.Tensor) -> torch.Tensor | None:
        if scores is None:
            return None
        if self.policy is not EvictionPolicy.CUSTOM:
            raise ValueError(f"scores can only be given with eviction='custom', this table uses {self.policy.value!r}")
        return check_scores(scores, keys.shape).to(self.device)

    def _touch_valid(self, rows: torch.Tensor, custom: torch.Tensor | None, counts: torch.Tensor | None = None) -> None:
        valid = rows >= 0
        if bool(valid.all()):
            self._touch(rows, custom, counts)
        else:
            keep = lambda t: t[valid] if t is not None else None  # noqa: E731
            self._touch(rows[valid], keep(custom), keep(counts))

    @property
    def access_clock(self) -> int:
        """The clock eviction scores read: ``clock`` less the ticks saves made, so that saving a checkpoint changes
        no score (a run that saves midway evicts exactly as one that does not, and as one resumed from the save)."""
        return self.clock - self.save_ticks

    def prefetch(self, keys: torch.Tensor) -> None:
        """Nothing to do: every row of an untiered table is in place (:class:`TieredTable` brings rows up), so a
        loader may call ``table.prefetch(next_keys)`` on any table."""

    def _touch(self, rows: torch.Tensor, custom: torch.Tensor | None = None,
               counts: torch.Tensor | None = None) -> None:
        # A score change is a change: incremental checkpoints must carry it for eviction order to resume exactly.
        filled = fill_score(self.policy, clock=self.access_clock, epoch=self.epoch)
        if filled is not None:  # both stamps, deferred or in one pass (they share a cache line, RowStore)
            if not self._defer_stamps(rows, filled, self.clock):
                fill_pair(self.scores, self._cols["version"], rows, filled, self.clock, self.backend)
            return
        touch_scores(self.policy, self.scores, rows, clock=self.access_clock, epoch=self.epoch, custom=custom,
                     counts=counts, half_life=self.half_life, backend=self.backend)
        self.mark_updated(rows)
