"""Numba kernels over a group of tables on CPU: the ``group`` family of :mod:`dynemb.kernels.dispatch` (the
contracts, and the per-table rows of ``meta``, are written there).

Each function is one call for every table of the group: a loop over the tables' runs of work inside compiled code,
each table's tensors viewed at the addresses ``meta`` holds (an ``int -> pointer`` cast, then ``numba.carray``), and
for each table the same per-table kernels its own lookups run: the index probe and placement and the hash-order
dedup of :mod:`~dynemb.kernels.numba_index`, the initializer of :mod:`~dynemb.kernels.numba_init`, the fused updates
of :mod:`~dynemb.kernels.numba_optim`. A group's call thus costs what its tables' kernels cost, without the Python
of one call a table (tens of microseconds each, the whole of a small batch's lookup). Results are the per-table
kernels' results: ``find_or_insert`` the table's own bit for bit; the pooled sums and updates within the same
float32 tolerance of the torch reference as those kernels.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .dispatch import GROUP_META
from .numba_index import _place_kernel, _probe_kernel, _unique_kernel
from .numba_init import uniform_salted
from .numba_optim import _adagrad, _adam, _ftrl, _rowwise_adagrad, _sgd
from .numba_pool import _AHEAD, _RADIX_PASSES, _radix_dedup_kernel, block_width, sum_terms

__all__ = ["find_or_insert", "pool", "sparse_update", "KINDS", "max_ids_per_table"]

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
#: A table passes at most this many ids to a grouped call; above it, its own lookup (which deduplicates before it
#: probes, and pools and updates unique rows) costs no more than its share of the group's call: on the Xeon guest
#: (1 thread) the main job's step ran 1.40x faster grouped at 512 ids a table, the same at 4,096, and a train step
#: of 81,920 zipf ids a table 0.88x (``benchmarks/job_step.py``, ``benchmarks/train_step_ab.py --same-process``).
_MAX_IDS_PER_TABLE = 4096


def max_ids_per_table() -> int | None:
    """The most ids a table passes to one grouped call (None: any); above it the table runs its own lookup."""
    return _MAX_IDS_PER_TABLE
(_BUCKETS, _OVERFLOW, _SHIFT, _NB, _VALUES, _DIM, _KEYS, _STAMPS, _SLOT0, _W0, _SLOT1, _W1, _SEED, _INIT,
 _CAPACITY) = range(len(GROUP_META))
_F32 = np.empty(0, np.float32)  # the dtypes the tables' tensors are viewed in (numba arrays carry them)
_I64 = np.empty(0, np.int64)
_BOOL = np.empty(0, np.bool_)
_NO_SLOTS = np.empty(0, np.int64)
_NO_F32 = np.empty(0, np.float32)


def find_or_insert(group, keys: torch.Tensor, seg: torch.Tensor, seg_first: torch.Tensor, sizes: torch.Tensor,
                   stamps: torch.Tensor) -> torch.Tensor:
    """``rows [N]`` int64 of ``keys [N]`` (key ``i`` of table ``seg[i]``), the absent ones inserted: see the
    contract (``group.meta`` and ``group.fmeta`` say where each table's storage is). Advances ``sizes [G]`` by each
    table's new keys."""
    meta, fmeta = group.meta, group.fmeta
    flat = keys.contiguous().numpy()
    rows = np.empty(flat.shape[0], np.int64)
    key_cols = 10 if flat.dtype == np.int64 else 8  # HashIndex._key_cols: 5 int64 or 8 int32 keys a bucket
    full = _find_or_insert_kernel(meta.numpy(), fmeta.numpy(), flat, seg.numpy(), sizes.numpy(), stamps.numpy(),
                                  rows, key_cols)
    if full:
        raise RuntimeError("a grouped table's index is full (the group leaves room before the call: unreachable)")
    return torch.from_numpy(rows)


def pool(group, rows: torch.Tensor, offsets: torch.Tensor, bag_seg: torch.Tensor,
         weights: torch.Tensor | None, denom: torch.Tensor | None, out: torch.Tensor, out_at: torch.Tensor,
         max_dim: int) -> torch.Tensor:
    """Bag ``b`` of table ``bag_seg[b]`` summed from its ids' ``rows`` into ``out`` (flat) at ``out_at[b]``: see
    the contract. Returns ``out``."""
    m = group.meta.numpy()
    dims = {int(d) for d in m[:, _DIM]}
    width = block_width(dims.pop()) if len(dims) == 1 else ()  # one dim: summed in vector registers
    _pool_kernel(m, rows.numpy(), offsets.numpy(), bag_seg.numpy(),
                 _NO_F32 if weights is None else weights.detach().numpy(), _NO_F32 if denom is None else denom.numpy(),
                 out.numpy(), out_at.numpy(), rows.shape[0], width)
    return out


def sparse_update(kind: str, group, hparams: torch.Tensor, versions: torch.Tensor, keyed: torch.Tensor,
                  grad: torch.Tensor, grad_at: torch.Tensor, table_bags: torch.Tensor, bag: torch.Tensor | None,
                  weights: torch.Tensor | None, max_dim: int) -> None:
    """Each distinct ``(table, row)`` of ``keyed [N]`` updated once with its summed gradient, by each table's own
    fused-update kernel and hyper-parameters: see the contract."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    m, h = group.meta.numpy(), hparams.numpy()
    dims = {int(m[t, _DIM]) for t in range(m.shape[0]) if h[t, 7] != 0}
    width = block_width(dims.pop()) if len(dims) == 1 else ()  # one dim: summed in vector registers
    _UPDATES[kind](m, h, versions.numpy(), keyed.numpy(), grad.numpy(), table_bags.numpy(),
                   _NO_SLOTS if bag is None else bag.numpy().astype(np.int64, copy=False),
                   _NO_F32 if weights is None else weights.detach().numpy(), width)


# --------------------------------------------------------------------------------------------------- compiled code
@intrinsic
def _pointer(typingctx, address, like):
    """``address`` (an int) as a pointer to ``like``'s element type: a table's tensor seen from compiled code."""
    if not (isinstance(address, types.Integer) and isinstance(like, types.Array)):
        return None
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


@numba.njit(nogil=True, cache=True)
def _find_or_insert_kernel(meta, fmeta, keys, seg, sizes, stamps, rows, key_cols):
    n = keys.shape[0]
    per_bucket = 64 // keys.itemsize  # a bucket is 64 bytes: 8 int64 or 16 int32 words
    lo = 0
    while lo < n:  # a table's keys are one run
        t = seg[lo]
        hi = lo + 1
        while hi < n and seg[hi] == t:
            hi += 1
        m = meta[t]
        nb, capacity = m[_NB], m[_CAPACITY]
        table = numba.carray(_pointer(m[_BUCKETS], keys), (nb, per_bucket))
        overflow = numba.carray(_pointer(m[_OVERFLOW], _BOOL), (nb,))
        part, out = keys[lo:hi], rows[lo:hi]
        missing = _probe_kernel(table, key_cols, overflow, part, m[_SHIFT], np.empty(0, np.int64), out)
        if missing > 0:
            # the table's own insert of its absent keys: deduplicated in hash order, placed, initialized
            at = np.empty(missing, np.int64)
            k = 0
            for j in range(hi - lo):
                if out[j] < 0:
                    at[k] = j
                    k += 1
            missed = part[at]
            unique, hashes = np.empty(missing, keys.dtype), np.empty(missing, np.int64)
            last, inverse = np.empty(missing, np.int64), np.empty(missing, np.int64)
            u = _unique_kernel(missed, unique, hashes, last, inverse)
            size = sizes[t]
            new_rows = np.arange(size, size + u)
            bucket = (hashes[:u] >> m[_SHIFT]) + nb // 2
            if not _place_kernel(table, key_cols, overflow, bucket, unique[:u], new_rows)[0]:
                return 1
            dim = m[_DIM]
            values = numba.carray(_pointer(m[_VALUES], _F32), (capacity, dim))
            if m[_INIT] == 1:
                uniform_salted(unique[:u], m[_SEED], fmeta[t, 0], fmeta[t, 1], values[size:size + u])
            else:
                values[size:size + u, :] = fmeta[t, 0]
            numba.carray(_pointer(m[_KEYS], keys), (capacity,))[size:size + u] = unique[:u]
            if m[_W0] > 0:
                numba.carray(_pointer(m[_SLOT0], _F32), (capacity, m[_W0]))[size:size + u, :] = fmeta[t, 2]
            if m[_W1] > 0:
                numba.carray(_pointer(m[_SLOT1], _F32), (capacity, m[_W1]))[size:size + u, :] = fmeta[t, 3]
            for k in range(missing):
                out[at[k]] = size + inverse[k]
            sizes[t] = size + u
        pair = numba.carray(_pointer(m[_STAMPS], _I64), (capacity, 2))  # score, version interleaved
        score, version = stamps[t, 0], stamps[t, 1]
        for j in range(hi - lo):
            pair[out[j], 0] = score
            pair[out[j], 1] = version
        lo = hi
    return 0


@numba.njit(nogil=True, cache=True)
def _pool_kernel(meta, rows, offsets, bag_seg, weights, denom, out, out_at, n, width):
    nbags = offsets.shape[0]
    starts = np.empty(nbags + 1, np.int64)  # each bag's first id, and the end
    starts[:nbags] = offsets
    starts[nbags] = n
    lo = 0
    while lo < nbags:  # a table's bags are one run: pooled by the per-table kernels' bag sum
        t = bag_seg[lo]
        hi = lo + 1
        while hi < nbags and bag_seg[hi] == t:
            hi += 1
        dim = meta[t, _DIM]
        values = numba.carray(_pointer(meta[t, _VALUES], _F32), (meta[t, _CAPACITY], dim))
        at = out_at[lo]
        block = out[at:at + (hi - lo) * dim].reshape((hi - lo, dim))
        sum_terms(lo, hi, block, values, starts, rows, weights, _AHEAD, width)
        if denom.shape[0] > 0:
            for b in range(lo, hi):
                for d in range(dim):
                    block[b - lo, d] /= denom[b]
        lo = hi


@numba.njit(nogil=True, cache=True)
def _grouping(meta, keyed, bag, weights):
    """The ids grouped by ``(table, row)``: rows numbered ``base[t] + row`` (tables one after the other) and
    radix-sorted, so that each table's rows are one run in address order. Returns ``(unique, starts, bases,
    bags, grouped weights)`` with each id's bag and weight in group order."""
    n, tables = keyed.shape[0], meta.shape[0]
    bases = np.empty(tables + 1, np.int64)
    bases[0] = 0
    for t in range(tables):
        bases[t + 1] = bases[t] + meta[t, _CAPACITY]
    flat = np.empty(n, np.int64)
    for j in range(n):
        flat[j] = bases[keyed[j] >> 32] + (keyed[j] & 0xFFFFFFFF)
    unique, order, starts = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n + 1, np.int64)
    u = _radix_dedup_kernel(flat, unique, np.empty(0, np.int64), order, starts, _RADIX_PASSES)
    if u < 0:  # more rows than 2**33 in all: a stable sort instead
        order[:] = np.argsort(flat, kind="mergesort")
        u = 0
        for k in range(n):
            if k == 0 or flat[order[k]] != flat[order[k - 1]]:
                unique[u] = flat[order[k]]
                starts[u] = k
                u += 1
        starts[u] = n
    bags = np.empty(n, np.int64)
    grouped = np.empty(n if weights.shape[0] > 0 else 0, np.float32)
    for k in range(n):
        j = order[k]
        bags[k] = bag[j] if bag.shape[0] > 0 else j
        if weights.shape[0] > 0:
            grouped[k] = weights[j]
    return unique[:u], starts[:u + 1], bases, bags, grouped


