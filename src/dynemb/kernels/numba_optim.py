"""Numba kernels for sparse optimizer updates on CPU: the ``optim`` family of :mod:`dynemb.kernels.dispatch`.

The torch path builds a ``[U, D]`` row gradient (a sum-pooling), then gathers values and slots, runs a handful of
elementwise passes and scatters them back: each a trip through memory, and two random accesses per row.
:func:`sparse_update` visits each touched row once: it sums the row's gradient from the pooled gradient into a
``D``-wide buffer, then reads, updates and writes the row's values and slots while they are in cache.

The arithmetic of each kind is its torch ``_update`` (:mod:`dynemb.optim.algorithms`) written out per element, in
float32, in the same order of operations; reductions and ``pow`` may round differently (the tests say where
results are bit-identical and where they are within a tolerance).

Every kernel compiles with numpy's error model: a float division by zero gives inf or NaN, as torch does, where
Python's model raises ZeroDivisionError (inside a backward). Without that check per division LLVM also vectorizes
the divisions and square roots: updates of 3.7k rows, same bits, Adagrad 2.1x (D=16) and 2.9x (D=64) faster, Adam
1.8-1.9x, FTRL 1.7-2.2x (each kernel against its Python-model build, in one process).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .numba_math import fma, prefetch_row_for_write
from .numba_pool import block_width, grouped_bags, sum_rows

__all__ = ["sparse_update", "KINDS"]

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
_NONE_F = np.empty(0, np.float32)
_NONE_I = np.empty(0, np.int64)
_NONE_2D = np.empty((0, 0), np.float32)


def sparse_update(kind: str, hparams: tuple, values: torch.Tensor, slots: tuple, rows: torch.Tensor,
                  grad: torch.Tensor, order: torch.Tensor | None, starts: torch.Tensor | None,
                  bag: torch.Tensor | None, weights: torch.Tensor | None) -> None:
    """Update ``values[rows]`` and ``slots`` in place: see the ``sparse_update`` contract."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    h = np.asarray(hparams, dtype=np.float64)
    if order is None and _mutates_gradient(kind, h):  # the kernel works on the given rows in place then
        grad = grad.clone()
    s = [t.numpy() for t in slots] + [_NONE_2D] * (2 - len(slots))
    bags, grouped = _NONE_I, _NONE_F
    if order is not None:
        bags, grouped = grouped_bags(order, bag, weights, grad.shape[0])
    args = (values.numpy(), s[0], s[1], rows.numpy(), grad.contiguous().numpy(),
            _NONE_I if starts is None else starts.numpy(), bags, grouped, h, block_width(values.shape[1]))
    _KERNELS[kind](*args)


def _mutates_gradient(kind: str, h: np.ndarray) -> bool:
    """Whether the kernel of ``kind`` rewrites a row's gradient (weight decay, momentum) before it applies it."""
    if kind == "sgd":
        return bool(h[1] or h[2])
    return kind in ("adagrad", "rowwise_adagrad") and bool(h[1])


