"""The parameter server's store tiers: a volatile store over an optional persistent one, their health, and the
markers that keep a shared Redis from answering with rows it lost or another server wrote.

Health. A tier whose store fails (:class:`~dynemb.serving.stores.StoreError`) is marked failed at once: a warning
is logged (once, on the change), its error counter rises, and lookups skip it. A monitor thread probes it again
with back-off (0.25 s doubling to 2 s): a ping, and the markers; once it answers, the tier is up again (logged
too). A lookup whose misses needed a failed tier and that no *complete* lower tier answered raises
:class:`TierUnavailableError` (the endpoint's 503) instead of answering initializer rows for ids the export holds:
the persistent tier is complete (it holds every row of the export), and so is the volatile one when there is no
persistent tier. :meth:`StoreTiers.ready` says whether the complete tier is up.

Markers (Redis, see :mod:`dynemb.serving.stores.redis`). Each export root a model is served from is a namespace
in the stores, ``<model>@<model id>``: the model's name and the id of the training run's exports
(``model.json``), so servers of different runs never share rows and replicas of one export do. Its marker key
holds ``"<version> <digest>"`` of the version whose rows are there; every read of the namespace's tables reads it in
the same round trip. Gone (Redis restarted empty, was flushed, or evicted keys): the tier fails as *lost*, the
monitor writes the rows of the version served again from the export (in the background; only the marker when a
persistent tier holds every row) and the tier is up again. Another version there: another server of the same run
wrote its rows; the newest version wins the namespace: a server never writes an older version over a newer one
(its load refuses, its updates leave the volatile tier alone until they reach that version), and a server whose
version is not the marker's reports not ready and answers 503 for requests that need the tier.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

import torch

from ..server_config import ServerConfig
from ..stores import Store, StoreError, StoreFullError, StoreRowsLostError, StoreUnavailableError, make_store

__all__ = ["StoreTier", "StoreTiers", "TierUnavailableError", "marker_token"]

_PUT_ROWS = 1 << 18  # most rows per store write while loading or updating
_FIRST_PROBE_S, _MOST_PROBE_S = 0.25, 2.0  # the monitor's back-off between probes of a failed tier
_EVICTION_CHECK_S = 1.0  # how often the monitor asks Redis whether it evicted keys
_EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")

log = logging.getLogger(__name__)


class TierUnavailableError(StoreUnavailableError):
    """A lookup's misses needed a tier that failed, and no tier holding every row answered them: answering would
    give initializer rows for ids the export holds. The message names the store and its address."""


def marker_token(version: int, digest: Optional[str]) -> str:
    """A namespace's marker value for an export ``version`` with ``digest``."""
    return f"{version} {digest or '-'}"


def _token_version(value: bytes) -> int:
    try:
        return int(value.split(b" ", 1)[0])
    except ValueError:
        return -1


class StoreTier:
    """A store with its health: failed (and why) or up, errors counted, probed again with back-off."""

    def __init__(self, name: str, store: Optional[Store]) -> None:
        self.name, self.store = name, store
        self.errors = 0
        self.failure: Optional[str] = None  # why the tier is failed; None while it is up
        self.lost = False  # the store lost rows of a namespace (a marker is gone): write them again before use
        self._lock = threading.Lock()
        self._next_probe, self._backoff = 0.0, _FIRST_PROBE_S
        self._soon = False  # a probe asked for (probe_soon) that a probe already under way must not back off
        self.wake: Optional[threading.Event] = None  # set by StoreTiers: wakes the monitor on a failure

    def __repr__(self) -> str:
        return f"the {self.name} tier ({self.store!r})"

    @property
    def available(self) -> bool:
        """There is a store, and it is up."""
        return self.store is not None and self.failure is None

    @property
    def writable(self) -> bool:
        """There is a store, and it was not opened read-only (failures aside)."""
        return self.store is not None and not getattr(self.store, "read_only", False)

    def call(self, fn, *args):
        """Run ``fn(*args)``; on a store failure count it, mark the tier failed, and return None. A write the
        store's row bound refused is counted only (the store itself is fine)."""
        try:
            return fn(*args)
        except StoreFullError:
            self.errors += 1
            return None
        except StoreError as error:
            self.fail(error)
            return None

    def fail(self, error: Exception) -> None:
        """Mark the tier failed by ``error`` (a warning once, when it was up)."""
        self.errors += 1
        with self._lock:
            if isinstance(error, StoreRowsLostError) and error.lost:
                self.lost = True
            if self.failure is not None:
                return
            self.failure = str(error)
            self._next_probe, self._backoff = time.monotonic() + _FIRST_PROBE_S, _FIRST_PROBE_S
        log.warning("%s failed: %s; lookups that need it fail until it is back (probed again with back-off)",
                    self, error)
        if self.wake is not None:
            self.wake.set()

    def recovered(self) -> None:
        """Mark the tier up (logged once, when it was failed)."""
        with self._lock:
            was, self.failure, self.lost, self._soon = self.failure, None, False, False
        if was is not None:
            log.warning("%s is back", self)

    def probe_soon(self) -> None:
        """The next probe at the monitor's next turn, its back-off reset."""
        with self._lock:
            self._next_probe, self._backoff, self._soon = 0.0, _FIRST_PROBE_S, True

    def probe_due(self, now: float) -> bool:
        return self.failure is not None and now >= self._next_probe

    def probed_in_vain(self, error: Exception) -> None:
        """A probe failed: the next one after a longer wait."""
        with self._lock:
            if isinstance(error, StoreRowsLostError) and error.lost:
                self.lost = True
            self.failure = str(error)
            if self._soon:  # asked for while this probe ran (which may predate what changed): probed again at once
                self._soon, self._next_probe = False, 0.0
                return
            self._backoff = min(self._backoff * 2, _MOST_PROBE_S)
            self._next_probe = time.monotonic() + self._backoff


