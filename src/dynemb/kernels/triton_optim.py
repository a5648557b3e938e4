"""Triton kernel for sparse optimizer updates: the ``optim`` family of :mod:`dynemb.kernels.dispatch`.

``sparse_update`` is the backward of a pooled lookup fused with the optimizer step: one program per unique row
sums the row's gradient from the pooled output gradient (through ``order``/``starts``/``bag``, as ``row_grad``),
then reads the row's values and slots, applies the optimizer and writes them back, all in registers. No ``[N, D]``
or ``[U, D]`` gradient is built, and the launch needs no host sync. The arithmetic is each optimizer's torch
``_update`` (:mod:`dynemb.optim.algorithms`) per element in float32, with scalars rounded to float32 as torch
rounds Python scalars; sums (the row gradient, RowWiseAdagrad's mean square) run in tile order, so results equal
the torch path within float32 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_device, row_warps
from .triton_pool import row_grad_tl

__all__ = ["sparse_update", "KINDS"]

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
_BLOCK_N = 16
_ARITY = {"sgd": 4, "adagrad": 3, "rowwise_adagrad": 3, "adam": 4, "ftrl": 4}  # hparams per kind (the contract)
_SLOTS = {"adagrad": 1, "rowwise_adagrad": 1, "adam": 2, "ftrl": 2}  # slot tensors per kind; sgd: 0 or 1


def sparse_update(kind: str, hparams: tuple, values: torch.Tensor, slots: tuple, rows: torch.Tensor,
                  grad: torch.Tensor, order: torch.Tensor | None, starts: torch.Tensor | None,
                  bag: torch.Tensor | None, weights: torch.Tensor | None) -> None:
    """Update ``values[rows]`` and ``slots`` in place with each row's gradient: see the contract in
    :mod:`dynemb.kernels.dispatch` (``hparams`` and ``slots`` per ``kind`` are listed there).

    Raises:
        ValueError: ``kind`` is not one of :data:`KINDS`, or ``hparams``/``slots`` do not fit it.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if len(hparams) != _ARITY[kind]:
        raise ValueError(f"hparams for {kind!r} must be {_ARITY[kind]} floats, got {hparams!r}")
    h = [float(x) for x in hparams] + [0.0] * (4 - _ARITY[kind])
    nslots = _SLOTS.get(kind, 1 if h[1] > 0 else 0)  # sgd: a momentum buffer only with momentum
    if len(slots) != nslots:
        raise ValueError(f"slots for {kind!r} with hparams {hparams!r} must be {nslots} tensors, got {len(slots)}")
    weight_decay = {"sgd": h[2], "adagrad": h[1], "rowwise_adagrad": h[1]}.get(kind, 0.0)
    if kind == "adam":  # torch computes 1 - beta in double, then rounds: do the same here
        h[0], h[1] = 1.0 - h[0], 1.0 - h[1]
    check_device(values, rows, grad, order, starts, bag, weights, *slots)
    nrows, dim = rows.numel(), values.shape[1]
    if not nrows or not dim:
        return
    s0 = slots[0] if slots else values  # unused pointers get any tensor of the call
    s1 = slots[1] if len(slots) > 1 else values
    block = triton.next_power_of_2(dim)  # the whole row in one tile: RowWiseAdagrad needs its full sum
    _update_kernel[(nrows,)](
        values, s0, s1, rows, grad, rows if order is None else order, rows if starts is None else starts,
        rows if bag is None else bag, values if weights is None else weights, dim, *h,
        KIND=KINDS.index(kind), HAS_ORDER=order is not None, HAS_BAG=bag is not None, HAS_W=weights is not None,
        HAS_WD=weight_decay != 0, HAS_MOM=kind == "sgd" and nslots == 1, NESTEROV=kind == "sgd" and h[3] != 0,
        BLOCK_N=_BLOCK_N, BLOCK_D=block, num_warps=row_warps(block))


@triton.jit
def _pow(x, p):
    """``x ** p`` for ``x >= 0`` as torch.pow gives it (``0 ** 0 == 1``, ``0 ** p == 0`` for ``p > 0``)."""
    safe = tl.where(x > 0, x, 1.0)
    return tl.where(x > 0, tl.exp2(tl.log2(safe) * p), tl.where(p == 0, 1.0, 0.0))


@triton.jit
def _update_kernel(values, s0, s1, rows, grad, order, starts, bag, weights, dim, h0, h1, h2, h3,
                   KIND: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_BAG: tl.constexpr, HAS_W: tl.constexpr,
                   HAS_WD: tl.constexpr, HAS_MOM: tl.constexpr, NESTEROV: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    u = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cm = cols < dim
    if HAS_ORDER:
        g = row_grad_tl(grad, order, starts, bag, weights, u, cols, cm, dim, HAS_BAG, HAS_W, BLOCK_N, BLOCK_D)
    else:
        g = tl.load(grad + u.to(tl.int64) * dim + cols, mask=cm, other=0.0).to(tl.float32)
    row = tl.load(rows + u).to(tl.int64)
    vp = values + row * dim + cols
    w = tl.load(vp, mask=cm, other=0.0).to(tl.float32)
    sp0 = s0 + row * dim + cols
    sp1 = s1 + row * dim + cols
    if KIND == 0:  # sgd: lr, momentum, weight_decay, nesterov
        if HAS_WD:
            g = g + w * h2
        if HAS_MOM:
            buf = tl.load(sp0, mask=cm, other=0.0) * h1 + g
            tl.store(sp0, buf, mask=cm)
            if NESTEROV:
                g = g + buf * h1
            else:
                g = buf
        w = w + g * -h0
    elif KIND == 1:  # adagrad: clr, weight_decay, eps
        if HAS_WD:
            g = g + w * h1
        state = tl.load(sp0, mask=cm, other=0.0) + g * g
        tl.store(sp0, state, mask=cm)
        w = w + (g / (tl.sqrt(state) + h2)) * -h0
    elif KIND == 2:  # rowwise_adagrad: lr, weight_decay, eps; one accumulator per row
        if HAS_WD:
            g = g + w * h1
        state = tl.load(s0 + row) + tl.sum(tl.where(cm, g * g, 0.0), axis=0) / dim
        tl.store(s0 + row, state)
        w = w + g * ((1.0 / (tl.sqrt(state) + h2)) * -h0)
    elif KIND == 3:  # adam: 1 - beta1, 1 - beta2, eps, step_size (bias-corrected lr)
        m_old = tl.load(sp0, mask=cm, other=0.0)
        v_old = tl.load(sp1, mask=cm, other=0.0)
        m = (g - m_old) * h0 + m_old
        v = (g * g - v_old) * h1 + v_old
        tl.store(sp0, m, mask=cm)
        tl.store(sp1, v, mask=cm)
        w = w + (m / (tl.sqrt(v) + h2)) * -h3
    else:  # ftrl: lr, power (= -learning_rate_power), l1, l2
        acc = tl.load(sp0, mask=cm, other=1.0)
        new_acc = acc + g * g
        sigma = (_pow(new_acc, h1) - _pow(acc, h1)) / h0
        linear = tl.load(sp1, mask=cm, other=0.0) + g - sigma * w
        quadratic = _pow(new_acc, h1) / h0 + 2 * h3
        sign = tl.where(linear > 0, 1.0, tl.where(linear < 0, -1.0, 0.0))
        w = tl.where(tl.abs(linear) > h2, (sign * h2 - linear) / quadratic, 0.0)
        tl.store(sp0, new_acc, mask=cm)
        tl.store(sp1, linear, mask=cm)
    tl.store(vp, w.to(values.dtype.element_ty), mask=cm)
