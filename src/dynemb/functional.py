"""Functional lookups over dynamic tables, with autograd.

Every lookup deduplicates its ids first (``unique -> find/insert -> gather -> expand``): a repeated id costs one row
read and produces one gradient row. The table's gradient is sparse, ``[U, D]`` for the ``U`` unique keys of the
call; nothing of table size is ever built. In backward the gradient goes to the table's optimizer: applied at
once when it is fused, otherwise kept until ``optimizer.step()``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .table import KeyValueTable
from .table.ops import gather_rows
from .table.static import StaticTable

__all__ = ["embedding_lookup", "embedding_lookup_sparse", "SparseGrad", "COMBINERS", "BagSet", "to_bags", "pool",
           "pool_many", "pooled_lookup", "unique_rows", "read_rows", "deliver_gradient", "current_rows",
           "clip_rows", "check_combiner", "counts_occurrences"]

COMBINERS = ("sum", "mean", "sqrtn")


class BagSet(NamedTuple):
    """Bags of one feature over a slice of concatenated ids: ``num_ids`` ids in ``num_bags`` bags starting at
    ``offsets [B]`` (relative to the slice), optional ``weights [num_ids]``, pooled by ``combiner``."""

    num_ids: int
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]
    num_bags: int
    combiner: str


def _table_of(embedding) -> KeyValueTable:
    return embedding if isinstance(embedding, (KeyValueTable, StaticTable)) else embedding.table


class SparseGrad:
    """Gradients recorded for one table between ``zero_grad`` and ``step``: ``(keys, rows, grad)`` batches."""

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    #: parts kept before they are summed into one, so that backward passes without a step stay bounded in memory
    MAX_PARTS = 8

    def add(self, keys: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        self._parts.append((keys, rows, grad.float()))
        if len(self._parts) > self.MAX_PARTS:
            self.coalesce()

    def empty(self) -> bool:
        return not self._parts

    def clear(self) -> None:
        self._parts.clear()

    def coalesce(self, with_rows: bool = False):
        """``(keys [U], grad [U, D])`` with each key once and its gradients summed; with ``with_rows``,
        ``(keys, rows, grad)`` where ``rows`` are the rows read in forward (-1 where batches were merged)."""
        if len(self._parts) > 1:
            keys, inverse = torch.unique(torch.cat([p[0] for p in self._parts]), return_inverse=True)
            grad = torch.cat([p[2] for p in self._parts])
            grad = torch.zeros(keys.numel(), grad.shape[1], device=grad.device).index_add_(0, inverse, grad)
            self._parts = [(keys, torch.full_like(keys, -1, dtype=torch.int64), grad)]
        keys, rows, grad = self._parts[0]
        return (keys, rows, grad) if with_rows else (keys, grad)


def current_rows(table, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` re-checked against the table: rows moved or reused since they were read are looked up again.
    (A static table's rows never move.)"""
    if isinstance(table, StaticTable):
        return rows
    size = table.size()
    stale = (rows < 0) | (rows >= size)
    stale |= gather_rows(table.row_keys, rows.clamp(0, max(size - 1, 0))) != keys
    if bool(stale.any()):
        rows = rows.clone()
        rows[stale] = table.index.find(keys[stale])
    return rows


