"""One table's part of a lookup, followed from the cache down the tiers to the default rows.

:meth:`Lookup.from_cache` reads the cache, :func:`read_tiers` asks each lower tier for the misses of every table of
a request in one call, and :meth:`Lookup.finish` fills in default rows, writes the answer and counts statistics.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .cache import TableState
from .tiers import StoreTiers

__all__ = ["Lookup", "read_tiers"]


@dataclasses.dataclass
class Lookup:
    """One table's part of a lookup: the cache's answer, and its misses as the lower tiers fill them in."""

    t: TableState
    values: torch.Tensor  # [N, D] on the cache's device: the answer
    at: torch.Tensor  # [K] positions in `values` that the cache missed
    keys: torch.Tensor  # [M] the missed keys, unique, on the CPU
    inverse: torch.Tensor  # [K] index in `keys` of each missed position
    weights: torch.Tensor  # [M] times each missed key was requested
    epoch: int
    served: dict  # ids served per tier, counted per request (the statistics)
    cache_skipped: bool  # the cache was busy with a write-back: the stores were asked first
    rows: Optional[torch.Tensor] = None  # [M, D] rows of `keys`, allocated when a second source fills them
    todo: torch.Tensor = None  # indices in `keys` that no tier has answered yet
    fetched: list = dataclasses.field(default_factory=list)  # indices in `keys` found in a store

    def __post_init__(self) -> None:
        self.todo = torch.arange(self.keys.numel())

    @classmethod
    def from_cache(cls, t: TableState, flat: torch.Tensor) -> "Lookup":
        """Look ``flat`` (int64 keys ``[N]``) up in ``t``'s cache; the misses are left to the lower tiers."""
        # The cache reads the batch as it is: de-duplicating first costs a sort and a second gather, and under
        # power-law traffic the duplicates are hot rows that hit anyway. Only the misses are de-duplicated.
        ids = flat.to(t.cache.device)
        busy = t.filling  # a background insert holds the cache for milliseconds: read the lower tiers meanwhile
        if busy:
            values = torch.empty(ids.numel(), t.dim, dtype=t.dtype, device=ids.device)
            found, epoch = torch.zeros_like(ids, dtype=torch.bool), t.epoch
        else:
            with t.cache_lock:
                values, found = t.cache.find(ids, update_scores=True)
                epoch = t.epoch
        at = (~found).nonzero().squeeze(1)
        keys, inverse, weights = torch.unique(ids.index_select(0, at).cpu(), return_inverse=True, return_counts=True)
        # Statistics count every requested id (a key asked for 5 times in a batch is 5 lookups), as a cache's
        # hit rate is usually meant: the share of traffic it absorbs.
        served = {"lookups": ids.numel(), "cache": ids.numel() - at.numel()}
        return cls(t, values, at, keys, inverse, weights, epoch, served, cache_skipped=busy)

    def take(self, tier: str, values: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        """Keep the rows a tier found for ``keys[todo]``; returns their indices in ``keys``."""
        values = values.to(self.t.dtype)
        if bool(found.all()):  # the usual case: the tier has every row it was asked for
            where, self.todo = self.todo, self.todo[:0]
        else:
            hit = found.nonzero().squeeze(1)
            where, values, self.todo = self.todo.index_select(0, hit), values.index_select(0, hit), self.todo[~found]
        self.served[tier] = int(self.put(where, values, self.weights))
        if where.numel():
            self.fetched.append(where)
        return where

    def put(self, where: torch.Tensor, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows ``values`` for ``keys[where]``; returns how often they were requested (``weights[where]``)."""
        if where.numel() == self.keys.numel():  # one source answers every key: its rows are the rows, no copy
            self.rows = values
            return weights.sum()
        if self.rows is None:
            self.rows = torch.empty(self.keys.numel(), self.t.dim, dtype=self.t.dtype)
        self.rows.index_copy_(0, where, values)
        return weights.index_select(0, where).sum()

    def picked(self, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys[where], rows[where])``."""
        if where.numel() == self.keys.numel():
            return self.keys, self.rows
        return self.keys.index_select(0, where), self.rows.index_select(0, where)

    def finish(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Default rows for keys no tier has, the misses' rows into the answer, and the statistics.

        Returns:
            ``(keys, rows)`` found in the stores, for a write-back into the cache; None when there are none, or
            when the cache was skipped (most of these rows are in it already then).
        """
        t = self.t
        if self.todo.numel() and self.cache_skipped:  # keys the stores lack (Redis restarted empty) may be cached
            with t.cache_lock:
                values, found = t.cache.find(self.keys.index_select(0, self.todo).to(t.cache.device),
                                             update_scores=True)
            self.take("cache", values.cpu(), found.cpu())
        if self.todo.numel():
            rows = t.default_rows(self.keys.index_select(0, self.todo))
            self.served["default"] = int(self.put(self.todo, rows, self.weights))
        if self.at.numel():
            self.values.index_copy_(0, self.at, self.rows.index_select(0, self.inverse).to(self.values.device))
        with t.stats_lock:
            for tier, n in self.served.items():
                t.stats[tier] += n
        if not self.fetched or self.cache_skipped:
            return None
        return self.picked(self.fetched[0] if len(self.fetched) == 1 else torch.cat(self.fetched))


def read_tiers(tiers: StoreTiers, lookups: list[Lookup]) -> None:
    """Ask the volatile tier, then the persistent one, for the keys of ``lookups`` that are still missing: one call
    per tier for every table. Rows found in the persistent tier are copied into the volatile one."""
    volatile = tiers.volatile
    answered = False  # the tier holding every row answered (else a key left is not known to be unknown)
    for tier in (volatile, tiers.persistent):
        waiting = [m for m in lookups if m.todo.numel()]
        if not waiting:
            answered = True
            break
        if not tier.available:
            continue
        got = tier.call(tier.store.get_many, {m.t.store_name: m.keys.index_select(0, m.todo) for m in waiting})
        if got is None:
            continue
        answered = answered or tier is tiers.complete
        for m in waiting:
            where = m.take(tier.name, *got[m.t.store_name])
            if tier is tiers.persistent and where.numel() and volatile.available:
                volatile.call(volatile.store.put, m.t.store_name, *m.picked(where))
    if not answered and any(m.todo.numel() and not m.cache_skipped for m in lookups):
        tiers.unanswered(False)
