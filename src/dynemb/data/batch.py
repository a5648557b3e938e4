"""The mini-batch type shared by the synthetic generator and the file readers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

__all__ = ["Batch"]


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
