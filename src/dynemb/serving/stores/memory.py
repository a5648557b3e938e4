"""The in-process volatile store: one :class:`~dynemb.table.KeyValueTable` per table, on the CPU.

Memory per row is the table's columns (key 8 B, value ``D * itemsize``, score 8 B, version 8 B) plus its hash
index (a 64-byte bucket per 5 index slots, 2-8 slots per row) and growth slack. For ``D = 64`` float32 that is
about 1.2x the raw ``8 + 4 D`` bytes when the store is bounded and full, and up to about 1.5x while an unbounded
table grows (``tests/serving/test_store_memory.py`` measures it). :meth:`MemoryStore.nbytes` reports the bytes held.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from dynemb.table import EvictionPolicy, KeyValueTable
from dynemb.checks import check_positive_int
from dynemb.kernels.dispatch import numba_available
from .store import OverflowPolicy, Store, StoreConfig, StoreFullError, TableSchema

__all__ = ["MemoryStore", "MemoryStoreConfig"]

# A small first allocation keeps many small tables cheap; tables grow on demand.
_INIT_CAPACITY = 1024


@dataclasses.dataclass(frozen=True)
class MemoryStoreConfig(StoreConfig):
    """Config of :class:`MemoryStore`.

    Args:
        max_rows_per_table: bound on rows per table; ``None`` for unbounded.
        overflow: ``"evict"`` (drop the lowest-score rows) or ``"refuse"`` (raise StoreFullError) when a put
            would exceed the bound.
        eviction: score used by ``overflow="evict"``: ``"lru"`` (last access) or ``"lfu"`` (access count).
            Reads count as accesses.
    """

    max_rows_per_table: int | None = None
    overflow: str = "evict"
    eviction: str = "lru"

    def __post_init__(self) -> None:
        check_positive_int(self.max_rows_per_table, "max_rows_per_table", allow_none=True)
        OverflowPolicy.parse(self.overflow)
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be 'lru' or 'lfu', got {self.eviction!r}")


class MemoryStore(Store):
    """Volatile rows in this process's memory; thread-safe (one lock per store).

    Args:
        config: a :class:`MemoryStoreConfig` (default: unbounded).

    Example:
        >>> import torch
        >>> store = MemoryStore(MemoryStoreConfig(max_rows_per_table=2, overflow="refuse"))
        >>> _ = store.create_table("t", dim=1)
        >>> store.put("t", torch.tensor([1, 2]), torch.zeros(2, 1))
        >>> try:
        ...     store.put("t", torch.tensor([3]), torch.zeros(1, 1))
        ... except StoreFullError as error:
        ...     print(error)
        table 't' holds 2 rows; 1 new would exceed max_rows_per_table=2
    """

    def __init__(self, config: MemoryStoreConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else MemoryStoreConfig()
        self.overflow = OverflowPolicy.parse(self.config.overflow)
        self._tables_by_name: dict[str, KeyValueTable] = {}
        self._lock = threading.Lock()
        self._writes = 0  # moved on by every write: the tables' storage may have moved (see _meta)
        self._metas: dict[tuple, tuple] = {}  # tables -> (writes, signature, meta) of _get_concat's kernel

    def __repr__(self) -> str:
        return f"MemoryStore(max_rows_per_table={self.config.max_rows_per_table}, overflow={self.overflow.value!r})"

    def nbytes(self) -> int:
        """Bytes held by every table (allocated storage and index)."""
        with self._lock:
            return sum(t.nbytes() for t in self._tables_by_name.values())

    def evicted(self, table: str) -> int:
        """Rows of ``table`` dropped by ``overflow="evict"`` so far."""
        self.schema(table)
        return self._tables_by_name[table].evicted

    # ------------------------------------------------------------------ hooks
    def _create(self, table: str, schema: TableSchema) -> TableSchema:
        with self._lock:
            self._writes += 1
            bound = self.config.max_rows_per_table
            self._tables_by_name[table] = KeyValueTable(
                schema.dim,
                dtype=schema.dtype,
                init_capacity=min(_INIT_CAPACITY, bound or _INIT_CAPACITY),
                max_capacity=bound,
                eviction=EvictionPolicy.parse(self.config.eviction),
                initializer="zeros",
            )
        return schema

    def _drop(self, table: str) -> None:
        with self._lock:
            self._writes += 1
            self._tables_by_name.pop(table, None)

    def _load_schema(self, table: str) -> TableSchema | None:
        return None  # every schema this store knows was created through it, so it is already cached

    def _get(self, table, schema, keys):
        with self._lock:
            kv = self._tables_by_name[table]
            if self.config.max_rows_per_table is not None:  # scores order evictions: count the read
                return kv.find(keys, update_scores=True)
            # An unbounded store never evicts: the index and a gather, no scores, no initializer rows for misses
            # (the keys were checked by get/get_many).
            rows, every = kv.index.find_all(keys)
            values = kv.values.index_select(0, rows if every else rows.clamp(min=0))
        found = rows >= 0
        if not every:
            values.masked_fill_(~found.unsqueeze(1), 0)
        return values, found

    def _get_concat(self, tables, schema, keys, sizes):
        if self.config.max_rows_per_table is not None or not numba_available() or len(tables) < 2:
            return super()._get_concat(tables, schema, keys, sizes)  # a bounded store counts each read in its scores
        from dynemb.kernels.numba_find_many import find_rows

        starts = torch.tensor([0, *sizes], dtype=torch.int64).cumsum_(0)
        out = torch.empty(keys.numel(), schema.dim, dtype=schema.dtype)
        with self._lock:
            found = find_rows(self._meta(tuple(tables)), keys, starts, out)
        return out, found

    @property
    def fused_reads(self) -> bool:
        """Whether :meth:`with_meta` serves: an unbounded store (a bounded one counts each read in its scores) with
        numba."""
        return self.config.max_rows_per_table is None and numba_available()

    def with_meta(self, tables: tuple, fn):
        """``fn(meta)`` under the store's lock, ``meta`` the :func:`~dynemb.kernels.numba_find_many.find_rows` rows
        of ``tables`` (created tables, in that order): how the parameter server's fused path reads a request's
        misses in the same kernel that computes their default rows. Only where :attr:`fused_reads` says so."""
        with self._lock:
            return fn(self._meta(tables))

    def _meta(self, tables: tuple) -> torch.Tensor:
        """The rows of :func:`~dynemb.kernels.numba_find_many.find_rows`'s ``meta`` for ``tables`` (call under the
        lock): kept while no write came, or none moved a table's storage."""
        kept = self._metas.get(tables)
        if kept is not None and kept[0] == self._writes:
            return kept[2]
        kvs = [self._tables_by_name[t] for t in tables]
        signature = tuple((kv.storage_generation, kv.index, kv.index.generation) for kv in kvs)
        if kept is None or kept[1] != signature:
            if len(self._metas) > 64:  # requests name few distinct lists of tables; bound it all the same
                self._metas.clear()
            meta = torch.tensor([[kv.index._buckets.data_ptr(), kv.index.overflow.data_ptr(), kv.index._shift,
                                  kv.index.num_buckets, kv.values.data_ptr(), kv.values.shape[0],
                                  kv.index._key_cols] for kv in kvs], dtype=torch.int64)
        else:
            meta = kept[2]
        self._metas[tables] = (self._writes, signature, meta)
        return meta

    def _put(self, table, schema, keys, values) -> None:
        with self._lock:
            self._writes += 1
            kv = self._tables_by_name[table]
            if self.overflow is OverflowPolicy.REFUSE:
                new = keys.numel() - int(kv.contains(keys).sum())
                bound = self.config.max_rows_per_table
                if bound is not None and kv.size() + new > bound:
                    raise StoreFullError(
                        f"table {table!r} holds {kv.size()} rows; {new} new would exceed max_rows_per_table={bound}"
                    )
            kv.insert_or_assign(keys, values)

    def _delete(self, table, schema, keys) -> int:
        with self._lock:
            self._writes += 1
            return self._tables_by_name[table].erase(keys)

    def _size(self, table, schema) -> int:
        return self._tables_by_name[table].size()

    def _keys(self, table, schema) -> torch.Tensor:
        with self._lock:
            kv = self._tables_by_name[table]
            return kv.row_keys[: kv.size()].clone()

    def _tables(self) -> list[str]:
        return list(self._tables_by_name)

    def _close(self) -> None:
        with self._lock:
            self._metas.clear()
            self._tables_by_name.clear()
