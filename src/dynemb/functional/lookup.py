"""Lookups with autograd: dedup, find (or insert), gather or pool straight from the table, ``max_norm``.

Every lookup deduplicates its ids first (``unique -> find/insert -> gather -> expand``): a repeated id costs one row
read and produces one gradient row. The table's gradient is sparse, ``[U, D]`` for the ``U`` unique keys of the
call; nothing of table size is ever built. A static table's id is its row, so it pools straight from the ids.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..kernels.dispatch import Backend, kernels_for, resolve_backend
from ..table.protocol import EmbeddingTable, is_table
from .grads import PooledGrad, TableRows, deliver_pooled_gradient, read_rows, row_kernels
from .ops import anchor_of, eager_anchor, pooled_lookup_op
from .pooling import (BagSet, BagSum, backward_bags, check_combiner, combine_denoms, concat_bags, pool, split_bags,
                      split_combine, to_bags)

__all__ = ["embedding_lookup", "embedding_lookup_sparse", "pooled_lookup", "pooled_lookups", "unique_rows",
           "counts_occurrences", "clip_rows", "find_unique", "find_ids", "FoundIds", "id_rows", "SortedIds", "sort_ids",
           "spread_groups", "trains", "table_of"]


def table_of(embedding) -> EmbeddingTable:
    """The table behind ``embedding``: a module holding one (``.table``), or a table itself."""
    return embedding if is_table(embedding) else embedding.table


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


def counts_occurrences(table) -> bool:
    """Whether ``table`` needs each key's number of occurrences on insert: lfu scores and admission count them."""
    return bool(getattr(table, "counts_occurrences", False))


def trains(table, training: bool | None = None, module=None) -> bool:
    """The mode rule, in one place: a lookup inserts and trains only when training (``training``, or when None the
    mode of ``module``, default True), with grad mode on, and the table not frozen (``requires_grad``). The
    executors and the plan ask this too."""
    if training is None:
        training = getattr(module, "training", True)
    return bool(training) and torch.is_grad_enabled() and bool(table.requires_grad)


def _trains(embedding, table, training: bool | None) -> bool:
    return trains(table, training, embedding)


class SortedIds(NamedTuple):
    """One grouping (a stable sort) of a call's ids ``[N]``, shared by dedup, the forward and the backward:
    ``unique [U]`` (ascending, or in order of first occurrence from a ``dedup`` kernel; None from a training lookup
    that grouped by row, whose keys are ``ids[order[starts[:-1]]]``, as they are for every grouping),
    ``inverse [N]`` (``unique[inverse] == ids``; None where not asked for: a grouping by row pools from each id's
    row), ``order [N]`` (the ids grouped by unique key, in input order within a key) and ``starts [U + 1]`` (key
    ``u``'s ids are ``order[starts[u]:starts[u + 1]]``)."""

    unique: torch.Tensor
    inverse: torch.Tensor
    order: torch.Tensor
    starts: torch.Tensor

    @property
    def counts(self) -> torch.Tensor:
        return torch.diff(self.starts)


