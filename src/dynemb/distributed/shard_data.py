"""Data-parallel sharding: a replica of the whole table on every rank.

Each step all-gathers the ranks' unique keys, so every replica finds or inserts the same keys with the same
counts (the same rows everywhere), and backward all-gathers the gradients, so every replica applies the same
update. Rank 0 alone writes the table to checkpoints and exports.

Wire floor: what the all-gathers need, each rank's unique keys (8 bytes) and their gradients (``dim`` floats) to
each of the ``W - 1`` others; no rows travel. Every rank holds every row and finds every rank's keys.
"""

from __future__ import annotations

import torch

from .comm import all_gather_varsize
from .strategy import ReplicatedRecord, ShardingStrategy, TableLoad, TableStats, register
from .sharding import Sharding

__all__ = ["DataParallel"]


@register
class DataParallel(ShardingStrategy):
    """A replica on every rank, kept identical by all-gathers of keys and gradients."""

    kind = "data"
    replicated = True

    def holds(self, rank=None) -> bool:
        return True

    def owned(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(keys, dtype=torch.bool)

    def writes(self, rank=None) -> bool:
        return (self.rank if rank is None else rank) == 0  # one copy

    def join(self, parts: dict, columnar: set) -> dict:
        return next(iter(parts.values()))

    def logical_rows(self, rows: list) -> int:
        return int(rows[0]) if rows else 0

    # ------------------------------------------------------------------ exchange
    def forward(self, shard, keys: torch.Tensor, counts: torch.Tensor, lookup, insert: bool, group):
        """Rows of this rank's unique ``keys`` and the record for :meth:`backward`. ``lookup(shards, keys,
        counts)`` is the collection's owner-side lookup; ``insert``: whether the table inserts and counts."""
        parts = all_gather_varsize(keys, group, f"all-gather of keys of {shard.name!r}")
        every_count = None
        if insert and shard.config.counts_occurrences:
            every_count = torch.cat(all_gather_varsize(counts, group, f"all-gather of counts of {shard.name!r}"))
        # every replica finds or inserts the union of the ranks' keys, with their counts: the same rows everywhere
        owner = lookup([shard], [torch.cat(parts)], [every_count])
        start = sum(p.numel() for p in parts[: self.rank])
        return owner.values[0][start: start + keys.numel()].to(shard.dtype), ReplicatedRecord(shard, owner)

    def backward(self, record: ReplicatedRecord, grad: torch.Tensor, group) -> None:
        shard = record.shard
        grads = all_gather_varsize(grad.float(), group, f"all-gather of gradients of {shard.name!r}")
        record.owner.backward([torch.cat(grads)])  # each row gets the sum of its keys' gradients

    # ------------------------------------------------------------------ estimates
    @classmethod
    def estimate(cls, sharding: Sharding, stats: TableStats, world: int) -> dict[int, TableLoad]:
        share = stats.accesses / world
        wire = share * (8 + stats.dim * stats.value_bytes) * (world - 1)
        return {r: TableLoad(stats.rows, stats.rows * stats.row_bytes, stats.accesses, wire) for r in range(world)}

    @classmethod
    def wire_floor(cls, sharding: Sharding, stats: TableStats, world: int) -> float:
        return stats.accesses * (8 + stats.dim * stats.value_bytes) * (world - 1)
