"""One cache for the tables of a model that share a row shape: a request reads it in one pass.

The tables of a model with the same dim, dtype and device share one bounded LRU :class:`KeyValueTable` (capacity: the
sum of theirs). Table ``i`` of the group keys its rows by ``key ^ salt[i]`` (``salt[i] = mix64(i + 1)``): a bijection,
so a table's keys never collide among themselves. Two tables' keys can still meet on one cache key (``k1 ^ salt[i] ==
k2 ^ salt[j]``, ``k1 != k2``), so every cached row carries its own key in extra columns (its 8 bytes viewed in the row
dtype; copies move bits unchanged): a row counts as found only when the key it carries is the key asked for. Two keys
that meet evict each other, as any two rows of a full cache may; neither is ever answered with the other's row.

:class:`TableCache` is one table's view of it, with the calls the rest of the parameter server makes on a cache
(find, insert, erase, contains, keys, size), so that per-table code (updates, write-backs, statistics) reads as before.
:func:`~dynemb.serving.ps.request_lookup.lookup_request` reads the group's cache directly, for every table at once.
"""

from __future__ import annotations

import threading
from typing import Optional

import numpy as np
import torch

from ...kernels.dispatch import numba_available
from ...table import KeyValueTable
from ...table.hashing import mix64

__all__ = ["GroupCache", "TableCache"]


def _key_columns(dtype: torch.dtype) -> int:
    return 8 // torch.empty(0, dtype=dtype).element_size()


class GroupCache:
    """The cache of the tables of one group (module docstring); ``lock`` guards it, ``filling`` is set while a
    background write-back inserts into it (readers then go to the lower tiers)."""

    def __init__(self, dim: int, dtype: torch.dtype, device, capacity: int, tables: int) -> None:
        self.dim, self.dtype = dim, dtype
        self.key_cols = _key_columns(dtype)
        self.kv = KeyValueTable(dim + self.key_cols, dtype=dtype, device=device, max_capacity=capacity,
                                init_capacity=min(capacity, 1 << 16), eviction="lru", initializer="zeros")
        self.salts = mix64(torch.arange(1, tables + 1, dtype=torch.int64)).to(self.kv.device)
        self.lock = threading.Lock()
        self.filling = False
        self._fused = self.kv.device.type == "cpu" and numba_available()
        self.tables = tables
        # [tables, 5] int64 counts (lookups, cache, volatile, persistent, default) of fused requests not yet added
        # to the tables' stats (request_lookup._account_fused, settle_stats); guarded by the tables' stats_lock
        self.pending_stats: Optional[np.ndarray] = None

    def ensure_pending_stats(self) -> None:
        if self.pending_stats is None:
            self.pending_stats = np.zeros((self.tables, 5), np.int64)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def carried_keys(self, raw: torch.Tensor) -> torch.Tensor:
        """The key each row of ``raw`` (``[N, dim + key_cols]``) carries: int64 ``[N]``."""
        # A copy of its own: a view at an offset that is not a multiple of 8 bytes cannot be read as int64.
        cols = torch.empty(raw.shape[0], self.key_cols, dtype=self.dtype, device=raw.device)
        return cols.copy_(raw[:, self.dim:]).view(torch.int64).view(-1)

    def with_keys(self, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[N, dim + key_cols]``: ``rows`` followed by the bits of ``keys``."""
        return torch.cat([rows.to(self.dtype), keys.to(torch.int64).view(-1, 1).view(self.dtype)], dim=1)

    def find(self, cache_keys: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [N, dim], found [N])`` of ``keys`` stored under ``cache_keys`` (zero rows where not found); each
        row the index finds counts as an access (LRU). Call under ``lock``."""
        kv = self.kv
        if self._fused:  # probe, gather and the carried keys' check in one pass (numba_find_many.find_carried)
            from ...kernels.numba_find_many import find_carried

            table, key_cols, overflow, _, shift = kv.index._kernel_args(cache_keys)
            out = torch.empty(cache_keys.numel(), self.dim, dtype=self.dtype)
            found, touched = find_carried(table, key_cols, overflow, shift, kv.values, cache_keys, keys, out)
            kv.clock += 1  # what kv.find(update_scores=True) stamps: every row the index found
            kv._touch(touched)
            return out, found
        raw, found = kv.find(cache_keys, update_scores=True)
        found = found & (self.carried_keys(raw) == keys)
        return raw[:, :self.dim].masked_fill(~found.unsqueeze(1), 0), found


class TableCache:
    """Table ``index``'s view of a :class:`GroupCache`: a cache of rows ``[dim]`` keyed by the table's keys.
    Callers hold the group's lock (``TableState.cache_lock`` is it), as they would a cache of their own."""

    def __init__(self, group: GroupCache, index: int, capacity: int) -> None:
        self.group, self.index, self.capacity = group, index, capacity
        self.salt = group.salts[index]

    @property
    def device(self) -> torch.device:
        return self.group.device

    @property
    def max_capacity(self) -> int:
        """The table's share of the group's capacity (the group's rows go to whichever tables are read most)."""
        return self.capacity

    def cache_keys(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.to(torch.int64) ^ self.salt

    def find(self, keys: torch.Tensor, update_scores: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [N, dim], found [N])``; a miss's row is zeros."""
        return self.group.find(self.cache_keys(keys), keys.to(torch.int64))

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        return self.find(keys)[1]

    def insert_or_assign(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        self.group.kv.insert_or_assign(self.cache_keys(keys), self.group.with_keys(keys, rows))

    def erase(self, keys: torch.Tensor) -> int:
        """Remove ``keys``' rows (only rows that carry one of them: another table's row is left alone)."""
        mine = self.contains(keys)
        return self.group.kv.erase(self.cache_keys(keys[mine])) if bool(mine.any()) else 0

    def _mine(self) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.group.kv
        n = kv.size()
        carried = self.group.carried_keys(kv.values[:n])
        return carried, (kv.row_keys[:n] ^ self.salt) == carried

    def keys(self) -> torch.Tensor:
        """The table's keys in the cache, int64 ``[n]``."""
        carried, mine = self._mine()
        return carried[mine]

    def size(self) -> int:
        return int(self._mine()[1].sum())

    def nbytes(self) -> int:
        """The table's share of the group cache's bytes (by capacity)."""
        group = self.group
        share = self.capacity / max(group.kv.max_capacity, 1)
        return int(group.kv.nbytes() * share)

    def export(self):
        """``(keys, values)`` of the table's cached rows (a :class:`~dynemb.table.rows.Rows`-like pair)."""
        kv = self.group.kv
        carried, mine = self._mine()
        rows = kv.values[:kv.size(), :self.group.dim][mine]
        return _Rows(carried[mine], rows)


class _Rows:
    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