class StoreTiers:
    """The volatile tier (memory or Redis) and the persistent tier (RocksDB or LMDB, or no store)."""

    def __init__(self, config: ServerConfig) -> None:
        self.volatile = StoreTier("volatile", make_store(config.volatile_db, name="volatile_db"))
        persistent = make_store(config.persistent_db, name="persistent_db") if config.persistent_db else None
        self.persistent = StoreTier("persistent", persistent)
        self._frozen: set[str] = set()  # tables whose namespace a newer version holds: not written in the volatile
        self._tokens: dict[str, str] = {}  # namespace -> the marker value of the version this server serves
        self._tables_of: dict[str, list] = {}  # namespace -> its tables' store names
        self._restore: Optional[Callable] = None
        self._evicted: Optional[int] = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._monitor: Optional[threading.Thread] = None
        self._probing = threading.Lock()  # one probe at a time: the monitor's, or one an update asks for
        for tier in (self.volatile, self.persistent):
            tier.wake = self._wake

    # ------------------------------------------------------------------ health
    @property
    def complete(self) -> StoreTier:
        """The tier that holds every row of the export: the persistent one, or the volatile one without it."""
        return self.persistent if self.persistent.store is not None else self.volatile

    def ready(self) -> tuple[bool, str]:
        """``(whether lookups answer correctly now, why not)``: the complete tier is up."""
        tier = self.complete
        return (True, "") if tier.available else (False, f"{tier} failed: {tier.failure}")

    def unanswered(self, answered: bool) -> None:
        """Raise :class:`TierUnavailableError` unless the complete tier ``answered`` a lookup's misses: called when
        misses are left that no tier found."""
        if not answered:
            tier = self.complete
            raise TierUnavailableError(f"cannot answer: rows missing from the cache are in {tier!r}, which failed "
                                       f"({tier.failure or 'unavailable'}); retry once it is back")

    def state(self) -> dict[str, dict]:
        """``{tier: {"up": bool, "errors": int, "failure": str | None}}`` of the tiers that have a store."""
        return {t.name: {"up": t.available, "errors": t.errors, "failure": t.failure}
                for t in (self.volatile, self.persistent) if t.store is not None}

    def start_monitor(self, restore: Callable[[StoreTier], None]) -> None:
        """Start the thread that probes failed tiers (``restore(tier)`` writes a lost tier's rows and markers
        again) and watches Redis's evictions."""
        self._restore = restore
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name="dynemb-ps-tiers", daemon=True)
            self._monitor.start()

    def _watch(self) -> None:
        checked = 0.0
        while not self._stop.is_set():
            # asleep while every tier is up but for the eviction check; woken by a failure (StoreTier.fail)
            failed = any(t.failure is not None for t in (self.volatile, self.persistent))
            self._wake.wait(0.05 if failed else _EVICTION_CHECK_S)
            self._wake.clear()
            now = time.monotonic()
            for tier in (self.volatile, self.persistent):
                if tier.store is not None and tier.probe_due(now):
                    self._probe(tier)
            if now - checked >= _EVICTION_CHECK_S:
                checked = now
                self._check_evictions()

    def _probe(self, tier: StoreTier) -> None:
        with self._probing:
            self._probe_once(tier, restore=True)

    def _probe_once(self, tier: StoreTier, restore: bool) -> None:
        if tier.lost and not restore:  # lost meanwhile: the monitor writes the rows again
            return
        try:
            if tier.lost and self._restore is not None:
                # A Redis set to evict at runtime would drop rows again as they are written: the tier stays failed
                # (ready false, misses 503) until it no longer evicts, instead of rewriting every row in a loop.
                why = self._evicting() if tier is self.volatile else None
                if why:
                    raise StoreRowsLostError(f"{why}; its rows are written again once it stops evicting", lost=True)
                self._restore(tier)
            check = getattr(tier.store, "check_markers", None)
            if check is not None:  # Redis: reachable, and the rows of the versions served are there
                check()
            else:  # a read of the store's own
                tier.store.tables()
            self._unfreeze_held()
            tier.recovered()
        except StoreError as error:
            tier.probed_in_vain(error)
        except Exception as error:  # noqa: BLE001 - a failed restore (an export gone): logged, probed again
            log.warning("%s: restoring its rows failed: %s: %s", tier, type(error).__name__, error)
            tier.probed_in_vain(StoreError(str(error)))

    def _check_evictions(self) -> None:
        """Keys Redis evicted on its own (``maxmemory``): rows may be lost, which no marker shows until the marker
        itself goes; the tier fails as lost, and its rows are written again."""
        tier = self.volatile
        evictions = getattr(tier.store, "evictions", None)
        if evictions is None or not tier.available or not self._tokens:
            return
        try:
            _, _, evicted = evictions()
        except StoreError as error:
            tier.fail(error)
            return
        if self._evicted is not None and evicted > self._evicted:
            tier.fail(StoreRowsLostError(f"{tier.store!r} evicted {evicted - self._evicted} keys (maxmemory): rows "
                                         "of the export may be gone", lost=True))
        self._evicted = evicted

    # ------------------------------------------------------------------ markers
    def check_evicting(self) -> None:
        """Refuse a Redis that evicts keys under ``maxmemory`` when it is the complete tier: its lost rows would be
        answered as defaults between two checks."""
        why = self._evicting()
        if why:
            raise ValueError(why)

    def _evicting(self) -> Optional[str]:
        """Why the volatile tier cannot hold every row (a Redis that evicts keys under ``maxmemory`` while it is the
        complete tier), or None."""
        evictions = getattr(self.volatile.store, "evictions", None)
        if evictions is None or self.complete is not self.volatile:
            return None
        policy, maxmemory, evicted = evictions()
        self._evicted = evicted
        if maxmemory and policy in _EVICTING:
            return (f"{self.volatile.store!r} evicts keys under maxmemory (maxmemory-policy {policy}): rows it drops "
                    "would be lost; set maxmemory-policy noeviction (writes beyond maxmemory then fail instead), or "
                    "add a persistent tier that holds every row")
        return None

    def claim(self, namespace: str, version: int, force: bool = False) -> None:
        """Before the tables of ``namespace`` are written with ``version``: raise ValueError when the shared
        volatile store holds a newer version there (another server's; unless ``force``: a rollback)."""
        store = self.volatile.store
        if getattr(store, "guard", None) is None:
            return
        held = store.read_marker(namespace)
        if held is not None and _token_version(held) > version and not force:
            raise ValueError(f"{store!r} holds version {_token_version(held)} of {namespace!r} (another server "
                             f"serves it); this server would write version {version} over it. Serve that version "
                             "(or follow the export with --watch), or use another model name or Redis")

    def mark(self, namespace: str, tables: list, version: int, digest: Optional[str]) -> None:
        """``tables`` of ``namespace`` now hold ``version``: its marker written, and checked on every read."""
        store = self.volatile.store
        if getattr(store, "guard", None) is None:
            return
        token = marker_token(version, digest)
        if self._evicted is None:  # evictions from now on lose rows
            self._evicted = store.evictions()[2]
        self._tokens[namespace], self._tables_of[namespace] = token, list(tables)
        self._frozen.difference_update(tables)
        store.write_marker(namespace, token)
        store.guard(tables, namespace, [token])
        self._probe_now()

    def begin_update(self, namespace: str, tables: list, version: int, digest: Optional[str]) -> None:
        """An update of ``namespace`` to ``version`` is about to write: the marker says so first (other servers
        at the old version stop reading the rows), and this server accepts both versions while it writes. When a
        newer version holds the namespace, the update leaves the volatile tier alone (:meth:`_writable`)."""
        store = self.volatile.store
        if getattr(store, "guard", None) is None or namespace not in self._tokens:
            return
        token = marker_token(version, digest)
        held = store.read_marker(namespace)
        if held is not None and _token_version(held) > version:
            self._frozen.update(tables)
            self._tokens[namespace] = token
            store.guard(tables, namespace, [token])
            return
        store.guard(tables, namespace, [self._tokens[namespace], token])
        store.write_marker(namespace, token)
        self._tokens[namespace] = token

    def end_update(self, namespace: str, tables: list) -> None:
        store = self.volatile.store
        if getattr(store, "guard", None) is None or namespace not in self._tokens:
            return
        store.guard(tables, namespace, [self._tokens[namespace]])
        self._probe_now()

    def _probe_now(self) -> None:
        """Probe a failed volatile tier at once, after this server's version or marker changed: a server that has
        just caught up with the marker's version (another server's update) is ready again now, not at the
        monitor's next probe (up to 2 s later under its back-off). A tier that lost rows waits for the monitor,
        which writes them again. The caller may hold a model's lock, which the monitor's restore takes: this
        never waits for the monitor (it is asked to probe again instead) and never restores."""
        tier = self.volatile
        if tier.failure is None or tier.lost or tier.store is None:
            return
        if self._probing.acquire(blocking=False):
            try:
                self._probe_once(tier, restore=False)
            finally:
                self._probing.release()
        else:  # the monitor is probing: it probes once more right after
            tier.probe_soon()
            self._wake.set()

    def _unfreeze_held(self) -> None:
        """Tables whose namespace's marker now holds this server's version are written again."""
        store = self.volatile.store
        if not self._frozen or getattr(store, "guard", None) is None:
            return
        for namespace, token in self._tokens.items():
            if store.read_marker(namespace) == token.encode():
                self._frozen.difference_update(self._tables_of[namespace])

    def rewrite_markers(self) -> None:
        """Write every namespace's marker again (after its rows were)."""
        for namespace, token in self._tokens.items():
            self.volatile.store.write_marker(namespace, token)

    # ------------------------------------------------------------------ writes
    def create_table(self, table: str, dim: int, dtype: torch.dtype, replace: bool = False) -> None:
        """Create ``table`` in every writable store. ``replace``: a table held there with another schema (rows of
        another dtype, from an earlier version) is dropped first; its rows are about to be replaced. A store error
        raises."""
        for tier in self._writable(table, self.volatile, self.persistent):
            if replace and table in tier.store.tables():
                held = tier.store.schema(table)
                if (held.dim, held.dtype) != (dim, dtype):
                    log.info("%s: table %s held rows of %s x %s, now %s x %s: dropped and created again", tier, table,
                             held.dim, held.dtype, dim, dtype)
                    tier.store.drop_table(table)
            tier.store.create_table(table, dim, dtype)

    def put(self, table: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows to every writable store, the persistent one first. A store error is counted (see
        :meth:`StoreTier.call`) and the write to that store given up."""
        for tier in self._writable(table, self.persistent, self.volatile):
            for start in range(0, keys.numel(), _PUT_ROWS):
                tier.call(tier.store.put, table, keys[start: start + _PUT_ROWS], values[start: start + _PUT_ROWS])

    def delete(self, table: str, keys: torch.Tensor) -> None:
        """Delete keys from every writable store, the persistent one first (so that a lookup in between cannot copy
        a deleted row from it back into the volatile one). A store error is counted."""
        for tier in self._writable(table, self.persistent, self.volatile):
            tier.call(tier.store.delete, table, keys)

    def replace(self, table: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make every writable store hold exactly these rows of ``table``: the keys it holds beyond ``keys`` are
        deleted (the persistent store first), then the rows are written. A store error is counted."""
        for tier in self._writable(table, self.persistent, self.volatile):
            held = tier.call(tier.store.keys, table)
            stale = None if held is None else held[~torch.isin(held, keys)]
            if stale is not None and stale.numel():
                tier.call(tier.store.delete, table, stale)
        self.put(table, keys, values)

    def _writable(self, table: str, *order: StoreTier) -> list[StoreTier]:
        """The tiers of ``order``, in that order, that take writes of ``table``."""
        return [tier for tier in order if tier.writable and not (tier is self.volatile and table in self._frozen)]

    @property
    def errors(self) -> dict[str, int]:
        """Store errors counted per tier."""
        return {"volatile": self.volatile.errors, "persistent": self.persistent.errors}

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._monitor is not None:
            self._monitor.join(timeout=10)
        for tier in (self.volatile, self.persistent):
            if tier.store is not None:
                tier.store.close()
