"""Numba kernels for pooled lookups on CPU: the ``pool`` family of :mod:`dynemb.kernels.dispatch` (its contract).

The torch reference gathers the call's ids into an ``[N]`` row list and runs ``F.embedding_bag`` over the table,
then divides by the combiner's denominators in another pass. Where torch has fbgemm, :func:`pool` does just
that: fbgemm's JIT kernels pool faster than a numba loop (measured 1.09-1.14x per train step). Elsewhere one numba
kernel, :func:`sum_terms`, sums each bag's rows in vector registers, the same kernel that sums a row's gradient
from its bags in the backward (:func:`sum_rows`); the division follows in torch, with the same bits.
:func:`row_grad` is the step-mode backward: each unique row sums its ids' bag gradients in the order of the
call's one sort. :func:`rows_current` (the backward's check that rows still hold their keys) and
:func:`fill_rows` (score and version stamps) are single passes that prefetch the random entries they read or
write ahead.

Float32 tables only (the caller routes other dtypes to torch). Sums run in the reference's order (ids in input
order within a bag, and within a row for the gradient).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba.extending import overload

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)
from .numba_index import _mix64, radix_sort
from .numba_math import (acc_add, acc_fma, acc_new, acc_store, bits_float, float_bits, fma, prefetch_row,
                         prefetch_row_for_write, rows_within)

__all__ = ["bag_of", "block_width", "dedup", "fill_pair", "fill_rows", "gather", "grouped_bags", "mark_rows",
           "move_rows", "offsets_valid", "pool", "row_grad", "rows_current", "lowest_rows", "scatter", "settle_marks",
           "spread", "sum_rows", "sum_terms", "touch_counts", "write_last"]

_AHEAD = 32  # ids between a row's prefetch and its use: enough misses in flight to hide most of the latency
# Rows between a stamp's prefetch and its write. The write itself is a few cycles, so it takes many misses in flight
# to cover the latency (78k random rows of an 8 MB column, cold): 32 ahead 0.19 ms, 64 0.17, 128 0.15, 192 0.13.
_FILL_AHEAD = 192
_LOWEST_SAMPLE = 4096  # scores sampled by lowest_rows to set its threshold
_GRAD_AHEAD = 16  # ids between the prefetch of a bag's gradient row and its sum (about 5% of a fused update)
# Passes of the radix dedup: each costs about 1.5 ns an id; past three the hash table is as fast (82k ids).
_RADIX_PASSES = 3
_RADIX_DIGIT = 11  # bits per pass at most: 2048 counters, in L1
_NONE_F = np.empty(0, np.float32)  # stands for an absent float tensor (numba needs one type per argument)
_NONE_I = np.empty(0, np.int64)
_INT32_MAX = 2**31 - 1  # a constant: np.iinfo costs microseconds a call, paid on every backward
#: whether :func:`pool` runs torch's ``embedding_bag`` (fbgemm's CPU kernels) rather than :func:`sum_terms`
USE_TORCH_BAG = "fbgemm" in torch.backends.quantized.supported_engines


def pool(values: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor | None, offsets: torch.Tensor,
         weights: torch.Tensor | None, denom: torch.Tensor | None) -> torch.Tensor:
    """``[B, D]`` pooled rows: see the ``pool`` contract in :mod:`dynemb.kernels.dispatch`. With a torch built
    with fbgemm, its ``embedding_bag`` over the ids' rows (fbgemm's JIT kernels: 10-20% faster than
    :func:`sum_terms` on 82k ids of a 1M-row table, same bits), else the numba kernel, then the division."""
    id_rows = rows if inverse is None else rows.index_select(0, inverse)
    if USE_TORCH_BAG:  # the op under F.embedding_bag, whose Python checks cost more than 16 ids' pooling
        out = torch.embedding_bag(values, id_rows, offsets, False, 0, False, weights, False, None)[0]
    else:
        bounds = np.empty(offsets.numel() + 1, np.int64)  # the bags' starts, and the end of the last
        bounds[:-1], bounds[-1] = offsets.numpy(), id_rows.numel()
        summed = np.empty((offsets.numel(), values.shape[1]), np.float32)
        _sum_runs(0, summed.shape[0], summed, values.contiguous().numpy(), bounds, id_rows.contiguous().numpy(),
                  _opt(weights), _AHEAD, block_width(summed.shape[1]))
        out = torch.from_numpy(summed)
    return out if denom is None else out.div_(denom.unsqueeze(1))


def gather(values: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i] = values[max(rows[i], 0)]`` (``out`` returned): see the ``gather`` contract. Unlike
    ``index_select`` it prefetches rows ahead, which matters for random rows of a large table."""
    _gather_kernel(values.numpy(), rows.numpy(), out.numpy())
    return out


