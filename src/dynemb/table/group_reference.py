"""The torch reference of the ``group`` kernel family (:mod:`dynemb.kernels.dispatch`): what a
:class:`~dynemb.table.group.TableGroup` runs on ``backend="torch"``, where no kernel follows the addresses in the
group's ``meta``.

The family's functions take the group itself; the numba and Triton kernels read its ``meta``/``fmeta`` rows
(addresses and sizes), this reference reads its ``tables`` and ``slots`` (each table's own index, columns and
slots). It runs the same operations with the same results as each table's own torch lookup and update:

- ``find_or_insert``: each table's keys probed in its own index; the missing keys of all the tables deduplicated by
  one stable sort with the table as the high key and the hash as the low one (each table's new keys come out in
  hash order, numbered from its size, as its own ``unique_by_hash`` numbers them); then each table's new keys
  placed, keyed, initialized and, with every row read, stamped. Rows, index layout, initial rows and stamps are the
  table's own ``find_or_insert``'s, bit for bit.
- ``pool``: every id's row gathered from its table into one ``[N, max_dim]`` tensor (columns past a table's dim are
  zero) and one ``embedding_bag`` sum over all the group's bags, in id order within a bag, as the per-table path.
- ``sparse_update``: one stable sort of every id by ``(table, row)``, one ``embedding_bag`` of the bags' gradients
  (padded to ``max_dim``) that sums each row's gradient in input order, then one update over all the rows of the
  tables of one shape (dim and slot widths), with each row's table's hyper-parameters as ``[U, 1]`` columns.
  The update's arithmetic is each optimizer's torch ``_update`` written as separate float32 ops (no fused
  multiply-add, which torch's vectorized ``add(alpha=)`` and ``addcmul`` use for some positions of a tensor and not
  others): a row's result does not depend on which rows share the call, so a table trains bit for bit the same
  alone as in a group; against the per-table torch path it is within float32 rounding (the tests' ``rtol=1e-5``).

A short loop over the group's tables (never over keys) remains where each table's storage is its own tensor:
probing and placing keys in its index, writing its new rows and stamps, gathering and scattering its rows. The
reference reads a few small tensors back to the host (the tables' runs of keys, sizes, stamps, hyper-parameters):
it is the reference, and the torch backend's grouped path; the kernels make no such read.

Cost: about the per-table torch path's at small batches of many tables, more at large ones (Xeon guest, 1 thread,
fused Adagrad, dim 16, a step of forward and backward: 26 tables x 512 ids 30-33 ms against 28-37 ms per table;
4 x 4,096 ids 16-24 against 13-15 ms), where the per-table path reuses its forward's sort in the backward and the
group sorts again by ``(table, row)``. The torch backend is the reference; numba and Triton are the fast paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .hashing import key_hash
from .initializers import initial_rows

__all__ = ["find_or_insert", "pool", "sparse_update", "max_ids_per_table", "KINDS"]

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")


def max_ids_per_table() -> int | None:
    """Any number of ids a table (None): the grouped path is the torch backend's training lookup."""
    return None


