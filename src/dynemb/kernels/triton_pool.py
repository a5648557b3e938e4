"""Triton kernels for pooled lookups straight from a table's rows: the ``pool`` family of
:mod:`dynemb.kernels.dispatch` (the contract of ``pool`` and ``row_grad`` is written there).

``pool`` runs one program per bag and column block: it walks the bag's ids ``BLOCK_N`` at a time, reads their rows
of the table through ``rows[inverse[j]]`` (no ``[N, D]`` gather is built) and sums them in float32. ``row_grad``
is the same walk over the ids of each unique row (``order``, ``starts``), reading the output gradient of their
bags. Both are single launches with no host sync. The sums run in float32 in tile order, so results equal the
torch reference within float32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import block_d, check_device, row_warps

__all__ = ["dedup", "pool", "row_grad", "decayed_scores"]

_BLOCK_N = 16  # ids per step of a bag: pooling factors are ~20, so most bags take one or two steps
_DECAY_BLOCK = 512  # rows a program of decayed_scores


def dedup(ids: torch.Tensor, inverse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                              torch.Tensor]:
    """``(unique [U], inverse [N], order [N], starts [U + 1])`` of ``ids [N]``: the ``dedup`` contract, by one
    stable device sort (a radix sort on CUDA; a hash pass could not keep input order within an id without one).
    ``unique`` is ascending. Its length is the step's one necessary host sync (the unique count). ``inverse``
    False: None in its place."""
    ordered, order = torch.sort(ids, stable=True)
    unique, grouped, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    where = torch.empty_like(order).scatter_(0, order, grouped) if inverse else None
    return unique, where, order, torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def pool(values: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor | None, offsets: torch.Tensor,
         weights: torch.Tensor | None, denom: torch.Tensor | None) -> torch.Tensor:
    """``[B, D]``: ``out[b] = sum(weights[j] * values[rows[inverse[j]]] for j in bag b) / denom[b]`` (``inverse``
    None: ``rows[j]``)."""
    check_device(values, rows, inverse, offsets, weights, denom)
    n, nbags, dim = (rows if inverse is None else inverse).numel(), offsets.numel(), values.shape[1]
    out = torch.empty(nbags, dim, dtype=values.dtype, device=values.device)
    if nbags and dim:
        bd = block_d(dim)
        _pool_kernel[(nbags, triton.cdiv(dim, bd))](
            values, rows, rows if inverse is None else inverse, offsets, offsets if weights is None else weights,
            offsets if denom is None else denom, out, n, nbags, dim, HAS_INV=inverse is not None,
            HAS_W=weights is not None, HAS_DENOM=denom is not None, BLOCK_N=_BLOCK_N, BLOCK_D=bd,
            num_warps=row_warps(bd))
    return out


def row_grad(grad: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, bag: torch.Tensor | None,
             weights: torch.Tensor | None) -> torch.Tensor:
    """``[U, D]`` float32: ``g[u] = sum(weights[j] * grad[bag[j]] for j in order[starts[u]:starts[u + 1]])``
    (``bag`` None: ``bag[j] == j``)."""
    check_device(grad, order, starts, bag, weights)
    nrows, dim = starts.numel() - 1, grad.shape[1]
    out = torch.empty(nrows, dim, dtype=torch.float32, device=grad.device)
    if nrows and dim:
        bd = block_d(dim)
        _row_grad_kernel[(nrows, triton.cdiv(dim, bd))](
            grad, order, starts, order if bag is None else bag, order if weights is None else weights, out, dim,
            HAS_BAG=bag is not None, HAS_W=weights is not None, BLOCK_N=_BLOCK_N, BLOCK_D=bd,
            num_warps=row_warps(bd))
    return out


def decayed_scores(old: torch.Tensor, n: torch.Tensor, now: int, constants) -> torch.Tensor:
    """``[N]`` int64 decayed_lfu scores of rows scored ``old`` accessed ``n`` times at fixed-point time ``now``: the
    optional ``decayed_scores`` of the ``pool`` contract, in one launch, every operation as the torch reference's
    (no fused multiply-add; the constants travel as float64, where a float argument would be float32)."""
    check_device(old, n)
    out = torch.empty_like(old)
    if old.numel():
        table = torch.tensor([*constants.exp2, *constants.log2, constants.sqrt_half], dtype=torch.float64,
                             device=old.device)
        _decayed_kernel[(triton.cdiv(old.numel(), _DECAY_BLOCK),)](
            old, n, table, out, now, old.numel(), NE=len(constants.exp2),
            NL=len(constants.log2), BLOCK=_DECAY_BLOCK, enable_fp_fusion=False)
    return out


@triton.jit
def _decayed_kernel(old, n, table, out, now, size, NE: tl.constexpr, NL: tl.constexpr, BLOCK: tl.constexpr):
    # policy._decayed op by op. 1.5 * 2**52 added and taken away rounds to an integer, half to even, as torch.round
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < size
    magic = 6755399441055744.0
    span = 1 << 50
    o = tl.load(old + i, mask=mask, other=0)
    d = tl.minimum(tl.maximum(o - now, -span), span).to(tl.float64) / 65536.0
    c = tl.minimum(tl.maximum(d, -1000.0), 60.0)
    k = (c + magic) - magic
    f = c - k
    p = tl.zeros([BLOCK], tl.float64) + tl.load(table + NE - 1)
    for j in tl.static_range(NE - 2, -1, -1):
        p = p * f + tl.load(table + j)
    two_k = ((k.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    x = p * two_k + tl.minimum(tl.load(n + i, mask=mask, other=1), span).to(tl.float64)
    bits = x.to(tl.int64, bitcast=True)  # x >= 1: x = m * 2**e with m in [0.5, 1), as frexp
    m = ((bits & ((1 << 52) - 1)) | (1022 << 52)).to(tl.float64, bitcast=True)
    e = ((bits >> 52) - 1022).to(tl.float64)
    low = m < tl.load(table + NE + NL)
    m = tl.where(low, m * 2.0, m)
    e = tl.where(low, e - 1.0, e)
    t = (m - 1.0) / (m + 1.0)
    t2 = t * t
    q = tl.zeros([BLOCK], tl.float64) + tl.load(table + NE + NL - 1)
    for j in tl.static_range(NL - 2, -1, -1):
        q = q * t2 + tl.load(table + NE + j)
    v = (e + t * q) * 65536.0
    new = ((v + magic) - magic).to(tl.int64) + now
    tl.store(out + i, tl.where(d > 60.0, o, new), mask=mask)


@triton.jit
def _pool_kernel(values, rows, inverse, offsets, weights, denom, out, n, nbags, dim, HAS_INV: tl.constexpr,
                 HAS_W: tl.constexpr, HAS_DENOM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    # HAS_INV False: rows holds each id's own row
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < dim
    start = tl.load(offsets + b)
    end = tl.load(offsets + b + 1, mask=b + 1 < nbags, other=n)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = j < end
        if HAS_INV:
            row = tl.load(rows + tl.load(inverse + j, mask=jm, other=0), mask=jm, other=0).to(tl.int64)
        else:
            row = tl.load(rows + j, mask=jm, other=0).to(tl.int64)
        v = tl.load(values + row[:, None] * dim + cols[None, :], mask=jm[:, None] & cm[None, :], other=0.0)
        v = v.to(tl.float32)
        if HAS_W:
            v = v * tl.load(weights + j, mask=jm, other=0.0).to(tl.float32)[:, None]
        acc += tl.sum(v, axis=0)
    if HAS_DENOM:
        acc = acc / tl.load(denom + b).to(tl.float32)
    tl.store(out + b.to(tl.int64) * dim + cols, acc.to(out.dtype.element_ty), mask=cm)


@triton.jit
def row_grad_tl(grad, order, starts, bag, weights, u, cols, cm, dim, HAS_BAG: tl.constexpr, HAS_W: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row ``u``'s gradient on columns ``cols`` (float32 ``[BLOCK_D]``): the sum over its ids, as ``row_grad``
    (``HAS_BAG`` False: ``bag[j] == j``). Shared with the fused optimizer update."""
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k0 in range(tl.load(starts + u), tl.load(starts + u + 1), BLOCK_N):
        k = k0 + tl.arange(0, BLOCK_N)
        km = k < tl.load(starts + u + 1)
        j = tl.load(order + k, mask=km, other=0)
        if HAS_BAG:
            g_row = tl.load(bag + j, mask=km, other=0)
        else:
            g_row = j
        g = tl.load(grad + g_row[:, None] * dim + cols[None, :], mask=km[:, None] & cm[None, :], other=0.0)
        w = tl.where(km, 1.0, 0.0)
        if HAS_W:
            w = w * tl.load(weights + j, mask=km, other=0.0).to(tl.float32)
        acc += tl.sum(g.to(tl.float32) * w[:, None], axis=0)
    return acc


@triton.jit
def _row_grad_kernel(grad, order, starts, bag, weights, out, dim, HAS_BAG: tl.constexpr, HAS_W: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    u = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = cols < dim
    acc = row_grad_tl(grad, order, starts, bag, weights, u, cols, cm, dim, HAS_BAG, HAS_W, BLOCK_N, BLOCK_D)
    tl.store(out + u.to(tl.int64) * dim + cols, acc, mask=cm)
