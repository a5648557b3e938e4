"""Lookups with autograd: dedup, find (or insert), gather or pool straight from the table, ``max_norm``.

Every lookup deduplicates its ids first (``unique -> find/insert -> gather -> expand``): a repeated id costs one row
read and produces one gradient row. The table's gradient is sparse, ``[U, D]`` for the ``U`` unique keys of the
call; nothing of table size is ever built. A static table's id is its row, so it pools straight from the ids.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..kernels.dispatch import kernels_for
from ..table.protocol import EmbeddingTable
from .grads import PooledGrad, TableRows, deliver_pooled_gradient, read_rows, row_kernels
from .custom_ops import anchor_of, eager_anchor, pooled_lookup_op
from .find import find_ids, find_unique, first_of_groups, mode_trains, sort_ids, table_of
from .pooling import (BagSet, BagSum, backward_bags, check_combiner, combine_denoms, concat_bags, pool, split_bags,
                      split_combine, to_bags)

__all__ = ["embedding_lookup", "embedding_lookup_sparse", "pooled_lookup", "pooled_lookups", "unique_rows",
           "clip_rows", "id_rows"]


def unique_rows(embedding, ids: torch.Tensor, max_norm: float | None = None, *, training: bool | None = None,
                checked: bool = False):
    """Deduplicate ``ids`` and read their rows: ``(values [U, D], inverse [N])`` with ``values[inverse]`` the rows
    of ``ids.reshape(-1)``. Inserts missing ids in training mode; differentiable when grad is enabled.
    ``training`` overrides the module's mode; ``checked`` says the ids were validated already."""
    if max_norm is not None:
        _check_max_norm(max_norm)
    table, unique, rows, inverse, grad = find_unique(embedding, ids, training, checked)
    values = _rows_tensor(table, unique, rows, grad)
    if max_norm is not None:
        values = clip_rows(values, max_norm)
    return values, inverse


def _rows_tensor(table, unique: torch.Tensor, rows: torch.Tensor, trains: bool) -> torch.Tensor:
    if trains:
        return TableRows.apply(eager_anchor(table), table, unique, rows)
    return read_rows(table, unique, rows)



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
    served = getattr(type(embedding), "served_lookup", None)
    if served is not None:  # a table's stand-in while its model is exported (dynemb.serving.export_model)
        return served(embedding, ids, max_norm)
    table = table_of(embedding)
    if torch.compiler.is_compiling():
        rows = id_rows(embedding, ids.reshape(-1))
        return (clip_rows(rows, max_norm) if max_norm is not None else rows).view(*ids.shape, table.dim)
    values, inverse = unique_rows(embedding, ids, max_norm)
    return F.embedding(inverse, values).view(*ids.shape, table.dim)


def id_rows(embedding, ids: torch.Tensor, training: bool | None = None) -> torch.Tensor:
    """``[N, D]``: the row of each of ``ids [N]``, as the compiled pooled-lookup op with one id per bag (what
    compiled code uses for unpooled lookups)."""
    bags = BagSet(ids.numel(), torch.arange(ids.numel(), device=ids.device), None, ids.numel(), "sum")
    return _compiled_pooled_lookup(embedding, table_of(embedding), ids, [bags], training)[0]



class _PooledTables(torch.autograd.Function):
    """The pooling of several tables' training lookups (``jobs``: :class:`_FoundRows` or :class:`_StaticIds`, one
    table each) as one autograd node, whose inputs are the tables' anchors and whose outputs are each job's sums.
    Backward hands each used output's gradient to its table; an unused one leaves its table untouched, as a lookup
    whose output is unused. One node a collection call rather than one a table: a node costs the engine and the
    Function's wrappers some tens of microseconds, which a small batch of many tables pays per table.

    The jobs' tensors are saved for backward, so autograd's rules hold for all of them at once: freed after the
    first backward unless ``retain_graph=True`` (two losses over one call's outputs need it, as over any shared
    node), kept by saved-tensor hooks (``save_on_cpu``, checkpointing)."""

    @staticmethod
    def forward(ctx, jobs, *anchors):
        pooled = tuple(job.pool() for job in jobs)
        ctx.save_for_backward(*(t for job in jobs for t in job.saved))
        ctx.jobs, ctx.counts = jobs, [len(job.saved) for job in jobs]
        for job in jobs:
            job.saved = None  # the node holds them now
        ctx.set_materialize_grads(False)
        return pooled

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        saved, start = ctx.saved_tensors, 0
        for job, count, grad in zip(ctx.jobs, ctx.counts, grads):
            if grad is not None:
                job.deliver(grad, *saved[start:start + count])
            start += count
        return (None,) * (len(grads) + 1)


