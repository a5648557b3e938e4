"""Shared layout of the persistent stores (RocksDB, LMDB): one ordered byte keyspace holding every table.

=================================  ===============================================================
key                                value
=================================  ===============================================================
``<table> NUL`` + 8-byte key        the row: ``D`` little-endian values of the table's dtype
``NUL "tables"``                    JSON ``{table: {"dim", "dtype"}}``
``NUL "count" NUL <table>``         the table's row count, 8 bytes little-endian
=================================  ===============================================================

The 8-byte key is big-endian with the sign bit flipped, so a table's rows sort in numeric key order. Table names
contain no NUL, so row keys never collide with each other or with the metadata keys (which start with NUL).

A put or delete commits its rows and the new row count in one atomic batch (RocksDB write batch, LMDB write
transaction). The count comes from a batched existence read just before, under a lock: one writing process per
path (the parameter server), any number of readers.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import threading

import numpy as np
import torch

from .store import Store, StoreConfig, TableSchema
from .row_bytes import decode_keys, decode_rows, encode_keys, encode_rows, sort_keys, unsort

__all__ = ["PersistentStore", "PersistentStoreConfig"]

_TABLES_KEY = b"\x00tables"
_COUNT_PREFIX = b"\x00count\x00"


@dataclasses.dataclass(frozen=True)
class PersistentStoreConfig(StoreConfig):
    """Config of a persistent store.

    Args:
        path: directory of the database (created unless ``read_only``).
        read_only: open without write access; writes raise StoreReadOnlyError. The database must exist.
    """

    path: str
    read_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise TypeError(f"path must be a non-empty str or os.PathLike, got {self.path!r}")
        if not isinstance(self.read_only, bool):
            raise TypeError(f"read_only must be a bool, got {self.read_only!r}")
        if self.read_only and not os.path.isdir(self.path):
            raise FileNotFoundError(f"path {os.fspath(self.path)!r} is not an existing database (read_only=True)")


class PersistentStore(Store):
    """Base of the embedded key-value stores; subclasses supply ``_read`` and ``_commit`` on raw bytes."""

    def __init__(self, config: PersistentStoreConfig) -> None:
        super().__init__(read_only=config.read_only)
        self.config = config
        self.path = os.fspath(config.path)
        self._write_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={self.path!r}, read_only={self.read_only})"

    # ------------------------------------------------------------------ backend primitives
    @abc.abstractmethod
    def _read(self, keys: list) -> list:
        """The value of each key (``bytes``), or None where absent."""

    @abc.abstractmethod
    def _scan(self, prefix: bytes) -> list:
        """Every key (``bytes``) that starts with ``prefix``, in byte order."""

    @abc.abstractmethod
    def _commit(self, keys: list, values: list, deletes: list = ()) -> None:
        """Atomically write ``keys -> values`` and remove ``deletes``."""

    # ------------------------------------------------------------------ hooks
    def _load_tables(self) -> dict:
        raw = self._read([_TABLES_KEY])[0]
        return {} if raw is None else json.loads(raw)

    def _create(self, table: str, schema: TableSchema) -> TableSchema:
        with self._write_lock:
            tables = self._load_tables()
            if table not in tables:
                tables[table] = schema.to_dict()
                record = json.dumps(tables, sort_keys=True).encode()
                self._commit([_TABLES_KEY, _count_key(table)], [record, _count_bytes(0)])
            return TableSchema.from_dict(tables[table])

    def _drop(self, table: str) -> None:
        with self._write_lock:
            tables = self._load_tables()
            tables.pop(table, None)
            self._commit([_TABLES_KEY], [json.dumps(tables, sort_keys=True).encode()], deletes=[_count_key(table)])

    def _load_schema(self, table: str) -> TableSchema | None:
        record = self._load_tables().get(table)
        return None if record is None else TableSchema.from_dict(record)

    def _tables(self) -> list[str]:
        return list(self._load_tables())

    def _get(self, table, schema, keys):
        ordered, order = sort_keys(keys)
        names = encode_keys(ordered, _prefix(table))
        values, found = decode_rows(self._read(names), schema, names)
        return unsort(values, order), unsort(found, order)

    def _put(self, table, schema, keys, values) -> None:
        names = encode_keys(keys, _prefix(table))
        with self._write_lock:
            new = self._read(names).count(None)
            count = self._size(table, schema) + new
            self._commit(names + [_count_key(table)], encode_rows(values) + [_count_bytes(count)])

    def _delete(self, table, schema, keys) -> int:
        names = encode_keys(keys, _prefix(table))
        with self._write_lock:
            removed = len(names) - self._read(names).count(None)
            count = self._size(table, schema) - removed
            self._commit([_count_key(table)], [_count_bytes(count)], deletes=names)
        return removed

    def _size(self, table, schema) -> int:
        raw = self._read([_count_key(table)])[0]
        return 0 if raw is None else int.from_bytes(raw, "little")

    def _keys(self, table, schema) -> torch.Tensor:
        return decode_keys([name[-8:] for name in self._scan(_prefix(table).tobytes())])


def _prefix(table: str) -> np.ndarray:
    return np.frombuffer(table.encode() + b"\x00", dtype=np.uint8)


def _count_key(table: str) -> bytes:
    return _COUNT_PREFIX + table.encode()


def _count_bytes(count: int) -> bytes:
    return count.to_bytes(8, "little")
