"""Numba kernel for string ids: XXH64 (seed 0 or any seed) of each value of an Arrow string or binary array.

:func:`dynemb.data.string_ids.hash_strings` defines a string id's key as XXH64 of its UTF-8 bytes. The ``xxhash``
binding hashes one value per Python call, so a column of mostly distinct ids (user ids) cost a Python call per row;
this kernel hashes every value of an array in one call, reading the array's offsets and data buffers where they lie.
It follows the XXH64 specification (xxHash's ``doc/xxhash_spec.md``): 32-byte stripes into four lanes, then 8-,
4- and 1-byte tails, then the avalanche; tests compare it with the binding over lengths 0 to 100 and random bytes.
"""

from __future__ import annotations

import numba
import numpy as np

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)

__all__ = ["xxh64_many", "split_length_prefixed"]

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@numba.njit(inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@numba.njit(inline="always")
def _read(data, at, size):
    """The ``size`` bytes at ``data[at]`` as a little-endian unsigned integer (uint64)."""
    v = np.uint64(0)
    for k in range(size):
        v |= np.uint64(data[at + k]) << np.uint64(8 * k)
    return v


@numba.njit(inline="always")
def _round(acc, value):
    acc = acc + value * _P2
    return _rotl(acc, 31) * _P1


@numba.njit(inline="always")
def _merge(acc, value):
    acc = acc ^ _round(np.uint64(0), value)
    return acc * _P1 + _P4


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _xxh64(data, start, end, seed):
    n = end - start
    p = start
    if n >= 32:
        v1 = seed + _P1 + _P2
        v2 = seed + _P2
        v3 = seed
        v4 = seed - _P1
        limit = end - 32
        while p <= limit:
            v1 = _round(v1, _read(data, p, 8))
            v2 = _round(v2, _read(data, p + 8, 8))
            v3 = _round(v3, _read(data, p + 16, 8))
            v4 = _round(v4, _read(data, p + 24, 8))
            p += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = seed + _P5
    h = h + np.uint64(n)
    while p + 8 <= end:
        h = h ^ _round(np.uint64(0), _read(data, p, 8))
        h = _rotl(h, 27) * _P1 + _P4
        p += 8
    if p + 4 <= end:
        h = h ^ (_read(data, p, 4) * _P1)
        h = _rotl(h, 23) * _P2 + _P3
        p += 4
    while p < end:
        h = h ^ (np.uint64(data[p]) * _P5)
        h = _rotl(h, 11) * _P1
        p += 1
    h = h ^ (h >> np.uint64(33))
    h = h * _P2
    h = h ^ (h >> np.uint64(29))
    h = h * _P3
    return h ^ (h >> np.uint64(32))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _xxh64_kernel(data, offsets, first, count, seed, out):
    for i in range(count):
        out[i] = _xxh64(data, offsets[first + i], offsets[first + i + 1], seed)


def xxh64_many(data: np.ndarray, offsets: np.ndarray, first: int, count: int, seed: int = 0) -> np.ndarray:
    """XXH64 of values ``first .. first + count - 1`` of an Arrow-layout array: value ``i`` is
    ``data[offsets[i]:offsets[i + 1]]``. ``data``: uint8 ``[bytes]``; ``offsets``: int32 or int64 ``[n + 1]`` (the
    caller checks they are non-decreasing and within ``data``). Returns uint64 ``[count]``.

    Example:
        >>> import xxhash
        >>> data, offsets = np.frombuffer(b"abcid-7", np.uint8), np.array([0, 3, 7], np.int64)
        >>> xxh64_many(data, offsets, 0, 2).tolist() == [xxhash.xxh64_intdigest(v) for v in (b"abc", b"id-7")]
        True
    """
    out = np.empty(count, np.uint64)
    _xxh64_kernel(data, offsets, first, count, np.uint64(seed), out)
    return out


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _split_kernel(raw, offsets, data):
    """Returns the number of values read, or -1 - (the byte offset of a truncated element)."""
    at = 0
    n = 0
    end = raw.shape[0]
    while at < end:
        if at + 4 > end:
            return -1 - at
        size = np.int64(raw[at]) | (np.int64(raw[at + 1]) << 8) | (np.int64(raw[at + 2]) << 16) | \
            (np.int64(raw[at + 3]) << 24)
        if at + 4 + size > end:
            return -1 - at
        start = offsets[n]
        for k in range(size):
            data[start + k] = raw[at + 4 + k]
        offsets[n + 1] = start + size
        n += 1
        at += 4 + size
    return n


def split_length_prefixed(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray] | int:
    """The values of a buffer of length-prefixed elements (each a 4-byte little-endian length, then that many
    bytes: the binary tensor form of the Open Inference Protocol's BYTES) as Arrow's layout: ``(offsets int64
    [n + 1], data uint8 [bytes])``; or, when an element runs past the end, the byte offset where it starts.

    Example:
        >>> raw = (2).to_bytes(4, "little") + b"hi" + (0).to_bytes(4, "little")
        >>> offsets, data = split_length_prefixed(np.frombuffer(raw, np.uint8))
        >>> offsets.tolist(), data.tobytes()
        ([0, 2, 2], b'hi')
    """
    offsets = np.zeros(raw.shape[0] // 4 + 1, np.int64)  # at most one element per 4 bytes
    data = np.empty(raw.shape[0], np.uint8)
    n = _split_kernel(raw, offsets, data)
    if n < 0:
        return -1 - n
    return offsets[:n + 1], data[:offsets[n]]
