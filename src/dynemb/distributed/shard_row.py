"""Row-wise sharding: each key's row on one rank of the world, ``partitioner(key, W)`` (default ``key % W``).

A static table's id ``i`` is row ``i // W`` of rank ``i % W`` (a rank at or past the vocabulary holds none).

Wire floor (stated for the planner and the benchmark): each unique key a rank looks up and does not own goes once
to its owner (8 bytes), its row comes back and its gradient goes there (``dim`` floats each way); keys of the
rank's own shard stay local. Every rank holds ``rows / W`` rows and finds ``accesses / W`` keys a step.
"""

from __future__ import annotations

from .strategy import ShardingStrategy, register

__all__ = ["RowWise"]


@register
class RowWise(ShardingStrategy):
    """Rows spread over every rank of the world by the sharding's partitioner."""

    kind = "row"

    @property
    def _row_static(self) -> bool:
        return self.config.is_static

    def static_rows(self) -> int:
        g = len(self.group)
        return (self.config.vocabulary_size - self.position + g - 1) // g
