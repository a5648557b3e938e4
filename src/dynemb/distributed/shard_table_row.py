"""Table-row-wise sharding: a table row-sharded within a group of ranks (``Sharding("table_row", ranks=...)``,
say the ranks of one node); other tables on other groups. Keys go to ``ranks[partitioner(key, len(ranks))]``.

Its all-to-all traffic stays inside the group for the group's own requesters; requesters outside send their
keys to the group as they would to a row-sharded table. The wire floor and estimate are row-wise's over the group:
each group rank holds ``rows / len(ranks)`` rows and finds ``accesses / len(ranks)`` keys a step.
"""

from __future__ import annotations

from .shard_row import RowWise
from .strategy import register

__all__ = ["TableRowWise"]


@register
class TableRowWise(RowWise):
    """Rows spread over ``ranks`` by the sharding's partitioner; a static id ``i`` is row ``i // len(ranks)`` of
    ``ranks[i % len(ranks)]``."""

    kind = "table_row"
