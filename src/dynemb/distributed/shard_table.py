"""Table-wise sharding: the whole table on one rank (``owner``); the others send it their keys.

Wire floor: each unique key of another rank once to the owner, its row back and its gradient there. The owner
holds every row and finds every key.
"""

from __future__ import annotations

from .strategy import ShardingStrategy, register

__all__ = ["TableWise"]


@register
class TableWise(ShardingStrategy):
    """The whole table on ``sharding.owner``."""

    kind = "table"
