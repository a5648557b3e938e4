"""One numba call that reads the rows of keys from several hash tables (the parameter server's in-process store).

Each table keeps its own index and rows; the kernel views them at the addresses a row of ``meta`` holds (the way
:mod:`~dynemb.kernels.numba_group` does) and runs the table's own index probe
(:func:`~dynemb.kernels.numba_index._probe_kernel`) on its run of keys, then copies the rows found. A request that
misses in a few keys of each of 26 tables thus costs one call, not 26 (tens of microseconds of Python each).
Results are the per-table ``find_all`` and ``index_select``'s, bit for bit (rows are copied as integer words).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .numba_group import _pointer
from .numba_index import _probe_kernel

__all__ = ["META", "find_rows"]

META = ("buckets", "overflow", "shift", "num_buckets", "values", "capacity", "key_cols")
"""The columns of a table's row of ``meta`` (int64): its index's buckets and overflow flags (addresses), hash
shift, bucket count and key columns, its rows' address and capacity (rows)."""
_BUCKETS, _OVERFLOW, _SHIFT, _NB, _VALUES, _CAPACITY, _KEY_COLS = range(len(META))
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # rows are copied as words of this size
_BOOL = np.empty(0, np.bool_)


def find_rows(meta: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of int64 ``keys [N]`` (table ``t``'s from ``starts[t]`` to ``starts[t + 1]``, ``starts [T + 1]``) into
    ``out [N, D]`` (zeros where absent), the tables' ``meta [T, len(META)]`` rows given; returns ``found [N]``
    bool. Every table's rows are ``[capacity, D]`` of ``out``'s dtype."""
    words = out.view(_WORDS[out.element_size()])
    found = np.empty(keys.shape[0], np.bool_)
    _find_rows_kernel(meta.numpy(), keys.contiguous().numpy(), starts.numpy(), words.numpy(), found)
    return torch.from_numpy(found)


@numba.njit(nogil=True, cache=True)
def _find_rows_kernel(meta, keys, starts, out, found):
    rows = np.empty(keys.shape[0], np.int64)
    width = out.shape[1]
    for t in range(meta.shape[0]):
        lo, hi = starts[t], starts[t + 1]
        if hi == lo:
            continue
        m = meta[t]
        nb = m[_NB]
        table = numba.carray(_pointer(m[_BUCKETS], keys), (nb, 64 // keys.itemsize))
        overflow = numba.carray(_pointer(m[_OVERFLOW], _BOOL), (nb,))
        _probe_kernel(table, m[_KEY_COLS], overflow, keys[lo:hi], m[_SHIFT], np.empty(0, np.int64), rows[lo:hi])
        values = numba.carray(_pointer(m[_VALUES], out), (m[_CAPACITY], width))
        for j in range(lo, hi):
            r = rows[j]
            found[j] = r >= 0
            if r >= 0:
                out[j, :] = values[r, :]
            else:
                out[j, :] = 0