# ------------------------------------------------------------------------------------------------ find_or_insert
def find_or_insert(group, keys: torch.Tensor, seg: torch.Tensor, seg_first: torch.Tensor, sizes: torch.Tensor,
                   stamps: torch.Tensor) -> torch.Tensor:
    """``rows [N]`` int64 of ``keys [N]`` (key ``i`` of table ``seg[i]``, each table's keys one run), the absent
    ones inserted as each table's own ``find_or_insert`` inserts them: see the contract. Advances ``sizes [G]`` by
    each table's new keys."""
    n = keys.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=keys.device)
    # one dedup of all the group's keys: a stable sort by hash, then by table (the high key); the hash is a
    # bijection, so equal (table, hash) is equal (table, key), and each table's keys come out in hash order
    hashes = key_hash(keys)
    by_hash = hashes.sort(stable=True).indices
    order = by_hash.index_select(0, seg.index_select(0, by_hash).sort(stable=True).indices)
    s_seg, s_hash = seg.index_select(0, order), hashes.index_select(0, order)
    first = torch.ones_like(s_seg, dtype=torch.bool)  # the first of each run of one (table, key)
    first[1:] = (s_seg[1:] != s_seg[:-1]) | (s_hash[1:] != s_hash[:-1])
    at = first.nonzero().squeeze(1)
    u_keys, u_hash = keys.index_select(0, order.index_select(0, at)), s_hash.index_select(0, at)
    counts = torch.bincount(s_seg.index_select(0, at), minlength=len(group.tables)).tolist()
    u_rows = torch.empty(at.numel(), dtype=torch.int64, device=keys.device)
    base, marks, new = sizes.tolist(), stamps.tolist(), [0] * len(counts)
    lo = 0
    for t, count in enumerate(counts):  # each table's unique keys: probed in its own index, the absent inserted
        if not count:
            continue
        hi, table = lo + count, group.tables[t]
        rows = u_rows[lo:hi]
        rows.copy_(table.index.find(u_keys[lo:hi], u_hash[lo:hi]))
        absent = (rows < 0).nonzero().squeeze(1)
        if absent.numel():  # in hash order, numbered from the table's size, as its own unique_by_hash numbers them
            new[t] = absent.numel()
            rows.index_copy_(0, absent, _insert(group, t, u_keys[lo:hi].index_select(0, absent),
                                                u_hash[lo:hi].index_select(0, absent), base[t]))
        columns = table._columns  # every row read: the access's score and version stamps
        columns["score"].index_fill_(0, rows, marks[t][0])
        columns["version"].index_fill_(0, rows, marks[t][1])
        lo = hi
    if any(new):
        sizes.add_(torch.tensor(new, dtype=sizes.dtype, device=sizes.device))
    return torch.empty_like(order).index_copy_(0, order, u_rows.index_select(0, first.cumsum(0) - 1))


def _insert(group, t: int, keys: torch.Tensor, hashes: torch.Tensor, size: int) -> torch.Tensor:
    """Rows ``size`` on for table ``t``'s absent unique ``keys`` (in hash order): placed in its index, keyed,
    initialized, slots at their initial values. The group made room for them before the call."""
    table, count = group.tables[t], keys.numel()
    rows = torch.arange(size, size + count, device=keys.device)
    table.index.insert(keys, rows, hashes)
    columns = table._columns
    columns["key"][size:size + count] = keys
    initial_rows(table.initializer, keys, table.dim, table.dtype, table.seed, table.backend,
                 out=columns["value"][size:size + count])
    for name in group.slots[t]:
        table.slot(name)[size:size + count] = table._slot_init[name]
    if table._marks is not None:
        table._marks[size:size + count] = 0  # a row cleared away may have left its deferred-stamp tag
    return rows


# ------------------------------------------------------------------------------------------------ pool
def pool(group, rows: torch.Tensor, offsets: torch.Tensor, bag_seg: torch.Tensor, weights: torch.Tensor | None,
         denom: torch.Tensor | None, out: torch.Tensor, out_at: torch.Tensor, max_dim: int) -> torch.Tensor:
    """Bag ``b`` of table ``bag_seg[b]`` summed from its ids' ``rows`` into ``out`` (flat) at ``out_at[b]``: see
    the contract. Returns ``out``."""
    nbags, n = offsets.numel(), rows.numel()
    if nbags == 0:
        return out
    uniform = out.numel() == nbags * max_dim  # every bag of the call is max_dim wide: out is [B, max_dim]
    id_tables = bag_seg.index_select(0, _bag_of(offsets, n)) if n else bag_seg[:0]
    gathered = rows.new_empty((n, max_dim), dtype=torch.float32) if uniform else \
        rows.new_zeros((n, max_dim), dtype=torch.float32)
    for t, lo, hi in _runs(id_tables):  # each table's rows from its own values
        table = group.tables[t]
        torch.index_select(table.values, 0, rows[lo:hi], out=gathered[lo:hi, :table.dim])
    summed = F.embedding_bag(torch.arange(n, device=rows.device), gathered, offsets, mode="sum",
                             per_sample_weights=weights)
    if denom is not None:
        summed = summed / denom.unsqueeze(1)
    if uniform:
        out.view(nbags, max_dim).copy_(summed)
        return out
    dims = torch.tensor([t.dim for t in group.tables], device=rows.device)
    cols = torch.arange(max_dim, device=rows.device)
    inside = cols < dims.index_select(0, bag_seg).unsqueeze(1)  # [B, max_dim]: the bag's table's columns
    out.index_copy_(0, (out_at.unsqueeze(1) + cols).masked_select(inside), summed.masked_select(inside))
    return out


