"""The preprocessing saved with a model: which columns it reads, and how dense values are normalized.

Dense rule (as the DLRM Criteo recipe, plus standardization): each value ``x`` (a null or NaN is 0) becomes
``z = sign(x) * log1p(|x|)``, then ``(z - mean) / std`` with the mean and standard deviation of ``z`` over the
training rows (a column with ``std == 0`` is only centered). The log compresses heavy-tailed counts and amounts;
standardizing puts every column on the same scale for the bottom MLP.

Ids are read by :mod:`dynemb.data.columns`: integers as they are, strings hashed with XXH64
(:func:`dynemb.data.hash_strings`), a null as :func:`dynemb.data.null_key` of its column. Nothing about ids is
learned from the data, so the same rule serves training, evaluation and serving.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Optional

import torch

from .batch import Batch

__all__ = ["Preprocessing", "dense_statistics", "signed_log1p"]

DENSE_RULE = "signed_log1p_standardize"
ID_RULE = "integers as they are; strings XXH64 (seed 0) of the UTF-8 bytes as signed int64; null: null_key(column)"


def signed_log1p(x: torch.Tensor) -> torch.Tensor:
    """``sign(x) * log1p(|x|)``, elementwise."""
    return torch.sign(x) * torch.log1p(x.abs())


def dense_statistics(batches: Iterable[Batch], max_rows: Optional[int] = None) -> tuple[list, list, int]:
    """``(mean, std, rows)`` of ``signed_log1p(dense)`` over the rows of ``batches`` (at most ``max_rows``).

    A column whose values are all equal has ``std`` 1.0 (it is only centered).

    Shape:
        each ``batch.dense``: ``[B, K]`` -> ``mean``, ``std``: ``K`` floats.

    Example:
        >>> from dynemb.data.batch import Batch
        >>> dense = torch.tensor([[9.5, 0.0], [9.5, math.e - 1]])
        >>> mean, std, rows = dense_statistics([Batch(dense=dense, sparse={}, labels=torch.zeros(2))])
        >>> [round(s, 6) for s in std], rows
        ([1.0, 0.5], 2)
    """
    shift, total, square, rows = None, None, None, 0
    for batch in batches:
        z = signed_log1p(batch.dense.double())
        if max_rows is not None:
            z = z[: max_rows - rows]
        if z.shape[0]:
            # Sums of z less the first row's: a constant column sums to exactly 0. Sums of z and z * z lose a small
            # variance to rounding, and a constant 9.5 got std 4e-8: any other value then normalized to 1e6.
            shift = z[0] if shift is None else shift
            d = z - shift
            total = d.sum(0) if total is None else total + d.sum(0)
            square = (d * d).sum(0) if square is None else square + (d * d).sum(0)
            rows += z.shape[0]
        if max_rows is not None and rows >= max_rows:
            break
    if not rows:
        return [], [], 0
    mean = total / rows
    std = (square / rows - mean * mean).clamp(min=0).sqrt()
    return (shift + mean).tolist(), [s if s > 1e-12 else 1.0 for s in std.tolist()], rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preprocessing:
    """The columns a model reads and the normalization of its dense features.

    Attributes:
        label: the label column (``None`` for a model that only scores).
        categorical: one-id-per-row categorical columns, one table each.
        multi_hot: list columns, pooled per row (the table's combiner, mean by default), one table each.
        dense: dense columns, in the order of the model's dense input.
        dense_mean: mean of ``signed_log1p`` of each dense column over the training rows.
        dense_std: its standard deviation (1.0 where it was 0).
        dense_rows: the number of training rows the statistics came from.
        list_separator: separator of the ids of a multi-hot CSV field.

    Raises:
        ValueError: the statistics do not have one entry per dense column, or a std is not positive.
    """

    label: Optional[str]
    categorical: tuple[str, ...]
    multi_hot: tuple[str, ...] = ()
    dense: tuple[str, ...] = ()
    dense_mean: tuple[float, ...] = ()
    dense_std: tuple[float, ...] = ()
    dense_rows: int = 0
    list_separator: str = "|"

    def __post_init__(self) -> None:
        for name in ("categorical", "multi_hot", "dense", "dense_mean", "dense_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(self.dense_mean) != len(self.dense) or len(self.dense_std) != len(self.dense):
            raise ValueError(f"dense_mean and dense_std must have one entry per dense column ({len(self.dense)}), "
                             f"got {len(self.dense_mean)} and {len(self.dense_std)}")
        if not all(s > 0 and math.isfinite(s) for s in self.dense_std):
            raise ValueError(f"dense_std must be positive and finite, got {list(self.dense_std)}")

    @property
    def features(self) -> list[str]:
        """The model's categorical features: the categorical columns, then the multi-hot ones."""
        return [*self.categorical, *self.multi_hot]

    def normalize(self, batch: Batch) -> Batch:
        """``batch`` with its dense features normalized by the rule of the module docstring."""
        if not self.dense:
            return batch
        mean = torch.tensor(self.dense_mean, dtype=torch.float32, device=batch.dense.device)
        std = torch.tensor(self.dense_std, dtype=torch.float32, device=batch.dense.device)
        dense = (signed_log1p(batch.dense) - mean) / std
        return Batch(dense, batch.sparse, batch.labels, batch.offsets)

    def to_json(self) -> dict:
        """A JSON object: the fields, the dense rule, the id rule and each column's null key."""
        from .hashing import null_key

        return {**dataclasses.asdict(self), "dense_rule": DENSE_RULE, "id_rule": ID_RULE,
                "null_keys": {c: null_key(c) for c in self.features}}

    @classmethod
    def from_json(cls, obj: dict) -> Preprocessing:
        """The preprocessing saved by :meth:`to_json`.

        Raises:
            ValueError: the object was written with another dense rule.
        """
        if obj.get("dense_rule") != DENSE_RULE:
            raise ValueError(f"dense_rule must be {DENSE_RULE!r}, got {obj.get('dense_rule')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in fields})
