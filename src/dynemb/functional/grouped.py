"""Grouped lookups: the pooled training lookups of many tables as one call of each ``group`` kernel.

A :class:`GroupedLookup` serves the tables of one execution group (:class:`~dynemb.table.group.TableGroup`: same
device, key dtype and backend; fused optimizers of one kind). One training step of the group is

1. one concatenation of every table's ids, each id tagged with its table (``seg``, made once a batch layout);
2. ``find_or_insert`` of all of them in one kernel call: found, or inserted and initialized, each in its own table,
   numbered as the table's own lookup numbers its new keys, every row stamped;
3. one autograd node whose forward pools every bag of every table in one kernel call, straight from the tables'
   rows, into one output cut into the features' ``[B, D]``;
4. its backward: one ``sparse_update`` call that groups the ids by ``(table, row)`` (a stable sort on Triton, a radix
   sort on numba), sums each row's gradient from its bags and applies its table's optimizer with that table's own
   hyper-parameters and step count.

Nothing in it reads from the device (the tables' sizes stay there, :mod:`dynemb.table.group`), every tensor is
sized by the batch, and its op count does not grow with the number of tables. A table the group cannot take this
call (frozen, a non-fused optimizer, a bound it would pass) runs its own lookup (:func:`~.lookup.pooled_lookups`)
with the same results. Each operation is a call of the ``group`` family (:func:`~dynemb.table.group.group_ops`):
numba's kernels (CPU), Triton's (GPU, or its interpreter), or on ``backend="torch"`` the family's torch reference
(:mod:`~dynemb.table.group_reference`), so that a torch collection runs each operation once a group too.
``tests/collection/test_grouped.py`` holds all three to the per-table path (grouping off), for every optimizer, and a
table alone to the same table in a group, bit for bit on each backend.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch

from ..kernels.dispatch import group_hparams, resolve_backend
from ..table.group import TableGroup, refusal
from .grads import PooledGrad, deliver_pooled_gradient
from .find import first_of_groups, sort_ids
from .pooling import BagSet, bag_of, combine_denoms, concat_bags, is_one_id_bags, one_id_bags

__all__ = ["GroupedLookup", "group_refusal", "group_tables"]


def group_refusal(table) -> str | None:
    """Why ``table``'s training lookups cannot run in a kernel group, or None when they can: the table's own rule
    (:func:`~dynemb.table.group.refusal`) and a fused optimizer whose update the ``group`` family implements."""
    why = refusal(table)
    if why is not None:
        return why
    optimizer = table.sparse_optimizer
    if optimizer is None or not optimizer.fused:
        return "its optimizer is not fused (or there is none)"
    if optimizer.kernel_slots(table) is None:
        return f"{type(optimizer).__name__} has no update kernel"
    return None


def group_tables(tables: dict) -> list[list[str]]:
    """The execution groups of ``tables`` (``{name: table}``, in order): the names of the tables that can run
    their training lookups together (:func:`group_refusal`), by device, key dtype, backend setting and update kind;
    each group in table order. Tables that cannot join one are in no group (they run their own lookups)."""
    groups: dict = {}
    for name, table in tables.items():
        if group_refusal(table) is None:
            kind = table.sparse_optimizer.kernel_slots(table)[0]
            groups.setdefault((table.device, table.key_dtype, table.backend, kind), []).append(name)
    return list(groups.values())


class _CallLayout(NamedTuple):
    """What a call's sizes fix (made once a layout): each id's table (``seg``), the start of its table's ids
    (``seg_first``), ``seg << 32``, each bag's table and its output's place in the flat output (``out_at``), the
    bags per table and the output's shape."""

    seg: torch.Tensor
    seg_first: torch.Tensor
    seg_high: torch.Tensor
    bag_seg: torch.Tensor
    out_at: torch.Tensor
    id_starts: tuple
    bag_starts: tuple
    out_starts: tuple
    table_bags: torch.Tensor
    dim: Optional[int]
    total: int
    max_dim: int


