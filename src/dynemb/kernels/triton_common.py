"""Shared pieces of the Triton kernels: the key hash, the counter-based uniform, launch sizes.

Imported only by the other ``triton_*`` modules, which :mod:`dynemb.kernels.dispatch` imports on first use: the
package itself imports without triton. Kernels take CUDA tensors; on CPU tensors they run only under Triton's
interpreter (``TRITON_INTERPRET=1``, read by triton itself when it is imported), which the tests use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mix64_tl", "unit_uniform_tl", "init_values_tl", "round_to", "init_args", "seed_mix", "check_device",
           "block_d", "row_warps", "KEY_BLOCK", "INIT_KINDS"]

INIT_KINDS = {"uniform": 1, "constant": 2}  # Initializer.kernel_spec() kinds -> the INIT code of the kernels
_MASK64 = (1 << 64) - 1
KEY_BLOCK = 128  # keys per program of the index kernels: 128 x 8 slot tiles fill a CTA's registers on an H100


@triton.jit
def mix64_tl(x):
    """:func:`dynemb.table.hashing.mix64` (splitmix64's finalizer) on int64 lanes, in uint64 arithmetic."""
    x = x.to(tl.uint64, bitcast=True)
    x ^= x >> 30
    x *= 0xBF58476D1CE4E5B9
    x ^= x >> 27
    x *= 0x94D049BB133111EB
    x ^= x >> 31
    return x.to(tl.int64, bitcast=True)


@triton.jit
def unit_uniform_tl(keys, cols, seed_mixed):
    """``[K] keys x [C] int64 columns (0-based) -> [K, C]`` float32 in (0, 1): the bits of
    :func:`dynemb.table.initializers._unit_uniform` (``seed_mixed`` is :func:`seed_mix` of the seed): a value's
    hash in uint32 lanes, which GPUs multiply natively (a uint64 multiply is several instructions)."""
    row = mix64_tl(keys.to(tl.int64) ^ seed_mixed).to(tl.uint64, bitcast=True)
    lo = (row & 0xFFFFFFFF).to(tl.uint32)
    hi = (row >> 32).to(tl.uint32)
    step = (cols + 1).to(tl.uint32) * tl.full([1], 0x9E3779B9, tl.uint32)
    x = (lo[:, None] + step[None, :]) ^ hi[:, None]
    x ^= x >> 16
    x *= tl.full([1], 0x7FEB352D, tl.uint32)
    x ^= x >> 15
    x *= tl.full([1], 0x846CA68B, tl.uint32)
    x ^= x >> 16
    return ((x >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24, exact


@triton.jit
def init_values_tl(keys, cols, seed_mixed, p0, p1, INIT: tl.constexpr):
    """``[K, C]`` float32 initializer values (see :func:`init_args` for ``p0, p1``); launch with
    ``enable_fp_fusion=False`` so that ``p0 + u * p1`` rounds twice, as torch's two ops do."""
    if INIT == 1:
        return p0 + unit_uniform_tl(keys, cols, seed_mixed) * p1
    else:
        return tl.zeros([keys.shape[0], cols.shape[0]], tl.float32) + p0


@triton.jit
def round_to(v, dtype: tl.constexpr):
    """float32 ``v`` rounded to ``dtype`` to nearest-even, as torch's ``.to(dtype)``. bfloat16 is rounded by hand:
    Triton's interpreter truncates it (finite values only: initializer rows are)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


def init_args(init: tuple[str, tuple] | None, dtype: torch.dtype, name: str = "kind") -> tuple[int, float, float]:
    """``(INIT, p0, p1)`` kernel arguments: uniform passes ``low, high - low`` (rounded to float32 in the kernel,
    as torch rounds its Python scalars), constant passes its value already rounded to ``dtype``."""
    if init is None:
        return 0, 0.0, 0.0
    if init[0] not in INIT_KINDS:
        raise ValueError(f"{name} must be one of {tuple(INIT_KINDS)} (an Initializer.kernel_spec()), got {init!r}")
    if init[0] == "uniform":
        low, high = init[1]
        return 1, float(low), float(high - low)
    return 2, float(torch.tensor(init[1][0], dtype=dtype).float()), 0.0


def seed_mix(seed: int) -> int:
    """``mix64(seed)`` (:func:`dynemb.table.hashing.mix64` of an int64) as a Python int, a kernel argument: the
    per-table half of the initializer's counter. Plain integer arithmetic: kernels sit below the table layer."""
    x = seed & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x - (1 << 64) if x >> 63 else x


def check_device(*tensors: torch.Tensor) -> None:
    """Triton kernels need their tensors on one device and contiguous; say which argument is not."""
    device = tensors[0].device
    for i, t in enumerate(tensors):
        if t is not None and (t.device != device or not t.is_contiguous()):
            raise ValueError(f"triton kernel argument {i} must be contiguous on {device}, got {t.device} "
                             f"contiguous={t.is_contiguous()}")


def row_warps(block: int) -> int:
    """Warps for a program that works on ``[*, block]`` row tiles: 4 warps (128 lanes) would idle on short rows."""
    return 2 if block <= 128 else 4


def block_d(dim: int) -> int:
    """Columns per program: the whole row up to 256 (one pass), else 256-wide column blocks."""
    return min(triton.next_power_of_2(max(dim, 1)), 256)
