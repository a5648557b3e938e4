"""Synthetic click logs: power-law categorical ids over the whole int64 range, dense features, and labels drawn
from a hidden logistic model, so that AUC is meaningful and every batch is reproducible from the seed.

The hidden model. Feature ``f`` (0-based) has a vocabulary of ``V_f`` ids; the id of rank ``r`` (0 = most
frequent) is ``mix64(((f << 40) | r) ^ k)`` for a seed-derived ``k``: a bijection, so ids are distinct across
features and spread evenly over all of int64, negatives included. Ranks follow a truncated continuous power law,
``P(rank >= r) ~ r ** (1 - alpha)``. Each id has a latent weight ``sigma_f * w(id)``, with ``w`` a standard normal
that is a pure function of ``(seed, id)`` (the counter-based :class:`dynemb.table.Normal` initializer), so the
ground truth needs no stored state and is the same for every split. The logit of a sample is::

    bias + sum_f sum(sigma_f * w(id) for id in bag_f) / sqrt(len(bag_f)) + dense @ v

Dense features are iid standard normal (already normalized). ``signal`` is the standard deviation of the logit
without the bias; ``dense_share`` of its variance comes from the dense term and the rest is split unevenly over the
categorical features. The bias is solved numerically so that the mean click rate is ``ctr``.

Batch ``i`` of a split is drawn from its own counter-based generator seeded by ``(seed, split, i)``, so batches
can be produced in any order, skipped over (resume) or sharded across ranks at no cost.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

import torch

from ..checks import check_int, is_int
from ..table.hashing import GOLDEN, mix64
from ..table.initializers import Normal
from .batch import Batch

__all__ = ["SyntheticClickLog", "SPLITS", "CRITEO_VOCAB_SIZES"]

SPLITS = ("train", "eval")

# Cardinalities of the 26 categorical columns of the Criteo Kaggle display-advertising data set.
CRITEO_VOCAB_SIZES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

_RANK_BITS = 40
_SEED_LIMIT = 2**63
_UNIT_NORMAL = Normal(0.0, 1.0)
_CALIBRATION_SAMPLES = 4096


def _derive(*parts: int) -> int:
    """A non-negative 63-bit seed that is a pure function of the integer ``parts``."""
    h = torch.zeros((), dtype=torch.int64)
    for part in parts:
        h = mix64((h ^ part) + GOLDEN)
    return int(h) & (_SEED_LIMIT - 1)


@dataclasses.dataclass(frozen=True)
class SyntheticClickLog:
    """An endless, reproducible stream of synthetic click-log batches (see the module docstring for the model).

    Nothing is materialized: each batch is generated on demand, in ``O(batch_size)`` memory.

    Args:
        num_categorical: number of categorical features ``F``, named ``C1 .. CF``.
        num_dense: number of dense features, named ``I1 .. I{num_dense}``.
        vocab_sizes: distinct ids per feature: one int for all, or ``F`` ints, each in ``[1, 2**40]``.
            Default: the Criteo Kaggle cardinalities (3 to 10M) when ``F == 26``, else 100,000.
        alpha: power-law exponent of the id frequencies (``>= 0``; 0 is uniform, larger is more skewed).
        batch_size: samples per batch ``B``.
        ids_per_feature: ``L``. 1 gives one id per sample and feature; above 1 every feature is multi-hot, with
            bag lengths uniform in ``[1, L]`` and ``Batch.offsets`` set.
        ctr: target mean click rate, in ``(0, 1)``.
        signal: standard deviation of the hidden logit without its bias (``>= 0``); sets the AUC ceiling.
        dense_share: fraction of the logit variance carried by the dense features, in ``[0, 1]``.
        seed: the world seed in ``[0, 2**63)``: it fixes the id mapping, the hidden model and every stream.

    Raises:
        ValueError: an argument is out of range (the message names it).

    Shape:
        Each batch: ``dense`` ``[B, num_dense]`` float32, ``sparse[name]`` ``[B]`` int64 (or ``[N]`` with
        ``offsets[name]`` ``[B + 1]``), ``labels`` ``[B]`` float32.

    Example:
        >>> log = SyntheticClickLog(batch_size=4, seed=7)
        >>> batch = next(log.batches())
        >>> batch.dense.shape, len(batch.sparse), batch.labels.shape
        (torch.Size([4, 13]), 26, torch.Size([4]))
        >>> torch.equal(batch.sparse["C3"], log.batch(0).sparse["C3"])  # batch 0 of "train", regenerated
        True
        >>> log.logits(batch).shape  # the hidden model's logits: the AUC ceiling
        torch.Size([4])
    """

    num_categorical: int = 26
    num_dense: int = 13
    vocab_sizes: int | tuple[int, ...] | None = None
    alpha: float = 1.05
    batch_size: int = 4096
    ids_per_feature: int = 1
    ctr: float = 0.25
    signal: float = 2.0
    dense_share: float = 0.25
    seed: int = 0
    _sigma: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    _dense_weight: torch.Tensor = dataclasses.field(init=False, repr=False, compare=False)
    _bias: float = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int(self.num_categorical, "num_categorical", minimum=1)
        check_int(self.num_dense, "num_dense", minimum=0)
        check_int(self.batch_size, "batch_size", minimum=1)
        check_int(self.ids_per_feature, "ids_per_feature", minimum=1)
        if self.num_categorical >= 2 ** (63 - _RANK_BITS):
            raise ValueError(f"num_categorical must be < {2 ** (63 - _RANK_BITS)}, got {self.num_categorical}")
        object.__setattr__(self, "vocab_sizes", self._normalized_vocab())
        _check_range("alpha", self.alpha, 0.0, math.inf)
        _check_range("ctr", self.ctr, 0.0, 1.0, closed=False)
        _check_range("signal", self.signal, 0.0, math.inf)
        _check_range("dense_share", self.dense_share, 0.0, 1.0)
        check_int(self.seed, "seed", minimum=0, maximum=_SEED_LIMIT - 1)
        self._init_hidden_model()

    # ------------------------------------------------------------------ public
    @property
    def categorical_names(self) -> tuple[str, ...]:
        """Names of the categorical features: ``("C1", ..., "CF")``."""
        return tuple(f"C{i + 1}" for i in range(self.num_categorical))

    @property
    def dense_names(self) -> tuple[str, ...]:
        """Names of the dense features: ``("I1", ...)``."""
        return tuple(f"I{i + 1}" for i in range(self.num_dense))

    def batch(self, index: int, split: str = "train") -> Batch:
        """Batch number ``index`` (``>= 0``) of ``split`` (``"train"`` or the held-out ``"eval"``)."""
        check_int(index, "index", minimum=0)
        gen = torch.Generator().manual_seed(_derive(self.seed, 5, _split_id(split), index))
        return self._sample(self.batch_size, gen)

    def batches(
        self, split: str = "train", num_batches: int | None = None, start: int = 0, step: int = 1
    ) -> Iterator[Batch]:
        """Batches ``start, start + step, ...`` of ``split``: forever, or ``num_batches`` of them.

        ``start`` resumes a stream; ``start=rank, step=world_size`` gives each rank a disjoint shard.
        """
        _split_id(split)
        check_int(num_batches, "num_batches", minimum=0, allow_none=True)
        check_int(start, "start", minimum=0)
        check_int(step, "step", minimum=1)
        indices = itertools.count(start, step)
        if num_batches is not None:
            indices = itertools.islice(indices, num_batches)
        return (self.batch(i, split) for i in indices)

    def logits(self, batch: Batch) -> torch.Tensor:
        """The hidden model's logit for each sample of ``batch`` (``[B]`` float32, on the batch's device).

        Raises:
            ValueError: ``batch`` lacks a feature of this generator or has the wrong number of dense features.
        """
        missing = [name for name in self.categorical_names if name not in batch.sparse]
        if missing or batch.dense.shape[1] != self.num_dense:
            raise ValueError(
                f"batch must have sparse features {list(self.categorical_names)} and {self.num_dense} dense "
                f"features, got sparse {sorted(batch.sparse)} and {batch.dense.shape[1]} dense"
            )
        return self._logits(batch.sparse, batch.offsets, batch.dense)

    # ------------------------------------------------------------------ hidden model
    def _normalized_vocab(self) -> tuple[int, ...]:
        vocab = self.vocab_sizes
        if vocab is None:
            vocab = CRITEO_VOCAB_SIZES if self.num_categorical == len(CRITEO_VOCAB_SIZES) else 100_000
        if is_int(vocab):
            vocab = (vocab,) * self.num_categorical
        vocab = tuple(vocab)
        bad = [v for v in vocab if not is_int(v) or not 1 <= v <= 2**_RANK_BITS]
        if len(vocab) != self.num_categorical or bad:
            raise ValueError(
                f"vocab_sizes must be an int or {self.num_categorical} ints (one per feature), each in "
                f"[1, 2**{_RANK_BITS}], got {self.vocab_sizes!r}"
            )
        return vocab

    def _init_hidden_model(self) -> None:
        gen = torch.Generator().manual_seed(_derive(self.seed, 3))
        share = torch.exp(0.75 * torch.randn(self.num_categorical, generator=gen, dtype=torch.float64))
        sparse_var = (1.0 - self.dense_share) * self.signal**2
        object.__setattr__(self, "_sigma", (sparse_var * share / share.sum()).sqrt().float())
        v = torch.randn(self.num_dense, generator=gen, dtype=torch.float64)
        v = v / v.norm().clamp(min=1e-12) * math.sqrt(self.dense_share) * self.signal
        object.__setattr__(self, "_dense_weight", v.float())
        object.__setattr__(self, "_bias", 0.0)
        calibration = self._sample(_CALIBRATION_SAMPLES, torch.Generator().manual_seed(_derive(self.seed, 4)))
        object.__setattr__(self, "_bias", _solve_bias(self.logits(calibration).double(), self.ctr))

    def _sample(self, n: int, gen: torch.Generator) -> Batch:
        f, length = self.num_categorical, self.ids_per_feature
        if length == 1:
            lengths = torch.ones(f, n, dtype=torch.int64)
        else:
            lengths = torch.randint(1, length + 1, (f, n), generator=gen)
        feature = torch.arange(f).repeat_interleave(n if length == 1 else lengths.sum(1))
        u = torch.rand(feature.numel(), generator=gen, dtype=torch.float64)
        ids = mix64(((feature << _RANK_BITS) | self._ranks(u, feature)) ^ _derive(self.seed, 1))
        sparse = dict(zip(self.categorical_names, ids.split(lengths.sum(1).tolist())))
        offsets = {}
        if length > 1:
            bounds = torch.cat([torch.zeros(f, 1, dtype=torch.int64), lengths.cumsum(1)], dim=1)
            offsets = dict(zip(self.categorical_names, bounds.unbind(0)))
        dense = torch.randn(n, self.num_dense, generator=gen)
        click_prob = torch.sigmoid(self._logits(sparse, offsets, dense))
        labels = (torch.rand(n, generator=gen) < click_prob).float()
        return Batch(dense, sparse, labels, offsets)

    def _ranks(self, u: torch.Tensor, feature: torch.Tensor) -> torch.Tensor:
        """Inverse CDF of the power law on ``[1, V + 1)``, floored to ranks ``0 .. V - 1``."""
        top = torch.tensor(self.vocab_sizes, dtype=torch.float64)[feature] + 1.0
        if abs(1.0 - self.alpha) < 1e-9:
            x = torch.exp(u * torch.log(top))
        else:
            e = 1.0 - self.alpha
            x = torch.pow(1.0 - u * (1.0 - torch.pow(top, e)), 1.0 / e)
        return torch.minimum(x.long() - 1, top.long() - 2).clamp_(min=0)

    def _logits(self, sparse, offsets, dense) -> torch.Tensor:
        ids, feature, sample, scale = _flatten(sparse, offsets, self.categorical_names, dense.shape[0])
        w = _UNIT_NORMAL(ids, 1, torch.float32, _derive(self.seed, 2)).squeeze(1)
        w = w * self._sigma.to(ids.device)[feature]
        if scale is not None:
            w = w * scale
        z = torch.full((dense.shape[0],), self._bias, device=dense.device).index_add_(0, sample, w)
        return z + (dense * self._dense_weight.to(dense.device)).sum(1)


def _check_range(name: str, value, low: float, high: float, closed: bool = True) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    inside = number and (low <= value <= high if closed else low < value < high)
    if not inside or (number and math.isnan(value)):
        brackets = "[]" if closed else "()"
        raise ValueError(f"{name} must be a number in {brackets[0]}{low}, {high}{brackets[1]}, got {value!r}")


def _split_id(split) -> int:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return SPLITS.index(split)


def _solve_bias(z: torch.Tensor, ctr: float) -> float:
    """The ``b`` with ``mean(sigmoid(z + b)) == ctr``, by bisection (the mean is increasing in ``b``)."""
    low, high = -40.0, 40.0
    for _ in range(60):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if float(torch.sigmoid(z + mid).mean()) < ctr else (low, mid)
    return round(0.5 * (low + high), 6)  # rounded so that float noise in the mean cannot move the hidden model


def _flatten(sparse, offsets, names, b: int):
    """Feature-major flat ids of ``names`` with, per id, its feature index, its sample index and ``1/sqrt(bag)``
    (``None`` when every feature has one id per sample: the common case skips the costly tensor repeats)."""
    device = sparse[names[0]].device
    ids = torch.cat([sparse[name] for name in names])
    features = torch.arange(len(names), device=device)
    if not offsets:
        return ids, features.repeat_interleave(b), torch.arange(b, device=device).repeat(len(names)), None
    one = torch.ones(b, dtype=torch.int64, device=device)
    lengths = torch.cat([offsets[name].diff() if name in offsets else one for name in names])
    feature = features.repeat_interleave(lengths.view(len(names), b).sum(1))
    sample = torch.arange(b, device=device).repeat(len(names)).repeat_interleave(lengths)
    scale = lengths.float().rsqrt().repeat_interleave(lengths)
    return ids, feature, sample, scale