def row_grad(grad: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, bag: torch.Tensor | None,
             weights: torch.Tensor | None) -> torch.Tensor:
    """``[U, D]`` float32 gradient of each unique row: see the ``row_grad`` contract."""
    out = np.empty((starts.numel() - 1, grad.shape[1]), np.float32)
    bags, weights = grouped_bags(order, bag, weights, grad.shape[0])
    sum_rows(0, out.shape[0], out, grad.contiguous().numpy(), starts.numpy(), bags, weights,
             block_width(out.shape[1]))
    return torch.from_numpy(out)


def grouped_bags(order: torch.Tensor, bag: torch.Tensor | None, weights: torch.Tensor | None,
                 num_bags: int) -> tuple[np.ndarray, np.ndarray]:
    """``(bag[order], weights[order])`` as :func:`sum_rows` reads them: each id's bag (``bag`` None: the id
    itself) and weight in row order (an empty weights array: none). One gather here, rather than a dependent random
    read of ``bag`` and ``weights`` per id inside the sum, where it stalled the loop; the bags come out as int32
    when ``num_bags`` (the pooled gradient's rows) allows, which halves the bytes the sum reads them from."""
    if bag is None:
        bags = order.numpy()
    else:
        bags = np.empty(order.numel(), _bag_dtype(num_bags))
        _gather_ids_kernel(bag.numpy(), order.numpy(), bags)
    if weights is None:
        return bags, _NONE_F
    grouped = np.empty(order.numel(), np.float32)
    _gather_ids_kernel(weights.detach().numpy(), order.numpy(), grouped)
    return bags, grouped


def offsets_valid(offsets: torch.Tensor, n: int) -> bool:
    """Whether int64 ``offsets [B >= 1]`` start at 0, never decrease and end at most at ``n``: see the optional
    ``offsets_valid`` of the ``pool`` contract (the torch check is a dozen small ops: 15-50 us a call)."""
    return bool(_offsets_valid_kernel(offsets.contiguous().numpy(), n))


def bag_of(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]`` bag of each id, int32 when the bag count allows (else int64): see the optional ``bag_of`` of the
    ``pool`` contract. One sequential pass; with :func:`grouped_bags`, 1.04-1.06x faster per fused update than the
    torch reference's int64 bags (82k ids, cold caches)."""
    out = np.empty(n, _bag_dtype(offsets.numel()))
    _bag_of_kernel(offsets.contiguous().numpy(), out)
    return torch.from_numpy(out)


