"""The parameter server's store tiers: a volatile store over an optional persistent one, each skipped for a while
when it fails."""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..server_config import ServerConfig
from ..stores import Store, StoreError, make_store

__all__ = ["StoreTier", "StoreTiers"]

_PUT_ROWS = 1 << 18  # most rows per store write while loading or updating


class StoreTier:
    """A store with failure accounting and exponential back-off."""

    def __init__(self, name: str, store: Optional[Store]) -> None:
        self.name, self.store = name, store
        self.errors, self._down_until, self._backoff = 0, 0.0, 0.5

    @property
    def available(self) -> bool:
        """There is a store, and it is not in a back-off period."""
        return self.store is not None and time.monotonic() >= self._down_until

    @property
    def writable(self) -> bool:
        """There is a store, and it was not opened read-only (back-off periods aside)."""
        return self.store is not None and not getattr(self.store, "read_only", False)

    def call(self, fn, *args):
        """Run ``fn(*args)``; on a store failure count it, back off, and return None."""
        try:
            result = fn(*args)
        except StoreError:
            self.errors += 1
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            return None
        self._backoff = 0.5
        return result


class StoreTiers:
    """The volatile tier (memory or Redis) and the persistent tier (RocksDB or LMDB, or no store)."""

    def __init__(self, config: ServerConfig) -> None:
        self.volatile = StoreTier("volatile", make_store(config.volatile_db, name="volatile_db"))
        persistent = make_store(config.persistent_db, name="persistent_db") if config.persistent_db else None
        self.persistent = StoreTier("persistent", persistent)

    def create_table(self, table: str, dim: int, dtype: torch.dtype) -> None:
        """Create ``table`` in every writable store. A store error raises."""
        for tier in self._writable(self.volatile, self.persistent):
            tier.store.create_table(table, dim, dtype)

    def put(self, table: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows to every writable store, the persistent one first. A store error is counted (see
        :meth:`StoreTier.call`) and the write to that store given up."""
        for tier in self._writable(self.persistent, self.volatile):
            for start in range(0, keys.numel(), _PUT_ROWS):
                tier.call(tier.store.put, table, keys[start: start + _PUT_ROWS], values[start: start + _PUT_ROWS])

    def delete(self, table: str, keys: torch.Tensor) -> None:
        """Delete keys from every writable store, the persistent one first (so that a lookup in between cannot copy
        a deleted row from it back into the volatile one). A store error is counted."""
        for tier in self._writable(self.persistent, self.volatile):
            tier.call(tier.store.delete, table, keys)

    def replace(self, table: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make every writable store hold exactly these rows of ``table``: the keys it holds beyond ``keys`` are
        deleted (the persistent store first), then the rows are written. A store error is counted."""
        for tier in self._writable(self.persistent, self.volatile):
            held = tier.call(tier.store.keys, table)
            stale = None if held is None else held[~torch.isin(held, keys)]
            if stale is not None and stale.numel():
                tier.call(tier.store.delete, table, stale)
        self.put(table, keys, values)

    @staticmethod
    def _writable(*order: StoreTier) -> list[StoreTier]:
        """The tiers of ``order``, in that order, that take writes."""
        return [tier for tier in order if tier.writable]

    @property
    def errors(self) -> dict[str, int]:
        """Store errors counted per tier."""
        return {"volatile": self.volatile.errors, "persistent": self.persistent.errors}

    def close(self) -> None:
        for tier in (self.volatile, self.persistent):
            if tier.store is not None:
                tier.store.close()
