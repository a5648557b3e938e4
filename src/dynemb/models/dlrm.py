"""DLRM: a bottom MLP for dense features, dynamic embedding tables for categorical ones, pairwise dot
interactions, and a top MLP that outputs a click logit. Plain PyTorch around an (optionally distributed)
EmbeddingCollection."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ..collection import EmbeddingCollection, FeatureConfig, TableConfig
from ..data.batch import Batch

__all__ = ["DLRM", "mlp", "dlrm_tables", "INTERACTION_ROWS"]

INTERACTION_ROWS = 1024
"""Samples per block of the interaction and the top MLP: a block's ``[rows, n, n]`` dots stay in cache, which on
CPU runs that part of a large batch (scoring) about 3x as fast as one ``bmm`` over the whole batch (measured with
the demo model, 26 tables); results are per sample, so blocks change nothing but speed."""


def mlp(sizes: Sequence[int], last_activation: bool = True) -> nn.Sequential:
    """``Linear -> ReLU`` layers through ``sizes`` (ReLU after the last one when ``last_activation``)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if last_activation or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def dlrm_tables(features: Sequence[str], dim: int, **table_kwargs) -> tuple[list[TableConfig], list[FeatureConfig]]:
    """One dynamic table per categorical feature (same name), all with ``table_kwargs``."""
    tables = [TableConfig(name=f, dim=dim, seed=i, **table_kwargs) for i, f in enumerate(features)]
    return tables, [FeatureConfig(name=f, table=f) for f in features]


class DLRM(nn.Module):
    """DLRM (Naumov et al., 2019) over dynamic tables.

    Args:
        num_dense: number of dense features.
        embeddings: an EmbeddingCollection (or DistributedEmbeddingCollection) whose pooled outputs all have
            width ``dim``.
        dim: embedding width, also the bottom MLP's output width.
        bottom: hidden sizes of the bottom MLP.
        top: hidden sizes of the top MLP.

    Shape:
        ``forward(batch)`` -> logits ``[B]``.

    Example:
        >>> from dynemb.data import SyntheticClickLog
        >>> data = SyntheticClickLog(num_categorical=3, num_dense=2, batch_size=8)
        >>> tables, features = dlrm_tables(data.categorical_names, dim=4)
        >>> model = DLRM(2, EmbeddingCollection(tables, features), dim=4)
        >>> model(data.batch(0)).shape
        torch.Size([8])
    """

    def __init__(self, num_dense: int, embeddings: EmbeddingCollection, dim: int,
                 bottom: Sequence[int] = (64,), top: Sequence[int] = (64, 32)) -> None:
        super().__init__()
        self.embeddings = embeddings
        self.features = list(embeddings.feature_configs)
        self.bottom = mlp([num_dense, *bottom, dim])
        n = len(self.features) + 1
        self.top = mlp([dim + n * (n - 1) // 2, *top, 1], last_activation=False)
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("_pairs", rows * n + cols, persistent=False)

    def sparse_inputs(self, batch: Batch) -> dict:
        """The batch's categorical features in the collection's input format."""
        return {f: (ids, batch.offsets[f][:-1]) if f in batch.offsets else ids for f, ids in batch.sparse.items()}

    def forward(self, batch: Batch, pooled: Optional[dict | torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[B]``. ``pooled``: the features' outputs when they were looked up elsewhere (a served model),
        either ``{feature: [B, D]}`` or one ``[B, F, D]`` tensor, features in :attr:`features` order (then the
        interaction takes it as it is, with no stack of ``F`` tensors); the same logits, bit for bit."""
        dense = self.bottom(batch.dense)
        pooled = self.embeddings(self.sparse_inputs(batch)) if pooled is None else pooled
        if isinstance(pooled, torch.Tensor):
            if dense.shape[0] <= INTERACTION_ROWS:
                return self._interact_and_top([dense], pooled)
            return torch.cat([self._interact_and_top([d], p)
                              for d, p in zip(dense.split(INTERACTION_ROWS), pooled.split(INTERACTION_ROWS))])
        vectors = [dense] + [pooled[f] for f in self.features]  # n x [B, D]
        if dense.shape[0] <= INTERACTION_ROWS:  # one block (a served request): no split of each vector
            return self._interact_and_top(vectors)
        # Blocks of rows: a block's stack and dots stay in cache (one stack of the whole batch is a large copy).
        blocks = zip(*(v.split(INTERACTION_ROWS) for v in vectors))
        return torch.cat([self._interact_and_top(list(block)) for block in blocks])

    def _interact_and_top(self, vectors: list[torch.Tensor], rest: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b]`` of ``b`` samples' ``n`` vectors ``[b, D]`` (dense first; ``rest``: the vectors after
        ``vectors`` as one ``[b, F, D]``): pairwise dots, then the top MLP."""
        if rest is None:
            stacked = torch.stack(vectors, 1)  # [b, n, D]
        else:
            stacked = torch.cat([torch.stack(vectors, 1), rest], 1)
        dots = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1).index_select(1, self._pairs)
        return self.top(torch.cat([vectors[0], dots], 1)).squeeze(1)
