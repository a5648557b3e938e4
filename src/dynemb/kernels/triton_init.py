"""Triton kernel for the built-in counter-based initializers: the ``init`` family of
:mod:`dynemb.kernels.dispatch`.

A new row's value is a pure function of ``(seed, key, column)`` (:mod:`dynemb.table.initializers`), so the kernel
computes it where it is stored: no ``[M, D]`` temporary and no host sync. The bits equal the torch path's: the
hashes are the same uint64 (row) and uint32 (value) arithmetic, and ``low + (high - low) * u`` runs as two float32
roundings (the launch turns off fused multiply-add, which torch's two separate ops never use).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import block_d, check_device, init_args, init_values_tl, round_to, seed_mix

__all__ = ["initial_rows"]

_BLOCK = 32  # keys per program


def initial_rows(kind: str, params: tuple, keys: torch.Tensor, seed: int, out: torch.Tensor) -> None:
    """Write into ``out [M, D]`` the rows ``Initializer(keys, D, out.dtype, seed)`` returns for ``[M]`` keys, bit
    for bit; ``(kind, params)`` is the initializer's ``kernel_spec()``: ``("uniform", (low, high))`` or
    ``("constant", (value,))``. ``out`` may be a row slice of a table's values (its rows must be contiguous).

    Raises:
        ValueError: an unknown ``kind``, or ``out`` not ``[M, D]`` with dense rows.
    """
    code, p0, p1 = init_args((kind, tuple(params)), out.dtype)
    if out.dim() != 2 or out.shape[0] != keys.numel() or (out.numel() and out.stride(1) != 1):
        raise ValueError(f"out must be [{keys.numel()}, D] with dense rows, got shape {tuple(out.shape)} strides "
                         f"{out.stride()}")
    keys = keys.contiguous()
    check_device(keys)
    if out.device != keys.device:
        raise ValueError(f"out must be on the keys' device {keys.device}, got {out.device}")
    m, dim = out.shape
    if m and dim:
        bd = block_d(dim)
        _init_kernel[(triton.cdiv(m, _BLOCK), triton.cdiv(dim, bd))](
            keys, out, m, dim, out.stride(0), seed_mix(seed), p0, p1, INIT=code, BLOCK=_BLOCK, BLOCK_D=bd,
            enable_fp_fusion=False)


@triton.jit
def _init_kernel(keys, out, m, dim, stride, seed_mixed, p0, p1, INIT: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    live = offs < m
    key = tl.load(keys + offs, mask=live, other=0)
    v = init_values_tl(key, cols.to(tl.int64), seed_mixed, p0, p1, INIT)
    tl.store(out + offs[:, None] * stride + cols[None, :], round_to(v, out.dtype.element_ty),
             mask=live[:, None] & (cols[None, :] < dim))