class _FoundRows:
    """A dynamic table's training lookup whose ids all have stored rows: it pools straight from the table's rows,
    without a ``[U, D]`` copy of them, and its backward hands the pooled gradient to the table
    (:func:`deliver_pooled_gradient`), with the ids' order from the forward's one sort.

    ``keys`` None: a grouping by row, whose keys ``first_of_groups(ids, ...)`` gives if the backward needs them; the
    ids are then copied (a sequential pass, far cheaper than that gather): they may be the caller's buffer.
    ``id_rows``: each id's row (then ``inverse`` is None), pooled from as they are."""

    def __init__(self, table, keys, rows, inverse, order, starts, offsets, weights, denom, flat, id_rows):
        self.table, self.anchor = table, eager_anchor(table)
        self.clock = table.clock  # the lookup that found these rows stamped them at this clock
        self.moves = getattr(table, "row_moves", None)  # they hold their keys while it is unchanged (current_rows)
        self.pooled_from = (rows if id_rows is None else id_rows, inverse, offsets, weights, denom)
        self.saved = (keys, rows, order, starts, offsets, weights, denom, flat.clone() if keys is None else None)

    def pool(self) -> torch.Tensor:
        pooled, self.pooled_from = _pool_rows(self.table, *self.pooled_from), None
        return pooled

    def deliver(self, grad, keys, rows, order, starts, offsets, weights, denom, ids) -> None:
        grad, pooled = _bags_gradient(self.table, grad, denom, order, starts, offsets, weights)
        if keys is None:
            keys = functools.cache(functools.partial(first_of_groups, ids, order, starts))  # gathered at most once
        deliver_pooled_gradient(self.table, keys, rows, grad, pooled, self.clock, self.moves)


def _bags_gradient(table, grad, denom, order, starts, offsets, weights) -> tuple[torch.Tensor, PooledGrad]:
    """``(grad [B, D], how each row sums it)``: the gradient of a lookup's bag sums (its bags' gradient divided by
    their combiner's divisors), and the ids grouped by row (``order``, ``starts``) with each id's bag and weight."""
    grad = (grad if denom is None else grad / denom.unsqueeze(1)).contiguous()
    bags = backward_bags(offsets, order.numel(), kernels_for(table.backend, table.device).pool)
    return grad, PooledGrad(order, starts, bags, weights)



def _pool_rows(table, rows, inverse, offsets, weights, denom=None) -> torch.Tensor:
    """``[B, D]``: bag ``b`` is ``sum(weights[j] * values[rows[inverse[j]]]) / denom[b]`` (``inverse`` None:
    ``values[rows[j]]``; the ``pool`` kernel when one serves the table, else ``F.embedding_bag``)."""
    kernels = row_kernels(table).pool
    if kernels and (weights is None or weights.dtype == torch.float32):
        return kernels.pool(table.values, rows, inverse, offsets, weights, denom)
    summed = F.embedding_bag(rows if inverse is None else rows.index_select(0, inverse), table.values, offsets,
                             mode="sum", per_sample_weights=weights)
    return summed if denom is None else summed / denom.unsqueeze(1)



def pooled_lookup(embedding, ids: torch.Tensor, bag_sets: list[BagSet], *, training: bool | None = None,
                  checked: bool = False) -> list[torch.Tensor]:
    """Pooled lookups of several bag sets in one table with one dedup and one find: ``ids`` is the concatenation
    of the sets' ids. ``training`` overrides the module's mode; ``checked`` says the ids were validated already.

    When every id has a stored row (always in training, unless admission or eviction says otherwise) the bags are
    pooled straight from the table; otherwise the unique rows are read first (initializer rows for the others).
    A static table's id is its row, so it pools straight from the ids and sorts them once, in backward.
    """
    return pooled_lookups([(embedding, ids, bag_sets)], training=training, checked=checked)[0]


