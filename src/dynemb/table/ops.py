"""Small tensor helpers shared by the table layer."""

from __future__ import annotations

import math

import torch

from ..kernels.dispatch import Backend, kernels_for

__all__ = ["all_nonnegative", "column_kernel", "copy_rows", "fill_pair", "fill_rows", "gather_rows", "last_occurrence",
           "lowest_rows", "scatter_rows", "stamp_kernels"]

# Rows gathered per step by copy_rows on CPU: a cache-sized temporary instead of one [N, D] tensor, whose fresh
# pages cost more to fault in than the copy itself.
_CPU_CHUNK_ELEMENTS = 1 << 18

# torch's index_select has a vectorized copy path for floating dtypes only; integer rows are gathered through a
# same-width float view, which copies the bits unchanged and runs several times faster on CPU.
_FLOAT_VIEW = {torch.int64: torch.float64, torch.int32: torch.float32, torch.int16: torch.float16}


def all_nonnegative(rows: torch.Tensor) -> bool:
    """Whether every entry of int ``rows`` is >= 0 (every key has a row). One ``min``: 30 us for 78.6k rows on CPU,
    where ``bool((rows >= 0).all())`` takes 190 (a comparison pass, then a bool reduction that does not vectorize).

    Example:
        >>> all_nonnegative(torch.tensor([3, 0, 7])), all_nonnegative(torch.tensor([3, -1]))
        (True, False)
    """
    return rows.numel() == 0 or int(rows.min()) >= 0


def fill_rows(dst: torch.Tensor, rows: torch.Tensor, value: int, backend: Backend | str | None = None) -> None:
    """``dst.index_fill_(0, rows, value)`` for a 1-D int64 column (score and version stamps). Large batches on CPU
    go to the pool kernels' ``fill_rows`` (rows prefetched ahead) where ``backend`` (the table's; None: the process
    default) has it."""
    fill = column_kernel(dst, rows, "fill_rows", backend)
    if fill is None or not fill(dst, rows, value):
        dst.index_fill_(0, rows, value)


def fill_pair(first: torch.Tensor, second: torch.Tensor, rows: torch.Tensor, a: int, b: int,
              backend: Backend | str | None = None) -> None:
    """:func:`fill_rows` of ``a`` into ``first`` and ``b`` into ``second`` (a lookup's score and version stamps):
    one pass of the pool kernels' optional ``fill_pair`` where it serves, else one fill after the other."""
    fill = column_kernel(first, rows, "fill_pair", backend)
    if fill is None or column_kernel(second, rows, "fill_pair", backend) is None \
            or not fill(first, second, rows, a, b):
        fill_rows(first, rows, a, backend)
        fill_rows(second, rows, b, backend)


def column_kernel(column: torch.Tensor, rows: torch.Tensor, name: str, backend: Backend | str | None = None):
    """``backend``'s pool kernel ``name`` (None: the process default's) for an access of ``rows`` (``[N]`` int64) to
    a 1-D int64 ``column`` of any stride (scores, version stamps), or None where the torch code serves better: off
    CPU, for a backend without it, or below a few thousand rows (a kernel call costs a few microseconds more than
    ``index_fill_``)."""
    if column.device.type == "cpu" and rows.numel() >= _KERNEL_FILL_MIN and column.dim() == rows.dim() == 1 \
            and column.dtype == rows.dtype == torch.int64 and rows.is_contiguous():
        return getattr(kernels_for(backend, column.device).pool, name)
    return None


_KERNEL_FILL_MIN = 4096


def stamp_kernels(device: torch.device, backend: Backend | str | None = None):
    """``backend``'s pool kernels on ``device`` (None: the process default's) when they defer stamps
    (``mark_rows`` and ``settle_marks``, see :meth:`~dynemb.table.rows.RowStore._defer_stamps`), else None."""
    kernels = kernels_for(backend, device).pool
    if kernels.mark_rows is None or kernels.settle_marks is None:
        return None
    return kernels


def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, backend: Backend | str | None = None
                 ) -> None:
    """``dst.index_copy_(0, rows, src)`` for unique ``rows``. Large 2-D float32 copies on CPU go to the pool
    kernels' ``scatter`` (rows claimed for writing ahead) where ``backend`` (None: the process default) has it."""
    if dst.device.type == "cpu" and rows.numel() >= _KERNEL_FILL_MIN and dst.dim() == 2 and dst.is_contiguous() \
            and src.is_contiguous() and dst.dtype == src.dtype == torch.float32 and rows.dtype == torch.int64 \
            and rows.is_contiguous() and src.shape == (rows.numel(), dst.shape[1]):
        kernel = kernels_for(backend, dst.device).pool.scatter
        if kernel is not None and kernel(dst, rows, src):
            return
    dst.index_copy_(0, rows, src)


