"""Numba kernel for a tiered table's exchange on CPU: the paired rows of the two tiers swap places in one pass.

:func:`dynemb.table.tier_moves.exchange` pairs each fast row moving down with a slow row moving up. In torch that
takes three passes per column: the slow rows gathered into a temporary, the fast rows copied over them, the
temporary scattered into the fast rows; each pass misses on its random rows again. :func:`swap_rows` reads both
rows of a pair and writes both back, with the rows of a later pair prefetched for writing, so each row's cache
lines are fetched once (the torch path is the reference; the tests run both).
"""

from __future__ import annotations

import numba
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .numba_math import prefetch_row_for_write

__all__ = ["swap_rows"]

_AHEAD = 16  # pairs between a prefetch and the swap (two random rows each)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width integer views


def swap_rows(a: torch.Tensor, a_rows: torch.Tensor, b: torch.Tensor, b_rows: torch.Tensor) -> bool:
    """Swap ``a[a_rows[i]]`` with ``b[b_rows[i]]`` for every ``i`` and return True; or return False, with nothing
    written, where a row is out of range or the tensors are not ones it takes (CPU, one dtype, the same row shape,
    1-D or 2-D, distinct storages, int64 ``[P]`` rows, unique on each side)."""
    if not (a.device.type == b.device.type == "cpu" and a.dtype == b.dtype and a.shape[1:] == b.shape[1:]
            and a.dim() in (1, 2) and a_rows.shape == b_rows.shape and a_rows.dim() == 1
            and a_rows.dtype == b_rows.dtype == torch.int64 and a.shape[0] and b.shape[0]
            and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()):
        return False
    bits = _BITS.get(a.element_size())
    if bits is None or a.is_complex():
        return False
    x, y = a.view(bits).numpy(), b.view(bits).numpy()  # rows move as their bits (numba has no float16/bfloat16)
    if a.dim() == 1:  # one value a row (keys, stamps): as [R, 1], any stride
        x, y = x[:, None], y[:, None]
    return bool(_swap_kernel(x, a_rows.contiguous().numpy(), y, b_rows.contiguous().numpy()))


@numba.njit(nogil=True, cache=True)
def _swap_kernel(a, a_rows, b, b_rows):
    n = a_rows.shape[0]
    for i in range(n):  # all or nothing
        if a_rows[i] < 0 or a_rows[i] >= a.shape[0] or b_rows[i] < 0 or b_rows[i] >= b.shape[0]:
            return False
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row_for_write(a, a_rows[i + _AHEAD])
            prefetch_row_for_write(b, b_rows[i + _AHEAD])
        ra, rb = a_rows[i], b_rows[i]
        for d in range(a.shape[1]):
            t = a[ra, d]
            a[ra, d] = b[rb, d]
            b[rb, d] = t
    return True
