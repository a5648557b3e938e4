"""Storage tiers of the serving parameter server: in-process memory, Redis, RocksDB and LMDB row stores.

Every store implements :class:`RowStore` (``create_table``, ``get``, ``put``, ``delete``, ``size``, ``keys``,
``tables``, ``close``) over int64 keys and binary rows; :func:`make_store` builds one from its JSON config. Backend
failures raise :class:`StoreError` subclasses, which the parameter server catches to fall through to the next tier.
"""

from .base import (
    OverflowPolicy,
    RowStore,
    StoreConfig,
    StoreCorruptError,
    StoreError,
    StoreFullError,
    StoreReadOnlyError,
    StoreUnavailableError,
    TableSchema,
)
from .factory import STORE_TYPES, make_store
from .lmdb import LMDBStore, LMDBStoreConfig
from .memory import MemoryStore, MemoryStoreConfig
from .redis import RedisStore, RedisStoreConfig
from .rocksdb import RocksDBStore, RocksDBStoreConfig

__all__ = [
    "RowStore",
    "TableSchema",
    "StoreConfig",
    "OverflowPolicy",
    "StoreError",
    "StoreUnavailableError",
    "StoreFullError",
    "StoreReadOnlyError",
    "StoreCorruptError",
    "make_store",
    "STORE_TYPES",
    "MemoryStore",
    "MemoryStoreConfig",
    "RedisStore",
    "RedisStoreConfig",
    "RocksDBStore",
    "RocksDBStoreConfig",
    "LMDBStore",
    "LMDBStoreConfig",
]
