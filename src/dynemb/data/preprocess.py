"""The preprocessing saved with a model: which columns it reads, the type of its ids, how dense values are
normalized, and what a null or non-finite dense value becomes.

The rules are written once, as tables, in docs/cli.md ("Ids, nulls and non-finite values"), and applied by this
module on every path (training statistics, training batches, evaluation, ``dynemb predict``, the endpoint).
Dense rule (:data:`DENSE_RULE`, as the DLRM Criteo recipe plus standardization): each value ``x`` becomes
``z = sign(x) * log1p(|x|)``, then ``(z - mean) / std`` with the mean and standard deviation of the finite ``z`` of
the training rows (a column with ``std == 0`` is only centered); a null or NaN reads as the training mean (0 after
standardization), ``inf`` as the column's largest finite training value and ``-inf`` as its smallest. The log
compresses heavy-tailed counts and amounts; standardizing puts every column on the same scale for the bottom MLP.

Ids are read by :mod:`dynemb.data.arrow_columns` by each column's id type (:attr:`Preprocessing.id_types`), decided
once when a run starts, so that every format and every endpoint datatype gives the same id for the same value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Optional

import torch

from .batch import Batch

__all__ = ["Preprocessing", "DenseStatistics", "NonFiniteCounts", "DataWarning", "dense_statistics",
           "signed_log1p", "DENSE_RULE", "LEGACY_DENSE_RULE"]

DENSE_RULE = "signed_log1p_standardize_finite"
"""The dense rule of the module docstring: statistics over finite values; null/NaN, inf, -inf read as the training
mean, max and min."""
LEGACY_DENSE_RULE = "signed_log1p_standardize"
"""The rule of models trained before :data:`DENSE_RULE`: a null or NaN was the raw value 0, and statistics took
every value. Such a model keeps reading null and NaN as 0 (as it was trained); it recorded no min or max, so
``±inf`` reads as its training mean."""
ID_RULE = ("INT64 columns: integers as they are, text a canonical decimal int64; BYTES columns: XXH64 (seed 0) of "
           "the UTF-8 text (of an integer, its canonical decimal text) as signed int64; null: null_key(column)")

# What each non-finite value reads as, per rule: the words of the warnings.
_READS_AS = {DENSE_RULE: ("the training mean", "the training max", "the training min"),
             LEGACY_DENSE_RULE: ("0", "the training mean", "the training mean")}
_KINDS = ("null/NaN", "inf", "-inf")


class DataWarning(UserWarning):
    """Values of the user's data that a rule replaced (nulls, NaN, ``±inf`` in a dense column), counted per pass.
    ``dynemb`` prints each as one line on stderr."""


def signed_log1p(x: torch.Tensor) -> torch.Tensor:
    """``sign(x) * log1p(|x|)``, elementwise (NaN stays NaN, ``±inf`` stays ``±inf``)."""
    return torch.sign(x) * torch.log1p(x.abs())


class NonFiniteCounts:
    """The null/NaN, ``inf`` and ``-inf`` values of each dense column over a pass, counted on the batches' device
    (no device sync until :attr:`counts` or :meth:`warn`).

    A column whose values are all equal has ``std`` 1.0 (it is only centered).

    Shape:
        :meth:`add` takes ``dense`` ``[B, K]``; :attr:`counts` is ``K`` triples ``(nan, inf, -inf)``.

    Example:
        >>> c = NonFiniteCounts(["x"])
        >>> c.add(torch.tensor([[1.0], [float("nan")], [float("inf")], [float("nan")]]))
        >>> c.counts
        [(2, 1, 0)]
    """

    def __init__(self, columns: Sequence[str]) -> None:
        self.columns = list(columns)
        self._counts: Optional[torch.Tensor] = None

    def add(self, dense: torch.Tensor) -> None:
        """Count the non-finite values of one batch's raw dense features."""
        if dense.shape[1] != len(self.columns):
            raise ValueError(f"dense must have {len(self.columns)} columns, got shape {tuple(dense.shape)}")
        # Count only over the rows that hold a non-finite value: one pass over the batch, the rest on few rows.
        rows = (~torch.isfinite(dense)).any(1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        dense = dense.index_select(0, rows)
        inf = torch.isinf(dense)
        counts = torch.stack([torch.isnan(dense).sum(0), (inf & (dense > 0)).sum(0), (inf & (dense < 0)).sum(0)], 1)
        self._counts = counts if self._counts is None else self._counts + counts

    @property
    def counts(self) -> list[tuple[int, int, int]]:
        """``(null/NaN, inf, -inf)`` of each column."""
        if self._counts is None:
            return [(0, 0, 0)] * len(self.columns)
        return [tuple(row) for row in self._counts.tolist()]

    def warn(self, where: str, rule: str = DENSE_RULE) -> None:
        """One :class:`DataWarning` per column with a non-finite value, naming ``where`` (the data), the column,
        the counts and what they read as under ``rule``, e.g. ``clicks.csv: column 'price': 3 null/NaN values
        read as the training mean, 1 inf value read as the training max``."""
        for name, counts in zip(self.columns, self.counts):
            parts = [f"{_plural(n, kind + ' value')} read as {what}"
                     for n, kind, what in zip(counts, _KINDS, _READS_AS[rule]) if n]
            if parts:
                warnings.warn(f"{where}: column {name!r}: {', '.join(parts)}", DataWarning, stacklevel=2)


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


@dataclasses.dataclass(frozen=True)
class DenseStatistics:
    """What :func:`dense_statistics` measured, one entry per dense column.

    Attributes:
        mean: mean of the finite ``signed_log1p`` values.
        std: their standard deviation (1.0 where it is 0).
        min: the smallest finite raw value.
        max: the largest finite raw value.
        rows: the rows read.
        non_finite: ``(null/NaN, inf, -inf)`` counts.
    """

    mean: list
    std: list
    min: list
    max: list
    rows: int
    non_finite: list


def dense_statistics(batches: Iterable[Batch], columns: Sequence[str], max_rows: Optional[int] = None,
                     where: str = "the training rows") -> DenseStatistics:
    """The statistics of the raw dense features of ``batches`` (at most ``max_rows`` rows) that the dense rule
    needs, over finite values only, with the non-finite values counted; warns once per column that has any.

    Args:
        batches: the training rows, raw (a null is NaN).
        columns: the dense column names, for messages.
        max_rows: read at most this many rows.
        where: the data, for messages (``clicks.parquet``).

    Raises:
        ValueError: a column has no finite value in the rows read (the message names it and the counts).

    Warns:
        DataWarning: one per column with null/NaN or ``±inf`` values, with their counts.

    Shape:
        each ``batch.dense``: ``[B, K]`` -> ``K`` entries in each list.

    Example:
        >>> b = Batch(torch.tensor([[0.0], [3.0], [-1.0]]), {}, torch.zeros(3))
        >>> s = dense_statistics([b], ["x"])
        >>> s.min, s.max, s.rows, s.non_finite
        ([-1.0], [3.0], 3, [(0, 0, 0)])
    """
    columns = list(columns)
    counts = NonFiniteCounts(columns)
    k = len(columns)
    total, square = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    # Sums of z less each column's first finite z: a constant column sums to exactly 0. Plain sums of z and z * z
    # lose a small variance to rounding (a constant 9.5 got std 4e-8, and any other value then normalized to 1e6).
    shift, shifted = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.bool)
    finite = torch.zeros(k, dtype=torch.int64)
    low, high = torch.full((k,), math.inf, dtype=torch.float64), torch.full((k,), -math.inf, dtype=torch.float64)
    rows = 0
    for batch in batches:
        x = batch.dense.double().cpu()
        if max_rows is not None:
            x = x[: max_rows - rows]
        if not len(x):
            continue
        counts.add(x)
        ok = torch.isfinite(x)
        z = signed_log1p(x)
        first = ~shifted & ok.any(0)
        if first.any():
            shift[first] = z[ok.to(torch.uint8).argmax(0), torch.arange(k)][first]
            shifted |= first
        d = torch.where(ok, z - shift, 0.0)
        total, square, finite = total + d.sum(0), square + (d * d).sum(0), finite + ok.sum(0)
        low = torch.minimum(low, torch.where(ok, x, math.inf).amin(0))
        high = torch.maximum(high, torch.where(ok, x, -math.inf).amax(0))
        rows += len(x)
        if max_rows is not None and rows >= max_rows:
            break
    for name, n, (nan, pinf, ninf) in zip(columns, finite.tolist(), counts.counts):
        if not n:
            raise ValueError(f"{where}: dense column {name!r} has no finite value in its {rows:,} rows "
                             f"({nan:,} null/NaN, {pinf:,} inf, {ninf:,} -inf); the dense rule needs numbers")
    counts.warn(where)
    n = finite.double()
    mean = total / n
    std = (square / n - mean * mean).clamp(min=0).sqrt()
    return DenseStatistics((shift + mean).tolist(), [s if s > 1e-12 else 1.0 for s in std.tolist()], low.tolist(),
                           high.tolist(), rows, counts.counts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preprocessing:
    """The columns a model reads, the type of its ids and the normalization of its dense features.

    Attributes:
        label: the label column (``None`` for a model that only scores).
        categorical: one-id-per-row categorical columns, one table each.
        multi_hot: list columns, pooled per row (the table's combiner, mean by default), one table each.
        dense: dense columns, in the order of the model's dense input.
        dense_mean: mean of ``signed_log1p`` of each dense column's finite values over the training rows.
        dense_std: its standard deviation (1.0 where it was 0).
        dense_min: each dense column's smallest finite training value (raw): what ``-inf`` reads as.
        dense_max: its largest finite training value (raw): what ``inf`` reads as.
        dense_rows: the number of training rows the statistics came from.
        list_separator: separator of the ids of a multi-hot CSV field.
        id_types: each categorical and multi-hot column's id type, ``"INT64"`` or ``"BYTES"`` (see
            :mod:`dynemb.data.arrow_columns`); a column not named is ``BYTES``.
        dense_rule: :data:`DENSE_RULE`, or :data:`LEGACY_DENSE_RULE` for a model card written before it (then
            ``dense_min`` and ``dense_max`` are empty).

    Raises:
        ValueError: the statistics do not have one entry per dense column, a std is not positive, a min or max
            is not finite, or an id type names another column or another type.
    """

    label: Optional[str]
    categorical: tuple[str, ...]
    multi_hot: tuple[str, ...] = ()
    dense: tuple[str, ...] = ()
    dense_mean: tuple[float, ...] = ()
    dense_std: tuple[float, ...] = ()
    dense_min: tuple[float, ...] = ()
    dense_max: tuple[float, ...] = ()
    dense_rows: int = 0
    list_separator: str = "|"
    id_types: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)
    dense_rule: str = DENSE_RULE

    def __post_init__(self) -> None:
        for name in ("categorical", "multi_hot", "dense", "dense_mean", "dense_std", "dense_min", "dense_max"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.dense_rule not in _READS_AS:
            raise ValueError(f"dense_rule must be one of {list(_READS_AS)}, got {self.dense_rule!r}")
        k = len(self.dense)
        bounds = k if self.dense_rule == DENSE_RULE else 0
        if (len(self.dense_mean), len(self.dense_std), len(self.dense_min), len(self.dense_max)) != (k, k, bounds,
                                                                                                     bounds):
            raise ValueError(f"dense_mean, dense_std, dense_min and dense_max must have one entry per dense column "
                             f"({k}), got {len(self.dense_mean)}, {len(self.dense_std)}, {len(self.dense_min)} and "
                             f"{len(self.dense_max)}")
        if not all(s > 0 and math.isfinite(s) for s in self.dense_std):
            raise ValueError(f"dense_std must be positive and finite, got {list(self.dense_std)}")
        if not all(math.isfinite(v) for v in (*self.dense_mean, *self.dense_min, *self.dense_max)):
            raise ValueError("dense_mean, dense_min and dense_max must be finite")
        types = dict(self.id_types)
        unknown = sorted(set(types) - set(self.features))
        if unknown or not all(t in ("INT64", "BYTES") for t in types.values()):
            raise ValueError(f"id_types must map id columns {self.features} to 'INT64' or 'BYTES', got {types}")
        object.__setattr__(self, "id_types", {f: types.get(f, "BYTES") for f in self.features})

    @property
    def features(self) -> list[str]:
        """The model's categorical features: the categorical columns, then the multi-hot ones."""
        return [*self.categorical, *self.multi_hot]

    def normalize(self, batch: Batch) -> Batch:
        """``batch`` with its raw dense features normalized by the dense rule (module docstring): every value
        comes out finite. Silent: :meth:`normalized` counts what it replaces.

        Shape:
            ``batch.dense``: ``[B, K]`` -> ``[B, K]``.

        Example:
            >>> prep = Preprocessing(label=None, categorical=("c",), dense=("x",), dense_mean=(1.0,),
            ...                      dense_std=(0.5,), dense_min=(0.0,), dense_max=(3.0,), dense_rows=9)
            >>> x = torch.tensor([[float("nan")], [float("inf")], [3.0], [float("-inf")], [0.0]])
            >>> prep.normalize(Batch(x, {"c": torch.zeros(5, dtype=torch.int64)}, torch.zeros(5))).dense[:, 0]
            tensor([ 0.0000,  0.7726,  0.7726, -2.0000, -2.0000])
        """
        if not self.dense:
            return batch
        from ..kernels.numba_dense import normalize_dense, takes

        mean, std, nan, inf, ninf = self._constants(batch.dense.device)
        x = batch.dense
        if takes(x):  # one pass after torch's log1p instead of 7 small ops (~0.1 ms of a request); the same bits
            x = x.contiguous()
            logs = torch.log1p(x.abs())
            out = torch.empty_like(x)
            normalize_dense(x.numpy(), logs.numpy(), *self._constant_arrays(), out.numpy())
            return batch.with_dense(out)
        z = signed_log1p(x)
        # On the CPU a check costs less than the three replacements when every value is finite (a served request's
        # usual case: 3 small ops instead of 6); on a GPU it would wait for the device.
        if z.device.type != "cpu" or not bool(torch.isfinite(z).all()):
            z = torch.where(torch.isnan(z), nan, torch.where(z == math.inf, inf, torch.where(z == -math.inf, ninf, z)))
        return batch.with_dense((z - mean) / std)

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(mean, std, what NaN, inf and -inf read as)`` of each column, in the ``z`` space, as float32 ``[K]``:
        made once per device (a served model normalizes every request with them)."""
        kept = self._kept_constants.get(device)
        if kept is None:
            kept = self._kept_constants[device] = self._make_constants(device)
        return kept

    def _constant_arrays(self) -> tuple:
        """:meth:`_constants` on the CPU as numpy arrays (the kernel's arguments), made once."""
        kept = self._kept_constants.get("numpy")
        if kept is None:
            kept = self._kept_constants["numpy"] = tuple(c.numpy() for c in self._constants(torch.device("cpu")))
        return kept

    @functools.cached_property
    def _kept_constants(self) -> dict:
        return {}  # in the instance's __dict__: not a field (equality, to_dict and copies ignore it)

    def _make_constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        mean = torch.tensor(self.dense_mean, dtype=torch.float32, device=device)
        std = torch.tensor(self.dense_std, dtype=torch.float32, device=device)
        if self.dense_rule == LEGACY_DENSE_RULE:
            return mean, std, torch.zeros_like(mean), mean, mean
        low = signed_log1p(torch.tensor(self.dense_min, dtype=torch.float32, device=device))
        high = signed_log1p(torch.tensor(self.dense_max, dtype=torch.float32, device=device))
        return mean, std, mean, high, low

    def normalized(self, batches: Iterable[Batch], where: str) -> Iterator[Batch]:
        """:meth:`normalize` of each of ``batches``, counting the non-finite values; when the batches are all
        read, one :class:`DataWarning` per column that had any, naming ``where`` (the data read)."""
        counts = NonFiniteCounts(self.dense)
        for batch in batches:
            if self.dense:
                counts.add(batch.dense)
            yield self.normalize(batch)
        counts.warn(where, self.dense_rule)

    def to_json(self) -> dict:
        """A JSON object: the fields, the dense rule, the id rule and each column's null key."""
        from .string_ids import null_key

        return {**dataclasses.asdict(self), "id_types": dict(self.id_types), "id_rule": ID_RULE,
                "null_keys": {c: null_key(c) for c in self.features}}

    @classmethod
    def from_json(cls, obj: dict, data: Optional[dict] = None) -> Preprocessing:
        """The preprocessing saved by :meth:`to_json`.

        A card written before the preprocessing held ``id_types`` gets them from ``data`` (the card's ``data``
        object): a Parquet run's recorded ``data.id_types``, ``BYTES`` for Criteo (hex text), ``INT64`` for
        synthetic data. Any other such card (a CSV run, which read each id value by value) is refused: no id type
        reads its ids as it was trained.

        Raises:
            ValueError: an unknown dense rule, or an old card whose id types cannot be told.
        """
        rule = obj.get("dense_rule")
        if rule not in _READS_AS:
            raise ValueError(f"dense_rule must be one of {list(_READS_AS)}, got {rule!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in obj.items() if k in fields}
        if "id_types" not in obj:  # a card written before the preprocessing held them
            data = data or {}
            if data.get("synthetic"):  # integer ids, made as integers
                values["id_types"] = dict.fromkeys([*obj.get("categorical", ()), *obj.get("multi_hot", ())], "INT64")
            elif data.get("format") == "criteo":  # hex text
                values["id_types"] = {}
            elif data.get("format") == "parquet" and data.get("id_types"):
                values["id_types"] = data["id_types"]
            else:
                raise ValueError("the model card has no id types (it was written by an older dynemb, which read "
                                 "ids by their file format, or CSV ids value by value): retrain the run")
        return cls(**values)