def sort_ids(flat: torch.Tensor, kernels=None, inverse: bool = True) -> SortedIds:
    """Sort ``flat [N]`` once (stably) and derive everything dedup and the backward need from it; ``kernels``: a
    ``pool`` family (:func:`~dynemb.kernels.dispatch.kernels_for`) whose ``dedup`` does it instead, in one O(N)
    pass (unique ids then come in order of first occurrence, not ascending); a false one (torch) or None sorts.
    ``inverse`` False: ``inverse`` is None.

    Example:
        >>> s = sort_ids(torch.tensor([5, -1, 5]))
        >>> s.unique.tolist(), s.inverse.tolist(), s.order.tolist(), s.starts.tolist()
        ([-1, 5], [1, 0, 1], [1, 0, 2], [0, 1, 3])
    """
    if kernels:
        return SortedIds(*kernels.dedup(flat, inverse))
    ordered, order = torch.sort(flat, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    torch.ne(ordered[1:], ordered[:-1], out=first[1:])
    starts = first.nonzero().squeeze(1)
    where = None
    if inverse:
        where = torch.empty_like(order)
        where[order] = first.cumsum(0) - 1
    return SortedIds(ordered.index_select(0, starts), where, order,
                     torch.cat([starts, starts.new_tensor([flat.numel()])]))


def spread_groups(values: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, kernels=None) -> torch.Tensor:
    """``[N]``: integer ``values [U]`` spread over a grouping's ids (see :class:`SortedIds`), ``out[order[k]] =
    values[u]`` for ``k`` in ``starts[u]:starts[u + 1]``: each id's row from its key's, or (``values = arange(U)``)
    the grouping's ``inverse``. ``kernels``: a ``pool`` family (:class:`~dynemb.kernels.dispatch.FamilyKernels`)
    whose optional ``spread`` does it in one pass.

    Example:
        >>> s = sort_ids(torch.tensor([5, -1, 5]), inverse=False)
        >>> spread_groups(torch.tensor([10, 20]), s.order, s.starts).tolist()
        [20, 10, 20]
    """
    fast = None if kernels is None else kernels.spread
    if fast is not None:
        return fast(values, order, starts)
    out = torch.empty(order.numel(), dtype=values.dtype, device=values.device)
    return out.index_put_((order,), values.repeat_interleave(torch.diff(starts), output_size=order.numel()))


class FoundIds(NamedTuple):
    """What :func:`find_ids` found for a call's ids ``[N]``: their grouping ``ids`` (:class:`SortedIds`, by key, or
    by row for a training lookup that grouped by row), each group's row ``rows [U]`` (int64, -1 where the key has
    none: admission, more new keys than a bound holds, or a read-only lookup of an unseen key), whether every group
    has one (``stored``), and each id's row ``id_rows [N]`` where the lookup has them (then ``ids.inverse`` may be
    None), else None (each id's row is ``rows[ids.inverse]``)."""

    ids: SortedIds
    rows: torch.Tensor
    stored: bool
    id_rows: Optional[torch.Tensor]


def find_ids(table, flat: torch.Tensor, *, insert: bool, counts: torch.Tensor | None = None,
             inverse: bool = False) -> FoundIds:
    """The one lookup of a call's checked ids ``flat [N]`` in ``table`` (any :class:`EmbeddingTable`): group them
    once (dedup, one stable sort or the ``dedup`` kernel), then find each key's row, or with ``insert`` find or
    insert it with its number of occurrences (``counts [N]``: what each id stands for, default 1; the sharded owner
    passes the requesters' counts), which lfu scores and admission count. Every lookup path uses it: pooled and
    unpooled, eager and compiled, one process and the owner side of a sharded collection.

    ``inverse``: the grouping must carry ``inverse`` (unpooled lookups read rows through it). A static table's id is
    its row: nothing is found or inserted. A training lookup of a table whose ``find_or_insert`` takes repeated keys
    as their counts (``keys_may_repeat``) may group by row instead (:func:`_groups_by_row`): the same bits and side
    effects, another cost.

    Shape: ``flat [N]`` -> ``FoundIds`` with ``U`` groups.
    """
    kernels = row_kernels(table).pool
    if table.ids_are_rows:  # a static table: id i is row i
        ids = sort_ids(flat, kernels, inverse=inverse)
        return FoundIds(ids, ids.unique.to(torch.int64), True, None)
    if insert and counts is None and not inverse and _groups_by_row(table):
        found = _find_by_row(table, flat, kernels)
    else:
        # A kernel that spreads each key's row to its ids spares the sort its inverse and the forward a gather through
        # it (about 1% of an SGD step on zipf ids, numba); without one (torch, Triton) the inverse costs no more.
        spreads = insert and not inverse and kernels.spread is not None
        ids = sort_ids(flat, kernels, inverse=not spreads)
        if not insert:
            rows, stored = table.lookup_rows(ids.unique, insert=False)
            return FoundIds(ids, rows, stored, None)
        occurrences = None
        if table.counts_occurrences:  # lfu scores and admission count every occurrence
            occurrences = ids.counts if counts is None else _group_sums(counts, ids.order, ids.starts)
        rows, stored = table.lookup_rows(ids.unique, insert=True, counts=occurrences)
        id_rows = None
        if spreads and stored:
            id_rows = spread_groups(rows, ids.order, ids.starts, kernels)
        elif spreads:  # keys left without a row read initializer rows through the inverse
            arange = torch.arange(rows.numel(), device=rows.device)
            ids = ids._replace(inverse=spread_groups(arange, ids.order, ids.starts, kernels))
        found = FoundIds(ids, rows, stored, id_rows)
    _note_share(table, (found.ids.starts.numel() - 1) / max(flat.numel(), 1))
    return found


def _group_sums(counts: torch.Tensor, order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``[U]`` int64: the sum of ``counts [N]`` over each group of a grouping (``order``, ``starts``)."""
    running = torch.cat([counts.new_zeros(1), counts.index_select(0, order).cumsum(0)])
    return running.index_select(0, starts[1:]) - running.index_select(0, starts[:-1])


#: Each table's share of distinct ids in its last training lookup (weakly held: tables come and go).
_distinct_share: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The share of distinct ids from which grouping by row pays: lower for a table with optimizer state, whose update
# gains more from address order (see _groups_by_row).
_BY_ROW_MIN_SHARE = {True: 0.5, False: 0.75}


def _groups_by_row(table) -> bool:
    """Whether the next training lookup of ``table`` groups its ids by row (see :func:`find_ids`): when it can
    (:func:`_can_group_by_row`) and most ids of the table's last training lookup were distinct: half of them for a
    table with optimizer state, three quarters without.

    Measured with ``benchmarks/train_step_phases.py --contestants dynemb-dyn-by-key dynemb-dyn-fused`` (1M-row tables):
    on uniform ids, where 96% of the ids are distinct, row order makes a RowWiseAdagrad step 1.17x and an Adam step
    1.19x faster, an SGD step 0.99-1.06x. On zipf ids (a third distinct) finding every occurrence, not each distinct
    key, costs about what the order saves with state (RowWiseAdagrad 1.0x, Adam 1.05x) and more without (SGD 0.94x). A
    linear fit of gain against the share breaks even near 0.3-0.5 with state and 0.7 without.
    """
    if not _can_group_by_row(table):
        return False
    return _distinct_share.get(table, 0.0) >= _BY_ROW_MIN_SHARE[bool(table.slot_names)]


def _can_group_by_row(table) -> bool:
    """Whether grouping ``table``'s training lookups by row gives the bits and the side effects of grouping them by
    key: a table whose ``find_or_insert`` takes repeated keys as their counts (``keys_may_repeat``: a plain
    :class:`~dynemb.table.KeyValueTable`; a tiered table would count every occurrence as a hit and move rows down
    for them), on CPU with the numba or torch kernels (the only place it was measured; Triton's one-launch insert
    sizes its headroom by the keys passed). ``decayed_lfu`` groups by row too: its score of a row is the same bits
    whatever the row's place in the batch (:func:`~dynemb.table.policy._decayed`)."""
    return bool(getattr(table, "keys_may_repeat", False)) and table.device.type == "cpu" \
        and resolve_backend(table.backend, table.device) is not Backend.TRITON


def _note_share(table, share: float) -> None:
    try:
        _distinct_share[table] = share
    except TypeError:  # a table type that cannot be weakly referenced or hashed: it cannot group by row anyway
        pass


def _find_by_row(table, flat: torch.Tensor, kernels) -> FoundIds:
    """:func:`find_ids` grouped by row: every occurrence is found or inserted (so lfu scores and admission count
    each one, as the counts of a deduplicated call do), then the rows are sorted. The forward pools from each id's
    row as found, so the sort skips ``inverse`` (its one pass of random writes). Where some id got no row
    (admission, or more new keys than a bound holds) the ids are grouped by key instead."""
    id_rows, stored = table.lookup_rows(flat, insert=True)
    if not stored:
        ids = sort_ids(flat, kernels)
        return FoundIds(ids, _first_of_groups(id_rows, ids.order, ids.starts), False, None)
    by_row = sort_ids(id_rows, kernels, inverse=False)
    # a row's key: _first_of_groups(flat, ...), gathered only if the backward needs it
    return FoundIds(by_row._replace(unique=None), by_row.unique, True, id_rows)


def _first_of_groups(values: torch.Tensor, order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``[U]``: ``values [N]`` (per id) at the first id of each group of a grouping (see :class:`SortedIds`): the
    ids themselves give each group's key, their rows its row. A lookup grouped by row leaves the keys to this,
    called only when needed (0.5 ms a table of 81,920 ids, which a fused update of unmoved rows never needs)."""
    return values.index_select(0, order.index_select(0, starts[:-1]))


def find_unique(embedding, ids: torch.Tensor, training: bool | None = None, checked: bool = False):
    """``(table, unique, rows, inverse, trains)``: ``ids`` deduplicated and looked up (:func:`find_ids`). A table
    inserts, evicts and counts only when training *and* grad mode is on (``trains``, which also says gradients flow
    to it); under ``eval()`` or ``torch.no_grad()`` it is read-only and unseen keys read their initializer row.
    A training lookup of a dynamic table returns its keys in row order (storage order makes the optimizer's
    ``index_add_``/``index_copy_`` about twice as fast on CPU)."""
    table = table_of(embedding)
    trains = _trains(embedding, table, training)
    flat = ids.reshape(-1) if checked else table.check_ids(ids)
    found = find_ids(table, flat, insert=trains, inverse=True)
    unique, rows, inverse = found.ids.unique, found.rows, found.ids.inverse
    if trains and not table.ids_are_rows:
        unique, rows, inverse = _in_row_order(unique, rows, inverse)
    return table, unique, rows, inverse, trains


def _rows_tensor(table, unique: torch.Tensor, rows: torch.Tensor, trains: bool) -> torch.Tensor:
    if trains:
        return TableRows.apply(eager_anchor(table), table, unique, rows)
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

    ``keys`` None: a grouping by row, whose keys ``_first_of_groups(ids, ...)`` gives if the backward needs them; the
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
            keys = functools.cache(functools.partial(_first_of_groups, ids, order, starts))  # gathered at most once
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
    trains = _trains(embedding, table, training)
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
    """The pooled lookup as one custom op (see :mod:`dynemb.functional.ops`): what ``torch.compile`` traces."""
    trains = _trains(embedding, table, training)
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
    if _trains(embedding, table, training):
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
    flat, offsets, weights, num_bags = to_bags(ids, offsets, weights, padding_value=padding_value,
                                                include_last_offset=include_last_offset,
                                                backend=table_of(embedding).backend)
    if max_norm is None:
        return pooled_lookup(embedding, flat, [BagSet(flat.numel(), offsets, weights, num_bags, combiner)])[0]
    values, inverse = unique_rows(embedding, flat, max_norm)
    return pool(values, inverse, offsets, weights, num_bags, combiner)
