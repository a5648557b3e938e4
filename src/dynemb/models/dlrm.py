"""DLRM: a bottom MLP for dense features, dynamic embedding tables for categorical ones, pairwise dot
interactions, and a top MLP that outputs a click logit. Plain PyTorch around an (optionally distributed)
EmbeddingCollection."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from ..collection import EmbeddingCollection, FeatureConfig, TableConfig
from ..data.batch import Batch
from ..kernels.numba_dense import select_pairs, takes

__all__ = ["DLRM", "mlp", "dlrm_tables", "INTERACTION_ROWS", "SCORING_ROWS"]

SCORING_ROWS = 16
"""A CPU scoring pass (no autograd) runs on a multiple of this many rows, padded with zero rows that are dropped
from the logits. torch's CPU matmuls (MKL) sum a row's products in another order when the row falls in a partial
block of rows, so without padding a sample's logit would depend on how many samples share its pass: a served
request's scores would move (by ~1e-6) with the traffic batched beside it, and differ from ``dynemb predict``'s.
With 16, every row's bits are independent of the batch (tested: any batch size from 0, any offset, bit-equal to
one 1,024-row pass; measured with torch 2.13's MKL on AVX-512, where 8 still left tails apart). GPU passes are
not padded: cuBLAS picks its kernels by shape, so their scores carry a stated tolerance instead."""

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
        pooled = self.embeddings(self.sparse_inputs(batch)) if pooled is None else pooled
        extra = _scoring_padding(batch.dense)
        if extra:
            rows = batch.dense.shape[0]
            padded = _pad_rows(batch.dense, extra)
            if isinstance(pooled, torch.Tensor):
                return self._logits(self.bottom(padded), _pad_rows(pooled, extra))[:rows]
            return self._logits(self.bottom(padded), {f: _pad_rows(pooled[f], extra) for f in self.features})[:rows]
        return self._logits(self.bottom(batch.dense), pooled)

    def _logits(self, dense: torch.Tensor, pooled: dict | torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` of the bottom MLP's output ``dense [B, D]`` and the features' ``pooled`` outputs."""
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

    def forward_stacked(self, dense: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
        """Logits ``[B]`` of dense features ``[B, num_dense]`` and the features' pooled rows already placed in
        ``stacked[:, 1:]`` (``[B, n, D]``, contiguous, features in :attr:`features` order): the bottom MLP's output
        is written into ``stacked[:, 0]`` and the interaction reads each block where it lies, with no stack or
        concatenation of the ``n`` vectors (a bulk scorer fills ``stacked`` while the previous block is scored).
        The same logits as :meth:`forward`, bit for bit (a pass of a row count that is not a multiple of
        :data:`SCORING_ROWS` runs on a padded copy)."""
        extra = _scoring_padding(dense)
        if extra:
            rows = dense.shape[0]
            padded = _pad_rows(stacked, extra)
            logits = self.forward_stacked(_pad_rows(dense, extra), padded)[:rows]
            stacked[:, 0] = padded[:rows, 0]
            return logits
        bottom = _run_mlp(self.bottom, dense)
        stacked[:, 0] = bottom
        if bottom.shape[0] <= INTERACTION_ROWS:
            return self._top(bottom, stacked, _run_mlp)
        return torch.cat([self._top(d, s, _run_mlp) for d, s in zip(bottom.split(INTERACTION_ROWS),
                                                                     stacked.split(INTERACTION_ROWS))])

    def _interact_and_top(self, vectors: list[torch.Tensor], rest: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``[b]`` of ``b`` samples' ``n`` vectors ``[b, D]`` (dense first; ``rest``: the vectors after
        ``vectors`` as one ``[b, F, D]``): pairwise dots, then the top MLP."""
        if rest is None:
            stacked = torch.stack(vectors, 1)  # [b, n, D]
        else:
            stacked = torch.cat([torch.stack(vectors, 1), rest], 1)
        return self._top(vectors[0], stacked)

    def _top(self, dense: torch.Tensor, stacked: torch.Tensor, run=None) -> torch.Tensor:
        """Logits ``[b]``: the pairwise dots of ``stacked [b, n, D]`` (``dense [b, D]`` its first vector), then
        the top MLP (through ``run(mlp, x)`` when given: :func:`_run_mlp`)."""
        dots = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)
        if takes(stacked, dense):
            # one pass writes the top MLP's input (index_select and cat: two passes and a temporary; same bits)
            x = torch.empty(dense.shape[0], dense.shape[1] + self._pairs.shape[0])
            select_pairs(dots.numpy(), dense.numpy(), self._pairs.numpy(), x.numpy())
        else:
            x = torch.cat([dense, dots.index_select(1, self._pairs)], 1)
        return (self.top(x) if run is None else run(self.top, x)).squeeze(1)


def _scoring_padding(dense: torch.Tensor) -> int:
    """Zero rows to add to a pass of ``dense [B, K]``'s rows: up to a multiple of :data:`SCORING_ROWS` for a CPU pass
    without autograd (scoring), else 0 (training keeps its batch as it is)."""
    if torch.is_grad_enabled() or not dense.is_cpu or type(dense) is not torch.Tensor or \
            torch.compiler.is_compiling():
        return 0  # training, a GPU, or tracing (torch.export: a symbolic batch size is not branched on)
    return -dense.shape[0] % SCORING_ROWS


def _pad_rows(t: torch.Tensor, extra: int) -> torch.Tensor:
    """``t`` with ``extra`` zero rows after its own (a new contiguous tensor)."""
    out = t.new_zeros((t.shape[0] + extra, *t.shape[1:]))
    out[:t.shape[0]] = t
    return out


def _run_mlp(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``layers(x)`` for an :func:`mlp`, calling ``linear`` and ``relu`` directly instead of a module a layer (11
    module calls are ~40 us of a served request's ~1 ms dense part); the same ops, so the same bits. A layer of
    another type, or any module hook, takes the modules' own calls. Without autograd the ReLUs run in place on the
    linear layers' fresh outputs."""
    if layers._forward_hooks or layers._forward_pre_hooks or nn.modules.module._global_forward_hooks or \
            nn.modules.module._global_forward_pre_hooks:
        return layers(x)
    in_place = not torch.is_grad_enabled()
    fresh = False  # x is a linear layer's output made here (in place is safe)
    for layer in layers:
        kind = type(layer)
        if layer._forward_hooks or layer._forward_pre_hooks:
            x, fresh = layer(x), False
        elif kind is nn.Linear:
            x, fresh = torch.nn.functional.linear(x, layer.weight, layer.bias), True
        elif kind is nn.ReLU:
            x = torch.relu_(x) if in_place and fresh else torch.relu(x)
        else:
            x, fresh = layer(x), False
    return x
