"""Numba kernels for sparse optimizer updates on CPU: the ``optim`` family of :mod:`dynemb.kernels.dispatch`.

The torch path builds a ``[U, D]`` row gradient (a sum-pooling), then gathers values and slots, runs a handful of
elementwise passes and scatters them back: each a trip through memory, and two random accesses per row.
:func:`sparse_update` visits each touched row once: it sums the row's gradient from the pooled gradient into a
``D``-wide buffer, then reads, updates and writes the row's values and slots while they are in cache.

The arithmetic of each kind is its torch ``_update`` (:mod:`dynemb.optim.algorithms`) written out per element, in
float32, in the same order of operations; reductions and ``pow`` may round differently (the tests say where
results are bit-identical and where they are within a tolerance).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .numba_math import fma, prefetch_row

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
    s = [t.numpy() for t in slots] + [_NONE_2D] * (2 - len(slots))
    args = (values.numpy(), s[0], s[1], rows.numpy(), grad.numpy(),
            _NONE_I if order is None else order.numpy(), _NONE_I if starts is None else starts.numpy(),
            _NONE_I if bag is None else bag.numpy(), _NONE_F if weights is None else weights.numpy(), h)
    _KERNELS[kind](*args)


_CHUNK = 32  # rows whose gradients are summed, then applied: the [32, D] buffer stays in L1


@numba.njit(nogil=True, cache=True)
def _gradients(lo, hi, out, grad, order, starts, bag, weights, values, rows, slot1, slot2):
    """Rows ``lo..hi-1``'s gradients into ``out[:hi-lo]``: ``grad[u]``, or the sum over the row's ids (see the
    contract). Each loop is branch-free inside, so that it vectorizes. First it prefetches the rows (values and
    slots) of the *next* chunk, which load while this one is summed and updated."""
    dim = out.shape[1]
    for u in range(hi if lo > 0 else 0, min(hi + (hi - lo), rows.shape[0])):  # the first chunk prefetches itself too
        prefetch_row(values, rows[u])
        if slot1.shape[0] > 0:
            prefetch_row(slot1, rows[u])
        if slot2.shape[0] > 0:
            prefetch_row(slot2, rows[u])
    if order.shape[0] == 0:
        for u in range(lo, hi):
            for d in range(dim):
                out[u - lo, d] = grad[u, d]
        return
    for u in range(lo, hi):
        o = out[u - lo]
        o[:] = 0.0
        for k in range(starts[u], starts[u + 1]):
            j = order[k]
            g = grad[bag[j] if bag.shape[0] > 0 else j]
            if weights.shape[0] > 0:
                w = weights[j]
                for d in range(dim):
                    o[d] = fma(w, g[d], o[d])
            else:
                for d in range(dim):
                    o[d] += g[d]


@numba.njit(nogil=True, cache=True)
def _sgd(values, buf, unused, rows, grad, order, starts, bag, weights, h):
    # Branches sit outside the loops over D, so that each of those loops vectorizes.
    momentum, decay = np.float32(h[1]), np.float32(h[2])
    nesterov, neg_lr = h[3] != 0.0, np.float32(-h[0])
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        _gradients(lo, hi, chunk, grad, order, starts, bag, weights, values, rows, buf, unused)
        for u in range(lo, hi):
            g, v = chunk[u - lo], values[rows[u]]
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


@numba.njit(nogil=True, cache=True)
def _adagrad(values, state, unused, rows, grad, order, starts, bag, weights, h):
    decay, eps, neg_lr = np.float32(h[1]), np.float32(h[2]), np.float32(-h[0])
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        _gradients(lo, hi, chunk, grad, order, starts, bag, weights, values, rows, state, unused)
        for u in range(lo, hi):
            g, v, s = chunk[u - lo], values[rows[u]], state[rows[u]]
            if decay != 0.0:
                for d in range(g.shape[0]):
                    g[d] = fma(decay, v[d], g[d])
            for d in range(g.shape[0]):
                s[d] = fma(g[d], g[d], s[d])  # torch's addcmul_, contracted
                v[d] += (g[d] / (np.sqrt(s[d]) + eps)) * neg_lr


@numba.njit(nogil=True, cache=True)
def _rowwise_adagrad(values, state, unused, rows, grad, order, starts, bag, weights, h):
    decay, eps, neg_lr = np.float32(h[1]), np.float32(h[2]), np.float32(-h[0])
    dim = values.shape[1]
    chunk = np.empty((_CHUNK, dim), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        _gradients(lo, hi, chunk, grad, order, starts, bag, weights, values, rows, state, unused)
        for u in range(lo, hi):
            r = rows[u]
            g, v = chunk[u - lo], values[r]
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


@numba.njit(nogil=True, cache=True)
def _adam(values, exp_avg, exp_avg_sq, rows, grad, order, starts, bag, weights, h):
    one_b1, one_b2 = np.float32(1.0 - h[0]), np.float32(1.0 - h[1])
    eps, neg_step = np.float32(h[2]), np.float32(-h[3])
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        _gradients(lo, hi, chunk, grad, order, starts, bag, weights, values, rows, exp_avg, exp_avg_sq)
        for u in range(lo, hi):
            r = rows[u]
            g, v, m, q = chunk[u - lo], values[r], exp_avg[r], exp_avg_sq[r]
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


@numba.njit(nogil=True, cache=True)
def _ftrl(values, accumulator, linear, rows, grad, order, starts, bag, weights, h):
    lr, power, l1 = np.float32(h[0]), np.float32(h[1]), np.float32(h[2])
    two_l2 = np.float32(2.0 * h[3])
    chunk = np.empty((_CHUNK, values.shape[1]), np.float32)
    for lo in range(0, rows.shape[0], _CHUNK):
        hi = min(lo + _CHUNK, rows.shape[0])
        _gradients(lo, hi, chunk, grad, order, starts, bag, weights, values, rows, accumulator, linear)
        for u in range(lo, hi):
            r = rows[u]
            for d in range(chunk.shape[1]):
                x, w, acc = chunk[u - lo, d], values[r, d], accumulator[r, d]
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
