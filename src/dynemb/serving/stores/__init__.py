"""Storage tiers of the serving parameter server: in-process memory, Redis, RocksDB and LMDB row stores.

Every store implements :class:`RowStore` (``create_table``, ``get``, ``put``, ``delete``, ``size``, ``keys``,
``tables``, ``close``) over int64 keys and binary rows; :func:`make_store` builds one from its JSON config. Backend
failures raise :class:`StoreError` subclasses, which the parameter server catches to fall through to the next tier.
The Redis, RocksDB and LMDB stores import their bindings (the ``serving`` extra) when first named, not here.
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
from .factory import STORE_TYPES, make_store, store_classes
from .memory import MemoryStore, MemoryStoreConfig

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
    "store_classes",
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


def __getattr__(name: str):
    # RedisStore, RocksDBStoreConfig, ...: loaded on first use (PEP 562), so that importing the serving package
    # needs none of the store bindings.
    for kind, (_, config_name, store_name, _) in STORE_TYPES.items():
        if name in (config_name, store_name):
            config_type, store_type = store_classes(kind)
            return config_type if name == config_name else store_type
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
