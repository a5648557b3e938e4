"""KeyValueTable: the storage engine. Keys map to dense rows of values, optimizer slots and a score.

Rows are kept compact: live rows are ``0 .. size-1`` of every column, so export is a slice and memory tracks the
number of keys. Evicted rows are reused in place by the keys that displaced them; ``erase`` and ``restrict`` fill
the holes they leave with rows from the end. Every row-aligned tensor (keys, values, scores, each optimizer slot)
is a *column* in one dict, so growth, compaction, eviction and export move them together by construction.

Invariant, after every call: ``size == inserted - removed - evicted``. Keys never vanish silently: automatic
eviction under ``max_capacity`` reports each evicted key to ``on_evict`` and counts it.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .checks import (
    KEY_DTYPES,
    VALUE_DTYPES,
    check_dtype,
    check_keys,
    check_positive_int,
    check_rows_like,
    check_scores,
    resolve_device,
)
from .admission import FrequencyAdmission
from .columns import RowColumns
from .hashing import unique_by_hash
from .index import HashIndex
from .initializers import CallableInitializer, InitializerSpec, resolve_initializer
from .ops import copy_rows, gather_rows
from .policy import EvictionPolicy, touch_scores

__all__ = ["KeyValueTable", "Rows", "EvictHook"]

_INT32_MAX = 2**31 - 1
_INIT_CHUNK = 1 << 17  # elements per initializer call on CPU


class Rows(NamedTuple):
    """A set of rows taken out of a table (evicted or exported). ``slots`` maps slot name to ``[E, d]``."""

    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    slots: dict


EvictHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class KeyValueTable(RowColumns):
    """A growable hash table from int32/int64 keys to rows of ``dim`` values, with optional row-wise slots.

    Args:
        dim: number of values per row (``D``).
        key_dtype: ``torch.int32`` or ``torch.int64``. Every value of the dtype is a valid key.
        dtype: value dtype: float32, float16 or bfloat16.
        device: where rows and the index live (default: CPU).
        init_capacity: rows to allocate up front; the table grows past it.
        max_capacity: bound on the number of rows; past it the lowest-score rows are evicted. ``None``: unbounded.
        eviction: an :class:`EvictionPolicy` (or its name) defining scores; default ``lru``.
        initializer: how new rows are filled (see :mod:`dynemb.table.initializers`).
        seed: seed of the initializer.
        on_evict: ``fn(keys, values, scores)`` called with every batch of evicted rows.
        admission: a :class:`FrequencyAdmission` (or an int threshold): ``find_or_insert`` stores a new key only
            from its ``threshold``-th sighting; before that it gets row -1 and its initializer row is read.

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
        eviction: EvictionPolicy | str | None = None,
        initializer: InitializerSpec = "uniform",
        seed: int = 0,
        on_evict: EvictHook | None = None,
        admission: "FrequencyAdmission | int | None" = None,
    ) -> None:
        self.dim = check_positive_int(dim, "dim")
        self.key_dtype = check_dtype(key_dtype, KEY_DTYPES, "key_dtype")
        self.dtype = check_dtype(dtype, VALUE_DTYPES, "dtype")
        self.device = resolve_device(device)
        check_positive_int(init_capacity, "init_capacity")
        self.max_capacity = check_positive_int(max_capacity, "max_capacity", allow_none=True)
        if self.max_capacity is not None and self.max_capacity > _INT32_MAX:
            raise ValueError(f"max_capacity must be <= {_INT32_MAX} rows per table, got {max_capacity}")
        self.policy = EvictionPolicy.parse(eviction)
        self.initializer = resolve_initializer(initializer)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        if on_evict is not None and not callable(on_evict):
            raise TypeError(f"on_evict must be a callable (keys, values, scores) or None, got {on_evict!r}")
        self.seed = seed
        self.on_evict = on_evict
        if isinstance(admission, int) and not isinstance(admission, bool):
            admission = FrequencyAdmission(admission)
        if admission is not None and not isinstance(admission, FrequencyAdmission):
            raise TypeError(f"admission must be an int threshold, a FrequencyAdmission or None, got {admission!r}")
        self.admission = admission
        capacity = min(init_capacity, self.max_capacity or init_capacity)
        self.index = HashIndex(self.key_dtype, self.device, capacity)
        self._slot_init: dict[str, float] = {}
        self._cols: dict[str, torch.Tensor] = {
            "key": torch.empty(capacity, dtype=self.key_dtype, device=self.device),
            "value": torch.empty(capacity, self.dim, dtype=self.dtype, device=self.device),
            "score": torch.zeros(capacity, dtype=torch.int64, device=self.device),
            "version": torch.zeros(capacity, dtype=torch.int64, device=self.device),
        }
        self._size = 0
        self.clock = 0
        self.epoch = 0
        self.inserted = 0
        self.removed = 0
        self.evicted = 0
        self._init_calls = 0
        self._deleted: list[tuple[int, torch.Tensor]] | None = None

    # ------------------------------------------------------------------ columns

    @property
    def row_keys(self) -> torch.Tensor:
        """Key of each row ``[capacity]``."""
        return self._cols["key"]

    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        """Add an optimizer-state column of width ``dim``; existing and future rows start at ``init``.

        Adding a slot that already exists with the same width keeps its contents.
        """
        check_positive_int(dim, "dim")
        key = f"slot:{name}"
        if key in self._cols:
            if self._cols[key].shape[1] != dim or self._cols[key].dtype != dtype:
                raise ValueError(f"slot {name!r} already exists with shape {tuple(self._cols[key].shape[1:])}")
            return
        self._cols[key] = torch.full((self.capacity, dim), init, dtype=dtype, device=self.device)
        self._slot_init[name] = init

    @property
    def capacity(self) -> int:
        """Rows allocated now (grows on demand)."""
        return self._cols["key"].shape[0]

    def size(self) -> int:
        """Number of keys stored."""
        return self._size

    def __len__(self) -> int:
        return self._size

    def nbytes(self) -> int:
        """Bytes held by the index and every column (allocated capacity, not just live rows)."""
        return self.index.nbytes() + sum(t.numel() * t.element_size() for t in self._cols.values())

    # ------------------------------------------------------------------ queries
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
        rows = self.index.find(flat)
        found = rows >= 0
        values = gather_rows(self.values, rows.clamp(min=0), out=out)
        if not bool(found.all()):
            miss = (~found).nonzero().squeeze(1)
            values.index_copy_(0, miss, self.initial_rows(flat.index_select(0, miss)))
        if update_scores:
            self.clock += 1
            self._touch(rows[found])
        return values.view(*keys.shape, self.dim), found.view(keys.shape)

    # ------------------------------------------------------------------ inserts
    def find_or_insert(
        self, keys: torch.Tensor, scores: torch.Tensor | None = None, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for ``keys``, inserting missing keys with initializer rows.

        Hit: the key's row, score updated. Miss: a new row, initialized. Full (``max_capacity``): the
        lowest-score rows not used by this call are evicted (reported to ``on_evict``) and reused. If one call
        brings more new keys than ``max_capacity`` can hold, the excess new keys are reported as evicted at once
        and get row ``-1``.

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
        rows = self.index.find(flat)
        found = rows >= 0
        self.clock += 1
        if not bool(found.all()):
            miss = (~found).nonzero().squeeze(1)
            missed = flat.index_select(0, miss)
            new_keys, hashes, _, inverse = unique_by_hash(missed)
            if self.admission is None:
                new_rows = self._insert_missing(new_keys, pinned=rows[found], hashes=hashes)
            else:
                missed_counts = counts.index_select(0, miss) if counts is not None else None
                admitted = self.admission.admit(missed, new_keys, missed_counts)
                new_rows = torch.full_like(new_keys, -1, dtype=torch.int64)
                new_rows[admitted] = self._insert_missing(
                    new_keys[admitted], pinned=rows[found], hashes=hashes[admitted]
                )
            rows.index_copy_(0, miss, new_rows.index_select(0, inverse))
        self._touch_valid(rows, custom, counts)
        return rows.view(keys.shape), found.view(keys.shape)

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
        unique, hashes, last, inverse = unique_by_hash(flat)
        rows = self.index.find(unique, hashes)
        found = rows >= 0
        self.clock += 1
        hit = found.nonzero().squeeze(1)
        hit_rows = rows.index_select(0, hit)
        if hit.numel() == flat.numel():  # every key present, once: copy the batch in place, no gather
            self.values.index_copy_(0, rows.index_select(0, inverse), vals)
        elif hit.numel():
            copy_rows(self.values, hit_rows, vals, last.index_select(0, hit))
        if hit.numel():
            self.mark_updated(hit_rows)
        if hit.numel() < unique.numel():
            new = (~found).nonzero().squeeze(1)
            new_rows = self._insert_missing(
                unique.index_select(0, new),
                pinned=hit_rows,
                values=(vals, last.index_select(0, new)),
                hashes=hashes.index_select(0, new),
            )
            rows.index_copy_(0, new, new_rows)
        self._touch_valid(rows.index_select(0, inverse), custom)

    def accum(
        self, keys: torch.Tensor, old_values: torch.Tensor, new_values: torch.Tensor, exists: torch.Tensor
    ) -> None:
        """Apply deltas read earlier (TFRA ``accum``), safe against concurrent removal.

        Present now: ``new - old`` is added (duplicates add all their deltas). Absent now and ``exists`` False
        for every occurrence: inserted with ``new`` of the first occurrence plus the deltas of the others.
        Absent now but ``exists`` True for some occurrence: the key was removed meanwhile; it is not revived.

        Shape: ``keys`` ``S``; ``old_values``/``new_values`` ``S + (D,)``; ``exists`` ``S`` bool.
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
        delta = new - old
        rows = self.index.find(flat)
        present = rows >= 0
        self.clock += 1
        if bool(present.any()):
            self.values.index_add_(0, rows[present], delta[present])
            self.mark_updated(rows[present])
        absent = (~present).nonzero().squeeze(1)
        if absent.numel():
            unique, inverse = torch.unique(flat.index_select(0, absent), return_inverse=True)
            m = unique.numel()
            first = torch.full((m,), n, dtype=torch.int64, device=self.device)
            first.scatter_reduce_(0, inverse, absent, "amin")
            seen_before = torch.zeros(m, dtype=torch.int64, device=self.device)
            removed_meanwhile = seen_before.index_add_(0, inverse, exists.index_select(0, absent).long()) > 0
            total = torch.zeros(m, self.dim, dtype=self.dtype, device=self.device)
            total.index_add_(0, inverse, delta.index_select(0, absent))
            value = old.index_select(0, first) + total
            keep = (~removed_meanwhile).nonzero().squeeze(1)
            new_rows = torch.full((m,), -1, dtype=torch.int64, device=self.device)
            if keep.numel():
                new_rows[keep] = self._insert_missing(unique[keep], pinned=rows[present], values=value[keep])
            rows.index_copy_(0, absent, new_rows.index_select(0, inverse))
        self._touch_valid(rows, None)

    # ------------------------------------------------------------------ removal
    def erase(self, keys: torch.Tensor) -> int:
        """Remove keys. Hit: row removed with its slots. Miss: ignored. Returns the number removed."""
        flat = check_keys(keys, self.key_dtype, self.device)
        if flat.numel() == 0:
            return 0
        unique, hashes, _, _ = unique_by_hash(flat)
        slots, rows = self.index.lookup(unique, hashes)
        hit = (slots >= 0).nonzero().squeeze(1)
        if hit.numel() == 0:
            return 0
        slots, rows = slots.index_select(0, hit), rows.index_select(0, hit)
        self.clock += 1
        self._log_deleted(unique.index_select(0, hit))
        self.index.remove(slots)
        self._compact(rows)
        self.removed += rows.numel()
        return rows.numel()

    def evict(self, n: int) -> Rows:
        """Evict the ``n`` lowest-score rows (all rows if fewer); reports them to ``on_evict`` and returns them."""
        check_positive_int(n, "n", minimum=0)
        n = min(n, self._size)
        if n == 0:
            return self._take(torch.empty(0, dtype=torch.int64, device=self.device))
        victims = torch.topk(self.scores[: self._size], n, largest=False).indices
        return self._evict_rows(victims)

    def restrict(self, num_reserved: int, trigger: int | None = None) -> Rows:
        """Keep the ``num_reserved`` highest-score rows when ``size > trigger`` (default ``num_reserved``).

        Removed rows count as evicted and go to ``on_evict``. Returns them.
        """
        check_positive_int(num_reserved, "num_reserved", minimum=0)
        trigger = num_reserved if trigger is None else check_positive_int(trigger, "trigger", minimum=0)
        if trigger < num_reserved:
            raise ValueError(f"trigger must be >= num_reserved ({num_reserved}), got {trigger}")
        excess = self._size - num_reserved if self._size > trigger else 0
        return self.evict(excess)

    def clear(self) -> None:
        """Remove every key (counted as removed). Capacity is kept."""
        self.clock += 1
        self._log_deleted(self.row_keys[: self._size].clone())
        self.removed += self._size
        self._size = 0
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
        self.index.clear()
        self._size = 0
        self._reserve(n)
        new = torch.arange(n, device=self.device)
        self.index.insert(keys, new)
        self._cols["key"][:n] = keys
        self._cols["value"][:n] = values
        self._cols["score"][:n] = scores if scores is not None else 0
        self._cols["version"][:n] = self.clock
        for name, init in self._slot_init.items():
            self.slot(name)[:n] = slots.get(name, init)
        self._size = n
        self.inserted, self.removed, self.evicted = n, 0, 0

    def to(self, device: torch.device | str) -> "KeyValueTable":
        """Move storage and index to ``device`` in place; returns self."""
        device = resolve_device(device)
        if device == self.device:
            return self
        self._cols = {k: v.to(device) for k, v in self._cols.items()}
        self.device = device
        self.index = HashIndex(self.key_dtype, device, self.capacity)
        self.index.insert(self.row_keys[: self._size], torch.arange(self._size, device=device))
        return self

    # ------------------------------------------------------------------ change tracking
    def mark_updated(self, rows: torch.Tensor) -> None:
        """Stamp rows as written now (optimizers call this after updating values or slots in place)."""
        self._cols["version"].index_fill_(0, rows, self.clock)

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

    # ------------------------------------------------------------------ internals
    def _check_scores(self, scores, keys: torch.Tensor) -> torch.Tensor | None:
        if scores is None:
            return None
        if self.policy is not EvictionPolicy.CUSTOM:
            raise ValueError(f"scores can only be given with eviction='custom', this table uses {self.policy.value!r}")
        return check_scores(scores, keys.shape).to(self.device)

    def initial_rows(self, keys: torch.Tensor) -> torch.Tensor:
        if isinstance(self.initializer, CallableInitializer):
            self._init_calls += 1
            return self.initializer(keys, self.dim, self.dtype, self.seed * 1_000_003 + self._init_calls)
        # Built-in initializers are pure functions of (seed, key, column), so chunks give the same rows. On CPU,
        # chunks keep their int64 temporaries cache-sized: one [N, D] pass costs ~10x more (measured, dim 64).
        n = keys.numel()
        step = n if keys.device.type != "cpu" else max(1, _INIT_CHUNK // self.dim)
        if n <= step:
            return self.initializer(keys, self.dim, self.dtype, self.seed)
        out = torch.empty(n, self.dim, dtype=self.dtype, device=self.device)
        for start in range(0, n, step):
            out[start : start + step] = self.initializer(keys[start : start + step], self.dim, self.dtype, self.seed)
        return out

    def _touch_valid(self, rows: torch.Tensor, custom: torch.Tensor | None, counts: torch.Tensor | None = None) -> None:
        valid = rows >= 0
        if bool(valid.all()):
            self._touch(rows, custom, counts)
        else:
            keep = lambda t: t[valid] if t is not None else None  # noqa: E731
            self._touch(rows[valid], keep(custom), keep(counts))

    def _touch(self, rows: torch.Tensor, custom: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> None:
        touch_scores(self.policy, self.scores, rows, clock=self.clock, epoch=self.epoch, custom=custom, counts=counts)
        # A score change is a change: incremental checkpoints must carry it for eviction order to resume exactly.
        self._cols["version"].index_fill_(0, rows, self.clock)

    def _reserve(self, n: int) -> None:
        """Make room for ``n`` live rows (columns and index) before anything is mutated."""
        capacity = self.capacity
        if n > capacity:
            grown = int(capacity * (2.0 if capacity < 65536 else 1.25))
            new_cap = max(n, grown)
            if self.max_capacity is not None:
                new_cap = min(new_cap, self.max_capacity)
            size = self._size
            for name, col in self._cols.items():
                fresh = col.new_empty((new_cap,) + tuple(col.shape[1:]))
                fresh[:size] = col[:size]
                self._cols[name] = fresh
        if self.index.needs_rehash(n):
            # Sized for n: bucket counts are powers of two, so this at least doubles the index (load just over
            # MAX_LOAD / 2 after a rehash for growth) without over-allocating it.
            self.index.rehash(self.row_keys[: self._size], torch.arange(self._size, device=self.device), n)

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
        n_append = stored - victims.numel()
        keep, dropped = keys[:stored], keys[stored:]
        # New rows come first: a user initializer that fails must leave the table as it was.
        init = _head(values, stored) if values is not None else self.initial_rows(keep)
        if stored < m:
            dropped_values = _tail(values, stored) if values is not None else self.initial_rows(dropped)
        self._reserve(self._size + n_append)
        evicted = self._take(victims)
        if victims.numel():
            self.index.remove(self.index.find_slots(evicted.keys))
        rows = torch.cat([victims, torch.arange(self._size, self._size + n_append, device=self.device)])
        self.index.insert(keep, rows, None if hashes is None else hashes[:stored])
        slots = {f"slot:{name}": value for name, value in self._slot_init.items()}
        columns = {"key": keep, "value": init, "score": 0, "version": self.clock, **slots}
        self._write_rows(rows, victims.numel(), columns)
        self._size += n_append
        self.inserted += m
        if stored < m:
            evicted = _concat_rows(evicted, self._fresh_rows(dropped, dropped_values))
        self._report(evicted)
        return torch.cat([rows, torch.full((m - stored,), -1, dtype=torch.int64, device=self.device)])

    def _write_rows(self, rows: torch.Tensor, k: int, columns: dict) -> None:
        """Fill new ``rows``: the first ``k`` reuse evicted rows, the rest follow ``size`` (plain slice copies).

        ``columns`` maps a column to a scalar, to ``[len(rows), ...]`` values, or to ``(source, index)`` to copy
        ``source[index]`` without materializing it.
        """
        appended = slice(self._size, self._size + rows.numel() - k)
        for name, src in columns.items():
            col = self._cols[name]
            if isinstance(src, tuple):
                source, index = src
                gather_rows(source, index[k:], out=col[appended])
                if k:
                    copy_rows(col, rows[:k], source, index[:k])
            elif isinstance(src, torch.Tensor):
                col[appended] = src[k:]
                if k:
                    col.index_copy_(0, rows[:k], src[:k])
            else:
                col[appended] = src
                if k:
                    col.index_fill_(0, rows[:k], src)

    def _pick_victims(self, need: int, pinned: torch.Tensor) -> torch.Tensor:
        size = self._size
        if size == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        unpinned = torch.ones(size, dtype=torch.bool, device=self.device)
        unpinned[pinned] = False
        candidates = unpinned.nonzero().squeeze(1)
        k = min(need, candidates.numel())
        if k == 0:
            return candidates[:0]
        lowest = torch.topk(self.scores.index_select(0, candidates), k, largest=False).indices
        return candidates.index_select(0, lowest)

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
        self.clock += 1
        evicted = self._take(rows)
        self.index.remove(self.index.find_slots(evicted.keys))
        self._compact(rows)
        self._report(evicted)
        return evicted

    def _report(self, evicted: Rows) -> None:
        if evicted.keys.numel() == 0:
            return
        self._log_deleted(evicted.keys)
        self.evicted += evicted.keys.numel()
        if self.on_evict is not None:
            self.on_evict(evicted.keys, evicted.values, evicted.scores)

    def _compact(self, dead: torch.Tensor) -> None:
        """Fill the holes left by ``dead`` rows (unique, already out of the index) with the last live rows."""
        size, k = self._size, dead.numel()
        new_size = size - k
        tail_alive = torch.ones(k, dtype=torch.bool, device=self.device)
        tail_alive[dead[dead >= new_size] - new_size] = False
        movers = torch.arange(new_size, size, device=self.device)[tail_alive]
        holes = dead[dead < new_size]
        if holes.numel():
            for col in self._cols.values():
                copy_rows(col, holes, col, movers)
            moved_keys = self.row_keys.index_select(0, holes)
            self.index.set_rows(self.index.find_slots(moved_keys), holes)
        self._size = new_size


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
