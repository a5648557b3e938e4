"""Numba kernels for the hash index on CPU (imported on first use, and only when numba is installed).

:class:`~dynemb.table.index.HashIndex` has one code path in batched torch ops for every device; it is the reference.
On CPU that path spends most of its time in dozens of elementwise passes over the batch (hash, compare, pick the
matching or the n-th free slot, follow overflow flags), each a separate trip through memory. These kernels do the
same work in one pass (lookups: each key's bucket prefetched 64 keys ahead; placement: per cache-sized chunk of
keys), with identical results (slots, rows and the bucket layout; the tests run both paths). Measured at 1 thread
with 1M keys and batches of 65,536: lookups take about half the time of the torch path and placing new keys about a
third (``benchmarks/table_ops.py`` times the torch path beside them).

:func:`dynemb.kernels.dispatch.index_kernels` decides, call by call, whether they run (backend ``numba``, or
``auto`` on CPU).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .numba_math import prefetch_row

__all__ = ["find", "probe", "place", "unique_by_hash"]

_CHUNK = 256  # keys per touch-then-match step of placement: their buckets (64 B each) stay in L1/L2
# Keys between a bucket's prefetch and its probe. 78k keys of an index of 1M, cold caches, since a bucket's match is
# a select: 16 ahead 13.2-13.8 ns a key, 32 9.4-9.6, 48 8.1-8.2, 64 7.7-7.9, 96 7.8-8.1.
_AHEAD = 64
_NO_SLOTS = np.empty(0, np.int64)  # passed as ``slots`` when only rows are wanted
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def probe(
    table: torch.Tensor, key_cols: int, overflow: torch.Tensor, keys: torch.Tensor, shift: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots int64, rows int32)`` of ``[N]`` CPU keys, -1 where absent: the contract of ``HashIndex._probe``.

    ``table``: the index's buckets viewed in the key dtype, ``[B, 8]`` (int64) or ``[B, 16]`` (int32);
    ``key_cols``: int32 words of keys per bucket (row ids follow them).
    """
    n = keys.numel()
    slots, rows = np.empty(n, np.int64), np.empty(n, np.int32)
    _probe_kernel(table.numpy(), key_cols, overflow.numpy(), keys.contiguous().numpy(), shift, slots, rows)
    return torch.from_numpy(slots), torch.from_numpy(rows)


def find(
    table: torch.Tensor, key_cols: int, overflow: torch.Tensor, keys: torch.Tensor, shift: int
) -> tuple[torch.Tensor, bool]:
    """``(rows int64, every key found)`` of ``[N]`` CPU keys, -1 where absent: :func:`probe`'s rows without the
    slots, written as int64 and counted in the same pass (what ``HashIndex.find_all`` returns). Optional in the
    index family."""
    rows = np.empty(keys.numel(), np.int64)  # numpy, wrapped once: torch.empty and .numpy() cost microseconds
    missing = _probe_kernel(table.numpy(), key_cols, overflow.numpy(), keys.contiguous().numpy(), shift, _NO_SLOTS,
                            rows)
    return torch.from_numpy(rows), missing == 0


def place(
    table: torch.Tensor, key_cols: int, overflow: torch.Tensor, bucket: torch.Tensor, keys: torch.Tensor,
    rows: torch.Tensor,
) -> bool:
    """``HashIndex._place`` on CPU: writes ``keys -> rows`` into ``table`` (as in :func:`probe`), keys in ``bucket``
    order; False if the index is full."""
    args = (bucket.contiguous().numpy(), keys.contiguous().numpy(), rows.contiguous().numpy())
    return _place_kernel(table.numpy(), key_cols, overflow.numpy(), *args)[0]