class GroupedLookup:
    """The pooled training lookups of a group of tables, one kernel call each operation (see the module).

    Args:
        tables: the group's tables, each accepted by :func:`group_refusal`, with optimizers of one kind.
    """

    def __init__(self, tables: list) -> None:
        kinds = {table.sparse_optimizer.kernel_slots(table)[0] for table in tables}
        if len(kinds) != 1:
            raise ValueError(f"the tables of a group update with one kernel kind, got {sorted(kinds)}")
        self.tables = list(tables)
        self.kind = kinds.pop()
        self._groups: dict = {}  # resolved backend -> TableGroup (or None: a table the group cannot hold)
        self._layouts: dict = {}
        self._hparams: tuple = (None, None)
        self._arange: dict = {}
        self._anchor = torch.empty(0, requires_grad=True)
        self._recording: list[dict] = []

    def __len__(self) -> int:
        return len(self.tables)

    def _group(self) -> TableGroup | None:
        first = self.tables[0]
        backend = resolve_backend(first.backend, first.device)
        if backend not in self._groups:
            ok = all(group_refusal(t) is None for t in self.tables)
            self._groups[backend] = TableGroup(self.tables, [t.sparse_optimizer.kernel_slots(t)[1]
                                                              for t in self.tables]) if ok else None
        return self._groups[backend]

    def _runs(self, t: int) -> bool:
        """Whether table ``t`` trains through the group this call: not frozen, its fused optimizer still bound, its
        rows still float32 (cheap checks, every call)."""
        table = self.tables[t]
        optimizer = table.sparse_optimizer
        return table.requires_grad and optimizer is not None and optimizer.fused and table.dtype == torch.float32

    def pooled(self, lookups: list[tuple[int, torch.Tensor, list[BagSet]]]) -> dict[int, list[torch.Tensor]]:
        """Pooled training lookups ``(table index, ids [N_t] checked, bag sets)`` (a table at most once), run as
        one grouped call for the tables that can take it; returns ``{table index: one [B, D] a bag set}`` for
        those. The caller runs the others (not in the result) through their own lookups."""
        call = self.start(lookups)
        if call is None:
            return {}
        blocks = _GroupedPool.apply(call, self._anchor)
        return self._split(blocks, call.runnable, call.layout)

    def start(self, lookups: list[tuple[int, torch.Tensor, list[BagSet]]]) -> "_Call | None":
        """The find-or-insert of a grouped call (no autograd): the tables of ``lookups`` that can run grouped this
        call, their rows found or inserted; None when none can. :meth:`forward` then pools them and :meth:`update`
        applies their gradients (the autograd node of :meth:`pooled` does both; the sharded owner calls them
        itself, see :func:`~.owner.owner_lookup`)."""
        group = self._group()
        if group is None:
            return None
        runnable = [item for item in lookups if self._runs(item[0])
                    and not any(s.weights is not None and s.weights.requires_grad for s in item[2])]
        if not runnable:
            return None
        admitted = set(group.admit({t: ids.numel() for t, ids, _ in runnable}))
        runnable = [item for item in runnable if item[0] in admitted]
        if not runnable:
            return None
        layout = self._layout(runnable)
        # the backward may need the keys: the caller's buffer is copied (a loader may refill it before the backward)
        keys = runnable[0][1].clone() if len(runnable) == 1 else torch.cat([ids for _, ids, _ in runnable])
        offsets, weights, denom, bags = self._bags(runnable, keys.numel(), layout)
        counts = {t: ids.numel() for t, ids, _ in runnable}
        if self.tables[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._recording.append({"counts": counts})
        rows = group.find_or_insert(keys, layout.seg, layout.seg_first, counts)
        return _Call(self, group, layout, runnable, keys, rows, offsets, weights, denom, bags)

    @staticmethod
    def forward(call: "_Call") -> tuple:
        """Pool every bag of a started call in one kernel call: each table's block of the output (``[B_t, D]``,
        flat for mixed dims), in the order of ``call.runnable``. Keeps what :meth:`update` needs in ``call``."""
        keys, rows, offsets, weights, denom, bags = call.saved
        layout, group = call.layout, call.group
        out = torch.empty(layout.total, dtype=torch.float32, device=rows.device)
        group.kernels.pool(group, rows, offsets, layout.bag_seg, weights, denom, out, layout.out_at,
                           layout.max_dim)
        keyed = layout.seg_high | rows  # (table, row) of each id: no two tables' rows meet
        call.saved = (keys, keyed, weights, denom, bags)
        counts = [hi - lo for lo, hi in zip(layout.bag_starts, layout.bag_starts[1:])]
        if layout.dim is not None:
            return out.view(-1, layout.dim).split(counts)
        return out.split([hi - lo for lo, hi in zip(layout.out_starts, layout.out_starts[1:])])

    @staticmethod
    def update(call: "_Call", grads: tuple) -> None:
        """The fused update of a forwarded call from each table's output gradient (``grads``: one a table of
        ``call.runnable``, None for an output no loss used: that table is left untouched): one ``sparse_update``
        call, each table with its own hyper-parameters and step count."""
        keys, keyed, weights, denom, bags = call.saved
        lookup, group, layout = call.lookup, call.group, call.layout
        tables = lookup.tables
        unused = {t for (t, _, _), g in zip(call.runnable, grads) if g is None}
        if len(unused) == len(grads):
            return
        moved = {t for t in call.moves if t not in unused and not tables[t].rows_unmoved_since(call.moves[t])}
        hparams, versions = lookup._hparams_for(group, call.runnable, call.clocks, unused | moved)
        grad = _flat_gradient(grads, layout)
        if denom is not None:
            grad = _divided(grad, denom, layout)
        group._refresh()  # a table grown since the forward has its storage elsewhere: its rows are the same
        group.kernels.sparse_update(lookup.kind, group, hparams, versions, keyed, grad, layout.out_at,
                                    layout.table_bags, bags, weights, layout.max_dim)
        for t in moved:
            _update_apart(call, t, keys, keyed, grad, weights, bags)

    # ------------------------------------------------------------------ the call's layout
    def _layout(self, runnable) -> _CallLayout:
        key = tuple((t, ids.numel(), tuple(s.num_bags for s in sets)) for t, ids, sets in runnable)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 16:  # a few batch shapes come and go (the last batch of an epoch)
                self._layouts.clear()
            layout = self._layouts[key] = self._make_layout(runnable)
        return layout

    def _make_layout(self, runnable) -> _CallLayout:
        device = self.tables[0].device
        n_ids = [ids.numel() for _, ids, _ in runnable]
        n_bags = [sum(s.num_bags for s in sets) for _, _, sets in runnable]
        dims = [self.tables[t].dim for t, _, _ in runnable]
        index = torch.tensor([t for t, _, _ in runnable], dtype=torch.int64, device=device)
        id_starts = [0]
        for n in n_ids:
            id_starts.append(id_starts[-1] + n)
        bag_starts, out_starts = [0], [0]
        for b, d in zip(n_bags, dims):
            bag_starts.append(bag_starts[-1] + b)
            out_starts.append(out_starts[-1] + b * d)
        ids_per = torch.tensor(n_ids, device=device)
        bags_per = torch.tensor(n_bags, device=device)
        seg = index.repeat_interleave(ids_per, output_size=id_starts[-1])
        seg_first = torch.tensor(id_starts[:-1], device=device).repeat_interleave(ids_per, output_size=id_starts[-1])
        bag_seg = index.repeat_interleave(bags_per, output_size=bag_starts[-1])
        # each bag's output row in the flat output: its table's block, then dim-sized rows
        first_bag = torch.tensor(bag_starts[:-1], device=device).repeat_interleave(bags_per, output_size=bag_starts[-1])
        block = torch.tensor(out_starts[:-1], device=device).repeat_interleave(bags_per, output_size=bag_starts[-1])
        width = torch.tensor(dims, device=device).repeat_interleave(bags_per, output_size=bag_starts[-1])
        out_at = block + (torch.arange(bag_starts[-1], device=device) - first_bag) * width
        uniform = dims[0] if len(set(dims)) == 1 else None
        # each group table's first bag in the call, its count, and where its block of the flat output starts
        table_bags = [[0, 0, 0] for _ in self.tables]
        for (t, _, _), lo, count, at in zip(runnable, bag_starts, n_bags, out_starts):
            table_bags[t] = [lo, count, at]
        return _CallLayout(seg, seg_first, seg << 32, bag_seg, out_at, tuple(id_starts), tuple(bag_starts),
                       tuple(out_starts), torch.tensor(table_bags, dtype=torch.int64, device=device), uniform,
                       out_starts[-1], max(dims))

    def _bags(self, runnable, n: int, layout: _CallLayout):
        """``(offsets [B], weights [N] | None, denom [B] | None, bag [N] | None)`` of the call's bags, in the
        concatenated ids (``bag`` None: bags of one id each, id ``j`` is bag ``j``)."""
        device = self.tables[0].device
        sets = [s for _, _, bag_sets in runnable for s in bag_sets]
        if all(s.one_id or is_one_id_bags(s.offsets, s.num_ids) for s in sets):
            offsets, bags = self._one_id_offsets(n, device), None
        else:
            parts = [concat_bags(bag_sets, torch.float32, device)[0] + start
                     for (_, _, bag_sets), start in zip(runnable, layout.id_starts)]
            offsets = parts[0] if len(parts) == 1 else torch.cat(parts)
            bags = bag_of(offsets, n)
        weights = None
        if any(s.weights is not None for s in sets):
            weights = torch.cat([concat_bags(bag_sets, torch.float32, device)[1]
                                 if any(s.weights is not None for s in bag_sets)
                                 else torch.ones(ids.numel(), device=device) for _, ids, bag_sets in runnable])
        denom = None
        if any(s.combiner != "sum" for s in sets):
            denom = torch.cat([combine_denoms(bag_sets, torch.float32, device)
                               if any(s.combiner != "sum" for s in bag_sets)
                               else torch.ones(sum(s.num_bags for s in bag_sets), device=device)
                               for _, _, bag_sets in runnable])
        return offsets, weights, denom, bags

    def _one_id_offsets(self, n: int, device) -> torch.Tensor:
        """``arange(n)``: the offsets of ``n`` bags of one id each, made once a size by this group (on CPU the
        shared :func:`~.pooling.one_id_bags`; a CUDA tensor of the group's own, which only its launches read)."""
        if device.type == "cpu":
            return one_id_bags(n, device)
        got = self._arange.get(n)
        if got is None:
            if len(self._arange) >= 16:
                self._arange.clear()
            got = self._arange[n] = torch.arange(n, device=device)
        return got

    def _split(self, blocks: tuple, runnable, layout: _CallLayout) -> dict[int, list[torch.Tensor]]:
        """Each table's block of the output (``[B_t, D_t]``; flat ones for mixed dims) cut into its bag sets."""
        result = {}
        for (t, _, sets), block in zip(runnable, blocks):
            if layout.dim is None:
                block = block.view(-1, self.tables[t].dim)
            result[t] = list(block.split([s.num_bags for s in sets])) if len(sets) > 1 else [block]
        return result

    # ------------------------------------------------------------------ the update
    def _hparam_values(self, tables, clocks: dict, skipped: set) -> tuple[list, list]:
        """``(hparams, versions)`` rows of one grouped update of ``tables`` (indices): each running table counts a
        step of its optimizer and gives its hyper-parameters."""
        rows = [[0.0] * 8 for _ in self.tables]
        versions = [-1] * len(self.tables)
        for t in tables:
            if t in skipped:  # no gradient (an unused output), or updated apart (its rows moved)
                continue
            table = self.tables[t]
            kind, hparams = table.sparse_optimizer.next_update(table)
            rows[t] = group_hparams(kind, hparams)
            if table.clock != clocks[t]:  # the lookup's version stamp is no longer the table's clock
                versions[t] = table.clock
        return rows, versions

    def _hparams_for(self, group: TableGroup, runnable, clocks: dict, skipped: set
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hparams [G, 8], versions [G])`` of one grouped update (made once while they repeat, as a constant
        lr does; kept in the group's staging while a CUDA graph is captured)."""
        rows, versions = self._hparam_values([t for t, _, _ in runnable], clocks, skipped)
        device = self.tables[0].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return (group.staging.put("hparams", rows, torch.float64),
                    group.staging.put("versions", versions, torch.int64))
        key = (tuple(map(tuple, rows)), tuple(versions))
        cached_key, tensors = self._hparams
        if key != cached_key:
            tensors = (torch.tensor(rows, dtype=torch.float64, device=device),
                       torch.tensor(versions, dtype=torch.int64, device=device))
            self._hparams = (key, tensors)
        return tensors

    # ------------------------------------------------------------------ CUDA-graph replays
    def recorded(self) -> list[dict]:
        """The grouped calls of the step being captured (:mod:`dynemb.collection.step_graph`), in order: each one's
        tables with their key counts; cleared by :meth:`record`."""
        return self._recording

    def record(self) -> None:
        """Start recording the grouped calls of a step to be captured."""
        self._recording = []

    def replay_fits(self, calls: list[dict]) -> bool:
        """Whether recorded ``calls`` can replay now: every table still runs grouped, and no table would read,
        grow or evict (:meth:`TableGroup.fits`)."""
        group = self._groups.get(resolve_backend(self.tables[0].backend, self.tables[0].device))
        return group is not None and len(calls) <= 1 and all(  # one call a step: one staging a group
            all(self._runs(t) for t in call["counts"]) and group.fits(call["counts"]) for call in calls)

    def replayed(self, calls: list[dict]) -> None:
        """The host's part of recorded ``calls``, before a replay: bounds, clocks and stamps
        (:meth:`TableGroup.replayed`), then each table's optimizer step and hyper-parameters, written to the
        staging the graph reads."""
        group = self._groups[resolve_backend(self.tables[0].backend, self.tables[0].device)]
        for call in calls:
            counts = call["counts"]
            clocks_before = {t: self.tables[t].clock for t in counts}
            group.replayed(counts)
            clocks = {t: clocks_before[t] + 1 for t in counts}
            rows, versions = self._hparam_values(list(counts), clocks, set())
            group.staging.fill("hparams", rows)
            group.staging.fill("versions", versions)


class _Call:
    """One grouped call's state, from its forward to its backward (the autograd node keeps it)."""

    def __init__(self, lookup: GroupedLookup, group: TableGroup, layout: _CallLayout, runnable, keys, rows, offsets,
                 weights, denom, bags) -> None:
        self.lookup, self.group, self.layout, self.runnable = lookup, group, layout, runnable
        tables = lookup.tables
        self.clocks = {t: tables[t].clock for t, _, _ in runnable}  # the lookup stamped its rows at these clocks
        self.moves = {t: tables[t].row_moves for t, _, _ in runnable}
        self.saved = (keys, rows, offsets, weights, denom, bags)


class _GroupedPool(torch.autograd.Function):
    """The pooling of a grouped call (forward: :meth:`GroupedLookup.forward`, one ``pool`` launch) and its fused
    update (backward: :meth:`GroupedLookup.update`, one ``sparse_update`` launch). Outputs: each table's block of
    the output, so that a table whose output no loss used gets no gradient and is left untouched, as by its own
    lookup. Its one input is the group's anchor, a leaf that requires grad, so that autograd runs the backward; the
    tables are no tensors."""

    @staticmethod
    def forward(ctx, call: _Call, anchor):
        blocks = GroupedLookup.forward(call)
        ctx.save_for_backward(*call.saved)
        ctx.call = call
        ctx.set_materialize_grads(False)
        call.saved = None  # the node holds the tensors now
        return blocks

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        call = ctx.call
        call.saved = ctx.saved_tensors
        GroupedLookup.update(call, grads)
        call.saved = None
        return None, None


def _flat_gradient(grads: tuple, layout: _CallLayout) -> torch.Tensor:
    """The tables' output gradients as one flat tensor in the output's layout (an unused table's block left
    unwritten: the update skips that table)."""
    blocks = [hi - lo for lo, hi in zip(layout.out_starts, layout.out_starts[1:])]
    if layout.dim is not None:
        device = next(g for g in grads if g is not None).device
        full = [g if g is not None else torch.empty(n // layout.dim, layout.dim, device=device)
                for g, n in zip(grads, blocks)]
        return (full[0].contiguous() if len(full) == 1 else torch.cat(full)).view(-1)
    device = next(g for g in grads if g is not None).device
    return torch.cat([g.reshape(-1) if g is not None else torch.empty(n, device=device)
                      for g, n in zip(grads, blocks)])


def _divided(grad: torch.Tensor, denom: torch.Tensor, layout: _CallLayout) -> torch.Tensor:
    """The flat bag gradient divided by each bag's combiner divisor (the gradient of its bag sum)."""
    if layout.dim is not None:
        return (grad.view(-1, layout.dim) / denom.unsqueeze(1)).view(-1)
    widths = torch.diff(torch.cat([layout.out_at, layout.out_at.new_tensor([grad.numel()])]))
    return grad / denom.repeat_interleave(widths, output_size=grad.numel())


def _update_apart(call: _Call, t: int, keys, keyed, grad, weights, bags) -> None:
    """Table ``t``'s update when its rows moved since the lookup (a lookup of its own evicted or compacted rows in
    between): its rows are found again by key and updated by its own path (``deliver_pooled_gradient``)."""
    layout, table = call.layout, call.lookup.tables[t]
    i = [item[0] for item in call.runnable].index(t)
    lo, hi = layout.id_starts[i], layout.id_starts[i + 1]
    b_lo, b_hi = layout.bag_starts[i], layout.bag_starts[i + 1]
    rows = keyed[lo:hi] & 0xFFFFFFFF
    by_row = sort_ids(rows, inverse=False)
    table_grad = grad.narrow(0, layout.out_starts[i], (b_hi - b_lo) * table.dim).view(-1, table.dim)
    local_bags = None if bags is None else bags[lo:hi] - b_lo
    pooled = PooledGrad(by_row.order, by_row.starts, local_bags, None if weights is None else weights[lo:hi])
    key_fn = functools.partial(first_of_groups, keys[lo:hi], by_row.order, by_row.starts)
    deliver_pooled_gradient(table, key_fn, by_row.unique, table_grad, pooled, call.clocks[t], call.moves[t])