# ------------------------------------------------------------------------------------------------ sparse_update
def sparse_update(kind: str, group, hparams: torch.Tensor, versions: torch.Tensor, keyed: torch.Tensor,
                  grad: torch.Tensor, grad_at: torch.Tensor, table_bags: torch.Tensor, bag: torch.Tensor | None,
                  weights: torch.Tensor | None, max_dim: int) -> None:
    """Each distinct ``(table, row)`` of ``keyed [N]`` (``table << 32 | row``) updated once with its summed
    gradient, by its table's hyper-parameters: see the contract."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    n, device = keyed.numel(), keyed.device
    if n == 0:
        return
    tables, h, stamp = group.tables, hparams.tolist(), versions.tolist()
    # the ids grouped by (table, row), in input order within one: one stable sort, the table the high word
    ordered, order = torch.sort(keyed, stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    at = first.nonzero().squeeze(1)
    unique = ordered.index_select(0, at)
    # each bag's gradient as a row of max_dim columns (zero past its table's dim), then each row's sum of them
    nbags = grad_at.numel()
    if grad.numel() == nbags * max_dim:  # every bag max_dim wide: the gradient is [B, max_dim] as it is
        bag_grad = grad.view(nbags, max_dim)
    else:
        bag_dims = torch.zeros(nbags, dtype=torch.int64, device=device)
        for t, (lo, count, _) in enumerate(table_bags.tolist()):
            bag_dims[lo:lo + count] = tables[t].dim
        cols = torch.arange(max_dim, device=device)
        inside = cols < bag_dims.unsqueeze(1)
        at_col = (grad_at.unsqueeze(1) + cols).clamp_(max=max(grad.numel() - 1, 0))
        bag_grad = torch.where(inside, grad.index_select(0, at_col.view(-1)).view(-1, max_dim), 0.0)
    ids_bags = order if bag is None else bag.index_select(0, order).to(torch.int64)
    row_grad = F.embedding_bag(ids_bags, bag_grad, at, mode="sum",
                               per_sample_weights=None if weights is None else weights.index_select(0, order))
    # each table's rows are one run of the sorted ids; tables of one shape are updated together
    u_rows = unique & 0xFFFFFFFF
    counts = torch.bincount(unique >> 32, minlength=len(tables)).tolist()
    shapes: dict = {}
    lo = 0
    for t, count in enumerate(counts):
        if count and h[t][7] != 0:
            table = tables[t]
            shape = (table.dim, tuple(table.slot(s).shape[1] for s in group.slots[t]))
            shapes.setdefault(shape, []).append((t, lo, lo + count))
        lo += count
    for (dim, _), parts in shapes.items():
        _update_shape(kind, group, parts, dim, h, u_rows, row_grad)
        for t, lo, hi in parts:
            if stamp[t] >= 0:  # the table's clock moved since the lookup stamped these rows
                tables[t]._columns["version"].index_fill_(0, u_rows[lo:hi], stamp[t])


def _update_shape(kind, group, parts, dim, h, u_rows, row_grad) -> None:
    """One update of the rows of the tables ``parts`` (``(t, lo, hi)``: table ``t``'s rows ``u_rows[lo:hi]``), all
    of width ``dim`` with slots of the same widths: gathered from each table, updated at once, written back."""
    tables = group.tables

    def gather(column):
        got = [column(t).index_select(0, u_rows[lo:hi]) for t, lo, hi in parts]
        return got[0] if len(got) == 1 else torch.cat(got)

    rows_of = [u_rows[lo:hi] for _, lo, hi in parts]
    g = torch.cat([row_grad[lo:hi, :dim] for _, lo, hi in parts]) if len(parts) > 1 else \
        row_grad[parts[0][1]:parts[0][2], :dim]
    per_row = torch.tensor([h[t] for t, _, _ in parts], dtype=torch.float64, device=g.device).repeat_interleave(
        torch.tensor([hi - lo for _, lo, hi in parts], device=g.device), dim=0)  # [U, 8] float64
    if kind == "adam":  # 1 - beta in double, then float32, as torch computes it from the Python scalar
        per_row[:, :2] = 1.0 - per_row[:, :2]
    hp = per_row.to(torch.float32)
    h0, h1, h2, h3, decay = (hp[:, k:k + 1] for k in range(5))
    v = gather(lambda t: tables[t].values)
    s0 = gather(lambda t: tables[t].slot(group.slots[t][0])) if group.slots[parts[0][0]] else None
    s1 = gather(lambda t: tables[t].slot(group.slots[t][1])) if len(group.slots[parts[0][0]]) > 1 else None
    rows_h = [h[t] for t, _, _ in parts]  # the same branches as each table's torch update, where all agree
    if kind in ("sgd", "adagrad", "rowwise_adagrad") and any(r[4] for r in rows_h):
        g = g + v * decay if all(r[4] for r in rows_h) else torch.where(decay != 0, g + v * decay, g)
    if kind == "sgd":  # lr, momentum, weight decay, nesterov
        if s0 is not None and any(r[1] for r in rows_h):  # a momentum buffer, and momentum (torch: else untouched)
            buf = s0 * h1 + g
            if all(r[3] for r in rows_h):
                step = g + buf * h1
            elif any(r[3] for r in rows_h):
                step = torch.where(h3 != 0, g + buf * h1, buf)
            else:
                step = buf
            if all(r[1] for r in rows_h):
                s0, g = buf, step
            else:
                moving = h1 != 0
                s0, g = torch.where(moving, buf, s0), torch.where(moving, step, g)
        v = v + g * -h0
    elif kind == "adagrad":  # clr, weight decay, eps
        s0 = s0 + g * g
        v = v + (g / (s0.sqrt() + h2)) * -h0
    elif kind == "rowwise_adagrad":  # lr, weight decay, eps
        s0 = s0 + torch.linalg.vector_norm(g, dim=1, keepdim=True).square() / dim
        v = v + g * ((s0.sqrt() + h2).reciprocal() * -h0)
    elif kind == "adam":  # 1 - beta1, 1 - beta2, eps, step size
        s0 = (g - s0) * h0 + s0
        s1 = (g * g - s1) * h1 + s1
        v = v + (s0 / (s1.sqrt() + h2)) * -h3
    else:  # ftrl: lr, power, l1, l2
        new_acc = s0 + g * g
        new_pow = _pow(new_acc, h1)
        sigma = (new_pow - _pow(s0, h1)) / h0
        s1 = s1 + g - sigma * v
        quadratic = new_pow / h0 + 2 * per_row[:, 3:4].to(torch.float32)
        v = torch.where(s1.abs() > h2, (torch.sign(s1) * h2 - s1) / quadratic, 0.0)
        s0 = new_acc
    lo = 0
    for (t, a, b), rows in zip(parts, rows_of):  # written back into each table's own storage
        hi = lo + (b - a)
        table = tables[t]
        table.values.index_copy_(0, rows, v[lo:hi])
        for k, state in enumerate((s0, s1)):
            if state is not None:
                table.slot(group.slots[t][k]).index_copy_(0, rows, state[lo:hi])
        lo = hi


def _pow(x: torch.Tensor, power: torch.Tensor) -> torch.Tensor:
    """``x ** power`` with the shortcuts torch's ``pow`` takes for a scalar exponent of 0.5 and 1."""
    return torch.where(power == 0.5, x.sqrt(), torch.where(power == 1.0, x, x.pow(power)))


# ------------------------------------------------------------------------------------------------ helpers
def _runs(seg: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(t, lo, hi)`` of each run of one table in ``seg`` (the tables' runs are contiguous): one read."""
    tables, counts = torch.unique_consecutive(seg, return_counts=True)
    runs, lo = [], 0
    for t, count in zip(tables.tolist(), counts.tolist()):
        runs.append((t, lo, lo + count))
        lo += count
    return runs


def _bag_of(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]``: each id's bag (ids ``offsets[b]`` up to the next offset, or ``n``)."""
    lengths = torch.diff(offsets, append=offsets.new_tensor([n]))
    return torch.arange(offsets.numel(), device=offsets.device).repeat_interleave(lengths, output_size=n)
