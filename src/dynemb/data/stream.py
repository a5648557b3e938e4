"""Streams of batches: the held-out split, the bounded shuffle of an epoch, and regrouping into mini-batches.

The held-out split. Row ``r`` of a data set (counted from 0 over its files in name order) is held out when
``mix64(r ^ salt(seed)) / 2**64 < fraction`` (:func:`held_out`): a pure function of the row number and the seed,
so every pass, process and machine agrees on it, and training never sees a held-out row.

The shuffle. An epoch visits every training row exactly once, in an order fixed by ``(seed, epoch)``. Rows pass
through a buffer of at most ``2 * buffer_rows`` rows: whenever it holds that many, a random half of it is sent
out. A data set of at most ``2 * buffer_rows`` rows is therefore shuffled uniformly; a larger one is mixed
within a sliding window of that size, in bounded memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ..table.hashing import mix64
from .batch import Batch, concat_batches, slice_rows, take_rows
from .synthetic import _derive  # one seed derivation for the whole data package

__all__ = ["held_out", "split", "shuffled", "rebatch"]

_SPLIT_SALT = 0x5EED5
_SHUFFLE_SALT = 0x5AFF1E


def held_out(rows: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """Which of ``rows`` (int64 row numbers) are held out: a seeded hash of each row number below ``fraction``.

    Shape:
        ``rows``: ``[N]`` -> bool ``[N]``.

    Example:
        >>> mask = held_out(torch.arange(100_000), 0.05, seed=0)
        >>> round(mask.float().mean().item(), 2), torch.equal(mask, held_out(torch.arange(100_000), 0.05, 0))
        (0.05, True)
    """
    h = mix64(rows.to(torch.int64) ^ _derive(_SPLIT_SALT, seed))
    u = ((h >> 11) & ((1 << 53) - 1)).to(torch.float64) * 2.0**-53  # top 53 bits: uniform in [0, 1)
    return u < fraction


def split(chunks: Iterable[tuple[int, Batch]], fraction: float, seed: int, part: str) -> Iterator[Batch]:
    """The ``part`` (``"train"`` or ``"eval"``) rows of ``chunks``, ``(first row number, batch)`` pairs.

    ``fraction == 0`` keeps every row in ``"train"``.
    """
    if part not in ("train", "eval"):
        raise ValueError(f"part must be 'train' or 'eval', got {part!r}")
    for first, batch in chunks:
        if fraction == 0:
            if part == "train":
                yield batch
            continue
        mask = held_out(torch.arange(first, first + len(batch)), fraction, seed)
        keep = mask if part == "eval" else ~mask
        if bool(keep.all()):
            yield batch
        elif bool(keep.any()):
            yield take_rows(batch, keep.nonzero().squeeze(1))


def shuffled(batches: Iterable[Batch], buffer_rows: int, seed: int, epoch: int = 0) -> Iterator[Batch]:
    """The samples of ``batches``, each exactly once, in an order fixed by ``(seed, epoch)`` (module docstring).

    Yields batches of any size; regroup them with :func:`rebatch`.
    """
    gen = torch.Generator().manual_seed(_derive(_SHUFFLE_SALT, seed, epoch))
    pending: list[Batch] = []
    count = 0
    for batch in batches:
        pending.append(batch)
        count += len(batch)
        if count >= 2 * buffer_rows:
            merged = concat_batches(pending)
            pending = []  # peak: the chunks and their concatenation, then it and its two halves
            order = torch.randperm(count, generator=gen)
            out = count - buffer_rows
            sent, kept = take_rows(merged, order[:out]), take_rows(merged, order[out:])
            del merged
            pending, count = [kept], buffer_rows
            yield sent
    if count:
        yield take_rows(concat_batches(pending), torch.randperm(count, generator=gen))


def rebatch(batches: Iterable[Batch], size: int, drop_last: bool = False) -> Iterator[Batch]:
    """Regroup batches of any sizes into batches of ``size`` samples (the last one smaller unless ``drop_last``)."""
    pending: list[Batch] = []
    count = 0
    for batch in batches:
        if not len(batch):
            continue
        pending.append(batch)
        count += len(batch)
        if count < size:
            continue
        merged = concat_batches(pending)
        start = 0
        while count - start >= size:
            yield slice_rows(merged, start, start + size)
            start += size
        pending = [slice_rows(merged, start, count)] if start < count else []
        count -= start
    if pending and not drop_last:
        yield concat_batches(pending)