def deliver_gradient(table, keys: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
    """Hand the gradient ``grad [U, D]`` of ``keys [U]`` (read from ``rows [U]``) to the table's optimizer: applied
    at once when it is fused, else kept until ``step()``. Keys without a stored row lose their gradient."""
    rows = current_rows(table, keys, rows)
    kept = rows >= 0  # keys not stored (admission, eviction) have no trainable row: their gradient is dropped
    if not bool(kept.all()):
        keys, rows, grad = keys[kept], rows[kept], grad[kept]
    optimizer = table.sparse_optimizer
    if optimizer is not None and optimizer.fused:
        optimizer.apply_gradient(table, rows, grad)
        return
    if table.sparse_grad is None:
        table.sparse_grad = SparseGrad()
    table.sparse_grad.add(keys, rows, grad)


class _TableRows(torch.autograd.Function):
    """Rows of unique keys as a differentiable ``[U, D]`` tensor; backward hands the gradient to the table."""

    @staticmethod
    def forward(ctx, anchor, table, keys, rows):
        ctx.table = table
        ctx.save_for_backward(keys, rows)
        return read_rows(table, keys, rows)

    @staticmethod
    def backward(ctx, grad):
        keys, rows = ctx.saved_tensors
        deliver_gradient(ctx.table, keys, rows, grad)
        return None, None, None, None


def read_rows(table, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[U, D]`` rows of ``keys`` read from ``rows``; keys without a row (-1) get their initializer row."""
    values = gather_rows(table.values, rows.clamp(min=0))
    missing = (rows < 0).nonzero().squeeze(1)
    if missing.numel():
        values.index_copy_(0, missing, table.initial_rows(keys.index_select(0, missing)))
    return values


def unique_rows(embedding, ids: torch.Tensor, max_norm: float | None = None, *, training: bool | None = None,
                checked: bool = False):
    """Deduplicate ``ids`` and read their rows: ``(values [U, D], inverse [N])`` with ``values[inverse]`` the rows
    of ``ids.reshape(-1)``. Inserts missing ids in training mode; differentiable when grad is enabled.
    ``training`` overrides the module's mode; ``checked`` says the ids were validated already."""
    if max_norm is not None:
        _check_max_norm(max_norm)
    table, unique, rows, inverse, grad = _find_unique(embedding, ids, training, checked)
    values = _rows_tensor(table, unique, rows, grad)
    if max_norm is not None:
        values = clip_rows(values, max_norm)
    return values, inverse


def counts_occurrences(table) -> bool:
    """Whether ``table`` needs each key's number of occurrences on insert: lfu scores and admission count them."""
    return isinstance(table, KeyValueTable) and (table.admission is not None or table.policy.value.endswith("lfu"))


def _find_unique(embedding, ids: torch.Tensor, training: bool | None = None, checked: bool = False):
    """``(table, unique, rows, inverse, trains)``: ``ids`` deduplicated and looked up (inserted in training mode);
    ``trains`` says whether gradients flow to the table."""
    table = _table_of(embedding)
    if training is None:
        training = getattr(embedding, "training", True)
    flat = ids.reshape(-1)
    trains = training and torch.is_grad_enabled()
    if isinstance(table, StaticTable):  # id i is row i: nothing to find or insert
        flat = flat if checked else table.check_ids(flat)
        unique, inverse = torch.unique(flat, return_inverse=True)
        return table, unique, unique.to(torch.int64), inverse, trains
    if training and counts_occurrences(table):
        # lfu scores and admission count every occurrence, not every distinct id of the call
        unique, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        rows, _ = table.find_or_insert(unique, counts=counts)
    elif training:
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows, _ = table.find_or_insert(unique)
    else:
        unique, inverse = torch.unique(flat, return_inverse=True)
        rows = table.find_rows(unique)
    if trains:
        unique, rows, inverse = _in_row_order(unique, rows, inverse)
    return table, unique, rows, inverse, trains


def _rows_tensor(table, unique: torch.Tensor, rows: torch.Tensor, trains: bool) -> torch.Tensor:
    if trains:
        return _TableRows.apply(torch.empty(0, requires_grad=True), table, unique, rows)
    return read_rows(table, unique, rows)


def _in_row_order(unique: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor):
    """``unique`` and ``rows`` sorted by row, ``inverse`` remapped. A dynamic table places keys in arbitrary rows;
    visiting them in storage order makes the optimizer's ``index_add_``/``index_copy_`` about twice as fast on CPU."""
    rows, order = rows.sort()
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    return unique.index_select(0, order), rows, position.index_select(0, inverse)


def clip_rows(values: torch.Tensor, max_norm: float) -> torch.Tensor:
    # tf.clip_by_norm semantics (as TF/HPS embedding lookups): v * max_norm / max(||v||, max_norm).
    _check_max_norm(max_norm)
    norm = values.float().norm(dim=1, keepdim=True)
    return (values * (max_norm / norm.clamp(min=max_norm))).to(values.dtype)


def _check_max_norm(max_norm) -> None:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or max_norm <= 0:
        raise ValueError(f"max_norm must be a float > 0 or None, got {max_norm!r}")


def embedding_lookup(embedding, ids: torch.Tensor, max_norm: float | None = None) -> torch.Tensor:
    """Rows for ``ids``: any shape ``S`` -> ``S + (D,)``.

    Training mode (``embedding.training``): missing ids are inserted; eval: they read their initializer row and
    nothing is inserted. ``max_norm`` clips each vector's L2 norm (``tf.clip_by_norm``).

    Example:
        >>> import dynemb
        >>> emb = dynemb.DynamicEmbedding(3, initializer=1.0)
        >>> embedding_lookup(emb, torch.tensor([[4, 4]]), max_norm=1.0).shape
        torch.Size([1, 2, 3])
    """
    table = _table_of(embedding)
    values, inverse = unique_rows(embedding, ids, max_norm)
    return F.embedding(inverse, values).view(*ids.shape, table.dim)


def check_combiner(combiner: str) -> str:
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    return combiner


def to_bags(ids, offsets=None, weights=None, *, padding_value=None, include_last_offset=False):
    """Normalize bag inputs to ``(ids [N], offsets [B] starts, weights [N] or None, B)``.

    Accepted forms: 1-D ``ids`` with ``offsets`` (``nn.EmbeddingBag``); a 2-D sparse COO tensor ``[B, M]`` whose
    values are ids (``tf.SparseTensor``; ``weights`` a COO tensor of the same pattern or ``[N]``); a dense
    ``[B, M]`` tensor, where entries equal to ``padding_value`` are skipped (``None``: every entry is an id).
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.is_sparse:
        if ids.dim() != 2:
            raise ValueError(f"sparse ids must be a 2-D COO tensor [B, M], got {ids.dim()}-D")
        if offsets is not None:
            raise ValueError("offsets must be None when ids is a sparse tensor")
        ids = ids.coalesce()
        bag = ids.indices()[0]
        b = ids.shape[0]
        if weights is not None and weights.is_sparse:
            weights = weights.coalesce()
            if not torch.equal(weights.indices(), ids.indices()):
                raise ValueError("sparse weights must have the same indices as sparse ids")
            weights = weights.values()
        counts = torch.bincount(bag, minlength=b)
        return ids.values(), counts.cumsum(0) - counts, weights, b
    if ids.dim() == 2:
        if offsets is not None:
            raise ValueError(f"offsets must be None for 2-D ids {tuple(ids.shape)}; bags are rows")
        if weights is not None and tuple(weights.shape) != tuple(ids.shape):
            raise ValueError(f"weights must have the shape of ids {tuple(ids.shape)}, got {tuple(weights.shape)}")
        mask = ids != padding_value if padding_value is not None else torch.ones_like(ids, dtype=torch.bool)
        counts = mask.sum(1)
        return ids[mask], counts.cumsum(0) - counts, (weights[mask] if weights is not None else None), ids.shape[0]
    if ids.dim() != 1 or offsets is None:
        raise ValueError(f"ids must be 1-D with offsets, 2-D dense [B, M], or 2-D sparse; got shape "
                         f"{tuple(ids.shape)} with offsets={'given' if offsets is not None else None}")
    if offsets.dim() != 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"offsets must be a 1-D int32/int64 tensor, got {offsets.dtype} {tuple(offsets.shape)}")
    offsets = offsets.to(torch.int64)
    if include_last_offset:
        offsets = offsets[:-1]
    if weights is not None and tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"weights must have the shape of ids {tuple(ids.shape)}, got {tuple(weights.shape)}")
    return ids, offsets, weights, offsets.numel()


class _BagSum(torch.autograd.Function):
    """``F.embedding_bag(inverse, values, offsets, mode="sum")`` with a faster backward for ``[U, D]`` rows.

    torch's dense embedding_bag backward accumulates into ``values`` one id at a time (tens of ms per 100k ids on
    CPU). Here the ids are ordered by row once and the row gradient is itself a sum-pooling of the output
    gradient: row ``u`` gets the sum of ``weight * grad[bag]`` over its ids.
    """

    @staticmethod
    def forward(ctx, values, inverse, offsets, weights):
        ctx.save_for_backward(values, inverse, offsets, weights)
        return F.embedding_bag(inverse, values, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        values, inverse, offsets, weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_values = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_values = _bag_sum_grad(grad, inverse, offsets, weights, values.shape[0])
        if ctx.needs_input_grad[3]:
            grad_weights = (grad.index_select(0, _bag_of(offsets, inverse.numel())) * values.index_select(0, inverse)
                            ).sum(1)
        return grad_values, None, None, grad_weights


class _TablePool(torch.autograd.Function):
    """Sum-pooling straight from the table's stored rows (every row >= 0), without a ``[U, D]`` copy of them;
    backward hands the ``[U, D]`` row gradient to the table, as :class:`_TableRows` does."""

    @staticmethod
    def forward(ctx, anchor, table, keys, rows, inverse, offsets, weights):
        ctx.table = table
        ctx.save_for_backward(keys, rows, inverse, offsets, weights)
        return _pool_rows(table, rows, inverse, offsets, weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        keys, rows, inverse, offsets, weights = ctx.saved_tensors
        deliver_gradient(ctx.table, keys, rows, _bag_sum_grad(grad.contiguous(), inverse, offsets, weights, keys.numel()))
        return (None,) * 7


def _pool_rows(table, rows, inverse, offsets, weights) -> torch.Tensor:
    return F.embedding_bag(rows.index_select(0, inverse), table.values, offsets, mode="sum",
                           per_sample_weights=weights)


def _bag_of(offsets: torch.Tensor, n: int) -> torch.Tensor:
    counts = torch.diff(offsets, append=offsets.new_tensor([n]))
    return torch.repeat_interleave(torch.arange(offsets.numel(), device=offsets.device), counts, output_size=n)


def _bag_sum_grad(grad, inverse, offsets, weights, num_rows: int) -> torch.Tensor:
    """``[U, D]`` gradient of a sum-pooling of rows ``inverse`` by bags ``offsets``: row ``u`` gets the sum of
    ``weight * grad[bag]`` over its ids, itself computed as a sum-pooling with the ids ordered by row."""
    order = inverse.argsort(stable=True)
    per_row = torch.bincount(inverse, minlength=num_rows)
    ordered_weights = None if weights is None else weights.index_select(0, order)
    return F.embedding_bag(_bag_of(offsets, inverse.numel()).index_select(0, order), grad, per_row.cumsum(0) - per_row,
                           mode="sum", per_sample_weights=ordered_weights)


def pool(values, inverse, offsets, weights, num_bags: int, combiner: str) -> torch.Tensor:
    """Pool rows ``values[inverse]`` per bag: ``[B, D]``; empty bags give zeros."""
    return pool_many(values, inverse, [BagSet(inverse.numel(), offsets, weights, num_bags, combiner)])[0]


def pool_many(values, inverse, bag_sets: list[BagSet]) -> list[torch.Tensor]:
    """Pool several bag sets over the same rows ``values``: ``inverse`` is the concatenation of the sets' row
    indices.

    One sum-pooling op serves all the sets, so backward builds a single ``[U, D]`` gradient instead of one per set
    (features sharing a table would otherwise each produce, and sum, a gradient the size of all the rows).
    """
    if not bag_sets:
        return []
    offsets, weights = _concat_bags(bag_sets, values.dtype, values.device)
    return _split_combine(_BagSum.apply(values, inverse, offsets, weights), bag_sets)


def pooled_lookup(embedding, ids: torch.Tensor, bag_sets: list[BagSet], *, training: bool | None = None,
                  checked: bool = False) -> list[torch.Tensor]:
    """Pooled lookups of several bag sets in one table with one dedup and one find: ``ids`` is the concatenation
    of the sets' ids. ``training`` overrides the module's mode; ``checked`` says the ids were validated already.

    When every id has a stored row (always in training, unless admission or eviction says otherwise) the bags are
    pooled straight from the table; otherwise the unique rows are read first (initializer rows for the others).
    A static table's id is its row, so it pools straight from the ids and sorts them once, in backward.
    """
    table = _table_of(embedding)
    if isinstance(table, StaticTable) and not (bag_sets and any(s.weights is not None and s.weights.requires_grad
                                                                for s in bag_sets)):
        return _static_pooled_lookup(embedding, table, ids, bag_sets, training, checked)
    table, unique, rows, inverse, trains = _find_unique(embedding, ids, training, checked)
    offsets, weights = _concat_bags(bag_sets, table.dtype, table.device)
    if (weights is not None and weights.requires_grad) or not bool((rows >= 0).all()):
        summed = _BagSum.apply(_rows_tensor(table, unique, rows, trains), inverse, offsets, weights)
    elif trains:
        anchor = torch.empty(0, requires_grad=True)
        summed = _TablePool.apply(anchor, table, unique, rows, inverse, offsets, weights)
    else:
        summed = _pool_rows(table, rows, inverse, offsets, weights)
    return _split_combine(summed, bag_sets)


def _static_pooled_lookup(embedding, table: StaticTable, ids: torch.Tensor, bag_sets: list[BagSet],
                          training: bool | None, checked: bool) -> list[torch.Tensor]:
    flat = ids.reshape(-1) if checked else table.check_ids(ids)
    offsets, weights = _concat_bags(bag_sets, table.dtype, table.device)
    if training is None:
        training = getattr(embedding, "training", True)
    if training and torch.is_grad_enabled():
        summed = _StaticPool.apply(torch.empty(0, requires_grad=True), table, flat, offsets, weights)
    else:
        summed = F.embedding_bag(flat, table.values, offsets, mode="sum", per_sample_weights=weights)
    return _split_combine(summed, bag_sets)


class _StaticPool(torch.autograd.Function):
    """Sum-pooling of a static table's rows straight from the ids (row ``i`` is id ``i``: no dedup in forward).
    Backward sorts the ids once (stably, so each row sums its ids in input order, as the dynamic path does) and
    reduces the pooled gradient to one ``[U, D]`` row gradient for the table's optimizer."""

    @staticmethod
    def forward(ctx, anchor, table, ids, offsets, weights):
        ctx.table = table
        ctx.save_for_backward(ids, offsets, weights)
        return F.embedding_bag(ids, table.values, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        ids, offsets, weights = ctx.saved_tensors
        ordered, order = torch.sort(ids.to(torch.int64), stable=True)
        rows, per_row = torch.unique_consecutive(ordered, return_counts=True)
        bags = _bag_of(offsets, ids.numel()).index_select(0, order)
        row_grad = F.embedding_bag(bags, grad.contiguous(), per_row.cumsum(0) - per_row, mode="sum",
                                   per_sample_weights=None if weights is None else weights.index_select(0, order))
        deliver_gradient(ctx.table, rows.to(ids.dtype), rows, row_grad)
        return (None,) * 5


def _concat_bags(bag_sets: list[BagSet], dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Offsets (shifted to the concatenated ids) and weights (ones for unweighted sets) of all the bag sets."""
    starts = [0]
    for s in bag_sets[:-1]:
        starts.append(starts[-1] + s.num_ids)
    offsets = torch.cat([s.offsets + start for s, start in zip(bag_sets, starts)])
    if all(s.weights is None for s in bag_sets):
        return offsets, None
    weights = torch.cat([s.weights.to(dtype) if s.weights is not None
                         else torch.ones(s.num_ids, dtype=dtype, device=device) for s in bag_sets])
    return offsets, weights


def _split_combine(summed: torch.Tensor, bag_sets: list[BagSet]) -> list[torch.Tensor]:
    return [_combine(part, *s) for part, s in zip(summed.split([s.num_bags for s in bag_sets]), bag_sets)]


def _combine(summed, n: int, offsets, weights, num_bags: int, combiner: str) -> torch.Tensor:
    """Divide bag sums by the bag's weight (``mean``) or root of squared weights (``sqrtn``)."""
    if combiner == "sum":
        return summed
    ends = torch.cat([offsets[1:], offsets.new_tensor([n])])
    counts = ends - offsets
    if weights is None:
        denom = counts.to(summed.dtype)
        denom = denom if combiner == "mean" else denom.sqrt()
    else:
        weights = weights.to(summed.dtype)
        bag = torch.repeat_interleave(torch.arange(num_bags, device=offsets.device), counts)
        w = weights if combiner == "mean" else weights * weights
        denom = torch.zeros(num_bags, dtype=summed.dtype, device=summed.device).index_add_(0, bag, w)
        denom = denom if combiner == "mean" else denom.sqrt()
    denom = torch.where(denom == 0, torch.ones_like(denom), denom)
    return summed / denom.unsqueeze(1)


def embedding_lookup_sparse(
    embedding,
    ids: torch.Tensor,
    offsets: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    combiner: str = "mean",
    max_norm: float | None = None,
    *,
    padding_value: int | None = None,
    include_last_offset: bool = False,
) -> torch.Tensor:
    """Pooled lookup: one ``[D]`` vector per bag, ``[B, D]`` in all.

    Args:
        embedding: a DynamicEmbedding (or table).
        ids: bags in one of the forms of :func:`to_bags`.
        offsets: ``[B]`` bag starts for 1-D ids (``include_last_offset``: ``[B+1]``).
        weights: per-id weights, same layout as ``ids``.
        combiner: ``"sum"``, ``"mean"`` (weighted sum / sum of weights) or ``"sqrtn"`` (weighted sum /
            sqrt(sum of squared weights)).
        max_norm: clip each vector's L2 norm before combining (TF semantics).

    Example:
        >>> import dynemb
        >>> emb = dynemb.DynamicEmbedding(2, initializer=1.0)
        >>> embedding_lookup_sparse(emb, torch.tensor([1, 2, 3]), torch.tensor([0, 2]), combiner="sum").tolist()
        [[2.0, 2.0], [1.0, 1.0]]
    """
    check_combiner(combiner)
    flat, offsets, weights, num_bags = to_bags(ids, offsets, weights, padding_value=padding_value,
                                                include_last_offset=include_last_offset)
    if max_norm is None:
        return pooled_lookup(embedding, flat, [BagSet(flat.numel(), offsets, weights, num_bags, combiner)])[0]
    values, inverse = unique_rows(embedding, flat, max_norm)
    return pool(values, inverse, offsets, weights, num_bags, combiner)
