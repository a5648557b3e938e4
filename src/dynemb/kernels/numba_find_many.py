"""One numba call that reads the rows of keys from several hash tables (the parameter server's in-process store).

Each table keeps its own index and rows; the kernel views them at the addresses a row of ``meta`` holds (the way
:mod:`~dynemb.kernels.numba_group` does) and runs the table's own index probe
(:func:`~dynemb.kernels.numba_index._probe_kernel`) on its run of keys, then copies the rows found. A request that
misses in a few keys of each of 26 tables thus costs one call, not 26 (tens of microseconds of Python each).
Results are the per-table ``find_all`` and ``index_select``'s, bit for bit (rows are copied as integer words).

:func:`probe_request` and :func:`finish_request` are a whole request's lookup in two calls (the parameter server's
fused path, :mod:`dynemb.serving.ps.request_lookup`): the first probes the group cache for every id of the request,
writes the rows it finds straight to their place in the output and returns the misses as distinct ``(table, key)``
pairs; the second reads those pairs from the in-process store (when it is the only tier), computes default rows for
the pairs no tier answered (uniform and constant initializers: :mod:`.numba_init`'s bits) and writes every miss's
row to its place, counting what each tier served per table. Rows are kept as stored (float32, float16, bfloat16,
or an 8-bit export's packed bytes as 16-bit words: :mod:`dynemb.checkpoint.row_codec`) and decoded to float32 as
they are written (:data:`ROW_FLOAT32` ...), with the bits of the torch code's decode (float16 and bfloat16 widened
exactly, 8-bit codes through the 256-entry table of their values and ``* scale (+ bias)`` as
:mod:`.numba_rows` computes them). Every finite or infinite value keeps its bits; a NaN stays a NaN (torch itself
writes a bfloat16 NaN summed to float32 as ``0xffff0000`` in its vector loop and ``0x7fc00000`` in its scalar one).

For Redis (:mod:`dynemb.serving.stores.redis`), :func:`pack_mget_into` writes a request's ``MGET`` commands and
:func:`read_mget_reply` parses their replies straight from the socket's bytes into the rows of the misses (no Python
object a key either way).
"""

from __future__ import annotations

from typing import Optional

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .numba_group import _pointer
from .numba_index import _mix64, _probe_kernel
from numba.core import types

from numba.extending import overload

from .numba_math import _bitcaster, cell_bits, prefetch_row

__all__ = ["META", "find_rows", "find_carried", "miss_pairs", "probe_request", "finish_request", "probe_request_arrays",
           "finish_request_arrays", "row_views", "add_counts", "pack_mget",
           "pack_mget_into", "mget_command_bound", "mget_reply_bound", "mget_reply_state", "read_mget_reply",
           "UNIFORM", "CONSTANT", "IN_PYTHON", "ROW_FLOAT32", "ROW_FLOAT16", "ROW_BFLOAT16", "ROW_INT8",
           "ROW_FLOAT8_E4M3", "ROW_FLOAT8_E5M2"]

META = ("buckets", "overflow", "shift", "num_buckets", "values", "capacity", "key_cols")
"""The columns of a table's row of ``meta`` (int64): its index's buckets and overflow flags (addresses), hash
shift, bucket count and key columns, its rows' address and capacity (rows)."""
_BUCKETS, _OVERFLOW, _SHIFT, _NB, _VALUES, _CAPACITY, _KEY_COLS = range(len(META))
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # rows are copied as words of this size
_BOOL = np.empty(0, np.bool_)
_ROWS_AHEAD = 16  # probe_request's prefetch distance, in keys


