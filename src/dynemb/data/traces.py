"""Id traces with drift, for measuring what a bounded table keeps: ids appear, stay popular a while, and fade.

The model. There are ``num_slots`` popularity slots; slot ``r`` (0 = most popular) is drawn with probability
``~ (r + 1) ** -alpha`` (the power law of :func:`zipf_ranks`). A slot is held by one id at a
time: after a *lifetime* its id disappears for good and a brand-new id takes the slot, as items, ads or queries
come and go in a click log. Lifetimes are per slot, log-uniform in ``[lifetime / 4, 4 * lifetime]`` batches, so
some ids are short fads and some are long-lived; each slot starts at a random phase so that turnover is spread
over time. A ``stable`` fraction of the slots never turns over (ids that are always there: countries, devices).
Slot assignment is a pure function of the seed, so ``trace.batch(i)`` needs no state and is reproducible.

With ``lifetime`` much longer than the trace there is no drift (a stationary power law, where lfu is best); with
a short one the popular ids change fast and recency matters (where lru is best).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..checks import check_int
from ..table.hashing import mix64

__all__ = ["DriftingTrace", "zipf_ranks"]

_SLOT_BITS = 32  # id = mix64(generation << 32 | slot): distinct for every (slot, generation) pair


def zipf_ranks(n: int, size: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """``size`` ranks in ``[0, n)`` with P(rank r) ~ (r + 1) ** -alpha (inverse-CDF of the continuous law).

    Raises:
        ValueError: ``n < 1``: there is no rank to draw.

    Example:
        >>> zipf_ranks(1, 3, 1.2, torch.Generator().manual_seed(0)).tolist()
        [0, 0, 0]
    """
    check_int(n, "n (ranks to draw from)", minimum=1)
    u = torch.rand(size, generator=generator, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        ranks = torch.exp(u * torch.log(torch.tensor(float(n) + 1))) - 1
    else:
        a = 1.0 - alpha
        ranks = ((float(n + 1) ** a - 1) * u + 1) ** (1 / a) - 1
    return ranks.long().clamp_(0, n - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DriftingTrace:
    """A reproducible stream of id batches from a drifting power law (see the module docstring).

    Args:
        num_slots: popularity slots ``S`` (ids alive at any time), in ``[1, 2**32)``.
        alpha: power-law exponent of slot popularity (``>= 0``).
        batch_size: ids per batch ``B`` (duplicates included, as a batch of a click log has them).
        num_batches: length of the trace.
        lifetime: mean-ish lifetime of an id, in batches (log-uniform in ``[lifetime / 4, 4 * lifetime]``).
        stable: fraction of slots, in ``[0, 1]``, that never turn over (taken at random).
        seed: seed of the slot lifetimes, phases and draws.

    Shape: ``batch(i)`` is ``[B]`` int64.

    Example:
        >>> trace = DriftingTrace(num_slots=1000, batch_size=256, num_batches=10, lifetime=20)
        >>> trace.batch(3).shape, torch.equal(trace.batch(3), trace.batch(3))
        (torch.Size([256]), True)
    """

    num_slots: int = 100_000
    alpha: float = 1.05
    batch_size: int = 4096
    num_batches: int = 400
    lifetime: float = 100.0
    stable: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        check_int(self.num_slots, "num_slots", minimum=1, maximum=2**_SLOT_BITS - 1)
        check_int(self.batch_size, "batch_size", minimum=1)
        check_int(self.num_batches, "num_batches", minimum=1)
        check_int(self.seed, "seed", minimum=0)
        for name, low, high in (("alpha", 0.0, math.inf), ("lifetime", 1.0, math.inf), ("stable", 0.0, 1.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be a number in [{low}, {high}], got {value!r}")

    def batch(self, index: int) -> torch.Tensor:
        """Ids of batch ``index`` (``[B]`` int64)."""
        check_int(index, "index", minimum=0)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index + 1)
        slots = zipf_ranks(self.num_slots, self.batch_size, self.alpha, g)
        life, phase, stable = self._slots()
        generation = torch.floor((index + phase.index_select(0, slots)) / life.index_select(0, slots)).long()
        generation = torch.where(stable.index_select(0, slots), 0, generation + 1)
        return mix64((generation << _SLOT_BITS) | slots)

    def batches(self):
        """The ``num_batches`` batches in order."""
        return (self.batch(i) for i in range(self.num_batches))

    def describe(self) -> dict:
        return dataclasses.asdict(self)

    def _slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per slot: lifetime (batches, float64), starting phase in ``[0, lifetime)``, and whether it is stable."""
        cached = self.__dict__.get("_cache")
        if cached is None:
            g = torch.Generator().manual_seed(self.seed)
            u = torch.rand(3, self.num_slots, generator=g, dtype=torch.float64)
            life = self.lifetime * torch.pow(16.0, u[0]) / 4  # log-uniform in [lifetime / 4, 4 * lifetime]
            cached = (life, u[1] * life, u[2] < self.stable)
            object.__setattr__(self, "_cache", cached)
        return cached
