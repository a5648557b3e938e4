"""Where ``dynemb train`` gets its batches: the user's files (held-out split, epochs, shuffle) or synthetic logs.

Both give the same three things: the training batches of an epoch, the held-out batches, and the training rows'
dense features (for the normalization statistics). Batches come out raw; the job normalizes them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Optional

from ..data import FileReader, SyntheticClickLog
from ..data.batch import Batch
from ..data.stream import rebatch, shuffled, split

__all__ = ["FileSource", "SyntheticSource", "epochs", "every_nth"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FileSource:
    """Batches from ``train`` and, for held-out rows, from ``held`` or from a seeded split of ``train``.

    Attributes:
        train: the reader of the training file(s).
        held: the reader of a separate held-out file, or ``None`` to hold out ``eval_fraction`` of ``train``.
        eval_fraction: the share of ``train``'s rows held out when ``held`` is ``None``.
        seed: the seed of the split and of the epochs' shuffles.
        shuffle_buffer: rows of the shuffle window (see :mod:`dynemb.data.stream`).
    """

    train: FileReader
    held: Optional[FileReader]
    eval_fraction: float
    seed: int
    shuffle_buffer: int

    def training_rows(self) -> Iterator[Batch]:
        """The training rows in file order, in chunks of any size."""
        fraction = 0.0 if self.held is not None else self.eval_fraction
        return split(self.train.chunks(), fraction, self.seed, "train")

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """Every training row once, shuffled by ``(seed, epoch)``, in batches of the reader's batch size."""
        return rebatch(shuffled(self.training_rows(), self.shuffle_buffer, self.seed, epoch), self.train.batch_size)

    def held_out(self) -> Iterator[Batch]:
        """The held-out rows in file order, in batches of the reader's batch size."""
        if self.held is not None:
            return iter(self.held)
        return rebatch(split(self.train.chunks(), self.eval_fraction, self.seed, "eval"), self.train.batch_size)


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """The synthetic click log's ``train`` split (an endless stream) and ``eval_batches`` of its ``eval`` split."""

    log: SyntheticClickLog
    eval_batches: int

    def training_rows(self) -> Iterator[Batch]:
        return self.log.batches("train", num_batches=64)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        return self.log.batches("train") if epoch == 0 else iter(())

    def held_out(self) -> Iterator[Batch]:
        return self.log.batches("eval", num_batches=self.eval_batches)


def epochs(source, count: Optional[int]) -> Iterator[Batch]:
    """The batches of ``count`` epochs of ``source`` in a row (``None``: without end)."""
    indices = itertools.count() if count is None else range(count)
    return itertools.chain.from_iterable(source.epoch(e) for e in indices)


def every_nth(batches: Iterator[Batch], rank: int, world: int) -> Iterator[Batch]:
    """Batch ``rank`` of each complete group of ``world`` batches: every rank gets as many batches (torchrun)."""
    if world == 1:
        yield from batches
        return
    while len(group := list(itertools.islice(batches, world))) == world:
        yield group[rank]
