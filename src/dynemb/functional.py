"""Functional lookups over dynamic tables."""

from __future__ import annotations

import torch

from .table import KeyValueTable
from .table.ops import gather_rows

__all__ = ["embedding_lookup"]


def _table_of(embedding) -> KeyValueTable:
    return embedding if isinstance(embedding, KeyValueTable) else embedding.table


def embedding_lookup(embedding, ids: torch.Tensor) -> torch.Tensor:
    """Rows for ``ids`` (any shape ``S``) as ``S + (D,)``.

    In training mode (``embedding.training``) missing ids are inserted; in eval they read their initializer row.
    """
    table = _table_of(embedding)
    if not getattr(embedding, "training", True):
        return table.find(ids)[0]
    rows, _ = table.find_or_insert(ids)
    flat = rows.reshape(-1)
    values = gather_rows(table.values, flat.clamp(min=0))
    dropped = (flat < 0).nonzero().squeeze(1)
    if dropped.numel():
        values.index_copy_(0, dropped, table._initial(ids.reshape(-1).index_select(0, dropped)))
    return values.view(*ids.shape, table.dim)
