"""``make_store``: build a store from its JSON config (the ``volatile_db`` / ``persistent_db`` entries)."""

from __future__ import annotations

import importlib
from typing import Mapping

from .store import Store

__all__ = ["make_store", "STORE_TYPES", "store_classes"]

# type -> (module, config class, store class, the package its module imports). The modules load on first use: a
# deployment that serves from memory and RocksDB, or a training job that never serves, needs no redis or lmdb.
STORE_TYPES = {
    "memory": (".memory", "MemoryStoreConfig", "MemoryStore", None),
    "redis": (".redis", "RedisStoreConfig", "RedisStore", "redis"),
    "rocksdb": (".rocksdb", "RocksDBStoreConfig", "RocksDBStore", "rocksdict"),
    "lmdb": (".lmdb", "LMDBStoreConfig", "LMDBStore", "lmdb"),
}


def store_classes(kind: str) -> tuple[type, type[Store]]:
    """The config and store classes of store type ``kind`` (a key of :data:`STORE_TYPES`), importing its module.

    Raises:
        ImportError: the type's Python package is not installed (the message names it and the extra to install).
    """
    module, config_name, store_name, package = STORE_TYPES[kind]
    try:
        loaded = importlib.import_module(module, __package__)
    except ModuleNotFoundError as error:
        if package is None or error.name != package:
            raise
        raise ImportError(f"store type {kind!r} needs the Python package {package!r}, which is not installed; "
                          f"install it, or all the serving stores with: pip install 'dynemb[serving]'") from error
    return getattr(loaded, config_name), getattr(loaded, store_name)


def make_store(config: Mapping, name: str = "store config") -> Store:
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
        ImportError: the type's Python package (redis, rocksdict or lmdb) is not installed.
        StoreUnavailableError: Redis cannot be reached. StoreError: a database cannot be opened.

    Example:
        >>> make_store({"type": "memory", "max_rows_per_table": 10})
        MemoryStore(max_rows_per_table=10, overflow='evict')
        >>> make_store({"type": "memory", "max_rows": 10}, name="volatile_db")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: volatile_db (type 'memory'): unknown field(s) ['max_rows']; allowed fields are [...
    """
    if not isinstance(config, Mapping):
        raise TypeError(f"{name} must be a dict with a 'type', got {type(config).__name__}")
    fields = dict(config)
    kind = fields.pop("type", None)
    if kind not in STORE_TYPES:
        raise ValueError(f"{name}: 'type' must be one of {sorted(STORE_TYPES)}, got {kind!r}")
    config_type, store_type = store_classes(kind)
    return store_type(config_type.from_dict(fields, where=f"{name} (type {kind!r})"))
