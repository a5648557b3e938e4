"""Numba kernels for the built-in initializers on CPU: the ``init`` family of :mod:`dynemb.kernels.dispatch`.

The torch reference (:mod:`dynemb.table.initializers`) hashes ``(seed, key, column)`` with a dozen elementwise
int64 passes over ``[N, D]`` temporaries. :func:`initial_rows` computes each value in registers and writes it once,
with the same bits: the same splitmix64 of the row and 32-bit hash of each value (``numba_math.cell_bits``, 8 lanes
a vector), and the same float32 operations in the same order.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .numba_index import _mix64
from .numba_math import cell_bits

__all__ = ["initial_rows", "uniform_salted", "KINDS"]

KINDS = ("uniform", "constant")


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
    uniform_salted(keys, np.int64(_mix64(seed)), low, width, out)


@numba.njit(nogil=True, cache=True)
def uniform_salted(keys, salt, low, width, out):
    """:func:`initial_rows`' uniform rows of ``keys`` into ``out``, the seed given mixed (``salt``: ``mix64(seed)``,
    as the group kernels keep it)."""
    salt = np.uint64(salt)
    for i in range(keys.shape[0]):
        row = np.uint64(_mix64(np.int64(np.uint64(np.int64(keys[i])) ^ salt)))
        for c in range(out.shape[1]):
            u = (np.float32(cell_bits(row, c)) + np.float32(0.5)) * np.float32(2.0**-24)
            out[i, c] = low + width * u