def unique_by_hash(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys [U], hashes [U], last [U], inverse [N])`` of ``[N]`` CPU keys: the contract of
    :func:`dynemb.table.hashing.unique_by_hash`, bit for bit (what its stable sort of the hashes gives). Optional in
    the index family.

    An LSD radix sort on the hashes' top bits (about 4 more than a position needs, so few keys share them) orders
    the batch; keys that share those bits are then put in order of their whole hash. 65,536 distinct keys: about a
    third of the time of the torch sort and its passes.
    """
    flat = keys.contiguous().numpy()
    n = flat.shape[0]
    unique, hashes, last, inverse = np.empty(n, flat.dtype), np.empty(n, np.int64), np.empty(n, np.int64), np.empty(
        n, np.int64)
    u = _unique_kernel(flat, unique, hashes, last, inverse)
    return (torch.from_numpy(unique[:u]), torch.from_numpy(hashes[:u]), torch.from_numpy(last[:u]),
            torch.from_numpy(inverse))


# A pass after the first whose largest digit holds more than this many times the mean count scatters run by run
# (radix_sort)
_RUN_PEAK = 8


@numba.njit(nogil=True, cache=True)
def radix_sort(src, dst, shift, digit, passes):
    """Sort the uint64 words of ``src`` stably by their bits ``shift`` to ``shift + digit * passes``, an LSD pass of
    ``digit`` bits (at most 11: 2048 counters, in L1) at a time; ``dst`` is scratch of the same size. Returns the
    array that holds the sorted words (``src`` or ``dst``)."""
    n = src.shape[0]
    mask = np.uint64((1 << digit) - 1)
    counts = np.zeros((max(passes, 1), 1 << digit), np.int64)
    for p in range(passes):  # a loop of its own per digit, unsigned index: 0.55-0.65x the time of one loop for all
        count, at = counts[p], np.uint64(shift + p * digit)
        for j in range(n):
            count[(src[j] >> at) & mask] += 1
    for p in range(passes):
        first, total, peak = counts[p], 0, 0
        for d in range(first.shape[0]):  # counts -> first position of each digit
            peak = max(peak, first[d])
            first[d], total = total, total + first[d]
        at = np.uint64(shift + p * digit)
        if p == 0 or peak * first.shape[0] <= _RUN_PEAK * n:
            for j in range(n):
                x = src[j]
                d = np.int64((x >> at) & mask)
                dst[first[d]] = x
                first[d] += 1
        else:
            # A digit of many words (repeated keys) that an earlier pass put together: the run keeps its next
            # position in a register, where ``first[d] += 1`` would chain each write on the one before (zipf ids,
            # 82k of 1M: the sort 0.39 against 0.56 ms). Without such runs the extra branch costs about 5%.
            prev, at_prev = np.int64(0), first[0]
            for j in range(n):
                x = src[j]
                d = np.int64((x >> at) & mask)
                if d != prev:
                    first[prev] = at_prev
                    prev, at_prev = d, first[d]
                dst[at_prev] = x
                at_prev += 1
        src, dst = dst, src
    return src


_SHORT_RUN = 16  # keys sharing their top hash bits put in order by insertion (longer runs: a merge sort)


@numba.njit(nogil=True, cache=True)
def _unique_kernel(keys, unique, hashes, last, inverse):
    n = keys.shape[0]
    if n == 0:
        return 0
    top = np.uint64(1) << np.uint64(63)  # flipping the sign bit makes unsigned order the hashes' signed order
    image = np.empty(n, np.uint64)
    for j in range(n):
        image[j] = np.uint64(_mix64(np.int64(keys[j]))) ^ top
    jbits = 1
    while (np.int64(1) << jbits) < n:
        jbits += 1
    # top bits sorted on: a position's bits and 4 more (1 key in 16 shares them), in passes of at most 11 bits
    want = min(jbits + 4, 64 - jbits)
    passes = (want + 10) // 11
    digit = want // passes
    bits = digit * passes
    src = np.empty(n, np.uint64)
    for j in range(n):
        src[j] = ((image[j] >> np.uint64(64 - bits)) << np.uint64(jbits)) | np.uint64(j)
    src = radix_sort(src, np.empty(n, np.uint64), jbits, digit, passes)
    jmask, jb = np.uint64((np.int64(1) << jbits) - 1), np.uint64(jbits)
    order = np.empty(n, np.int64)
    start = 0
    for k in range(n + 1):  # runs of equal top bits -> in order of the whole hash, positions ascending in a tie
        if k < n:
            order[k] = np.int64(src[k] & jmask)
            if k == 0 or (src[k] >> jb) == (src[k - 1] >> jb):
                continue
        size = k - start
        if size > _SHORT_RUN:
            run = order[start:k].copy()
            order[start:k] = run[np.argsort(image[run], kind="mergesort")]
        else:
            for a in range(start + 1, k):  # stable: moves a position only past strictly greater hashes
                j, x = order[a], image[order[a]]
                b = a
                while b > start and image[order[b - 1]] > x:
                    order[b] = order[b - 1]
                    b -= 1
                order[b] = j
        start = k
    u = -1
    prev = image[order[0]]
    for k in range(n):  # equal hashes are equal keys: a run of them is one key, its positions ascending
        j = order[k]
        x = image[j]
        if k == 0 or x != prev:
            u += 1
            prev = x
            hashes[u] = np.int64(x ^ top)
        last[u] = j
        inverse[j] = u
    for v in range(u + 1):
        unique[v] = keys[last[v]]
    return u + 1


@numba.njit(inline="always")
def _mix64(key):
    # hashing.mix64 on uint64: the same bits as the torch version's signed arithmetic.
    x = np.uint64(np.int64(key))
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return np.int64(x)


@numba.njit(nogil=True, cache=True, inline="always")
def _width(table, key_cols):
    """Slots a bucket (``HashIndex.width``): as many as its int32 words of keys hold keys."""
    return key_cols * 4 // table.itemsize


@numba.njit(nogil=True, cache=True)
def _match_row(table, words, key_cols, key, bucket):
    """``(slot, row)`` of the last slot of ``bucket`` holding ``key`` with a row (>= 0), or ``(-1, -1)``."""
    slot, row = -1, -1
    for p in range(_width(table, key_cols)):
        if table[bucket, p] == key and words[bucket, key_cols + p] >= 0:
            slot, row = bucket * 8 + p, words[bucket, key_cols + p]
    return slot, row


@numba.njit(nogil=True, cache=True)
def _follow(table, key_cols, overflow, key, bucket):
    """Probe the buckets after ``bucket`` while the one just probed has its overflow flag set."""
    words = table.view(np.int32)
    mask = table.shape[0] - 1
    for _ in range(table.shape[0] - 1):
        bucket = (bucket + 1) & mask
        slot, row = _match_row(table, words, key_cols, key, bucket)
        if slot >= 0:
            return slot, row
        if not overflow[bucket]:
            break
    return -1, -1


@numba.njit(nogil=True, cache=True)
def _probe_kernel(table, key_cols, overflow, keys, shift, slots, rows):
    # ``slots`` empty: rows only. Returns the number of keys not found.
    half, width = table.shape[0] // 2, _width(table, key_cols)
    with_slots, missing = slots.shape[0] > 0, 0
    words = table.view(np.int32)  # row ids are the int32 words after the keys
    n = keys.shape[0]
    home = np.empty(n, np.int64)
    for j in range(n):
        home[j] = (_mix64(keys[j]) >> shift) + half
    for j in range(min(_AHEAD, n)):
        prefetch_row(table, home[j])
    for j in range(n):
        # Prefetch the bucket _AHEAD keys on: many cache misses stay in flight while this one is matched.
        if j + _AHEAD < n:
            prefetch_row(table, home[j + _AHEAD])
        key, bucket = keys[j], home[j]
        # The last slot holding the key, matched on keys alone: a select, not a branch per slot. The branch of the
        # two-condition loop, taken at a random slot, mispredicted about once a key (this runs in 0.62x its time
        # warm, 0.75x cold). A match without a row (the fill key, in a freed slot) takes the exact loop.
        p = -1
        for q in range(width):
            if table[bucket, q] == key:
                p = q
        slot, row = -1, -1
        if p >= 0:
            row = words[bucket, key_cols + p]
            if row >= 0:
                slot = bucket * 8 + p
            else:
                slot, row = _match_row(table, words, key_cols, key, bucket)
        if slot < 0 and overflow[bucket]:
            slot, row = _follow(table, key_cols, overflow, key, bucket)
        if with_slots:
            slots[j] = slot
        rows[j] = row
        missing += slot < 0
    return missing


@numba.njit(nogil=True, cache=True)
def _place_kernel(table, key_cols, overflow, bucket, keys, rows):
    # Round by round like the torch path: a key takes the first free slot of its bucket or spills to the next one
    # in the following round, so keys whose home is that next bucket are placed first (identical layout).
    words = table.view(np.int32)
    mask = table.shape[0] - 1
    pending = np.empty(keys.shape[0], np.int64)  # keys spilled by the last round, and their next bucket
    at = np.empty(keys.shape[0], np.int64)
    n, last, width = keys.shape[0], words.shape[1] - 1, _width(table, key_cols)
    touched = 0  # returned, so that the touching loads are not optimized away
    for round_ in range(table.shape[0] + 1):
        spilled = 0
        for i in range(n):
            if round_ == 0 and i % _CHUNK == 0:  # touch the next chunk's buckets: many cache misses in flight
                for t in range(i, min(i + _CHUNK, n)):
                    touched ^= words[bucket[t], 0] ^ words[bucket[t], last]
            j, b = (i, bucket[i]) if round_ == 0 else (pending[i], at[i])
            placed = False
            for p in range(width):
                if words[b, key_cols + p] < 0:
                    table[b, p] = keys[j]
                    words[b, key_cols + p] = rows[j]
                    placed = True
                    break
            if not placed:
                overflow[b] = True
                pending[spilled], at[spilled] = j, (b + 1) & mask
                spilled += 1
        if spilled == 0:
            return True, touched
        n = spilled
    return False, touched
