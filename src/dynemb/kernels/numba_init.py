"""Numba kernels for the built-in initializers on CPU: the ``init`` family of :mod:`dynemb.kernels.dispatch`.

The torch reference (:mod:`dynemb.table.initializers`) hashes ``(seed, key, column)`` with a dozen elementwise
int64 passes over ``[N, D]`` temporaries. :func:`initial_rows` computes each value in registers and writes it once,
with the same bits: the hash is the same splitmix64 on uint64 words and the float arithmetic the same float32
operations in the same order.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .numba_index import _mix64

__all__ = ["initial_rows", "KINDS"]

KINDS = ("uniform", "constant")
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def initial_rows(kind: str, params: tuple, keys: torch.Tensor, seed: int, out: torch.Tensor) -> None:
    """Write the initializer's rows of ``keys [M]`` into ``out [M, D]`` (float32): see the ``initial_rows``
    contract."""
    if kind == "constant":
        out.fill_(params[0])
    elif kind == "uniform":
        low, high = params
        _uniform(keys.contiguous().numpy(), np.int64(seed), np.float32(low), np.float32(high - low), out.numpy())
    else:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


@numba.njit(nogil=True, cache=True)
def _uniform(keys, seed, low, width, out):
    # initializers._unit_uniform, then Uniform: low + (high - low) * u, each op rounded to float32 as torch does.
    salt = np.uint64(_mix64(seed))
    for i in range(keys.shape[0]):
        row = np.uint64(_mix64(np.int64(np.uint64(np.int64(keys[i])) ^ salt)))
        h = row
        for c in range(out.shape[1]):
            # row + (c + 1) * golden mod 2**64 as an induction: AVX2 has no 64-bit multiply, and its emulation
            # was a third of the loop (1.2x faster, same bits)
            h += _GOLDEN
            bits = np.uint64(_mix64(np.int64(h)))
            u = (np.float32((bits >> np.uint64(40)) & np.uint64(0xFFFFFF)) + np.float32(0.5)) * np.float32(2.0**-24)
            out[i, c] = low + width * u
