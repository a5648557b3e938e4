"""Storage tiers of the serving parameter server: in-process memory, Redis, RocksDB and LMDB stores.

Every store implements :class:`Store` (``create_table``, ``get``, ``put``, ``delete``, ``size``, ``keys``,
``tables``, ``close``) over int64 keys and binary rows; :func:`make_store` builds one from its JSON config. Backend
failures raise :class:`StoreError` subclasses, which the parameter server catches to fall through to the next tier.
The Redis, RocksDB and LMDB stores and their configs import their bindings (the ``serving`` extra) when first
named, not here: naming one whose package is missing raises ImportError, and ``from ... import *`` leaves them out.
"""

from .store import (
    OverflowPolicy,
    Store,
    StoreConfig,
    StoreCorruptError,
    StoreError,
    StoreFullError,
    StoreReadOnlyError,
    StoreRowsLostError,
    StoreUnavailableError,
    TableSchema,
)
from .factory import STORE_TYPES, make_store, store_classes
from .memory import MemoryStore, MemoryStoreConfig

__all__ = [
    "Store",
    "TableSchema",
    "StoreConfig",
    "OverflowPolicy",
    "StoreError",
    "StoreUnavailableError",
    "StoreFullError",
    "StoreReadOnlyError",
    "StoreCorruptError",
    "StoreRowsLostError",
    "make_store",
    "store_classes",
    "STORE_TYPES",
    "MemoryStore",
    "MemoryStoreConfig",
]


# RedisStore, RocksDBStoreConfig, ...: loaded on first use (PEP 562), so that importing the serving package needs
# none of the store bindings.
_LAZY = {name: kind for kind, (_, *names, _) in STORE_TYPES.items() for name in names if name not in globals()}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    config_type, store_type = store_classes(_LAZY[name])
    return config_type if name == config_type.__name__ else store_type


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
