"""HPS-style lookup layers over a :class:`ParameterServer`, with the training-side combiner semantics."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..functional import check_combiner, clip_rows, pool, to_bags
from .ps import ParameterServer

__all__ = ["LookupLayer", "SparseLookupLayer"]


class _ServedTable(nn.Module):
    def __init__(self, model_name: str, table: str, ps: ParameterServer) -> None:
        super().__init__()
        if not isinstance(ps, ParameterServer):
            raise TypeError(f"ps must be a ParameterServer, got {type(ps).__name__}")
        ps._table(model_name, table)  # fails early, naming the model or table, if not loaded
        self.model_name, self.table_name, self.ps = model_name, table, ps

    def _unique_rows(self, ids: torch.Tensor, max_norm: Optional[float]):
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = self.ps.lookup(self.model_name, self.table_name, unique)
        return (clip_rows(rows, max_norm) if max_norm is not None else rows), inverse

    def extra_repr(self) -> str:
        return f"model={self.model_name!r}, table={self.table_name!r}"


class LookupLayer(_ServedTable):
    """Rows for ids of any shape ``S`` -> ``S + (D,)`` (HPS ``LookupLayer``; ``max_norm`` as ``tf.clip_by_norm``).

    Example: ``LookupLayer("ctr", "user", ps=ps)(torch.tensor([[1, 2]]))`` -> ``[1, 2, D]``.
    """

    def forward(self, ids: torch.Tensor, max_norm: Optional[float] = None) -> torch.Tensor:
        rows, inverse = self._unique_rows(ids, max_norm)
        return rows.index_select(0, inverse).view(*ids.shape, rows.shape[1])


class SparseLookupLayer(_ServedTable):
    """Pooled rows per bag: ``[B, D]`` (HPS ``SparseLookupLayer``), with the inputs and combiners of
    :func:`dynemb.functional.embedding_lookup_sparse` (sum, mean, sqrtn; weights; max_norm before combining)."""

    def forward(self, ids: torch.Tensor, offsets: Optional[torch.Tensor] = None,
                weights: Optional[torch.Tensor] = None, combiner: str = "mean", max_norm: Optional[float] = None,
                padding_value: Optional[int] = None) -> torch.Tensor:
        check_combiner(combiner)
        flat, offsets, weights, bags = to_bags(ids, offsets, weights, padding_value=padding_value)
        rows, inverse = self._unique_rows(flat, max_norm)
        return pool(rows, inverse, offsets, weights, bags, combiner)