def find_rows(meta: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Rows of int64 ``keys [N]`` (table ``t``'s from ``starts[t]`` to ``starts[t + 1]``, ``starts [T + 1]``) into
    ``out [N, D]`` (zeros where absent), the tables' ``meta [T, len(META)]`` rows given; returns ``found [N]``
    bool. Every table's rows are ``[capacity, D]`` of ``out``'s dtype."""
    words = out.view(_WORDS[out.element_size()])
    found = np.empty(keys.shape[0], np.bool_)
    _find_rows_kernel(meta.numpy(), keys.contiguous().numpy(), starts.numpy(), words.numpy(), found)
    return torch.from_numpy(found)


@numba.njit(nogil=True, cache=True)
def _probe_store(m, keys, rows):
    """``rows[i]``: the row of ``keys[i]`` in the store whose addresses ``m`` (a row of ``meta``) holds, -1 if none."""
    nb = m[_NB]
    index = numba.carray(_pointer(m[_BUCKETS], keys), (nb, 64 // keys.itemsize))
    overflow = numba.carray(_pointer(m[_OVERFLOW], _BOOL), (nb,))
    _probe_kernel(index, m[_KEY_COLS], overflow, keys, m[_SHIFT], np.empty(0, np.int64), rows)


@numba.njit(nogil=True, cache=True)
def _find_rows_kernel(meta, keys, starts, out, found):
    rows = np.empty(keys.shape[0], np.int64)
    width = out.shape[1]
    for t in range(meta.shape[0]):
        lo, hi = starts[t], starts[t + 1]
        if hi == lo:
            continue
        m = meta[t]
        _probe_store(m, keys[lo:hi], rows[lo:hi])
        values = numba.carray(_pointer(m[_VALUES], out), (m[_CAPACITY], width))
        for j in range(lo, hi):
            r = rows[j]
            found[j] = r >= 0
            if r >= 0:
                for d in range(width):
                    out[j, d] = values[r, d]
            else:
                for d in range(width):
                    out[j, d] = 0


def find_carried(table: torch.Tensor, key_cols: int, overflow: torch.Tensor, shift: int, values: torch.Tensor,
                 cache_keys: torch.Tensor, keys: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of a cache whose rows carry their own key (:mod:`dynemb.serving.ps.group_cache`): the index
    (``table``, ``key_cols``, ``overflow``, ``shift``: ``HashIndex._kernel_args``) probed for ``cache_keys [N]``,
    and where a row is found and the key in its last columns is ``keys[j]``, its first ``D`` columns copied into
    ``out [N, D]`` (zeros elsewhere). ``values [R, D + K]`` holds the rows, the key's 8 bytes in the last ``K``
    columns.

    Returns:
        ``(found [N] bool, touched [T] int64)``: whether each key's row was found (and carries it), and the rows
        the index found, in order (what a lookup stamps).
    """
    word = _WORDS[values.element_size()]
    n = cache_keys.shape[0]
    found, touched = np.empty(n, np.bool_), np.empty(n, np.int64)
    t = _find_carried_kernel(table.numpy(), key_cols, overflow.numpy(), shift, values.view(word).numpy(),
                             cache_keys.contiguous().numpy(), keys.contiguous().numpy(), out.view(word).numpy(), found,
                             touched)
    return torch.from_numpy(found), torch.from_numpy(touched[:t])


@numba.njit(nogil=True, cache=True)
def _find_carried_kernel(table, key_cols, overflow, shift, values, cache_keys, keys, out, found, touched):
    n, dim = cache_keys.shape[0], out.shape[1]
    rows = np.empty(n, np.int64)
    _probe_kernel(table, key_cols, overflow, cache_keys, shift, np.empty(0, np.int64), rows)
    bits = values.itemsize * 8
    mask = np.uint64((1 << bits) - 1)
    words = values.shape[1] - dim
    t = 0
    for j in range(n):
        r = rows[j]
        ok = False
        if r >= 0:
            touched[t] = r
            t += 1
            carried = np.uint64(0)
            for w in range(words):  # the key's words, little-endian
                carried |= (np.uint64(np.int64(values[r, dim + w])) & mask) << np.uint64(w * bits)
            ok = np.int64(carried) == keys[j]
        found[j] = ok
        if ok:
            for d in range(dim):
                out[j, d] = values[r, d]
        else:
            for d in range(dim):
                out[j, d] = 0
    return t


def miss_pairs(found: torch.Tensor, keys: torch.Tensor, tid: torch.Tensor, salts: torch.Tensor,
               tables: int) -> tuple:
    """The misses of a cache pass, as the distinct ``(table, key)`` pairs a request's lower tiers are asked for.

    Args:
        found: ``[N]`` bool, whether the cache answered position ``j``.
        keys: ``[N]`` int64 keys; ``tid``: ``[N]`` int64 table of each; ``salts``: ``[T]`` int64 each table's cache
            salt (pairs are ordered by ``key ^ salt`` within a table, as the torch code's unique orders them).
        tables: ``T``.

    Returns:
        ``(miss_at [K], table [M], key [M], inverse [K], counts [M], missed [T])`` int64: the positions missed, the
        distinct pairs sorted by table, each miss's pair, how often each pair was asked for, each table's misses.
    """
    miss_at, utid, ukey, inverse, counts, missed = _miss_pairs_kernel(
        found.numpy(), keys.contiguous().numpy(), tid.contiguous().numpy(), salts.contiguous().numpy(), tables)
    return tuple(torch.from_numpy(a) for a in (miss_at, utid, ukey, inverse, counts, missed))


@numba.njit(nogil=True, cache=True)
def _miss_pairs_kernel(found, keys, tid, salts, tables):
    n = found.shape[0]
    k = 0
    for j in range(n):
        k += not found[j]
    miss_at = np.empty(k, np.int64)
    ckeys = np.empty(k, np.int64)
    missed = np.zeros(tables, np.int64)
    k = 0
    for j in range(n):
        if not found[j]:
            miss_at[k] = j
            t = tid[j]
            ckeys[k] = keys[j] ^ salts[t]
            missed[t] += 1
            k += 1
    by_key = np.argsort(ckeys, kind="mergesort")
    starts = np.zeros(tables + 1, np.int64)  # a stable counting sort by table on top: (table, cache key) order
    for t in range(tables):
        starts[t + 1] = starts[t] + missed[t]
    at = starts[:tables].copy()
    order = np.empty(k, np.int64)
    for i in range(k):
        t = tid[miss_at[by_key[i]]]
        order[at[t]] = by_key[i]
        at[t] += 1
    utid, ukey = np.empty(k, np.int64), np.empty(k, np.int64)
    counts, inverse = np.zeros(k, np.int64), np.empty(k, np.int64)
    m = -1
    for i in range(k):
        j = order[i]
        t, key = tid[miss_at[j]], keys[miss_at[j]]
        if m < 0 or utid[m] != t or ukey[m] != key:
            m += 1
            utid[m], ukey[m] = t, key
        counts[m] += 1
        inverse[j] = m
    return miss_at, utid[:m + 1], ukey[:m + 1], inverse, counts[:m + 1], missed


UNIFORM, CONSTANT, IN_PYTHON = 0, 1, 2
"""Default-row kinds of :func:`finish_request`: ``low + width * u`` (the uniform initializer's bits; float32 rows, or
8-bit rows quantized as :func:`dynemb.checkpoint.row_codec.encode_rows` does), a fixed stored row (a constant, as the
table stores it), or rows the caller computed beforehand (no pair is left open then)."""

ROW_FLOAT32, ROW_FLOAT16, ROW_BFLOAT16, ROW_INT8, ROW_FLOAT8_E4M3, ROW_FLOAT8_E5M2 = range(6)
"""How a stored row becomes the float32 row written: as it is, float16 or bfloat16 widened (exact), or an 8-bit
export's packed row (:mod:`dynemb.checkpoint.row_codec`: ``D`` code bytes, then float32 scale and, for int8, bias)
decoded as ``lut[code] * scale (+ bias)``."""

_as_float32 = _bitcaster(types.uint32, types.float32)
_as_bits32 = _bitcaster(types.float32, types.uint32)
_NO_LUT = np.zeros(256, np.float32)


def row_views(rows: torch.Tensor) -> tuple:
    """``(words, values, raw)``: the numpy views of stored rows ``[R, C]`` (float32, float16 or bfloat16, CPU,
    contiguous rows) the kernels take: the rows as integer words of their width, as float32 (float32 rows; else an
    empty ``[0, 0]``) and as bytes ``[R, C * itemsize]``."""
    size = rows.element_size()
    words = rows.view(_WORDS[size]).numpy()
    values = rows.numpy() if rows.dtype == torch.float32 else np.zeros((0, 0), np.float32)
    raw = rows.view(torch.uint8).numpy()
    return words, values, raw


def probe_request(table: torch.Tensor, key_cols: int, overflow: torch.Tensor, shift: int, values: torch.Tensor,
                  ids: torch.Tensor, tid: torch.Tensor, salts: torch.Tensor, out: torch.Tensor, batch: int,
                  pool: bool, kind: int = ROW_FLOAT32, lut: Optional[torch.Tensor] = None) -> tuple:
    """Probe a group cache (:func:`find_carried`'s index and rows) for every id of a request, write each row found
    to its place in ``out``, and return the misses as :func:`miss_pairs` does.

    Args:
        table, key_cols, overflow, shift: the cache's index (``HashIndex._kernel_args``).
        values: ``[R, W + K]`` rows as stored (float32; float16 or bfloat16 rows, or packed 8-bit rows as 16-bit
            words), each carrying its key's 8 bytes in the last ``K`` columns.
        ids: ``[N]`` int64 keys, ``N = F * batch``: ``F`` runs of ``batch`` ids (one run of ``N``: ``batch = N``).
        tid: ``[N]`` int64 table of each id; ``salts``: ``[T]`` int64 each table's cache salt.
        out: ``[N, D]`` float32; the row of ``ids[f * batch + b]`` goes to ``out[b * F + f]`` (``[batch, F, D]``
            seen flat; with ``batch = N`` that is ``out[j]``), decoded to float32.
        pool: write ``0.0 + row`` (what summing a bag of one id gives: a ``-0.0`` becomes ``+0.0``), else the row.
        kind: how the rows decode (:data:`ROW_FLOAT32` ...); ``lut``: ``float32 [256]`` each code's value (8-bit).

    Returns:
        ``(touched [H], miss_at [K], table [M], key [M], inverse [K], counts [M], missed [T])`` int64: the cache rows
        the index found (what a lookup stamps), then :func:`miss_pairs`' arrays.
    """
    touched = np.empty(ids.shape[0], np.int64)
    words, floats, raw = row_views(values)
    t, *pairs = probe_request_arrays(table.numpy(), key_cols, overflow.numpy(), shift, words, floats, ids.numpy(),
                                     tid.numpy(), salts.numpy(), _as_runs(out.numpy(), batch), pool, touched,
                                     _NO_STAMPS, _NO_STAMPS, 0, 0, raw, kind, _NO_LUT if lut is None else lut.numpy())
    return (torch.from_numpy(touched[:t]), *(torch.from_numpy(a) for a in pairs))


def _as_runs(out: np.ndarray, batch: int) -> np.ndarray:
    """``out [N, D]`` seen as the ``[batch, N // batch, D]`` the kernels write (``batch = 0``: ``[0, 0, D]``)."""
    return out.reshape(batch, out.shape[0] // batch if batch else 0, out.shape[1])


_NO_STAMPS = np.zeros(0, np.int64)


def probe_request_arrays(table, key_cols, overflow, shift, words, values, ids, tid, salts, out, pool, touched,
                         scores, versions, score, version, raw, kind, lut):
    """:func:`probe_request` on numpy arrays the caller keeps from request to request (the parameter server's fused
    path: no tensor made or converted a call): ``words``, ``values``, ``raw``: the cache rows' :func:`row_views`;
    ``out [B, F, D]`` float32, any strides (a view of a model's ``[B, F + 1, D]`` input), the row of ``ids[f * B +
    b]`` written to ``out[b, f]``; ``touched [N]`` int64 filled with the cache rows the index found. ``scores``,
    ``versions``: the cache's stamp columns (int64 ``[R]``, any stride), where every row the index found gets
    ``score`` and ``version`` (what an LRU lookup stamps, ``fill_pair``), or empty arrays (no stamps: the caller
    stamps ``touched``). Returns ``(how many touched, miss_at, table, key, inverse, counts, missed)``, numpy
    arrays."""
    return _probe_request_kernel(table, key_cols, overflow, shift, words, values, ids, tid, salts, out, pool, touched,
                                 salts.shape[0], scores, versions, score, version, raw, _TAGS[kind], lut)


@numba.njit(nogil=True, cache=True, inline="always")
def _put_row(out, b, f, src, r, pool):
    """``out[b, f] = src[r]``; pooled (``pool``), as a sum from 0.0, so a -0.0 comes out as pooling's +0.0."""
    zero = np.float32(0.0)
    if pool:
        for d in range(out.shape[2]):
            out[b, f, d] = zero + src[r, d]
    else:
        for d in range(out.shape[2]):
            out[b, f, d] = src[r, d]


@numba.njit(nogil=True, cache=True, inline="always")
def _half(h):
    """The float32 of float16 bits ``h`` (the low 16 bits of an integer), exact."""
    h = np.int64(h) & 0xFFFF
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    if exp == 0:  # zero or subnormal: mant * 2^-24, exact in float32
        return _as_float32(np.uint32(np.int64(_as_bits32(np.float32(mant) * np.float32(2.0**-24))) | sign))
    if exp == 31:  # inf, nan
        return _as_float32(np.uint32(sign | 0x7F800000 | (mant << 13)))
    return _as_float32(np.uint32(sign | ((exp + 112) << 23) | (mant << 13)))


@numba.njit(nogil=True, cache=True, inline="always")
def _param(raw, r, at):
    """The little-endian float32 at bytes ``raw[r, at:at + 4]``."""
    bits = np.int64(raw[r, at]) | (np.int64(raw[r, at + 1]) << 8) | (np.int64(raw[r, at + 2]) << 16) | \
        (np.int64(raw[r, at + 3]) << 24)
    return _as_float32(np.uint32(bits))


_TAGS = (np.float32(0), np.int16(0), np.uint16(0), np.int8(0), np.uint8(0), np.uint32(0))
"""What the kernels take for each row kind (:data:`ROW_FLOAT32` ...): a scalar whose type names the kind, so that each
kind compiles a kernel of its own (a float32 kernel with the other kinds' decode in its loop ran 2-3x slower)."""


def _put_stored(out, b, f, words, values, raw, r, pool, tag, lut):
    """``out[b, f]`` = stored row ``r`` (``words``/``values``/``raw``: its :func:`row_views`) decoded as ``tag``
    (:data:`_TAGS`) says; pooled as :func:`_put_row`. The 8-bit decode is :mod:`.numba_rows`' (``lut[q] * scale +
    bias``, float32). Compiled code only (:func:`_put_stored_kind`)."""
    raise NotImplementedError("_put_stored runs in compiled kernels only")


@overload(_put_stored, inline="always")
def _put_stored_kind(out, b, f, words, values, raw, r, pool, tag, lut):
    if tag == types.float32:
        def put(out, b, f, words, values, raw, r, pool, tag, lut):
            _put_row(out, b, f, values, r, pool)
    elif tag == types.int16:
        def put(out, b, f, words, values, raw, r, pool, tag, lut):
            zero = np.float32(0.0 if pool else -0.0)  # -0.0 + x is x, bit for bit (a -0.0 stays)
            for d in range(out.shape[2]):
                out[b, f, d] = zero + _half(words[r, d])
    elif tag == types.uint16:
        def put(out, b, f, words, values, raw, r, pool, tag, lut):
            zero = np.float32(0.0 if pool else -0.0)
            for d in range(out.shape[2]):
                out[b, f, d] = zero + _as_float32(np.uint32((np.int64(words[r, d]) & 0xFFFF) << 16))
    elif tag == types.int8:
        def put(out, b, f, words, values, raw, r, pool, tag, lut):
            zero = np.float32(0.0 if pool else -0.0)
            dim = out.shape[2]
            scale, bias = _param(raw, r, dim), _param(raw, r, dim + 4)
            for d in range(dim):
                out[b, f, d] = zero + (lut[raw[r, d]] * scale + bias)
    elif tag in (types.uint8, types.uint32):
        def put(out, b, f, words, values, raw, r, pool, tag, lut):
            zero = np.float32(0.0 if pool else -0.0)
            dim = out.shape[2]
            scale = _param(raw, r, dim)
            for d in range(dim):
                out[b, f, d] = zero + lut[raw[r, d]] * scale
    else:
        return None
    return put


@numba.njit(nogil=True, cache=True, inline="always")
def _put_param(raw, i, at, x):
    """``x`` (float32) little-endian at bytes ``raw[i, at:at + 4]``."""
    bits = np.int64(_as_bits32(x))
    for k in range(4):
        raw[i, at + k] = np.uint8((bits >> (8 * k)) & 0xFF)


@numba.njit(nogil=True, cache=True, inline="always")
def _fp8_code(v, mbits, bias):
    """The byte of float32 ``v`` (finite, within the format's range) as a float8 of ``mbits`` mantissa bits and
    exponent ``bias``, rounded to nearest even (torch's cast)."""
    bits = np.int64(_as_bits32(v))
    sign = (bits >> 31) & 1
    a = np.float32(abs(v))
    if a < np.float32(2.0 ** (1 - bias)):  # subnormal (or the smallest normal it rounds up to): units of 2^(1-b-m)
        code = np.int64(np.rint(a * np.float32(2.0 ** (bias - 1 + mbits))))
    else:
        ab = bits & 0x7FFFFFFF
        shift = 23 - mbits
        ab = (ab + (1 << (shift - 1)) - 1 + ((ab >> shift) & 1)) >> shift
        code = ab - ((127 - bias) << mbits)
    return np.uint8(code | (sign << 7))


def _put_uniform(rows, values, raw, i, row, low, span, tag, scratch):
    """Pair ``i``'s default row of a uniform initializer (``row``: its hashed key) as stored: float32 (``values[i]``)
    or quantized into the packed bytes ``raw[i]`` as :func:`dynemb.checkpoint.row_codec.encode_rows` quantizes the
    float32 row (``scratch``: ``[D]`` float32). Compiled code only (:func:`_put_uniform_kind`)."""
    raise NotImplementedError("_put_uniform runs in compiled kernels only")


@numba.njit(nogil=True, cache=True, inline="always")
def _uniform_row(out, row, low, span):
    """numba_init.uniform_salted's bits: ``low + span * u`` of each column."""
    for c in range(out.shape[0]):
        u = (np.float32(cell_bits(row, c)) + np.float32(0.5)) * np.float32(2.0**-24)
        out[c] = low + span * u


@overload(_put_uniform, inline="always")
def _put_uniform_kind(rows, values, raw, i, row, low, span, tag, scratch):
    if tag == types.float32:
        def put(rows, values, raw, i, row, low, span, tag, scratch):
            _uniform_row(values[i, :scratch.shape[0]], row, low, span)
    elif tag == types.int8:
        def put(rows, values, raw, i, row, low, span, tag, scratch):
            dim = scratch.shape[0]
            _uniform_row(scratch, row, low, span)
            lo, hi = scratch[0], scratch[0]
            for c in range(1, dim):
                lo, hi = min(lo, scratch[c]), max(hi, scratch[c])
            scale = (hi - lo) / np.float32(255.0)
            safe = scale if scale > np.float32(0.0) else np.float32(1.0)
            for c in range(dim):
                q = np.rint((scratch[c] - lo) / safe) - np.float32(128.0)
                q = min(max(q, np.float32(-128.0)), np.float32(127.0))
                raw[i, c] = np.uint8(np.int64(q) & 0xFF)
            _put_param(raw, i, dim, scale)
            _put_param(raw, i, dim + 4, lo)
            for c in range(dim + 8, raw.shape[1]):
                raw[i, c] = 0
    elif tag in (types.uint8, types.uint32):
        mbits, bias, top = (3, 7, 448.0) if tag == types.uint8 else (2, 15, 57344.0)

        def put(rows, values, raw, i, row, low, span, tag, scratch):
            dim = scratch.shape[0]
            _uniform_row(scratch, row, low, span)
            amax = np.float32(0.0)
            for c in range(dim):
                amax = max(amax, np.float32(abs(scratch[c])))
            scale = amax / np.float32(top)
            safe = scale if scale > np.float32(0.0) else np.float32(1.0)
            for c in range(dim):
                v = min(max(scratch[c] / safe, np.float32(-top)), np.float32(top))
                raw[i, c] = _fp8_code(v, mbits, bias)
            _put_param(raw, i, dim, scale)
            for c in range(dim + 4, raw.shape[1]):
                raw[i, c] = 0
    else:  # 16-bit rows: their uniform defaults come from torch (request_lookup._kernel_defaults)
        def put(rows, values, raw, i, row, low, span, tag, scratch):
            pass
    return put


@numba.njit(nogil=True, cache=True)
def _probe_request_kernel(table, key_cols, overflow, shift, words, values, ids, tid, salts, out, pool, touched,
                          tables, scores, versions, score, version, raw, kind, lut):
    n = ids.shape[0]
    batch, runs = out.shape[0], out.shape[1]
    stamp = scores.shape[0] > 0
    cache_keys = np.empty(n, np.int64)
    for j in range(n):
        cache_keys[j] = ids[j] ^ salts[tid[j]]
    rows = np.empty(n, np.int64)
    _probe_kernel(table, key_cols, overflow, cache_keys, shift, np.empty(0, np.int64), rows)
    found = np.zeros(n, np.bool_)
    bits = words.itemsize * 8
    mask = np.uint64((1 << bits) - 1)
    kwords = 8 // words.itemsize
    width = words.shape[1] - kwords  # the stored row's words, then its key's
    t = 0
    for f in range(runs):
        for b in range(batch):
            j = f * batch + b
            if j + _ROWS_AHEAD < n and rows[j + _ROWS_AHEAD] >= 0:  # the rows' lines in flight a few keys ahead
                prefetch_row(words, rows[j + _ROWS_AHEAD])
            r = rows[j]
            if r < 0:
                continue
            touched[t] = r
            t += 1
            if stamp:
                scores[r] = score
                versions[r] = version
            carried = np.uint64(0)
            for w in range(kwords):  # the key's words, little-endian
                carried |= (np.uint64(np.int64(words[r, width + w])) & mask) << np.uint64(bits * w)
            if np.int64(carried) != ids[j]:
                continue
            found[j] = True
            _put_stored(out, b, f, words, values, raw, r, pool, kind, lut)
    miss_at, utid, ukey, inverse, counts, missed = _miss_pairs_kernel(found, ids, tid, salts, tables)
    return t, miss_at, utid, ukey, inverse, counts, missed


def finish_request(meta: torch.Tensor, utid: torch.Tensor, ukey: torch.Tensor, counts: torch.Tensor,
                   rows: torch.Tensor, source: torch.Tensor, kinds: torch.Tensor, params: torch.Tensor,
                   seeds: torch.Tensor, miss_at: torch.Tensor, inverse: torch.Tensor, out: torch.Tensor, batch: int,
                   pool: bool, fixed: Optional[torch.Tensor] = None, kind: int = ROW_FLOAT32,
                   lut: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The misses of :func:`probe_request` answered and written to their places in ``out``.

    Args:
        meta: ``[T, len(META)]`` the in-process store's tables (one a table of the group, in its order) to read
            every pair from first, or ``[0, len(META)]`` when the caller asked the tiers itself.
        utid, ukey, counts: ``[M]`` the distinct missed pairs (sorted by table) and how often each was asked for.
        rows: ``[M, W]`` the pairs' rows as stored (the cache's dtype); ``source``: ``[M]`` int64 the tier that
            answered each (1 volatile, 2 persistent, 3 default; 0 none yet). Both are filled in here for the pairs
            still open: from ``meta``'s store, else with default rows.
        kinds, params, seeds: ``[T]`` each table's default: kind (:data:`UNIFORM`: ``params[t] = (low, width)``,
            float32 or 8-bit rows; :data:`CONSTANT`: the stored row ``fixed[t]``, ``fixed [T, W]`` of ``rows``' dtype,
            default ``params[t, 0]`` cast to it (8-bit rows: pass ``fixed``, encoded); :data:`IN_PYTHON`: none is
            open) and ``mix64(seed)``.
        miss_at, inverse: ``[K]`` the positions missed and the pair of each; ``out``, ``batch``, ``pool``,
            ``kind``, ``lut``: as :func:`probe_request` took them.

    Returns:
        ``served [T, 4]`` int64: the ids of each table answered by each source code.
    """
    served = np.zeros((kinds.shape[0], 4), np.int64)
    if fixed is None:
        fixed = params[:, :1].to(torch.float32).expand(-1, rows.shape[1]).contiguous().to(rows.dtype)
    words, floats, raw = row_views(rows)
    _finish_request_kernel(meta.numpy(), utid.numpy(), ukey.numpy(), counts.numpy(), words, floats, raw,
                           source.numpy(), kinds.numpy(), params.numpy(), row_views(fixed)[0], seeds.numpy(),
                           miss_at.numpy(), inverse.numpy(), _as_runs(out.numpy(), batch), pool, served, _TAGS[kind],
                           _NO_LUT if lut is None else lut.numpy(), False)
    return torch.from_numpy(served)


def finish_request_arrays(meta, utid, ukey, counts, words, values, raw, source, kinds, params, fixed, seeds, miss_at,
                          inverse, out, pool, served, kind, lut, read_only=False):
    """:func:`finish_request` on numpy arrays (the pairs' rows as their :func:`row_views`; ``fixed``: the words of
    each table's fixed row; ``out [B, F, D]`` as :func:`probe_request_arrays` takes it), adding each table's counts
    to ``served [T, 4]`` int64. ``read_only``: only read the open pairs' rows from ``meta``'s store (no default rows,
    counts or writes: a later call finishes, after the tiers and default rows the kernel does not compute)."""
    _finish_request_kernel(meta, utid, ukey, counts, words, values, raw, source, kinds, params, fixed, seeds, miss_at,
                           inverse, out, pool, served, _TAGS[kind], lut, read_only)


@numba.njit(nogil=True, cache=True)
def _finish_request_kernel(meta, utid, ukey, counts, rows, values, raw, source, kinds, params, fixed, seeds,
                           miss_at, inverse, out, pool, served, kind, lut, read_only):
    m_pairs, width = ukey.shape[0], rows.shape[1]
    if meta.shape[0]:  # the store's rows of every pair, table by table (the pairs are sorted by table)
        at = np.empty(m_pairs, np.int64)
        lo = 0
        while lo < m_pairs:
            t = utid[lo]
            hi = lo
            while hi < m_pairs and utid[hi] == t:
                hi += 1
            m = meta[t]
            _probe_store(m, ukey[lo:hi], at[lo:hi])
            stored = numba.carray(_pointer(m[_VALUES], rows), (m[_CAPACITY], width))
            for i in range(lo, hi):
                r = at[i]
                if r >= 0 and source[i] == 0:
                    for d in range(width):
                        rows[i, d] = stored[r, d]
                    source[i] = 1
            lo = hi
    if read_only:
        return
    scratch = np.empty(out.shape[2], np.float32)
    for i in range(m_pairs):  # default rows of the pairs no tier answered
        if source[i] != 0:
            continue
        t = utid[i]
        if kinds[t] == UNIFORM:  # numba_init.uniform_salted's bits, quantized for 8-bit rows
            low, span = np.float32(params[t, 0]), np.float32(params[t, 1])
            row = np.uint64(_mix64(np.int64(np.uint64(np.int64(ukey[i])) ^ np.uint64(seeds[t]))))
            _put_uniform(rows, values, raw, i, row, low, span, kind, scratch)
        else:
            for c in range(width):
                rows[i, c] = fixed[t, c]
        source[i] = 3
    for i in range(m_pairs):
        served[utid[i], source[i]] += counts[i]
    batch = out.shape[0]
    for k in range(miss_at.shape[0]):
        j = miss_at[k]
        b, f = j % batch, j // batch
        _put_stored(out, b, f, rows, values, raw, inverse[k], pool, kind, lut)


def add_counts(pending: np.ndarray, rows: np.ndarray, sizes: np.ndarray, missed: np.ndarray,
               served: np.ndarray) -> None:
    """A fused request's counts added to its group cache's pending statistics ``pending [R, 5]`` int64 (lookups,
    cache, volatile, persistent, default): table ``t``'s ``sizes[t]`` lookups, ``missed[t]`` of them not in the cache,
    and ``served[t, 1:]`` (:func:`finish_request`'s, or ``[0, 4]`` for a request that missed nothing), to row
    ``rows[t]``."""
    _add_counts_kernel(pending, rows, sizes, missed, served)


@numba.njit(nogil=True, cache=True)
def _add_counts_kernel(pending, rows, sizes, missed, served):
    for t in range(rows.shape[0]):
        r = rows[t]
        pending[r, 0] += sizes[t]
        pending[r, 1] += sizes[t] - missed[t]
        if served.shape[0]:
            for c in range(1, 4):
                pending[r, 1 + c] += served[t, c]


def pack_mget(keys: torch.Tensor, table_of: torch.Tensor, shards, base, width, prefixes: np.ndarray,
              chunk: int) -> tuple[bytes, int]:
    """The Redis ``MGET`` commands of ``keys`` in RESP, ``chunk`` names a command: key ``j`` of table
    ``t = table_of[j]`` is named ``prefix(t, s) + 8 bytes``, the key big-endian with its sign bit flipped, ``s =
    mix64(key) mod shards[t]`` its shard and ``prefix(t, s)`` the ``width[t]`` bytes of ``prefixes`` from ``base[t]
    + s * width[t]`` (:mod:`dynemb.serving.stores.redis`'s layout). What redis-py's ``execute_command("MGET",
    *names)`` sends for each chunk, written in one pass instead of a Python object a name. ``shards``, ``base``,
    ``width``: ``[T]`` int64 (tensors or numpy arrays).

    Returns:
        ``(the commands' bytes, how many commands)``.
    """
    n = keys.shape[0]
    shards, base, width = (np.asarray(a, dtype=np.int64) for a in (shards, base, width))
    out = np.empty(mget_command_bound(n, chunk, int(width.max()) if width.shape[0] else 0), np.uint8)
    used = pack_mget_into(keys.numpy(), table_of.numpy(), shards, base, width, prefixes, chunk, out)
    if used < 0:
        raise ValueError(f"table_of must index the {shards.shape[0]} tables, got {int(table_of[-1 - used])}")
    return out[:used].tobytes(), -(-n // chunk)


def mget_command_bound(n: int, chunk: int, width: int) -> int:
    """Bytes :func:`pack_mget_into` writes at most for ``n`` keys, ``chunk`` a command, prefixes of ``width`` bytes
    at most."""
    return 32 * -(-n // chunk) + n * (16 + width)


def pack_mget_into(keys: np.ndarray, table_of: np.ndarray, shards: np.ndarray, base: np.ndarray, width: np.ndarray,
                   prefixes: np.ndarray, chunk: int, out: np.ndarray) -> int:
    """:func:`pack_mget` on numpy arrays (int64 ``keys``, ``table_of``, ``shards``, ``base``, ``width``), written to
    ``out`` (uint8, :func:`mget_command_bound` bytes at least: a buffer the caller keeps); returns the bytes used, or
    ``-1 - j`` when ``table_of[j]`` is outside ``[0, T)`` (nothing written)."""
    return _pack_mget_kernel(keys, table_of, shards, base, width, prefixes, chunk, out)


def mget_reply_bound(n: int, chunk: int, row_bytes: int) -> int:
    """Bytes the replies of :func:`pack_mget`'s commands take at most when every row has ``row_bytes`` bytes (a
    longer row is refused by :func:`read_mget_reply` from its length line, before its bytes are needed)."""
    return 24 * -(-n // chunk) + n * (26 + row_bytes)


MGET_RUNNING, MGET_DONE, MGET_ERROR_REPLY, MGET_BAD_REPLY, MGET_BAD_LENGTH = range(5)
"""``state[4]`` of :func:`read_mget_reply`: more bytes needed, every reply read, a Redis error reply at ``state[0]``,
bytes that are no MGET reply at ``state[0]``, a row of key ``state[1]`` with ``state[5]`` bytes."""


def mget_reply_state(commands: int) -> np.ndarray:
    """The parse state :func:`read_mget_reply` starts from for the replies of ``commands`` MGET commands."""
    return np.array([0, 0, -1, commands, MGET_RUNNING, 0], np.int64)


def read_mget_reply(buf: np.ndarray, end: int, state: np.ndarray, out: np.ndarray, found: np.ndarray,
                    zero: bool) -> int:
    """Parse the RESP replies of MGET commands in ``buf[:end]`` (uint8) as far as they are complete, from and into
    ``state`` (:func:`mget_reply_state`): called again after each read from the socket, with the bytes appended.

    The row of the ``j``-th key asked (a bulk string of exactly ``out.shape[1]`` bytes) is copied to ``out[j]``
    (``[N, row_bytes]`` uint8: a byte view of the caller's rows, any dtype, so the bits are the stored ones) and
    ``found[j]`` (bool ``[N]``) set; a null leaves ``out[j]`` as it is (zeros when ``zero``) and clears ``found[j]``.
    Replies that answer fewer than ``N`` keys in all are :data:`MGET_BAD_REPLY`.

    Returns:
        ``state[4]``: :data:`MGET_RUNNING` (more bytes needed), :data:`MGET_DONE` or an error code (see there).
    """
    return _read_mget_reply_kernel(buf, end, state, out, found, zero)


@numba.njit(nogil=True, cache=True)
def _line_end(buf, at, end):
    """Position of the ``\r`` of the first ``\r\n`` at or after ``at`` in ``buf[:end]``, -1 if none yet."""
    for k in range(at, end - 1):
        if buf[k] == 13 and buf[k + 1] == 10:
            return k
    return -1


@numba.njit(nogil=True, cache=True)
def _get_int(buf, lo, hi):
    """The decimal in ``buf[lo:hi]`` (an optional ``-``); -2**62 when it is no decimal."""
    sign, value = 1, 0
    if lo < hi and buf[lo] == 45:
        sign, lo = -1, lo + 1
    if lo >= hi or hi - lo > 18:
        return -(1 << 62)
    for k in range(lo, hi):
        c = buf[k]
        if c < 48 or c > 57:
            return -(1 << 62)
        value = value * 10 + (c - 48)
    return sign * value


@numba.njit(nogil=True, cache=True)
def _read_mget_reply_kernel(buf, end, state, out, found, zero):
    pos, j, left, commands = state[0], state[1], state[2], state[3]
    width = out.shape[1]
    status = MGET_RUNNING
    while commands > 0 and status == MGET_RUNNING:
        if left < 0:  # *<names>\r\n
            stop = _line_end(buf, pos, end)
            if stop < 0:
                break
            if buf[pos] != 42:
                status = MGET_ERROR_REPLY if buf[pos] == 45 else MGET_BAD_REPLY
                break
            left = _get_int(buf, pos + 1, stop)
            if left < 0 or j + left > min(found.shape[0], out.shape[0]):
                status = MGET_BAD_REPLY
                break
            pos = stop + 2
        while left > 0:  # a null ($-1\r\n, or _\r\n in RESP3) or $<length>\r\n<row>\r\n
            stop = _line_end(buf, pos, end)
            if stop < 0:
                break
            length = -1 if buf[pos] == 95 and stop == pos + 1 else -2
            if buf[pos] == 36:
                length = _get_int(buf, pos + 1, stop)
            if length < -1:
                status = MGET_BAD_REPLY
                break
            if length == -1:
                found[j] = False
                if zero:
                    for d in range(width):
                        out[j, d] = 0
                pos = stop + 2
            else:
                if length != width:
                    status = MGET_BAD_LENGTH
                    state[5] = length
                    break
                if stop + 4 + width > end:
                    break
                if buf[stop + 2 + width] != 13 or buf[stop + 3 + width] != 10:
                    status = MGET_BAD_REPLY
                    break
                for d in range(width):
                    out[j, d] = buf[stop + 2 + d]
                found[j] = True
                pos = stop + 4 + width
            j += 1
            left -= 1
        if status != MGET_RUNNING or left > 0:
            break
        left = -1
        commands -= 1
    if status == MGET_RUNNING and commands == 0:  # every key answered, or the reply is short of rows
        status = MGET_DONE if j == found.shape[0] else MGET_BAD_REPLY
    state[0], state[1], state[2], state[3], state[4] = pos, j, left, commands, status
    return status


@numba.njit(nogil=True, cache=True)
def _put_int(out, at, value):
    """``value`` >= 0 in decimal at ``out[at:]``; returns the position after it."""
    digits = 1
    while value >= 10**digits:
        digits += 1
    for k in range(digits - 1, -1, -1):
        out[at + k] = 48 + value % 10
        value //= 10
    return at + digits


@numba.njit(nogil=True, cache=True)
def _pack_mget_kernel(keys, table_of, shards, base, width, prefixes, chunk, out):
    n = keys.shape[0]
    for j in range(n):  # nothing written for a table out of range
        if table_of[j] < 0 or table_of[j] >= shards.shape[0]:
            return -1 - j
    at = 0
    for j in range(n):
        if j % chunk == 0:  # *<names + 1>\r\n$4\r\nMGET\r\n
            out[at] = 42
            at = _put_int(out, at + 1, min(chunk, n - j) + 1)
            for c in (13, 10, 36, 52, 13, 10, 77, 71, 69, 84, 13, 10):
                out[at] = c
                at += 1
        t = table_of[j]
        w = width[t]
        out[at] = 36  # $<length>\r\n<name>\r\n
        at = _put_int(out, at + 1, w + 8)
        out[at], out[at + 1] = 13, 10
        at += 2
        start = base[t] + (_mix64(keys[j]) % shards[t]) * w  # a Python modulo: torch's remainder of the hash
        for k in range(w):
            out[at + k] = prefixes[start + k]
        at += w
        flipped = np.uint64(np.int64(keys[j])) ^ np.uint64(0x8000000000000000)
        for k in range(8):
            out[at + k] = np.uint8((flipped >> np.uint64(56 - 8 * k)) & np.uint64(0xFF))
        at += 8
        out[at], out[at + 1] = 13, 10
        at += 2
    return at
