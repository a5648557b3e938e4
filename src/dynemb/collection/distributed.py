"""DistributedEmbeddingCollection: an :class:`~dynemb.EmbeddingCollection` sharded over the world by default."""

from __future__ import annotations

from typing import Optional

from .collection import EmbeddingCollection, PlanSpec
from .config import FeatureConfig, TableConfig

__all__ = ["DistributedEmbeddingCollection"]


class DistributedEmbeddingCollection(EmbeddingCollection):
    """``EmbeddingCollection(tables, features, plan=plan or "auto", ...)``: the sharded collection.

    Args:
        tables, features: as for EmbeddingCollection. ``max_capacity`` is per rank for row-sharded tables.
        plan: explicit shardings by table name (see :mod:`dynemb.distributed.sharding`); the rest is automatic.
        process_group: the group to shard over (default: the world).
        timeout: seconds before a collective gives up with :class:`DistributedError` (a dead or stuck rank).
        device: where this rank's shards live (``cuda`` for NCCL).
    """

    def __init__(self, tables: list[TableConfig], features: list[FeatureConfig], *, plan: Optional[PlanSpec] = None,
                 process_group=None, timeout: float = 300.0, device=None, validate: Optional[bool] = None) -> None:
        super().__init__(tables, features, plan=plan if plan is not None else "auto", process_group=process_group,
                         timeout=timeout, device=device, validate=validate)