def pooled_lookups(lookups: list[tuple], *, training: bool | None = None, checked: bool = False
                   ) -> list[list[torch.Tensor]]:
    """:func:`pooled_lookup` of each of ``lookups``: ``(embedding, ids [N], bag_sets)`` each, ``ids`` the
    concatenation of the sets' ids; one list of ``[B, D]`` outputs (one a bag set) a lookup. The training lookups
    that pool straight from their table do it in one autograd node (:class:`_PooledTables`), which costs a small
    batch over many tables less than a node each. A table looked up twice pools its first lookup before its second
    one finds: the results are those of the lookups one after another.

    Example:
        >>> import dynemb
        >>> from dynemb.functional import BagSet
        >>> a, b = dynemb.DynamicEmbedding(2, initializer=1.0), dynemb.DynamicEmbedding(3, initializer=2.0)
        >>> one_each = [BagSet(2, torch.tensor([0, 1]), None, 2, "sum")]  # two bags of one id
        >>> out = pooled_lookups([(a, torch.tensor([7, -1]), one_each), (b, torch.tensor([7, 7]), one_each)])
        >>> [o[0].shape for o in out]
        [torch.Size([2, 2]), torch.Size([2, 3])]
    """
    results: list = [None] * len(lookups)
    jobs, where = [], []
    for i, (embedding, ids, bag_sets) in enumerate(lookups):
        table = table_of(embedding)
        if any(job.table is table for job in jobs):
            _run_jobs(jobs, where, results, lookups)
            jobs, where = [], []
        started = _start_pooled(embedding, table, ids, bag_sets, training, checked)
        if isinstance(started, list):
            results[i] = started
        else:
            jobs.append(started)
            where.append(i)
    _run_jobs(jobs, where, results, lookups)
    return results


def _run_jobs(jobs: list, where: list[int], results: list, lookups: list[tuple]) -> None:
    if jobs:
        pooled = _PooledTables.apply(jobs, *(job.anchor for job in jobs))
        for i, out in zip(where, pooled):
            results[i] = split_bags(out, lookups[i][2])


def _start_pooled(embedding, table, ids: torch.Tensor, bag_sets: list[BagSet], training: bool | None, checked: bool):
    """The outputs of a pooled lookup (one per bag set), or, for a training lookup that pools straight from the
    table, its :class:`_FoundRows` or :class:`_StaticIds` job, found but not yet pooled."""
    weights_train = any(s.weights is not None and s.weights.requires_grad for s in bag_sets)
    if torch.compiler.is_compiling() and not weights_train:
        return _compiled_pooled_lookup(embedding, table, ids, bag_sets, training)
    if table.ids_are_rows and not weights_train:
        return _static_pooled_lookup(embedding, table, ids, bag_sets, training, checked)
    if weights_train or table.ids_are_rows:
        table, unique, rows, inverse, trains = find_unique(embedding, ids, training, checked)
        offsets, weights = concat_bags(bag_sets, table.dtype, table.device)
        summed = BagSum.apply(_rows_tensor(table, unique, rows, trains), inverse, offsets, weights)
        return split_combine(summed, bag_sets)
    if checked:
        flat = ids if ids.dim() == 1 else ids.reshape(-1)
    else:
        flat = table.check_ids(ids)
    trains = mode_trains(embedding, table, training)
    sorted_ids, rows, stored, id_rows = find_ids(table, flat, insert=trains)
    offsets, weights = concat_bags(bag_sets, table.dtype, table.device)
    if not stored:  # keys without a stored row read their initializer row
        summed = BagSum.apply(_rows_tensor(table, sorted_ids.unique, rows, trains), sorted_ids.inverse, offsets,
                              weights)
        return split_combine(summed, bag_sets)
    denom = combine_denoms(bag_sets, table.dtype, table.device)
    if trains:
        return _FoundRows(table, sorted_ids.unique, rows, sorted_ids.inverse, sorted_ids.order,
                          sorted_ids.starts, offsets, weights, denom, flat, id_rows)
    return split_bags(_pool_rows(table, rows, sorted_ids.inverse, offsets, weights, denom), bag_sets)



