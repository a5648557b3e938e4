"""Numba kernel for a tiered table's exchange on CPU: the paired rows of the two tiers swap places in one pass.

:func:`dynemb.table.tier_moves.exchange` pairs each fast row moving down with a slow row moving up. In torch that
takes three passes per column: the slow rows gathered into a temporary, the fast rows copied over them, the
temporary scattered into the fast rows; each pass misses on its random rows again. :func:`swap_rows` reads both
rows of a pair and writes both back, with the rows of a later pair prefetched for writing, so each row's cache
lines are fetched once (the torch path is the reference; the tests run both).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .numba_math import prefetch_row, prefetch_row_for_write, rows_within

__all__ = ["exchange_with_file", "gather_raw", "rows_from_raw", "rows_to_raw", "swap_rows", "swap_with_raw", "words"]

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
    if not (rows_within(a_rows, n, a.shape[0]) and rows_within(b_rows, n, b.shape[0])):  # all or nothing
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


def words(t: torch.Tensor):
    """``t`` (CPU, ``[R, ...]`` whose rows are dense, any row stride) as ``[R, W]`` int32 words sharing its memory,
    or None where its rows are not whole, aligned words (a view, never a copy: writes must land in ``t``)."""
    if t.device.type != "cpu" or t.shape[0] == 0 or t.is_conj() or t.is_neg() or t.element_size() not in (1, 2, 4, 8):
        return None
    size = t.element_size()
    try:
        rows = t.view(t.shape[0], -1)  # a view or an error, never a copy
    except RuntimeError:
        return None
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        return None
    if (rows.shape[1] * size) % 4 or (rows.stride(0) * size) % 4 or rows.data_ptr() % 4:
        return None
    return rows.view(_BITS[size]).numpy().view(np.int32)  # as bits: numpy has no bfloat16


def gather_raw(raw: torch.Tensor, rows: torch.Tensor) -> torch.Tensor | None:
    """``raw[rows]`` for raw rows ``[N, width]`` (uint8, dense, width a multiple of 8), rows prefetched ahead (a
    file's random rows); None where ``raw`` is not such rows or a row is out of range."""
    if raw.dim() != 2 or raw.shape[1] % 8 or not raw.is_contiguous() or raw.data_ptr() % 8 or raw.shape[0] == 0:
        return None
    out = torch.empty((rows.numel(), raw.shape[1]), dtype=torch.uint8)
    if rows.numel() and not _gather_raw_kernel(raw.view(torch.int64).numpy(), rows.contiguous().numpy(),
                                               out.view(torch.int64).numpy()):
        return None
    return out


@numba.njit(nogil=True, cache=True)
def _gather_raw_kernel(raw, rows, out):
    n, w = rows.shape[0], raw.shape[1]
    if not rows_within(rows, n, raw.shape[0]):
        return False
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row(raw, rows[i + _AHEAD])
        r = rows[i]
        for d in range(w):
            out[i, d] = raw[r, d]
    return True


def rows_to_raw(raw: torch.Tensor, offset: int, col: torch.Tensor, rows: torch.Tensor) -> bool:
    """Row ``i`` of ``raw`` (``[N, width]`` uint8, dense), bytes ``offset ..``, from ``col[rows[i]]``; True, or
    False with nothing written where the layout is not whole words or a row is out of range (no rows: True)."""
    if rows.numel() == 0:
        return True
    w, c = words(raw), words(col)
    if w is None or c is None or offset % 4 or rows.numel() > raw.shape[0]:
        return False
    return bool(_to_raw_kernel(w, offset // 4, c, rows.contiguous().numpy()))


def rows_from_raw(col: torch.Tensor, rows: torch.Tensor, raw: torch.Tensor, raw_rows: torch.Tensor,
                  offset: int) -> bool:
    """``col[rows[i]]`` from row ``raw_rows[i]`` of ``raw`` (``[N, width]`` uint8), bytes ``offset ..``; True, or
    False with nothing written where the layout is not whole words or a row is out of range (no rows: True)."""
    if rows.numel() == 0:
        return True
    w, c = words(raw), words(col)
    if w is None or c is None or offset % 4 or rows.shape != raw_rows.shape:
        return False
    return bool(_from_raw_kernel(c, rows.contiguous().numpy(), w, raw_rows.contiguous().numpy(), offset // 4))


@numba.njit(nogil=True, cache=True)
def _to_raw_kernel(raw, off, col, rows):
    n, w = rows.shape[0], col.shape[1]
    if off + w > raw.shape[1]:
        return False
    if not rows_within(rows, n, col.shape[0]):
        return False
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row_for_write(col, rows[i + _AHEAD])
        r = rows[i]
        for d in range(w):
            raw[i, off + d] = col[r, d]
    return True


@numba.njit(nogil=True, cache=True)
def _from_raw_kernel(col, rows, raw, raw_rows, off):
    n, w = rows.shape[0], col.shape[1]
    if off + w > raw.shape[1]:
        return False
    if not (rows_within(rows, n, col.shape[0]) and rows_within(raw_rows, n, raw.shape[0])):
        return False
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row_for_write(col, rows[i + _AHEAD])
            prefetch_row(raw, raw_rows[i + _AHEAD])
        r, s = rows[i], raw_rows[i]
        for d in range(w):
            col[r, d] = raw[s, off + d]
    return True


def swap_with_raw(col: torch.Tensor, rows: torch.Tensor, down: torch.Tensor, up: torch.Tensor, offset: int) -> bool:
    """For each ``i``: row ``i`` of ``down`` (bytes ``offset ..``) gets ``col[rows[i]]``, then ``col[rows[i]]`` gets
    row ``i`` of ``up`` (``down``, ``up``: ``[>= len(rows), width]`` uint8, dense). One pass over the random rows of
    ``col`` where :func:`rows_to_raw` then :func:`rows_from_raw` make two. True, or False with nothing written where
    the layout is not whole words or a row is out of range (no rows: True)."""
    if rows.numel() == 0:
        return True
    c, d, u = words(col), words(down), words(up)
    if c is None or d is None or u is None or offset % 4 or rows.numel() > min(down.shape[0], up.shape[0]):
        return False
    return bool(_swap_raw_kernel(c, rows.contiguous().numpy(), d, u, offset // 4))


@numba.njit(nogil=True, cache=True)
def _swap_raw_kernel(col, rows, down, up, off):
    n, w = rows.shape[0], col.shape[1]
    if off + w > down.shape[1] or off + w > up.shape[1]:
        return False
    if not rows_within(rows, n, col.shape[0]):
        return False
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row_for_write(col, rows[i + _AHEAD])
        r = rows[i]
        for j in range(w):
            down[i, off + j] = col[r, j]
            col[r, j] = up[i, off + j]
    return True


def exchange_with_file(cols: list, offsets: list, victims: torch.Tensor, down: torch.Tensor, file: torch.Tensor,
                       up_at: torch.Tensor, up_dest: torch.Tensor, pads: list) -> bool:
    """A tiered exchange into row files written as a log, every column in one pass over the rows:
    ``down[i]`` (``[>= V, width]`` uint8, dense) gets row ``victims[i]`` of every column (column ``c`` at byte
    ``offsets[c]``; the byte ranges ``pads`` zeroed), and row ``up_dest[i]`` of every column gets its bytes of
    ``file[up_at[i]]`` (the file's raw rows ``[R, width]``), each victim's row read before it is overwritten
    (``up_dest[i] == victims[i]`` for the paired rows). Each row's columns are touched once, the file's rows read
    straight into the columns (no staging copy). True, or False with nothing written where a column is not dense
    whole words (``[R, ...]`` rows contiguous), an offset not a word, or a row out of range (no rows: True)."""
    if victims.numel() == 0 and up_at.numel() == 0:
        return True
    words_of = [words(c) for c in cols]
    d, f = words(down), words(file)
    if d is None and victims.numel() == 0 and down.dim() == 2 and down.shape[1] % 4 == 0:
        d = np.empty((1, down.shape[1] // 4), dtype=np.int32)  # no row goes down: a row never written
    if d is None or f is None or any(w is None or not w.flags.c_contiguous for w in words_of) \
            or not d.flags.c_contiguous or not f.flags.c_contiguous or up_at.shape != up_dest.shape \
            or any(o % 4 for o in offsets) or any(a % 4 or b % 4 for a, b in pads) or victims.numel() > d.shape[0]:
        return False
    offs = np.asarray([o // 4 for o in offsets], dtype=np.int64)
    for w, o in zip(words_of, offs):
        if o + w.shape[1] > d.shape[1]:
            return False
    pad = np.asarray([(a // 4, b // 4) for a, b in pads], dtype=np.int64).reshape(-1, 2)
    return bool(_exchange_file_kernel(tuple(words_of), offs, victims.contiguous().numpy(), d, f,
                                      up_at.contiguous().numpy(), up_dest.contiguous().numpy(), pad))


@numba.njit(nogil=True, cache=True)
def _exchange_file_kernel(cols, offs, victims, down, file, up_at, up_dest, pad):
    v, u, nc = victims.shape[0], up_at.shape[0], len(cols)
    rows = cols[0].shape[0]
    for c in range(nc):
        if cols[c].shape[0] != rows:
            return False
    if not (rows_within(victims, v, rows) and rows_within(up_dest, u, rows) and rows_within(up_at, u, file.shape[0])):
        return False
    for i in range(max(u, v)):
        a = i + _AHEAD
        if a < v:
            for c in range(nc):
                prefetch_row_for_write(cols[c], victims[a])
        if a < u:
            prefetch_row(file, up_at[a])
            if a >= v:
                for c in range(nc):
                    prefetch_row_for_write(cols[c], up_dest[a])
        if i < v:
            r = victims[i]
            for c in range(nc):
                col, o = cols[c], offs[c]
                for j in range(col.shape[1]):
                    down[i, o + j] = col[r, j]
            for p in range(pad.shape[0]):
                for j in range(pad[p, 0], pad[p, 1]):
                    down[i, j] = 0
        if i < u:
            r, s = up_dest[i], up_at[i]
            for c in range(nc):
                col, o = cols[c], offs[c]
                for j in range(col.shape[1]):
                    col[r, j] = file[s, o + j]
    return True
