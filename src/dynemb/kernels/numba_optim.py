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


@numba.njit(inline="always")
def _row_gradient(u, acc, grad, order, starts, bag, weights):
    """Row ``u``'s gradient into ``acc``: ``grad[u]``, or the sum over its ids (see the contract)."""
    dim = acc.shape[0]
    if order.shape[0] == 0:
        for d in range(dim):
            acc[d] = grad[u, d]
        return
    acc[:] = 0.0
    weighted = weights.shape[0] > 0
    for k in range(starts[u], starts[u + 1]):
        j = order[k]
        b = bag[j] if bag.shape[0] > 0 else j
        if weighted:
            w = weights[j]
            for d in range(dim):
                acc[d] += w * grad[b, d]
        else:
            for d in range(dim):
                acc[d] += grad[b, d]


@numba.njit(nogil=True, cache=True)
def _sgd(values, buf, unused, rows, grad, order, starts, bag, weights, h):
    momentum, decay = np.float32(h[1]), np.float32(h[2])
    nesterov, neg_lr = h[3] != 0.0, np.float32(-h[0])
    g = np.empty(values.shape[1], np.float32)
    for u in range(rows.shape[0]):
        _row_gradient(u, g, grad, order, starts, bag, weights)
        r = rows[u]
        for d in range(g.shape[0]):
            x = g[d]
            if decay != 0.0:
                x = x + decay * values[r, d]
            if momentum != 0.0:
                m = buf[r, d] * momentum + x
                buf[r, d] = m
                x = x + momentum * m if nesterov else m
            values[r, d] += x * neg_lr


@numba.njit(nogil=True, cache=True)
def _adagrad(values, state, unused, rows, grad, order, starts, bag, weights, h):
    decay, eps, neg_lr = np.float32(h[1]), np.float32(h[2]), np.float32(-h[0])
    g = np.empty(values.shape[1], np.float32)
    for u in range(rows.shape[0]):
        _row_gradient(u, g, grad, order, starts, bag, weights)
        r = rows[u]
        for d in range(g.shape[0]):
            x = g[d]
            if decay != 0.0:
                x = x + decay * values[r, d]
            s = state[r, d] + x * x
            state[r, d] = s
            values[r, d] += (x / (np.sqrt(s) + eps)) * neg_lr


@numba.njit(nogil=True, cache=True)
def _rowwise_adagrad(values, state, unused, rows, grad, order, starts, bag, weights, h):
    decay, eps, neg_lr = np.float32(h[1]), np.float32(h[2]), np.float32(-h[0])
    dim = values.shape[1]
    g = np.empty(dim, np.float32)
    for u in range(rows.shape[0]):
        _row_gradient(u, g, grad, order, starts, bag, weights)
        r = rows[u]
        square = np.float32(0.0)
        for d in range(dim):
            if decay != 0.0:
                g[d] = g[d] + decay * values[r, d]
            square += g[d] * g[d]
        norm = np.sqrt(square)  # as the reference: ||g||, squared, over D
        s = state[r, 0] + (norm * norm) / np.float32(dim)
        state[r, 0] = s
        scale = (np.float32(1.0) / (np.sqrt(s) + eps)) * neg_lr
        for d in range(dim):
            values[r, d] += g[d] * scale


@numba.njit(nogil=True, cache=True)
def _adam(values, exp_avg, exp_avg_sq, rows, grad, order, starts, bag, weights, h):
    one_b1, one_b2 = np.float32(1.0 - h[0]), np.float32(1.0 - h[1])
    eps, neg_step = np.float32(h[2]), np.float32(-h[3])
    g = np.empty(values.shape[1], np.float32)
    for u in range(rows.shape[0]):
        _row_gradient(u, g, grad, order, starts, bag, weights)
        r = rows[u]
        for d in range(g.shape[0]):
            x = g[d]
            m0, v0 = exp_avg[r, d], exp_avg_sq[r, d]
            m = (x - m0) * one_b1 + m0
            v = (x * x - v0) * one_b2 + v0
            exp_avg[r, d] = m
            exp_avg_sq[r, d] = v
            values[r, d] += (m / (np.sqrt(v) + eps)) * neg_step


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
    g = np.empty(values.shape[1], np.float32)
    for u in range(rows.shape[0]):
        _row_gradient(u, g, grad, order, starts, bag, weights)
        r = rows[u]
        for d in range(g.shape[0]):
            x, w, acc = g[d], values[r, d], accumulator[r, d]
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
