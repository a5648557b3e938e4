"""The mini-batch type shared by the synthetic generator and the file readers, and the row operations on it
(concatenate, slice, gather) that keep multi-hot bags whole."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

import torch

__all__ = ["Batch", "concat_batches", "slice_rows", "take_rows"]


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} tensor of shape {tuple(t.shape)}"


def _check(t, name: str, dtype: torch.dtype, shape: tuple) -> None:
    """``shape`` entries of ``None`` match any size."""
    ok = isinstance(t, torch.Tensor) and t.dtype == dtype and t.dim() == len(shape)
    if not ok or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        expected = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must be a {dtype} tensor of shape {expected}, got {_describe(t)}")


@dataclasses.dataclass(frozen=True)
class Batch:
    """One mini-batch of click-log samples: dense features, categorical ids per feature and 0/1 labels.

    A feature listed in ``offsets`` is multi-hot: its ids are the concatenated bags of the ``B`` samples and
    ``offsets[name]`` holds the ``B + 1`` bag boundaries (EmbeddingBag style, ending with the number of ids).
    Any other feature has exactly one id per sample.

    Args:
        dense: float32 dense features.
        sparse: feature name -> int64 ids. Every int64 value is a valid id.
        labels: float32 labels, 0.0 or 1.0.
        offsets: feature name -> int64 bag offsets, for multi-hot features only.

    Raises:
        ValueError: a field has the wrong dtype or shape (the message names the field).

    Shape:
        ``dense``: ``[B, num_dense]``; ``labels``: ``[B]``; ``sparse[name]``: ``[B]``, or ``[N]`` with
        ``offsets[name]``: ``[B + 1]``.

    Example:
        >>> b = Batch(torch.zeros(2, 3), {"C1": torch.tensor([7, -7])}, torch.tensor([0.0, 1.0]))
        >>> len(b), b.sparse["C1"].tolist()
        (2, [7, -7])
    """

    dense: torch.Tensor
    sparse: Mapping[str, torch.Tensor]
    labels: torch.Tensor
    offsets: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check(self.labels, "labels", torch.float32, (None,))
        b = self.labels.shape[0]
        _check(self.dense, "dense", torch.float32, (b, None))
        unknown = sorted(set(self.offsets) - set(self.sparse))
        if unknown:
            raise ValueError(f"offsets must name features of sparse {sorted(self.sparse)}, got unknown {unknown}")
        for name, ids in self.sparse.items():
            multi = name in self.offsets
            _check(ids, f"sparse[{name!r}]", torch.int64, (None,) if multi else (b,))
            if multi:
                _check(self.offsets[name], f"offsets[{name!r}]", torch.int64, (b + 1,))

    def __len__(self) -> int:
        return self.labels.shape[0]

    def with_dense(self, dense: torch.Tensor) -> Batch:
        """This batch with ``dense`` (float32 ``[B, num_dense]``) in place of its dense features; only they are
        checked again (a served model normalizes every request's: checking its ids again would cost more).

        Raises:
            ValueError: ``dense`` has the wrong dtype or shape.
        """
        _check(dense, "dense", torch.float32, (len(self), None))
        new = copy.copy(self)  # frozen: the fields are set as __init__ would, without __post_init__'s checks
        object.__setattr__(new, "dense", dense)
        return new

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """This batch with every tensor on ``device``."""

        def move(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {k: v.to(device, non_blocking=non_blocking) for k, v in tensors.items()}

        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            move(self.sparse),
            self.labels.to(device, non_blocking=non_blocking),
            move(self.offsets),
        )


def concat_batches(batches) -> Batch:
    """The samples of ``batches`` (a non-empty sequence with the same features) in order, as one batch.

    Shape:
        ``B_1, B_2, ...`` samples -> ``sum(B_i)`` samples; a multi-hot feature's ids are concatenated and its
        offsets rebased.
    """
    batches = list(batches)
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    offsets = {}
    for name in first.offsets:
        parts = [b.offsets[name] for b in batches]
        ends = torch.stack([p[-1] for p in parts])
        shifts = torch.cumsum(ends, 0) - ends
        offsets[name] = torch.cat([p[:-1] + s for p, s in zip(parts, shifts)] + [ends.sum().reshape(1)])
    return Batch(
        torch.cat([b.dense for b in batches]),
        {name: torch.cat([b.sparse[name] for b in batches]) for name in first.sparse},
        torch.cat([b.labels for b in batches]),
        offsets,
    )


def slice_rows(batch: Batch, start: int, stop: int) -> Batch:
    """Samples ``start:stop`` of ``batch`` (views, no copy)."""
    sparse, offsets = {}, {}
    for name, ids in batch.sparse.items():
        if name in batch.offsets:
            bounds = batch.offsets[name][start : stop + 1]
            sparse[name] = ids[int(bounds[0]) : int(bounds[-1])]
            offsets[name] = bounds - bounds[0]
        else:
            sparse[name] = ids[start:stop]
    return Batch(batch.dense[start:stop], sparse, batch.labels[start:stop], offsets)


def take_rows(batch: Batch, index: torch.Tensor) -> Batch:
    """The samples of ``batch`` at ``index`` (int64, any order, repeats allowed), as a new batch.

    Shape:
        ``index``: ``[K]`` -> a batch of ``K`` samples; a multi-hot sample keeps its whole bag.
    """
    sparse, offsets = {}, {}
    for name, ids in batch.sparse.items():
        if name in batch.offsets:
            sparse[name], offsets[name] = _take_bags(ids, batch.offsets[name], index)
        else:
            sparse[name] = ids.index_select(0, index)
    return Batch(batch.dense.index_select(0, index), sparse, batch.labels.index_select(0, index), offsets)


def _take_bags(ids: torch.Tensor, offsets: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    starts = offsets[:-1].index_select(0, index)
    lengths = offsets[1:].index_select(0, index) - starts
    new = torch.zeros(index.numel() + 1, dtype=torch.int64, device=offsets.device)
    torch.cumsum(lengths, 0, out=new[1:])
    total = int(new[-1])
    positions = torch.repeat_interleave(starts - new[:-1], lengths, output_size=total)
    positions += torch.arange(total, device=ids.device)
    return ids.index_select(0, positions), new
