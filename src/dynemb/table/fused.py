"""The table's one-launch paths on the ``triton`` backend: :class:`~dynemb.table.KeyValueTable`'s ``find``,
``find_or_insert`` and ``erase`` through :mod:`dynemb.kernels.triton_index`'s ``find_gather``,
``find_or_insert`` and ``erase``, with the results of the torch path.

Each function returns ``None`` when its preconditions do not hold, and the caller then runs its own (torch
reference) path; the decision reads only Python state, never the device:

- ``find``: the initializer has a kernel spec (uniform, constant): missing keys' rows are generated in the kernel.
- ``find_or_insert``: no admission filter, a built-in initializer (it cannot raise after the index changed), and
  room for the whole batch as new keys without eviction, column growth or an index past ``MAX_LOAD``:
  ``size + N <= capacity``, ``<= max_capacity`` and ``<= MAX_LOAD * slots``. A bounded table that is full, a
  growing one about to grow, or a batch larger than the headroom falls back (the fallback grows the table).

New keys are numbered as the torch path numbers them: the kernel hands out rows in the order it claims slots
(on a GPU, a race), so its new rows are renumbered to the keys' hash order (``unique_by_hash``'s order), and
everything else (initializer rows, scores, version stamps, counters, ``found``) is written as
:meth:`~dynemb.table.rows.RowStore._insert_missing` writes it. Only the index's slot layout may differ from the
torch path's (which keys are found, and with which row, does not).

Host syncs: ``find`` none; ``find_or_insert`` one (the new-key count and the overflow-flag count, read together:
the table's size is a Python int, and stale flags decide a rehash as in the torch path); ``erase`` none (its
caller still reads its dedup and hit counts).
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..kernels.dispatch import Backend, kernels_for, resolve_backend
from .hashing import key_hash
from .initializers import CallableInitializer

__all__ = ["kernels", "find", "find_or_insert", "erase"]


def kernels(table) -> ModuleType | None:
    """:mod:`~dynemb.kernels.triton_index` when ``table``'s backend resolves to triton for this call, else None."""
    if resolve_backend(table.backend, table.device) is not Backend.TRITON:
        return None
    return kernels_for(Backend.TRITON, table.device).index


def _index_args(index) -> tuple:
    return index._buckets.view(index.key_dtype), index._key_cols, index.overflow


def find(table, ti: ModuleType, flat: torch.Tensor, out: torch.Tensor | None
         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows [N] int64, values [N, D])`` of ``flat`` keys in one launch (misses: initializer rows), or None."""
    spec = None if isinstance(table.initializer, CallableInitializer) else table.initializer.kernel_spec()
    if spec is None:
        return None
    index = table.index
    direct = out if out is not None and out.is_contiguous() else None
    rows, values = ti.find_gather(*_index_args(index), flat, index._shift, table.values, spec, table.seed, out=direct)
    if out is not None and direct is None:
        values = out.copy_(values)
    return rows.long(), values


def find_or_insert(table, ti: ModuleType, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(rows [N] int64, found [N] bool)`` with absent keys inserted and initialized, or None (see the module).

    Advances the clock and the counters; the caller touches the scores of ``rows``.
    """
    index, size, n = table.index, table._size, flat.numel()
    headroom = min(table.capacity, table.max_capacity or table.capacity, int(index.MAX_LOAD * index.slots))
    if table.admission is not None or isinstance(table.initializer, CallableInitializer) or size + n > headroom:
        return None
    counter = torch.full((1,), size, dtype=torch.int32, device=table.device)
    flags = index.overflow.count_nonzero()  # before the kernel, read with its result: the torch path's rehash rule
    slots, rows, inserted = ti.find_or_insert(*_index_args(index), flat, index._shift, counter)
    m, flags = torch.stack([counter[0].long() - size, flags]).tolist()  # the one sync
    table.clock += 1
    rows = rows.long()
    found = rows < size  # the headroom check leaves every key a slot: no row is -1
    if m:
        _number_new(table, flat, slots, rows, inserted, m)
    table.inserted += m
    if m and flags > index.MAX_OVERFLOW_FRACTION * index.num_buckets:
        # RowStore._reserve rehashes before inserting when stale flags pile up; rebuilding after gives the same
        # bucket count and flags (linear probing's bucket counts and spills do not depend on insertion order).
        index.rehash(table.row_keys[: table._size], torch.arange(table._size, device=table.device), table._size)
    return rows, found


def _number_new(table, flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, inserted: torch.Tensor,
                m: int) -> None:
    """Give the ``m`` keys the kernel inserted rows ``size .. size + m - 1`` in hash order (``rows`` and the index
    are renumbered in place) and write their columns."""
    size, device = table._size, table.device
    at = torch.nonzero_static(inserted, size=m).squeeze(1)  # the position that created each new key
    order = key_hash(flat.index_select(0, at)).sort().indices
    at = at.index_select(0, order)
    keys = flat.index_select(0, at)
    numbered = torch.arange(size, size + m, device=device)
    renumber = torch.empty(m, dtype=torch.int64, device=device).index_copy_(0, rows.index_select(0, at) - size,
                                                                             numbered)
    new = rows >= size
    rows.copy_(torch.where(new, renumber.index_select(0, (rows - size).clamp_(0, m - 1)), rows))
    table.index.set_rows(slots.index_select(0, at), numbered)
    slot_cols = {f"slot:{name}": value for name, value in table._slot_init.items()}
    columns = {"key": keys, "value": table.initial_rows(keys), "score": 0, "version": table.clock, **slot_cols}
    table._write_rows(numbered, 0, columns)
    table._size += m


def erase(table, ti: ModuleType, unique: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Free unique keys' slots in one launch: ``(slots, rows)`` int64, -1 where absent (as ``HashIndex.lookup``
    before ``remove``)."""
    index = table.index
    slots, rows = ti.erase(*_index_args(index), unique, index._shift, with_rows=True)
    return slots, rows.long()