def spread(values: torch.Tensor, order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``[N]``: ``out[order[k]] = values[u]`` for ``k`` in ``starts[u]:starts[u + 1]``: see the optional ``spread`` of
    the ``pool`` contract. One pass, sequential in ``order``; the dedup then skips its own pass of the same random
    writes (``inverse``), and the rows need no gather through it."""
    out = np.empty(order.numel(), values.numpy().dtype)
    _spread_kernel(values.numpy(), order.numpy(), starts.numpy(), out)
    return torch.from_numpy(out)


def _bag_dtype(num_bags: int):
    """The integer dtype bag ids are kept in: int32 unless there are more bags than it holds."""
    return np.int32 if num_bags <= _INT32_MAX else np.int64


def dedup(ids: torch.Tensor, inverse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                                              torch.Tensor]:
    """``(unique [U], inverse [N], order [N], starts [U + 1])`` of ``ids [N]``: see the ``dedup`` contract
    (``inverse`` False: None in its place; the radix sort then skips its one pass of random writes, 0.26 ms of
    1.26 for 82k ids of 1M).

    When the call's ids span at most ``2**33`` values (ids of a vocabulary, hashed into a bucket range, or int32),
    a radix sort of at most three passes groups them: unique ids ascending, exactly as
    :func:`~dynemb.functional.find.sort_ids`. Wider spans (64-bit hashes) take a hash table and a counting
    sort: unique ids in order of first occurrence. Both O(N); 82k ids of a 1M vocabulary take the radix sort
    about half the time of the hash table (5.6 against 9.3 ns an id).

    Example:
        >>> [t.tolist() for t in dedup(torch.tensor([5, -1, 5]))]
        [[-1, 5], [1, 0, 1], [1, 0, 2], [0, 1, 3]]
    """
    # numpy buffers, wrapped once at the end: torch.empty and .numpy() cost microseconds each, a fixed cost paid
    # by every table on every step
    flat = ids.contiguous().numpy()
    n = flat.shape[0]
    unique, order, starts = np.empty(n, flat.dtype), np.empty(n, np.int64), np.empty(n + 1, np.int64)
    wanted = np.empty(n if inverse else 0, np.int64)
    u = _radix_dedup_kernel(flat, unique, wanted, order, starts, _RADIX_PASSES)
    if u < 0:  # the hash table needs each id's unique index to count-sort them: scratch when not wanted
        u = _dedup_kernel(flat, unique, wanted if inverse else np.empty(n, np.int64), order, starts)
    return (torch.from_numpy(unique[:u]), torch.from_numpy(wanted) if inverse else None, torch.from_numpy(order),
            torch.from_numpy(starts[: u + 1]))


def rows_current(row_keys: torch.Tensor, size: int, keys: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether every ``0 <= rows[u] < size`` holds ``row_keys[rows[u]] == keys[u]``: see the ``rows_current``
    contract. One pass, row keys prefetched ahead (the torch check is seven passes and a random gather)."""
    return bool(_rows_current_kernel(row_keys.numpy(), size, keys.numpy(), rows.numpy()))


def fill_rows(column: torch.Tensor, rows: torch.Tensor, value: int) -> bool:
    """``column[rows] = value`` for a 1-D int column of any stride (score and version stamps) when every row is in
    range (returns True); False, with nothing written, otherwise. ``index_fill_`` waits on each row's cache miss in
    turn; this prefetches rows ahead (about half the time for 78k random rows of 1M)."""
    column = _as_rows(column)
    return bool(_fill_pair_kernel(column, column, rows.numpy(), value, value))


def fill_pair(first: torch.Tensor, second: torch.Tensor, rows: torch.Tensor, a: int, b: int) -> bool:
    """``first[rows] = a`` and ``second[rows] = b`` in one pass (a lookup's score and version stamps), as
    :func:`fill_rows`: True, or False with nothing written when a row is out of range. When the two columns are
    interleaved (a table's stamps are, see ``RowStore``), both stamps of a row share one cache line: 0.78 ms for
    78.6k random rows of 1M on the Zen 3 guest, where two :func:`fill_rows` take 1.48."""
    return bool(_fill_pair_kernel(_as_rows(first), _as_rows(second), rows.numpy(), a, b))


def mark_rows(marks: torch.Tensor, rows: torch.Tensor, tag: int) -> bool:
    """``marks[rows] = tag`` for a uint8 ``marks [C]`` when every row is in range (returns True); False, with
    nothing written, otherwise: see the optional ``mark_rows`` of the ``pool`` contract. A lookup's deferred stamps
    (``RowStore``): one byte a row of a ``[C]`` array that stays in cache, instead of a 16-byte stamp pair whose
    line is read and written back (3.4-3.6% of an SGD step on uniform ids, 4 tables of 1M rows, Zen 3 guest)."""
    return bool(_mark_rows_kernel(marks.numpy(), rows.numpy(), tag))


def settle_marks(marks: torch.Tensor, first: torch.Tensor, second: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor) -> None:
    """For each row ``r`` with ``t = marks[r] > 0``: ``first[r] = a[t - 1]``, ``second[r] = max(second[r],
    b[t - 1])`` and ``marks[r] = 0``: see the optional ``settle_marks`` of the ``pool`` contract. One sequential
    pass over ``marks`` (eight bytes a step, skipping clean words), the stamps written in row order."""
    _settle_marks_kernel(marks.numpy(), _as_rows(first), _as_rows(second), a.numpy(), b.numpy())


def _as_rows(column: torch.Tensor) -> np.ndarray:
    """A 1-D column of any stride as a ``[C, 1]`` view (never a copy), the shape the prefetch helpers take."""
    return column.numpy()[:, None]


def touch_counts(column: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(before [N] int64, total [N] int64, last [N] bool)`` of an access of ``rows`` to an int64 ``column``: see
    the optional ``touch_counts`` of the ``pool`` contract. One prefetched pass over the rows, where the torch
    reference makes four, none prefetched; the rows hold scratch values until :func:`write_last`."""
    n = rows.numel()
    before, total, last = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.bool_)
    ok = _touch_counts_kernel(_as_rows(column), rows.numpy(), _NONE_I if counts is None else counts.numpy(),
                              before, total, last)
    return (torch.from_numpy(before), torch.from_numpy(total), torch.from_numpy(last)) if ok else None


def decayed_scores(old: torch.Tensor, n: torch.Tensor, now: int, constants) -> torch.Tensor:
    """``[N]`` int64 decayed_lfu scores of rows scored ``old`` accessed ``n`` times at fixed-point time ``now``: see
    the optional ``decayed_scores`` of the ``pool`` contract: the torch reference's operations, pass by pass over
    chunks of rows."""
    out = np.empty(old.numel(), np.int64)
    _decayed_kernel(old.contiguous().numpy(), n.contiguous().numpy(), now, np.asarray(constants.exp2),
                    np.asarray(constants.log2), constants.sqrt_half, out)
    return torch.from_numpy(out)


def write_last(column: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, last: torch.Tensor) -> None:
    """``column[rows[j]] = values[j]`` where ``last[j]``: see the optional ``touch_counts`` of the ``pool``
    contract (``write_last`` comes with it)."""
    _write_last_kernel(_as_rows(column), rows.numpy(), values.numpy(), last.numpy())


def lowest_rows(scores: torch.Tensor, k: int, pinned: torch.Tensor | None) -> torch.Tensor:
    """The ``min(k, unpinned)`` positions of int64 ``scores`` not in ``pinned`` lowest by ``(score, position)``, in
    that order: see the optional ``lowest_rows`` of the ``pool`` contract (the reference is
    :func:`dynemb.table.ops.lowest_rows`)."""
    return torch.from_numpy(_lowest_kernel(scores.numpy(), k, _NONE_I if pinned is None else pinned.numpy()))


def scatter(values: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> bool:
    """``values[rows[i]] = src[i]`` and True when every row is in range (else False, nothing written): see the
    optional ``scatter`` of the ``pool`` contract. Unlike ``index_copy_`` it claims rows for writing ahead
    (1.5-1.9x faster for 39k random rows of 256 bytes, cold)."""
    return bool(_scatter_kernel(values.numpy(), rows.numpy(), src.numpy()))


def move_rows(dst: torch.Tensor, dst_rows: torch.Tensor, src: torch.Tensor, src_rows: torch.Tensor) -> bool:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` and True, or False with nothing written when a row is out of range
    or the tensors are not ones it moves (see the optional ``move_rows`` of the ``pool`` contract). Rows move as raw
    32-bit words, so every dtype keeps its bits; one pass with both rows prefetched ahead, where ``index_select``
    then ``index_copy_`` make two passes and a temporary. Into random rows of an 800k-row table (a value and a key
    column, 1k-20k rows): 1.06-1.26x faster as a compaction, 1.11-1.33x from a batch. Into a fresh batch,
    ``index_select`` is faster (0.73-0.85x): ``gather_rows`` keeps it."""
    if not (dst.dtype == src.dtype and dst.shape[1:] == src.shape[1:] and dst_rows.dim() == 1
            and dst_rows.shape == src_rows.shape and dst_rows.dtype == src_rows.dtype == torch.int64
            and _whole_words(dst) and _whole_words(src)
            # a view of dst as src would see rows this pass has already written (one tensor: disjoint rows)
            and (src is dst or src.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr())):
        return False
    try:
        dst_words, src_words = _words(dst), _words(src)
    except RuntimeError:  # a layout the checks above let through that torch will not view as words
        return False
    return bool(_move_kernel(dst_words, dst_rows.contiguous().numpy(), src_words, src_rows.contiguous().numpy()))


def _whole_words(t: torch.Tensor) -> bool:
    """Whether ``t`` (``[R >= 1, ...]``, dense and row-major, 4-byte aligned, no lazy conj/neg bit) has rows of
    whole 32-bit words."""
    if t.device.type != "cpu" or t.shape[0] == 0 or t.is_conj() or t.is_neg() or t.data_ptr() % 4 \
            or t.element_size() not in (1, 2, 4, 8):
        return False
    dense = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if size != 1 and stride != dense:
            return False
        dense *= size
    return (dense // t.shape[0] * t.element_size()) % 4 == 0


def _words(t: torch.Tensor) -> np.ndarray:
    """``[R, W]`` int32 words of a tensor that :func:`_whole_words` accepts: views only (a copy would take the
    writes), so a layout torch cannot view raises instead."""
    return t.view(t.shape[0], -1).view(torch.int32).numpy()


def _opt(t: torch.Tensor | None) -> np.ndarray:
    return _NONE_F if t is None else t.numpy()


@numba.njit(nogil=True, cache=True)
def _gather_kernel(values, rows, out):
    n = rows.shape[0]
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row(values, max(rows[i + _AHEAD], 0))
        r = max(rows[i], 0)
        for d in range(values.shape[1]):
            out[i, d] = values[r, d]


@numba.njit(nogil=True, cache=True)
def _move_kernel(dst, dst_rows, src, src_rows):
    n = dst_rows.shape[0]
    if not (rows_within(dst_rows, n, dst.shape[0]) and rows_within(src_rows, n, src.shape[0])):  # all or nothing
        return False
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row(src, src_rows[i + _AHEAD])
            prefetch_row_for_write(dst, dst_rows[i + _AHEAD])
        dst[dst_rows[i]] = src[src_rows[i]]
    return True


@numba.njit(nogil=True, cache=True)
def _scatter_kernel(values, rows, src):
    n = rows.shape[0]
    if not rows_within(rows, n, values.shape[0]):  # all or nothing, as _fill_pair_kernel
        return False
    for i in range(n):
        if i + _AHEAD < n:
            prefetch_row_for_write(values, rows[i + _AHEAD])
        values[rows[i]] = src[i]
    return True


@numba.njit(nogil=True, cache=True)
def _rows_current_kernel(row_keys, size, keys, rows):
    n, as_rows = rows.shape[0], row_keys.reshape((row_keys.shape[0], 1))  # one key per "row" to prefetch
    for u in range(n):
        if u + _AHEAD < n:
            ahead = rows[u + _AHEAD]
            if 0 <= ahead < size:
                prefetch_row(as_rows, ahead)
        r = rows[u]
        if r < 0 or r >= size or row_keys[r] != keys[u]:
            return False
    return True


@numba.njit(nogil=True, cache=True)
def _offsets_valid_kernel(offsets, n):
    if offsets[0] != 0 or offsets[offsets.shape[0] - 1] > n:
        return False
    for b in range(1, offsets.shape[0]):
        if offsets[b] < offsets[b - 1]:
            return False
    return True


@numba.njit(nogil=True, cache=True)
def _gather_ids_kernel(source, index, out):
    for k in range(index.shape[0]):
        out[k] = source[index[k]]


@numba.njit(nogil=True, cache=True)
def _spread_kernel(values, order, starts, out):
    for u in range(starts.shape[0] - 1):
        v = values[u]
        for k in range(starts[u], starts[u + 1]):
            out[order[k]] = v


@numba.njit(nogil=True, cache=True)
def _bag_of_kernel(offsets, out):
    n, num_bags = out.shape[0], offsets.shape[0]
    for b in range(num_bags):
        stop = offsets[b + 1] if b + 1 < num_bags else n
        for j in range(offsets[b], stop):
            out[j] = b


@numba.njit(nogil=True, cache=True)
def _fill_pair_kernel(first, second, rows, a, b):
    # first, second: [C, 1] of any row stride (stamps are interleaved); one column twice for fill_rows
    n, size = rows.shape[0], min(first.shape[0], second.shape[0])
    for u in range(n):  # all or nothing: a row out of range leaves the columns to the caller's error
        if rows[u] < 0 or rows[u] >= size:
            return False
    for u in range(n):
        if u + _FILL_AHEAD < n:  # interleaved columns: the second prefetch finds its line already on the way
            prefetch_row_for_write(first, rows[u + _FILL_AHEAD])
            prefetch_row_for_write(second, rows[u + _FILL_AHEAD])
        first[rows[u], 0] = a
        second[rows[u], 0] = b
    return True


@numba.njit(nogil=True, cache=True)
def _mark_rows_kernel(marks, rows, tag):
    n, size = rows.shape[0], marks.shape[0]
    for u in range(n):  # all or nothing, as _fill_pair_kernel
        if rows[u] < 0 or rows[u] >= size:
            return False
    for u in range(n):
        marks[rows[u]] = tag
    return True


@numba.njit(nogil=True, cache=True)
def _settle_marks_kernel(marks, first, second, a, b):
    words = marks[: marks.shape[0] // 8 * 8].view(np.uint64)
    for w in range(words.shape[0] + 1):
        if w < words.shape[0] and words[w] == 0:
            continue
        for r in range(8 * w, min(8 * w + 8, marks.shape[0])):
            t = np.int64(marks[r])
            if t and t <= a.shape[0]:  # a tag past the pairs (only a racing writer makes one) writes nothing
                first[r, 0] = a[t - 1]
                second[r, 0] = max(second[r, 0], b[t - 1])
            marks[r] = 0


@numba.njit(nogil=True, cache=True)
def _touch_counts_kernel(column, rows, counts, before, total, last):
    n, size = rows.shape[0], column.shape[0]
    for j in range(n):  # all or nothing, as _fill_pair_kernel
        if rows[j] < 0 or rows[j] >= size:
            return False
    for j in range(n):  # the one random pass: read each row's value and leave this position in its place
        if j + _FILL_AHEAD < n:
            prefetch_row_for_write(column, rows[j + _FILL_AHEAD])
        r = rows[j]
        before[j] = column[r, 0]
        column[r, 0] = j
    # So an occurrence reads the position of the row's previous occurrence, and only then: no earlier position
    # holds the row of its first occurrence, whatever value that read. The chains give each row's value before the
    # call and its total count, in sequential passes.
    counted = counts.shape[0] > 0
    for j in range(n):
        p = before[j]
        c = counts[j] if counted else 1
        last[j] = True
        if 0 <= p < j and rows[p] == rows[j]:
            before[j], total[j], last[p] = before[p], total[p] + c, False
        else:
            total[j] = c
    return True


@numba.njit(nogil=True, cache=True)
def _lowest_kernel(scores, k, pinned):
    size = scores.shape[0]
    free = np.ones(size, np.bool_)
    for p in pinned:
        if 0 <= p < size:
            free[p] = False
    n = 0
    for r in range(size):
        n += free[r]
    k = min(k, n)
    if k == 0:
        return np.empty(0, np.int64)
    # A threshold from a strided sample of the free scores, a little above the k-th of n, so that one pass over the
    # column collects every row below it; a threshold that proves too low (rare) is raised to the top.
    step = max(1, size // _LOWEST_SAMPLE)
    sample = np.empty(size // step + 1, np.int64)
    m = 0
    for r in range(0, size, step):
        if free[r]:
            sample[m] = scores[r]
            m += 1
    sample = np.sort(sample[:m])
    q = k / n * m
    at = min(m - 1, int(q + 3.0 * np.sqrt(q) + 2.0)) if k < n else m - 1
    t = sample[at] if m > 0 and k < n else np.iinfo(np.int64).max
    below, tied = np.empty(size, np.int64), np.empty(k, np.int64)
    while True:
        nb, nt = 0, 0
        for r in range(size):  # rows in order: rows tied at t are kept lowest first
            if free[r]:
                s = scores[r]
                if s < t:
                    below[nb] = r
                    nb += 1
                elif s == t and nt < k:
                    tied[nt] = r
                    nt += 1
        if nb + nt >= k:
            break
        t = np.iinfo(np.int64).max
    found = below[:nb]
    found = found[np.argsort(scores[found], kind="mergesort")]  # stable: equal scores stay lowest row first
    if nb >= k:
        return found[:k].copy()
    out = np.empty(k, np.int64)
    out[:nb] = found
    out[nb:] = tied[: k - nb]
    return out


_MAGIC = 6755399441055744.0  # 1.5 * 2**52: an integer |i| < 2**51 added to it sits in the low bits of its mantissa
_MAGIC_BITS = 0x4338000000000000  # its bits
_DECAY_CHUNK = 256  # rows a pass at a time: the chunk's float64 scratch stays in L1


@numba.njit(nogil=True, cache=True)
def _decayed_kernel(old, n, now, exp2, log2, sqrt_half, out):
    # policy._decayed, its torch ops pass by pass over a chunk, so that each pass vectorizes (one loop over all the
    # steps of a row ran at a third of the speed: the polynomials are chains of dependent operations). numba fuses
    # no multiply-add (no fastmath), so each operation rounds as torch's does; int64/float64 conversions (none in
    # AVX2) are bit operations, exact in the ranges the clamps keep.
    span, mantissa, half_exponent = np.int64(1) << 50, (np.int64(1) << 52) - 1, np.int64(1022) << 52
    d, f, p, a, b = np.empty(_DECAY_CHUNK), np.empty(_DECAY_CHUNK), np.empty(_DECAY_CHUNK), np.empty(_DECAY_CHUNK), \
        np.empty(_DECAY_CHUNK)
    top, last = exp2[exp2.shape[0] - 1], log2[log2.shape[0] - 1]
    for lo in range(0, old.shape[0], _DECAY_CHUNK):
        size = min(_DECAY_CHUNK, old.shape[0] - lo)
        for i in range(size):
            diff = old[lo + i] - now
            diff = -span if diff < -span else (span if diff > span else diff)  # selects: min/max branch on NaN
            di = (bits_float(diff + _MAGIC_BITS) - _MAGIC) / 65536.0
            c = -1000.0 if di < -1000.0 else (60.0 if di > 60.0 else di)
            k = np.rint(c)
            d[i], a[i], f[i], p[i] = di, k, c - k, top  # each loop writes its arrays and reads locals or others
        for j in range(exp2.shape[0] - 2, -1, -1):
            c = exp2[j]  # hoisted by hand: LLVM cannot tell that p does not alias the coefficients
            for i in range(size):
                p[i] = p[i] * f[i] + c  # p = 2**f
        for i in range(size):
            two_k = bits_float((float_bits(a[i] + _MAGIC) - _MAGIC_BITS + 1023) << 52)
            count = span if n[lo + i] > span else n[lo + i]
            x = p[i] * two_k + (bits_float(count + _MAGIC_BITS) - _MAGIC)
            bits = float_bits(x)  # x >= 1: x = m * 2**e with m in [0.5, 1), as frexp
            m = bits_float((bits & mantissa) | half_exponent)
            e = bits_float((bits >> 52) - 1022 + _MAGIC_BITS) - _MAGIC
            low = m < sqrt_half
            m = m * 2.0 if low else m
            t = (m - 1.0) / (m + 1.0)
            a[i], f[i], b[i], p[i] = e - 1.0 if low else e, t, t * t, last
        for j in range(log2.shape[0] - 2, -1, -1):
            c = log2[j]
            for i in range(size):
                p[i] = p[i] * b[i] + c  # q
        for i in range(size):
            new = float_bits((a[i] + f[i] * p[i]) * 65536.0 + _MAGIC) - _MAGIC_BITS + now  # rint, as an integer
            out[lo + i] = old[lo + i] if d[i] > 60.0 else new


@numba.njit(nogil=True, cache=True)
def _write_last_kernel(column, rows, values, last):
    n = rows.shape[0]
    for j in range(n):
        if j + _FILL_AHEAD < n:
            prefetch_row_for_write(column, rows[j + _FILL_AHEAD])
        if last[j]:
            column[rows[j], 0] = values[j]


@numba.njit(nogil=True, cache=True)
def sum_rows(lo, hi, out, grad, starts, bags, weights, width):
    """Rows ``lo..hi-1``'s gradients into ``out[:hi-lo]`` (returned): ``grad[lo:hi]`` itself when ``starts`` is
    empty, else row ``u`` sums ``weights[k] * grad[bags[k]]`` over ``k in starts[u]:starts[u + 1]`` in that order
    (``bags``, ``weights``: the ids' bags and weights in row order, :func:`grouped_bags`; ``weights`` empty: ones;
    ``width``: :func:`block_width` of the dimension), with FMA as torch's ``embedding_bag``."""
    if starts.shape[0] == 0:
        return grad[lo:hi]  # already one row per row
    sum_terms(lo, hi, out, grad, starts, bags, weights, _GRAD_AHEAD, width)
    return out


@numba.njit(nogil=True, cache=True)
def _sum_runs(lo, hi, out, src, starts, index, weights, ahead, width):
    # sum_terms as a kernel of its own: a pooled bag of table rows (pool) or each row's gradient (row_grad)
    sum_terms(lo, hi, out, src, starts, index, weights, ahead, width)


def block_width(dim: int) -> tuple:
    """The ``width`` argument of :func:`sum_terms` for rows of ``dim`` columns: a tuple of 64, 32, 16 or 8 Nones, the
    widest that divides ``dim`` in at most four blocks (its length, known at compile time, is the block of columns
    summed in vector registers; numba compiles one kernel per length; each block is a pass over the terms), or
    ``()``: sums in the output row itself, in one pass."""
    for count in (64, 32, 16, 8):
        if dim % count == 0 and dim // count <= 4:
            return _WIDTHS[count]
    return ()


_WIDTHS = {count: (None,) * count for count in (64, 32, 16, 8)}


def sum_terms(lo, hi, out, src, starts, index, weights, ahead, width):
    """``out[u - lo] = sum(weights[k] * src[index[k]] for k in starts[u]:starts[u + 1])`` for ``u`` in ``lo..hi-1``,
    term by term in that order (``weights`` empty: ones; FMA as torch's ``embedding_bag``): a pooled bag of table
    rows (:func:`pool`) or a row's gradient summed from its bags' (:func:`sum_rows`). The row ``ahead`` terms on is
    prefetched. ``width`` (:func:`block_width`) picks the code at compile time: blocks of ``len(width)`` columns
    summed in vector registers (``acc_new``: one load and one add per term, where a sum into ``out`` stores and
    reloads the row per term; isolated, the train step's zipf ids: a row-gradient sum 0.65-0.7x the time, a fused
    SGD update 0.8x), or with ``()`` loops over ``out`` itself, which vectorize. Numba only, inlined where called."""
    raise NotImplementedError("sum_terms is compiled into numba kernels only")


@overload(sum_terms, inline="always")
def _sum_terms(lo, hi, out, src, starts, index, weights, ahead, width):
    count = len(width)
    if count == 0:
        def in_place(lo, hi, out, src, starts, index, weights, ahead, width):
            dim = out.shape[1]
            weighted, n = weights.shape[0] > 0, index.shape[0]
            for u in range(lo, hi):
                i = u - lo
                for d in range(dim):
                    out[i, d] = 0.0
                for k in range(starts[u], starts[u + 1]):
                    if k + ahead < n:
                        prefetch_row(src, index[k + ahead])
                    row = index[k]
                    if weighted:
                        w = weights[k]
                        for d in range(dim):
                            out[i, d] = fma(w, src[row, d], out[i, d])
                    else:
                        for d in range(dim):
                            out[i, d] += src[row, d]
        return in_place

    def in_registers(lo, hi, out, src, starts, index, weights, ahead, width):
        weighted, n = weights.shape[0] > 0, index.shape[0]
        for c in range(0, out.shape[1], count):
            for u in range(lo, hi):
                acc = acc_new(width)
                for k in range(starts[u], starts[u + 1]):
                    if k + ahead < n:  # random rows of src: start loading a later term's row now
                        prefetch_row(src, index[k + ahead])
                    if weighted:
                        acc_fma(acc, width, src, index[k], c, weights[k])
                    else:
                        acc_add(acc, width, src, index[k], c)
                acc_store(acc, width, out, u - lo, c)
    return in_registers


@numba.njit(nogil=True, cache=True)
def _dedup_kernel(ids, unique, inverse, order, starts):
    n = ids.shape[0]
    bits = 4  # at least one cache line of slots
    while (1 << bits) < 2 * n:
        bits += 1
    shift = np.uint64(64 - bits)
    slot_of = np.full(1 << bits, -1, np.int32)  # slot -> unique index (int32: half the cache footprint)
    lines = slot_of.reshape((slot_of.shape[0] // 16, 16))  # 16 slots a cache line, to prefetch by line
    mask = (1 << bits) - 1
    u = 0
    starts[0] = 0
    for j in range(n):
        # slot_of (1 MB at N=82k) is past L1 and L2 for most of a train step: start loading the slot _AHEAD ids on
        # (the hash again there is cheaper than the wait; 0.75-0.9x the time of the kernel without it)
        if j + _AHEAD < n:
            prefetch_row_for_write(lines, np.int64(np.uint64(_mix64(ids[j + _AHEAD])) >> shift) >> 4)
        key = ids[j]
        h = np.int64(np.uint64(_mix64(key)) >> shift)
        while True:
            k = slot_of[h]
            if k < 0:
                slot_of[h] = k = u
                unique[u] = key
                starts[u + 1] = 0
                u += 1
                break
            if unique[k] == key:
                break
            h = (h + 1) & mask
        inverse[j] = k
        starts[k + 1] += 1
    for k in range(u):  # counts -> starts
        starts[k + 1] += starts[k]
    fill = starts[:u].copy()
    for j in range(n):  # counting sort: each key's ids in input order
        k = inverse[j]
        order[fill[k]] = j
        fill[k] += 1
    return u


@numba.njit(nogil=True, cache=True)
def _radix_dedup_kernel(ids, unique, inverse, order, starts, max_passes):
    """:func:`dedup` by an LSD radix sort (``inverse`` empty: not written), or -1 (nothing written) when the ids
    span more than ``max_passes`` digits. Each id is packed as ``(id - min) << jbits | position`` in one word, so a
    pass moves 8 bytes an id; the sort is stable, so each id's positions stay in input order."""
    n = ids.shape[0]
    if n == 0:
        starts[0] = 0
        return 0
    # an order-preserving unsigned image of the key: its dtype's sign bit flipped
    width = np.uint64(0xFFFFFFFF) if ids.itemsize == 4 else np.uint64(0xFFFFFFFFFFFFFFFF)
    top = np.uint64(1) << np.uint64(ids.itemsize * 8 - 1)
    lo, hi = width, np.uint64(0)
    for j in range(n):
        x = (np.uint64(np.int64(ids[j])) & width) ^ top
        lo, hi = min(lo, x), max(hi, x)
    bits, jbits = 0, 1
    while bits < 64 and ((hi - lo) >> np.uint64(bits)) != 0:
        bits += 1
    while (np.int64(1) << jbits) < n:
        jbits += 1
    passes = (bits + _RADIX_DIGIT - 1) // _RADIX_DIGIT
    if passes > max_passes or bits + jbits > 64:
        return -1
    digit = (bits + passes - 1) // passes if passes else 0
    src = np.empty(n, np.uint64)
    for j in range(n):
        src[j] = ((((np.uint64(np.int64(ids[j])) & width) ^ top) - lo) << np.uint64(jbits)) | np.uint64(j)
    src = radix_sort(src, np.empty(n, np.uint64), jbits, digit, passes)
    jmask, jb = np.uint64((np.int64(1) << jbits) - 1), np.uint64(jbits)
    u, prev = -1, ~(src[0] >> jb)
    with_inverse = inverse.shape[0] > 0
    for k in range(n):  # runs of equal ids -> unique ids
        x = src[k]
        j = np.int64(x & jmask)
        order[k] = j
        if (x >> jb) != prev:
            u += 1
            prev = x >> jb
            starts[u] = k
            unique[u] = ((prev + lo) ^ top) & width  # the id back from its unsigned image
        if with_inverse:
            inverse[j] = u
    starts[u + 1] = n
    return u + 1
