"""Numba kernel for 8-bit serving rows (``dynemb.checkpoint.row_codec``): packed rows to float32 in one pass.

The torch reference decodes in several passes (a copy of the codes, a cast, a multiply, an add); casting float8 to
float32 is slow on CPUs without a native path (E4M3: about 1 us for 64 values). Here each code goes through a
256-entry table of its float32 value (``q + 128`` for int8, the float8 value itself, built by torch's own cast, so
exact), then ``* scale`` (``+ bias``): the same float32 operations in the same order, so the same bits.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)

__all__ = ["decode"]


@numba.njit(nogil=True, cache=True)
def _decode_kernel(raw, dim, lut, params, with_bias, out):
    for i in range(raw.shape[0]):
        scale = params[i, 0]
        if with_bias:
            bias = params[i, 1]
            for j in range(dim):
                out[i, j] = lut[raw[i, j]] * scale + bias
        else:
            for j in range(dim):
                out[i, j] = lut[raw[i, j]] * scale


def decode(raw: torch.Tensor, dim: int, lut: torch.Tensor, params: torch.Tensor, with_bias: bool) -> torch.Tensor:
    """``float32 [N, dim]`` of packed CPU rows ``raw`` (``uint8 [N, W]``), ``lut`` (``float32 [256]``: each code's
    value) and ``params`` (``float32 [N, 1 or 2]``: scale, bias)."""
    out = np.empty((raw.shape[0], dim), np.float32)
    _decode_kernel(raw.numpy(), dim, lut.numpy(), params.numpy(), with_bias, out)
    return torch.from_numpy(out)