def _compiled_pooled_lookup(embedding, table, ids: torch.Tensor, bag_sets: list[BagSet],
                            training: bool | None) -> list[torch.Tensor]:
    """The pooled lookup as one custom op (see :mod:`dynemb.functional.custom_ops`): what ``torch.compile`` traces."""
    trains = mode_trains(embedding, table, training)
    offsets, weights = concat_bags(bag_sets, table.dtype, table.device)
    if table.op_handle is None:
        raise RuntimeError("dynemb: a table used in compiled code must belong to a DynamicEmbedding, StaticEmbedding "
                           "or EmbeddingCollection (they register their tables for the compiled ops)")
    anchor = anchor_of(table) if trains else anchor_of(table).detach()
    summed = pooled_lookup_op(anchor, table.op_handle, ids.reshape(-1), offsets, weights, trains)[0]
    return split_combine(summed, bag_sets)


def _static_pooled_lookup(embedding, table: EmbeddingTable, ids: torch.Tensor, bag_sets: list[BagSet],
                          training: bool | None, checked: bool):
    flat = ids.reshape(-1) if checked else table.check_ids(ids)
    offsets, weights = concat_bags(bag_sets, table.dtype, table.device)
    denom = combine_denoms(bag_sets, table.dtype, table.device)
    if mode_trains(embedding, table, training):
        return _StaticIds(table, flat, offsets, weights, denom)
    return split_bags(_static_pool(table, flat, offsets, weights, denom), bag_sets)



def _static_pool(table: EmbeddingTable, ids: torch.Tensor, offsets, weights, denom) -> torch.Tensor:
    if row_kernels(table).pool:  # id i is row i
        return _pool_rows(table, ids.to(torch.int64), None, offsets, weights, denom)
    summed = F.embedding_bag(ids, table.values, offsets, mode="sum", per_sample_weights=weights)
    return summed if denom is None else summed / denom.unsqueeze(1)



class _StaticIds:
    """A static table's training lookup: it pools straight from the ids (row ``i`` is id ``i``: no dedup in
    forward). Its backward sorts the ids once (stably, so each row sums its ids in input order, as the dynamic path
    does) and hands the pooled gradient to the table (:func:`deliver_pooled_gradient`). The ids are copied (a
    sequential pass): they may be the caller's buffer, refilled before the backward."""

    def __init__(self, table: EmbeddingTable, ids, offsets, weights, denom):
        self.table, self.anchor = table, eager_anchor(table)
        self.saved = (ids.clone(), offsets, weights, denom)

    def pool(self) -> torch.Tensor:
        return _static_pool(self.table, *self.saved)

    def deliver(self, grad, ids, offsets, weights, denom) -> None:
        table = self.table
        s = sort_ids(ids, row_kernels(table).pool, inverse=False)
        grad, pooled = _bags_gradient(table, grad, denom, s.order, s.starts, offsets, weights)
        deliver_pooled_gradient(table, s.unique, s.unique.to(torch.int64), grad, pooled)



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
    served = getattr(type(embedding), "served_lookup_sparse", None)
    if served is not None:  # a table's stand-in while its model is exported (dynemb.serving.export_model)
        return served(embedding, ids, offsets, weights, combiner, max_norm, padding_value, include_last_offset)
    flat, offsets, weights, num_bags = to_bags(ids, offsets, weights, padding_value=padding_value,
                                                include_last_offset=include_last_offset,
                                                backend=table_of(embedding).backend)
    if max_norm is None:
        return pooled_lookup(embedding, flat, [BagSet(flat.numel(), offsets, weights, num_bags, combiner)])[0]
    values, inverse = unique_rows(embedding, flat, max_norm)
    return pool(values, inverse, offsets, weights, num_bags, combiner)