_CHUNK = 64  # rows whose gradients are summed, then applied: the [64, D] buffer stays in L1 (16 KB at D=64)
# Rows between a row's prefetch and its update: about one chunk, so that a chunk's rows load while the previous
# chunk is summed and applied. Measured (RowWiseAdagrad, 78k random rows of 1M, D=64, cold caches): 64 rows ahead
# take 0.85x the time of 8. Kernels that touch three D-wide rows per row (Adam, FTRL; Adagrad and SGD with momentum
# two) prefetch 16 ahead: 64 rows of three arrays overflow L1 (Adam ran 5% slower at 64). Each kernel writes its
# prefetch out in its own loop: the same code in a numba ``inline="always"`` helper ran 2-3x slower.
_AHEAD = 64
_AHEAD_WIDE = 16


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _sgd_plain(values, rows, grad, starts, bags, weights, neg_lr, width):
    # SGD without momentum or weight decay (the common case) in a loop of its own: in the general loop below, with
    # its branches and writes to the gradient, the same arithmetic ran 1.3-1.6x slower (78k random rows of 1M).
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        rows_grad = sum_rows(lo, hi, chunk, grad, starts, bags, weights, width)
        for u in range(lo, hi):
            if u + _AHEAD < rows.shape[0]:  # start loading a later row now (see _AHEAD)
                prefetch_row_for_write(values, rows[u + _AHEAD])
            g, v = rows_grad[u - lo], values[rows[u]]
            for d in range(g.shape[0]):
                v[d] += g[d] * neg_lr


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _sgd(values, buf, unused, rows, grad, starts, bags, weights, h, width):
    # Branches sit outside the loops over D, so that each of those loops vectorizes.
    momentum, decay = np.float32(h[1]), np.float32(h[2])
    nesterov, neg_lr = h[3] != 0.0, np.float32(-h[0])
    if momentum == 0.0 and decay == 0.0:
        _sgd_plain(values, rows, grad, starts, bags, weights, neg_lr, width)
        return
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    far = _AHEAD if buf.shape[0] == 0 else _AHEAD_WIDE
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        rows_grad = sum_rows(lo, hi, chunk, grad, starts, bags, weights, width)
        for u in range(lo, hi):
            if u + far < rows.shape[0]:  # start loading a later row now (see _AHEAD)
                ahead = rows[u + far]
                prefetch_row_for_write(values, ahead)
                if buf.shape[0] > 0:
                    prefetch_row_for_write(buf, ahead)
            g, v = rows_grad[u - lo], values[rows[u]]
            if decay != 0.0:
                for d in range(g.shape[0]):
                    g[d] = fma(decay, v[d], g[d])
            if momentum != 0.0:
                m = buf[rows[u]]
                for d in range(g.shape[0]):
                    m[d] = m[d] * momentum + g[d]
                for d in range(g.shape[0]):
                    g[d] = fma(momentum, m[d], g[d]) if nesterov else m[d]
            for d in range(g.shape[0]):
                v[d] += g[d] * neg_lr


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _adagrad(values, state, unused, rows, grad, starts, bags, weights, h, width):
    decay, eps, neg_lr = np.float32(h[1]), np.float32(h[2]), np.float32(-h[0])
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        rows_grad = sum_rows(lo, hi, chunk, grad, starts, bags, weights, width)
        for u in range(lo, hi):
            if u + _AHEAD_WIDE < rows.shape[0]:  # start loading a later row now (see _AHEAD)
                ahead = rows[u + _AHEAD_WIDE]
                prefetch_row_for_write(values, ahead)
                prefetch_row_for_write(state, ahead)
            g, v, s = rows_grad[u - lo], values[rows[u]], state[rows[u]]
            if decay != 0.0:
                for d in range(g.shape[0]):
                    g[d] = fma(decay, v[d], g[d])
            for d in range(g.shape[0]):
                s[d] = fma(g[d], g[d], s[d])  # torch's addcmul_, contracted
                v[d] += (g[d] / (np.sqrt(s[d]) + eps)) * neg_lr


