"""``make_store``: build a row store from its JSON config (the ``volatile_db`` / ``persistent_db`` entries)."""

from __future__ import annotations

from typing import Mapping

from .base import RowStore
from .lmdb import LMDBStore, LMDBStoreConfig
from .memory import MemoryStore, MemoryStoreConfig
from .redis import RedisStore, RedisStoreConfig
from .rocksdb import RocksDBStore, RocksDBStoreConfig

__all__ = ["make_store", "STORE_TYPES"]

STORE_TYPES = {
    "memory": (MemoryStoreConfig, MemoryStore),
    "redis": (RedisStoreConfig, RedisStore),
    "rocksdb": (RocksDBStoreConfig, RocksDBStore),
    "lmdb": (LMDBStoreConfig, LMDBStore),
}


def make_store(config: Mapping, name: str = "store config") -> RowStore:
    """Build the store described by ``config``.

    Args:
        config: ``{"type": "memory" | "redis" | "rocksdb" | "lmdb", **fields of that type's config}``; see
            :class:`MemoryStoreConfig`, :class:`RedisStoreConfig`, :class:`RocksDBStoreConfig`,
            :class:`LMDBStoreConfig`.
        name: what to call the config in error messages (e.g. ``"volatile_db"``).

    Returns:
        The opened store.

    Raises:
        TypeError/ValueError: unknown type or field, or a bad value (the message names it).
        StoreUnavailableError: Redis cannot be reached. StoreError: a database cannot be opened.

    Example:
        >>> make_store({"type": "memory", "max_rows_per_table": 10})
        MemoryStore(max_rows_per_table=10, overflow='evict')
        >>> make_store({"type": "redis", "adress": "127.0.0.1:6379"}, name="volatile_db")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: volatile_db (type 'redis'): unknown field(s) ['adress']; allowed fields are ['address', ...
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"{name} must be a dict with a 'type', got {type(config).__name__}")
    fields = dict(config)
    kind = fields.pop("type", None)
    if kind not in STORE_TYPES:
        raise ValueError(f"{name}: 'type' must be one of {sorted(STORE_TYPES)}, got {kind!r}")
    config_type, store_type = STORE_TYPES[kind]
    return store_type(config_type.from_dict(fields, where=f"{name} (type {kind!r})"))
