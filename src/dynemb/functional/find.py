"""The one lookup of a call's ids: dedup (one stable sort, or the ``dedup`` kernel), then find, or find or insert
with each key's count (:func:`find_ids`). Pooled and unpooled, eager and compiled lookups (:mod:`.lookup`,
:mod:`.custom_ops`), grouped lookups (:mod:`.grouped`) and the owner side of a sharded collection (:mod:`.owner`)
all find their rows here, and the mode rule (:func:`trains`) that says whether a lookup inserts is here too.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from ..kernels.dispatch import Backend, resolve_backend
from ..table.protocol import EmbeddingTable, is_table
from .grads import row_kernels

__all__ = ["table_of", "counts_occurrences", "trains", "SortedIds", "sort_ids", "spread_groups", "FoundIds",
           "find_ids", "find_unique", "first_of_groups", "mode_trains"]


def table_of(embedding) -> EmbeddingTable:
    """The table behind ``embedding``: a module holding one (``.table``), or a table itself."""
    return embedding if is_table(embedding) else embedding.table


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


def mode_trains(embedding, table, training: bool | None) -> bool:
    """:func:`trains` of ``embedding``'s ``table`` (a module's mode when ``training`` is None)."""
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
        return FoundIds(ids, first_of_groups(id_rows, ids.order, ids.starts), False, None)
    by_row = sort_ids(id_rows, kernels, inverse=False)
    # a row's key: first_of_groups(flat, ...), gathered only if the backward needs it
    return FoundIds(by_row._replace(unique=None), by_row.unique, True, id_rows)


def first_of_groups(values: torch.Tensor, order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
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
    trains = mode_trains(embedding, table, training)
    flat = ids.reshape(-1) if checked else table.check_ids(ids)
    found = find_ids(table, flat, insert=trains, inverse=True)
    unique, rows, inverse = found.ids.unique, found.rows, found.ids.inverse
    if trains and not table.ids_are_rows:
        unique, rows, inverse = _in_row_order(unique, rows, inverse)
    return table, unique, rows, inverse, trains


def _in_row_order(unique: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor):
    """``unique`` and ``rows`` sorted by row, ``inverse`` remapped. A dynamic table places keys in arbitrary rows;
    visiting them in storage order makes the optimizer's ``index_add_``/``index_copy_`` about twice as fast on CPU."""
    rows, order = rows.sort()
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    return unique.index_select(0, order), rows, position.index_select(0, inverse)