# Reassociation over the whole kernel, not only in a called helper: LLVM then sums the row norm in vector lanes
# inline (measured 0.73x the time of the helper version, 78k random rows of 1M, D=64). The per-element update has
# no reduction, and without ``contract`` nothing is fused into an FMA, so only the norm's rounding changes.
@numba.njit(nogil=True, cache=True, fastmath={"reassoc", "nsz"}, error_model="numpy")
def _rowwise_adagrad(values, state, unused, rows, grad, starts, bags, weights, h, width):
    decay, eps, neg_lr = np.float32(h[1]), np.float32(h[2]), np.float32(-h[0])
    dim = values.shape[1]
    chunk = np.empty((_CHUNK, dim), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        rows_grad = sum_rows(lo, hi, chunk, grad, starts, bags, weights, width)
        for u in range(lo, hi):
            if u + _AHEAD < rows.shape[0]:  # start loading a later row now (see _AHEAD)
                ahead = rows[u + _AHEAD]
                prefetch_row_for_write(values, ahead)
                prefetch_row_for_write(state, ahead)
            r = rows[u]
            g, v = rows_grad[u - lo], values[r]
            if decay != 0.0:
                for d in range(dim):
                    g[d] = fma(decay, v[d], g[d])
            square = np.float32(0.0)
            for d in range(dim):
                square += g[d] * g[d]
            norm = np.sqrt(square)  # as the reference: ||g||, squared, over D
            s = state[r, 0] + (norm * norm) / np.float32(dim)
            state[r, 0] = s
            scale = (np.float32(1.0) / (np.sqrt(s) + eps)) * neg_lr
            for d in range(dim):
                v[d] += g[d] * scale


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _adam(values, exp_avg, exp_avg_sq, rows, grad, starts, bags, weights, h, width):
    one_b1, one_b2 = np.float32(1.0 - h[0]), np.float32(1.0 - h[1])
    eps, neg_step = np.float32(h[2]), np.float32(-h[3])
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        rows_grad = sum_rows(lo, hi, chunk, grad, starts, bags, weights, width)
        for u in range(lo, hi):
            if u + _AHEAD_WIDE < rows.shape[0]:  # start loading a later row now (see _AHEAD)
                ahead = rows[u + _AHEAD_WIDE]
                prefetch_row_for_write(values, ahead)
                prefetch_row_for_write(exp_avg, ahead)
                prefetch_row_for_write(exp_avg_sq, ahead)
            r = rows[u]
            g, v, m, q = rows_grad[u - lo], values[r], exp_avg[r], exp_avg_sq[r]
            for d in range(g.shape[0]):
                m[d] = (g[d] - m[d]) * one_b1 + m[d]
                q[d] = (g[d] * g[d] - q[d]) * one_b2 + q[d]
                v[d] += (m[d] / (np.sqrt(q[d]) + eps)) * neg_step


@numba.njit(inline="always")
def _pow(x, power):
    # torch's pow with a scalar exponent takes these shortcuts; the general case may round differently
    if power == 0.5:
        return np.sqrt(x)
    if power == 1.0:
        return x
    return x ** power


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _ftrl(values, accumulator, linear, rows, grad, starts, bags, weights, h, width):
    lr, power, l1 = np.float32(h[0]), np.float32(h[1]), np.float32(h[2])
    two_l2 = np.float32(2.0 * h[3])
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        rows_grad = sum_rows(lo, hi, chunk, grad, starts, bags, weights, width)
        for u in range(lo, hi):
            if u + _AHEAD_WIDE < rows.shape[0]:  # start loading a later row now (see _AHEAD)
                ahead = rows[u + _AHEAD_WIDE]
                prefetch_row_for_write(values, ahead)
                prefetch_row_for_write(accumulator, ahead)
                prefetch_row_for_write(linear, ahead)
            r = rows[u]
            for d in range(rows_grad.shape[1]):
                x, w, acc = rows_grad[u - lo, d], values[r, d], accumulator[r, d]
                new_acc = acc + x * x
                new_pow = _pow(new_acc, power)
                sigma = (new_pow - _pow(acc, power)) / lr
                lin = (linear[r, d] + x) - sigma * w
                quadratic = new_pow / lr + two_l2
                accumulator[r, d] = new_acc
                linear[r, d] = lin
                if abs(lin) > l1:
                    sign = np.float32(1.0) if lin > 0 else (np.float32(-1.0) if lin < 0 else np.float32(0.0))
                    values[r, d] = (sign * l1 - lin) / quadratic
                else:
                    values[r, d] = 0.0


_KERNELS = {"sgd": _sgd, "adagrad": _adagrad, "rowwise_adagrad": _rowwise_adagrad, "adam": _adam, "ftrl": _ftrl}
