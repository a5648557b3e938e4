"""The owner side of a sharded lookup: the rows of the keys a rank received for its tables, grouped.

:func:`owner_lookup` is the one entry point sharding code calls on the rank that holds a table's rows (row-,
table- or column-wise shards alike: whatever the strategy, the owner gets keys and returns rows, then gets
gradients). It runs the tables of one execution group (:class:`~.grouped.GroupedLookup`, the plan's groups) as one
call of each group kernel, and every other table through the one per-table lookup
(:func:`~.find.find_ids`), with the same results: the rows and updates of the per-table path, bit for bit where
the group kernels are (within float32 summation order otherwise; ``tests/collection/test_owner.py``).

Example:
    >>> import torch, dynemb
    >>> from dynemb.functional.owner import owner_lookup
    >>> emb = dynemb.DynamicEmbedding(4)
    >>> opt = dynemb.optim.SGD([emb], lr=0.1, fused=True)
    >>> got = owner_lookup([emb.table], [torch.tensor([7, 9, 7])], insert=[True])
    >>> got.values[0].shape
    torch.Size([3, 4])
    >>> got.backward([torch.ones(3, 4)])  # row 7 gets the sum of its two gradients
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .grads import deliver_gradient, read_rows
from .grouped import GroupedLookup
from .find import find_ids
from .pooling import BagSet, one_id_bags

__all__ = ["owner_lookup", "OwnerRows"]


class OwnerRows:
    """What :func:`owner_lookup` found: ``values[t]`` the rows of table ``t``'s received keys (``[N_t, D_t]``
    float32, one row per key in arrival order; None where ``tables[t]`` was None), and :meth:`backward`, which hands
    each table its keys' gradients once."""

    def __init__(self, values: list, grouped: list, apart: dict) -> None:
        self.values = values
        self._grouped = grouped  # (GroupedLookup call, [(position t, group index)]) a group call
        self._apart = apart  # position t -> (table, unique keys, rows, inverse) of the per-table lookups
        self._done = False

    def backward(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Apply the gradients ``grads[t]`` (``[N_t, D_t]``, one per received key, None: no gradient) of the
        tables that trained in the lookup: a fused optimizer at once (a group's in one ``sparse_update`` call),
        else kept for ``step()``. Each table's rows get the sum of their keys' gradients. Once only."""
        if self._done:
            raise RuntimeError("owner_lookup's gradients were already applied (backward runs once a lookup)")
        if len(grads) != len(self.values):
            raise ValueError(f"grads must hold one entry a table ({len(self.values)}), got {len(grads)}")
        self._done = True
        for call, members in self._grouped:
            GroupedLookup.update(call, tuple(None if grads[pos] is None else grads[pos].float().contiguous()
                                             for pos, _ in members))
        for pos, (table, unique, rows, inverse) in self._apart.items():
            grad = grads[pos]
            if grad is None:
                continue
            total = torch.zeros(unique.numel(), grad.shape[1], device=grad.device).index_add_(0, inverse,
                                                                                                grad.float())
            deliver_gradient(table, unique, rows, total)


def owner_lookup(tables: Sequence, keys: Sequence[torch.Tensor], *, insert: Sequence[bool],
                 counts: Optional[Sequence[Optional[torch.Tensor]]] = None,
                 groups: Sequence[GroupedLookup] = ()) -> OwnerRows:
    """Rows of the keys this rank received for each of its tables, found or inserted (the owner side of a sharded
    lookup; no autograd: call it where grad mode may be off, e.g. inside an autograd node's forward).

    Args:
        tables: ``T`` tables (any :class:`~dynemb.table.EmbeddingTable`; None where this rank holds none of the
            table: its entries are None).
        keys: ``keys[t] [N_t]``, table ``t``'s received keys in its key dtype (a sharded table's shard keys), in
            arrival order; a key may come several times (from several requesters).
        insert: ``insert[t]``: whether the lookup inserts and trains table ``t`` (the caller's
            :func:`~.find.trains`; False: read-only, absent keys read their initializer row).
        counts: ``counts[t] [N_t]`` int64 or None: the occurrences each received key stands for (tables that
            count occurrences: lfu scores, admission); such a table runs the per-table lookup.
        groups: the execution groups whose tables may run grouped (the plan's ``ExecutionGroup.lookup`` s); a table
            runs grouped when it is in one (by identity), inserts, has keys and no ``counts``, and the group takes it
            this call (:meth:`GroupedLookup.start`).

    Returns:
        :class:`OwnerRows`: ``values[t] [N_t, D_t]`` float32 and ``backward(grads)``.

    Raises:
        ValueError: ``keys``, ``insert`` or ``counts`` not one entry a table.
    """
    n = len(tables)
    if len(keys) != n or len(insert) != n or (counts is not None and len(counts) != n):
        raise ValueError(f"keys, insert and counts must hold one entry for each of the {n} tables, got "
                         f"{len(keys)}, {len(insert)} and {None if counts is None else len(counts)}")
    values: list = [None] * n
    grouped, taken = [], set()
    for lookup in groups:
        members = [(pos, i) for pos, table in enumerate(tables) for i, member in enumerate(lookup.tables)
                   if table is member and insert[pos] and keys[pos].numel() and (counts is None or counts[pos] is None)]
        if not members:
            continue
        device = keys[members[0][0]].device
        call = lookup.start([(i, keys[pos], [_one_id(keys[pos].numel(), device)]) for pos, i in members])
        if call is None:
            continue
        ran = {t for t, _, _ in call.runnable}
        members = [(pos, i) for pos, i in members if i in ran]  # call.runnable keeps the order of members
        for (pos, _), block in zip(members, GroupedLookup.forward(call)):
            values[pos] = block.view(keys[pos].numel(), tables[pos].dim)
            taken.add(pos)
        grouped.append((call, members))
    apart = {}
    for pos, table in enumerate(tables):
        if table is None or pos in taken:
            continue
        found = find_ids(table, keys[pos], insert=insert[pos], counts=None if counts is None else counts[pos],
                         inverse=True)
        unique, rows, inverse = found.ids.unique, found.rows, found.ids.inverse
        values[pos] = read_rows(table, unique, rows).float().index_select(0, inverse)
        if insert[pos]:
            apart[pos] = (table, unique, rows, inverse)
    return OwnerRows(values, grouped, apart)


def _one_id(n: int, device) -> BagSet:
    """``n`` bags of one id each: the owner returns one row a received key."""
    return BagSet(n, one_id_bags(n, device), None, n, "sum", one_id=True)