def lowest_rows(scores: torch.Tensor, k: int, pinned: torch.Tensor | None = None,
                backend: Backend | str | None = None) -> torch.Tensor:
    """The ``min(k, unpinned)`` positions of ``scores`` (``[S]`` int64) not in ``pinned`` (``[P]`` int64 positions in
    ``[0, S)``, duplicates allowed) with the lowest scores, lowest first; equal scores go lowest position first, so
    every path and device picks the same rows. ``[k']`` int64: eviction's victims. Large CPU columns go to the pool
    kernels' ``lowest_rows`` (one pass over the column after a sample finds a threshold, where this reference makes a
    ``topk`` and several passes).

    Example:
        >>> lowest_rows(torch.tensor([5, 1, 3, 1, 0]), 3, pinned=torch.tensor([4])).tolist()
        [1, 3, 2]
    """
    if scores.device.type == "cpu" and scores.numel() >= _KERNEL_LOWEST_MIN and scores.dtype == torch.int64 \
            and scores.dim() == 1:
        kernel = kernels_for(backend, scores.device).pool.lowest_rows
        if kernel is not None:
            return kernel(scores, k, None if pinned is None else pinned.contiguous())
    candidates = None
    if pinned is not None and pinned.numel():
        free = torch.ones(scores.numel(), dtype=torch.bool, device=scores.device)
        free[pinned] = False
        candidates = free.nonzero().squeeze(1)
        scores = scores.index_select(0, candidates)
    k = min(k, scores.numel())
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=scores.device)
    lowest, at = scores.topk(k, largest=False, sorted=False)  # the k lowest scores; which of the tied is arbitrary
    kth = lowest.max()
    below = at[lowest < kth].sort().values  # every position scored below the k-th, in position order
    tied = (scores == kth).nonzero().squeeze(1)[: k - below.numel()]  # then the first of those tied with it
    picked = torch.cat([below, tied])
    picked = picked.index_select(0, scores.index_select(0, picked).sort(stable=True).indices)
    return picked if candidates is None else candidates.index_select(0, picked)


# Scores below which the torch code wins (one kernel call and its sample cost more than a few small ops).
_KERNEL_LOWEST_MIN = 1 << 14


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src.index_select(0, index)``, bit-exact for every dtype; writes into ``out`` when given."""
    view = _FLOAT_VIEW.get(src.dtype)
    if view is None:
        return torch.index_select(src, 0, index, out=out) if out is not None else src.index_select(0, index)
    if out is not None:
        torch.index_select(src.view(view), 0, index, out=out.view(view))
        return out
    return src.view(view).index_select(0, index).view(src.dtype)


def copy_rows(dst: torch.Tensor, dst_index: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor,
              backend: Backend | str | None = None) -> None:
    """``dst[dst_index] = src[src_index]`` row-wise; ``dst_index`` unique. ``src`` may be ``dst`` if the two index
    sets are disjoint. On CPU, 256 rows or more go to the pool kernels' ``move_rows`` where ``backend`` (None: the
    process default) has it (one pass, rows as raw words); otherwise the rows move in cache-sized chunks on CPU, in
    one step elsewhere.

    Example:
        >>> dst = torch.zeros(3, 2)
        >>> copy_rows(dst, torch.tensor([2, 0]), torch.ones(4, 2).cumsum(0), torch.tensor([3, 1]))
        >>> dst.tolist()
        [[2.0, 2.0], [0.0, 0.0], [4.0, 4.0]]
    """
    n = dst_index.numel()
    if n >= _KERNEL_MOVE_MIN and dst.device.type == "cpu":
        kernel = kernels_for(backend, dst.device).pool.move_rows
        if kernel is not None and kernel(dst, dst_index, src, src_index):
            return  # else a row out of range (the torch code below raises as it does) or a layout it does not take
    step = max(1, n if dst.device.type != "cpu" else _CPU_CHUNK_ELEMENTS // max(1, math.prod(src.shape[1:])))
    for start in range(0, n, step):
        dst.index_copy_(0, dst_index[start : start + step], gather_rows(src, src_index[start : start + step]))


# Rows from which the pool kernels' move_rows serves copy_rows (below, the kernel call costs more than it saves)
_KERNEL_MOVE_MIN = 256


def last_occurrence(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ``keys`` (sorted) with the value of each key's last occurrence; deterministic on every device."""
    unique, inverse = torch.unique(keys, return_inverse=True)
    position = torch.arange(keys.numel(), device=keys.device)
    last = torch.full_like(unique, -1, dtype=torch.int64).scatter_reduce_(0, inverse, position, "amax")
    return unique, values.index_select(0, last)
