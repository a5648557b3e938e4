"""The LMDB persistent store (through the ``lmdb`` binding).

Reads run in one read transaction per call; writes in one write transaction (``putmulti``). See
:mod:`.persistent` for the key layout. Readers in other processes see each committed write at once.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import lmdb

from dynemb.checks import check_positive_int
from .store import StoreError, StoreFullError
from .persistent import PersistentStore, PersistentStoreConfig

__all__ = ["LMDBStore", "LMDBStoreConfig"]


@dataclasses.dataclass(frozen=True)
class LMDBStoreConfig(PersistentStoreConfig):
    """Config of :class:`LMDBStore`: ``path``, ``read_only`` (see :class:`PersistentStoreConfig`) and:

    Args:
        map_size: the largest size the database may reach, in bytes (address space only, not allocated).
            A write past it raises StoreFullError.
    """

    map_size: int = 1 << 40

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(self.map_size, "map_size", minimum=1 << 20)


class LMDBStore(PersistentStore):
    """Rows in an LMDB environment at ``config.path``.

    Raises:
        StoreError: the environment cannot be opened.

    Example:
        >>> import tempfile, torch
        >>> with tempfile.TemporaryDirectory() as d, LMDBStore(LMDBStoreConfig(path=d)) as store:
        ...     _ = store.create_table("t", dim=2)
        ...     store.put("t", torch.tensor([2**63 - 1]), torch.ones(1, 2))
        ...     store.get("t", torch.tensor([2**63 - 1, 0]))[1].tolist()
        [True, False]
    """

    def __init__(self, config: LMDBStoreConfig) -> None:
        if not isinstance(config, LMDBStoreConfig):
            raise TypeError(f"config must be a LMDBStoreConfig, got {type(config).__name__}")
        super().__init__(config)
        try:
            self._env = lmdb.open(
                self.path, map_size=config.map_size, readonly=config.read_only, create=not config.read_only
            )
        except lmdb.Error as error:
            raise StoreError(f"cannot open LMDB at {self.path!r}: {error}") from error

    def _read(self, keys: list) -> list:
        # map(txn.get) beats cursor.getmulti here: it keeps positions (None for misses) and skips tuple building.
        try:
            with self._env.begin(buffers=False) as txn:
                return list(map(txn.get, keys))
        except lmdb.Error as error:
            raise StoreError(f"LMDB read from {self.path!r} failed: {error}") from error

    def _scan(self, prefix: bytes) -> list:
        try:
            with self._env.begin(buffers=False) as txn:
                cursor = txn.cursor()
                if not cursor.set_range(prefix):
                    return []
                return list(itertools.takewhile(lambda key: key.startswith(prefix), cursor.iternext(values=False)))
        except lmdb.Error as error:
            raise StoreError(f"LMDB scan of {self.path!r} failed: {error}") from error

    def _commit(self, keys: list, values: list, deletes: list = ()) -> None:
        try:
            with self._env.begin(write=True) as txn:
                collections.deque(map(txn.delete, deletes), maxlen=0)
                txn.cursor().putmulti(zip(keys, values))
        except lmdb.MapFullError as error:
            raise StoreFullError(f"LMDB at {self.path!r} reached map_size={self.config.map_size}") from error
        except lmdb.Error as error:
            raise StoreError(f"LMDB write to {self.path!r} failed: {error}") from error

    def _close(self) -> None:
        self._env.close()
