"""The RocksDB persistent store (through ``rocksdict``, in raw-bytes mode: nothing is pickled).

Reads are one ``multi_get`` per call; writes are one atomic ``WriteBatch``. See :mod:`.persistent` for the key
layout. RocksDB allows one read-write process per path; ``read_only=True`` opens a consistent read-only view
that does not see later writes of another process.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import rocksdict

from .store import StoreError
from .persistent import PersistentStore, PersistentStoreConfig

__all__ = ["RocksDBStore", "RocksDBStoreConfig"]


@dataclasses.dataclass(frozen=True)
class RocksDBStoreConfig(PersistentStoreConfig):
    """Config of :class:`RocksDBStore`: ``path`` and ``read_only`` (see :class:`PersistentStoreConfig`)."""


class RocksDBStore(PersistentStore):
    """Rows in a RocksDB database at ``config.path``.

    Raises:
        StoreError: the database cannot be opened (locked by another writer, corrupt, not a database).

    Example:
        >>> import tempfile, torch
        >>> with tempfile.TemporaryDirectory() as d, RocksDBStore(RocksDBStoreConfig(path=d)) as store:
        ...     _ = store.create_table("t", dim=2)
        ...     store.put("t", torch.tensor([-2**63]), torch.ones(1, 2))
        ...     store.get("t", torch.tensor([-2**63, 0]))[1].tolist()
        [True, False]
    """

    def __init__(self, config: RocksDBStoreConfig) -> None:
        if not isinstance(config, RocksDBStoreConfig):
            raise TypeError(f"config must be a RocksDBStoreConfig, got {type(config).__name__}")
        super().__init__(config)
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(not config.read_only)
        access = rocksdict.AccessType.read_only(False) if config.read_only else rocksdict.AccessType.read_write()
        try:
            self._db = rocksdict.Rdict(self.path, options, access_type=access)
        except Exception as error:  # rocksdict raises plain Exception for every RocksDB status
            raise StoreError(f"cannot open RocksDB at {self.path!r}: {error}") from error

    def _read(self, keys: list) -> list:
        try:
            return self._db.get(keys)
        except Exception as error:
            raise StoreError(f"RocksDB read from {self.path!r} failed: {error}") from error

    def _scan(self, prefix: bytes) -> list:
        try:
            return list(itertools.takewhile(lambda key: key.startswith(prefix), self._db.keys(from_key=prefix)))
        except Exception as error:
            raise StoreError(f"RocksDB scan of {self.path!r} failed: {error}") from error

    def _commit(self, keys: list, values: list, deletes: list = ()) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        # deque(map(...), maxlen=0) runs the native calls without a Python-level loop body.
        collections.deque(map(batch.delete, deletes), maxlen=0)
        collections.deque(map(batch.put, keys, values), maxlen=0)
        try:
            self._db.write(batch)
        except Exception as error:
            raise StoreError(f"RocksDB write to {self.path!r} failed: {error}") from error

    def _close(self) -> None:
        self._db.close()
