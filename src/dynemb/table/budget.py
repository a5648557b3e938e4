"""Byte budgets: how many rows fit in ``max_bytes``, counting every column (key, value, score, version stamp,
optimizer slots) and the hash index.

The index grows in powers of two (see :class:`~dynemb.table.index.HashIndex`), so bytes are not linear in rows:
:func:`rows_for_bytes` searches for the largest row count whose whole footprint fits. A table never allocates more
than that footprint, so ``nbytes() <= max_bytes`` holds at all times; the index's power-of-two steps can leave up
to ``26 / (row_bytes + 52)`` of the budget unused (about 4% for ``dim=64`` float32 with one Adagrad slot).
"""

from __future__ import annotations

import torch

from .index import HashIndex

__all__ = ["row_bytes", "index_bytes", "table_bytes", "rows_for_bytes", "split_bytes"]


def row_bytes(dim: int, dtype: torch.dtype, key_dtype: torch.dtype, slots: dict[str, tuple[int, torch.dtype]]) -> int:
    """Bytes of one row's columns: key, ``dim`` values, int64 score and version stamp, and each ``(width, dtype)``
    slot. (A table under a byte budget never defers its stamps, so it holds no tags: ``RowStore._defer_stamps``.)"""
    size = lambda dt: torch.empty(0, dtype=dt).element_size()  # noqa: E731
    return size(key_dtype) + dim * size(dtype) + 16 + sum(width * size(dt) for width, dt in slots.values())


def index_bytes(capacity: int, key_dtype: torch.dtype) -> int:
    """Bytes of a :class:`HashIndex` sized for ``capacity`` keys: per bucket, a 64-byte line of keys and row ids,
    and one overflow flag."""
    return HashIndex.buckets_for(capacity, key_dtype) * (HashIndex.BUCKET_WORDS * 4 + 1)


def table_bytes(rows: int, per_row: int, key_dtype: torch.dtype) -> int:
    """Footprint of a table holding (and allocated for) ``rows`` rows of ``per_row`` column bytes."""
    return rows * per_row + index_bytes(rows, key_dtype)


def rows_for_bytes(max_bytes: int, per_row: int, key_dtype: torch.dtype, what: str = "max_bytes") -> int:
    """The most rows whose :func:`table_bytes` fits in ``max_bytes``.

    Raises:
        ValueError: not even one row fits; the message names ``what``, the budget and the smallest that works.

    Example:
        >>> rows_for_bytes(1 << 20, row_bytes(16, torch.float32, torch.int64, {}), torch.int64)
        8890
    """
    if table_bytes(1, per_row, key_dtype) > max_bytes:
        raise ValueError(f"{what}={max_bytes} is too small for one row: a row of this table takes {per_row} bytes "
                         f"plus its index, at least {table_bytes(1, per_row, key_dtype)} bytes in all")
    lo, hi = 1, max(1, max_bytes // per_row)  # table_bytes(lo) fits; nothing above hi can
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if table_bytes(mid, per_row, key_dtype) <= max_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def split_bytes(max_bytes: int, tables: dict[str, tuple[int, torch.dtype]]) -> dict[str, int]:
    """Split ``max_bytes`` across tables given as ``{name: (bytes per row, key dtype)}`` so that each can hold
    the same number of rows ``R`` (the largest for which every table's :func:`table_bytes` fits together); what is
    left over is shared in proportion to bytes per row. Shares never sum past the budget.

    Raises:
        ValueError: the budget does not hold one row of every table.

    Example:
        >>> shares = split_bytes(1 << 20, {"a": (40, torch.int64), "b": (200, torch.int64)})
        >>> [rows_for_bytes(shares[n], per_row, torch.int64) for n, per_row in (("a", 40), ("b", 200))]
        [3259, 3259]
    """
    total = lambda r: sum(table_bytes(r, per_row, kd) for per_row, kd in tables.values())  # noqa: E731
    if not tables or total(1) > max_bytes:
        raise ValueError(f"max_bytes={max_bytes} does not hold one row of each of the tables {sorted(tables)}")
    lo, hi = 1, max_bytes // sum(per_row for per_row, _ in tables.values())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= max_bytes else (lo, mid - 1)
    left = max_bytes - total(lo)
    weight = sum(per_row for per_row, _ in tables.values())
    return {name: table_bytes(lo, per_row, kd) + left * per_row // weight for name, (per_row, kd) in tables.items()}


def budget_rows(table) -> int:
    """The row bound ``table.max_bytes`` gives with the table's current columns."""
    slots = {n: (table.slot(n).shape[1], table.slot(n).dtype) for n in table.slot_names}
    per_row = row_bytes(table.dim, table.dtype, table.key_dtype, slots)
    return rows_for_bytes(table.max_bytes, per_row, table.key_dtype)


def fit(table) -> None:
    """Re-derive ``max_capacity`` from ``max_bytes`` after the columns changed (a slot added, values cast): rows
    past the new bound are evicted (lowest scores, reported), and columns and index shrink to it."""
    cap = min(budget_rows(table), 2**31 - 1)
    table.max_capacity = cap
    if table.size() > cap:
        table.evict(table.size() - cap)
    if table.capacity > cap:
        table._resize_columns(cap, min(cap, table.live_rows()))
    if table.index.num_buckets > table.index.buckets_for(cap, table.index.key_dtype):
        n = table.size()
        table.index.rehash(table.row_keys[:n], torch.arange(n, device=table.device), cap)