@numba.njit(inline="always")
def _slot(meta, t, k):
    if meta[t, k + 1] == 0:
        return np.empty((0, 0), np.float32)  # made here: a global array is read-only to compiled code
    return numba.carray(_pointer(meta[t, k], _F32), (meta[t, _CAPACITY], meta[t, k + 1]))


@numba.njit(inline="always")
def _update_tables(kernel, meta, hparams, versions, keyed, grad, table_bags, bag, weights, width):
    unique, starts, bases, bags, grouped = _grouping(meta, keyed, bag, weights)
    u, t, lo = unique.shape[0], 0, 0
    while lo < u:  # table by table: its rows are one run of the grouping
        while unique[lo] >= bases[t + 1]:
            t += 1
        hi = lo
        while hi < u and unique[hi] < bases[t + 1]:
            hi += 1
        if hparams[t, 7] != 0:
            dim, capacity = meta[t, _DIM], meta[t, _CAPACITY]
            values = numba.carray(_pointer(meta[t, _VALUES], _F32), (capacity, dim))
            first, count, start = table_bags[t, 0], table_bags[t, 1], table_bags[t, 2]
            table_grad = grad[start:start + count * dim].reshape((count, dim))  # the table's block of the gradient
            k0, k1 = starts[lo], starts[hi]
            rows = unique[lo:hi] - bases[t]
            local_starts = starts[lo:hi + 1] - k0
            local_bags = bags[k0:k1] - first
            local_weights = grouped[k0:k1] if grouped.shape[0] > 0 else grouped
            kernel(values, _slot(meta, t, _SLOT0), _slot(meta, t, _SLOT1), rows, table_grad, local_starts, local_bags,
                   local_weights, hparams[t, :4], width)
            if versions[t] >= 0:  # the table's clock moved since the lookup stamped these rows
                pair = numba.carray(_pointer(meta[t, _STAMPS], _I64), (capacity, 2))
                for r in rows:
                    pair[r, 1] = versions[t]
        lo = hi


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _update_sgd(meta, hparams, versions, keyed, grad, table_bags, bag, weights, width):
    _update_tables(_sgd, meta, hparams, versions, keyed, grad, table_bags, bag, weights, width)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _update_adagrad(meta, hparams, versions, keyed, grad, table_bags, bag, weights, width):
    _update_tables(_adagrad, meta, hparams, versions, keyed, grad, table_bags, bag, weights, width)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _update_rowwise_adagrad(meta, hparams, versions, keyed, grad, table_bags, bag, weights, width):
    _update_tables(_rowwise_adagrad, meta, hparams, versions, keyed, grad, table_bags, bag, weights, width)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _update_adam(meta, hparams, versions, keyed, grad, table_bags, bag, weights, width):
    _update_tables(_adam, meta, hparams, versions, keyed, grad, table_bags, bag, weights, width)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _update_ftrl(meta, hparams, versions, keyed, grad, table_bags, bag, weights, width):
    _update_tables(_ftrl, meta, hparams, versions, keyed, grad, table_bags, bag, weights, width)


_UPDATES = {"sgd": _update_sgd, "adagrad": _update_adagrad, "rowwise_adagrad": _update_rowwise_adagrad,
            "adam": _update_adam, "ftrl": _update_ftrl}
