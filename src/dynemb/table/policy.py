"""Eviction policies: what a row's score means, and how an access changes it.

The lowest score is evicted first, by automatic eviction under ``max_capacity`` and by ``restrict``.

============  ====================================================  ========================================
policy        score of a row                                        updated by
============  ====================================================  ========================================
lru           table clock at the last access (one tick per batch)   every access (insert, training lookup)
lfu           number of accesses (each occurrence in a batch)       every access
epoch_lru     ``epoch << 32 | clock & 0xFFFFFFFF``                   every access
epoch_lfu     ``epoch << 32 | accesses within that epoch``          every access; resets when the epoch moves
decayed_lfu   ``2**16 * log2(sum of 2**(t / half_life))`` over the  every access (``t``: the table clock)
              row's accesses: an access count that halves every
              ``half_life`` clock ticks
custom        the caller's ``scores``                               only calls that pass ``scores``
============  ====================================================  ========================================

``epoch`` is set by the caller (``table.epoch = e``), for example once per training day, so that under
``epoch_*`` rows from older epochs always go first.

Why ``decayed_lfu``. Under ``lfu`` a new row has the lowest count in a full table, so it is the next victim: new
ids never build up history and the table churns through them (the LFU tables of ``dynemb demo`` evicted 14 rows
per stored row). ``decayed_lfu`` counts accesses with exponential decay, written in forward form (Cormode et al.,
"Forward decay", 2009; LRFU, Lee et al. 2001): an access at clock ``t`` weighs ``2**(t / half_life)``, so recent
accesses weigh more and no score ever needs aging. A new row scores like one access *now*, above every row whose
decayed count has fallen below one, so it outlives stale rows; a row used often and lately outranks it. Ranks
between rows follow the decayed counts to the fixed point (1/65536 of a doubling); the log keeps it in int64 for
``2**47 * half_life`` ticks. A new row starts at score 0, an access at clock 0: the same for every row, which
does not change their order. ``half_life=inf``-like values make it ``lfu``; small ones make it ``lru``.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import torch

from ..kernels.dispatch import Backend, kernels_for
from .ops import column_kernel, fill_rows, last_occurrence

__all__ = ["EvictionPolicy", "fill_score", "touch_scores", "DEFAULT_HALF_LIFE", "DEFAULT_BOUNDED"]

_LOW32 = 0xFFFFFFFF
_DECAY_SCALE = float(1 << 16)  # fixed point of the decayed_lfu score: 1/65536 of a doubling
# Half-life of decayed_lfu in clock ticks (about one per training batch), chosen on drifting traces: see
# docs/tables.md "Choosing an eviction policy".
DEFAULT_HALF_LIFE = 16


class EvictionPolicy(str, enum.Enum):
    """Score policy of a table. See the module docstring for what each score means."""

    LRU = "lru"
    LFU = "lfu"
    EPOCH_LRU = "epoch_lru"
    EPOCH_LFU = "epoch_lfu"
    DECAYED_LFU = "decayed_lfu"
    CUSTOM = "custom"

    @classmethod
    def parse(cls, value: "EvictionPolicy | str | None", name: str = "eviction") -> "EvictionPolicy":
        if value is None:
            return cls.LRU
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"{name} must be one of {choices} or None, got {value!r}") from None


def touch_scores(
    policy: EvictionPolicy,
    scores: torch.Tensor,
    rows: torch.Tensor,
    *,
    clock: int,
    epoch: int,
    custom: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    half_life: int = DEFAULT_HALF_LIFE,
    backend: Backend | str | None = None,
) -> None:
    """Apply one access of ``rows`` (``[N]`` int64, duplicates allowed, all >= 0) to ``scores`` in place.

    ``custom`` (``[N]`` int64) is used by the ``custom`` policy only; duplicates take the last occurrence.
    ``counts`` (``[N]`` int64) is how many accesses each entry stands for under the lfu policies (default 1).
    ``half_life`` (clock ticks) is used by ``decayed_lfu`` only. ``backend``: the table's kernel backend (None: the
    process default), which may run large CPU batches.
    """
    if counts is not None and counts.shape != rows.shape:
        raise ValueError(f"counts must have the shape of rows {tuple(rows.shape)}, got {tuple(counts.shape)}")
    if rows.numel() == 0:
        return
    counted = _COUNTED.get(policy)
    if counted is not None and _touch_counted(scores, rows, counts, counted, backend, clock=clock, epoch=epoch,
                                              half_life=half_life):
        return
    filled = fill_score(policy, clock=clock, epoch=epoch)
    if filled is not None:
        fill_rows(scores, rows, filled, backend)
    elif policy is EvictionPolicy.LFU:
        scores.index_add_(0, rows, torch.ones_like(rows) if counts is None else counts)
    elif policy is EvictionPolicy.EPOCH_LFU:
        current = scores.index_select(0, rows)
        fresh = torch.where((current >> 32) == epoch, current, epoch << 32)
        scores.index_copy_(0, rows, fresh)
        scores.index_add_(0, rows, torch.ones_like(rows) if counts is None else counts)
    elif policy is EvictionPolicy.DECAYED_LFU:
        _touch_decayed(scores, rows, counts, clock / half_life, backend)
    elif custom is not None:
        scores.index_copy_(0, *last_occurrence(rows, custom))


def fill_score(policy: EvictionPolicy, *, clock: int, epoch: int) -> int | None:
    """The score an access writes to every row it touches under ``policy`` (``lru``, ``epoch_lru``), or None for
    a policy whose new score depends on the old one or on the caller."""
    if policy is EvictionPolicy.LRU:
        return clock
    if policy is EvictionPolicy.EPOCH_LRU:
        return (epoch << 32) | (clock & _LOW32)
    return None


def _touch_counted(scores: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor | None, score, backend,
                   **when) -> bool:
    """A counting policy's access through the pool kernels (large CPU batches; False: not taken, nothing written).

    ``touch_counts`` reads each occurrence's score before the call and, at each row's last occurrence, its total
    count, in one prefetched pass over the rows (the torch code makes two to four, none prefetched); ``score(old,
    n, **when)`` computes the new scores on all ``[N]`` positions (what the torch code computes for those rows,
    on the same positions for decayed_lfu, so every path gives the same bits); ``write_last`` writes them back.
    """
    gather = column_kernel(scores, rows, "touch_counts", backend)
    write = column_kernel(scores, rows, "write_last", backend)
    if gather is None or write is None:  # a module with one and not the other: the torch code serves
        return False
    got = gather(scores, rows, None if counts is None else counts.contiguous())
    if got is None:
        return False
    old, n, last = got
    try:
        new = score(old, n, backend=backend, **when)
    except BaseException:
        write(scores, rows, old, last)  # the rows hold scratch values until written: put the scores back
        raise
    write(scores, rows, new, last)
    return True


def _touch_decayed(scores: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor | None, now: float,
                   backend: Backend | str | None = None) -> None:
    """``score = log2(2**score + n * 2**now)`` per distinct row (``n`` its accesses here), in fixed point.

    Written as ``now + log2(2**(score - now) + n)``: the difference is small for live rows (float32 is exact to
    the fixed point there) and a row far below ``now`` just becomes ``now + log2(n)``. Duplicates need no sort:
    ``n`` is summed in ``scores`` itself, read back per occurrence, and every occurrence of a row writes the same
    value.
    """
    old = scores.index_select(0, rows)
    scores.index_fill_(0, rows, 0)
    scores.index_add_(0, rows, torch.ones_like(rows) if counts is None else counts)
    n = scores.index_select(0, rows)
    scores.index_copy_(0, rows, _decayed(old, n, round(now * _DECAY_SCALE), backend))


def _decayed(old: torch.Tensor, n: torch.Tensor, now_fixed: int, backend: Backend | str | None = None) -> torch.Tensor:
    """The new fixed-point score of rows scored ``old`` (``[N]`` int64) accessed ``n`` times now (``[N]`` int64,
    >= 1): ``now + log2(2**(old - now) + n)``, in the arithmetic of :data:`DECAY_MATH`. The pool kernels'
    ``decayed_scores`` computes it where ``backend`` (None: the process default) has them, else these torch ops,
    with the same bits.

    Every step is an IEEE operation rounded once (or exact: ``frexp``, ``ldexp``), so an element's result does not
    depend on its position: torch's ``exp2``/``log2`` round an element in a vector's tail (scalar libm) differently
    from one in its body (SIMD), and the dedup order of a batch, which differs between backends and between 1 and N
    ranks, then moved scores by a unit and changed which row is evicted (found by review).
    """
    kernel = kernels_for(backend, old.device).pool.decayed_scores
    if kernel is not None:
        return kernel(old, n, now_fixed, DECAY_MATH)
    exp2, log2 = DECAY_MATH.exp2, DECAY_MATH.log2
    span = 1 << 50  # exact in float64 either way; the kernel converts by bit operations, exact below 2**51
    d = (old - now_fixed).clamp(-span, span).to(torch.float64) / _DECAY_SCALE
    stays = d > 60.0  # above 2**60 the n added is below the fixed point's resolution: the score stays
    d = d.clamp(-1000.0, 60.0)  # 2**-1000 + n is n: the row's history is gone
    k = d.round()  # half to even, as numpy's rint
    f = d - k  # exact, |f| <= 0.5
    p = torch.full_like(f, exp2[-1])
    for c in exp2[-2::-1]:
        p.mul_(f).add_(c)  # two roundings, as the kernel's (no fused multiply-add); in place: no [N] tensor a step
    x = p * ((k.to(torch.int64) + 1023) << 52).view(torch.float64) + n.clamp(max=span).to(torch.float64)  # exact
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    low = m < DECAY_MATH.sqrt_half
    m = torch.where(low, m * 2.0, m)  # m in [sqrt(1/2), sqrt(2)): |t| <= 0.172
    e = e.to(torch.float64) - low.to(torch.float64)
    t = (m - 1.0) / (m + 1.0)
    t2 = t * t
    q = torch.full_like(t, log2[-1])
    for c in log2[-2::-1]:
        q.mul_(t2).add_(c)
    added = ((e + t * q) * _DECAY_SCALE).round().to(torch.int64) + now_fixed
    return torch.where(stays, old, added)


class _DecayMath(NamedTuple):
    """The constants of :func:`_decayed`'s arithmetic, passed to the kernel so that both use the same ones:
    ``2**f = sum(exp2[i] * f**i)`` for ``|f| <= 0.5`` (Taylor, ``ln2**i / i!``) and ``log2(m) = t * sum(log2[i]
    * t**(2 i))`` with ``t = (m - 1) / (m + 1)`` (``2 / ((2 i + 1) ln 2)``, ``|t| <= 0.172``). The first terms left
    out are below ``3e-13`` and ``7e-13``: under ``1e-7`` of a fixed-point unit."""

    exp2: tuple
    log2: tuple
    sqrt_half: float


DECAY_MATH = _DecayMath(tuple(math.log(2) ** i / math.factorial(i) for i in range(11)),
                        tuple(2.0 / ((2 * i + 1) * math.log(2)) for i in range(7)), math.sqrt(0.5))


_COUNTED = {  # the new score of a counting policy from the old one and the row's accesses: see _touch_counted
    EvictionPolicy.LFU: lambda old, n, **when: old + n,
    EvictionPolicy.EPOCH_LFU: lambda old, n, *, epoch, **when: torch.where((old >> 32) == epoch, old, epoch << 32) + n,
    EvictionPolicy.DECAYED_LFU: lambda old, n, *, clock, half_life, backend, **when: _decayed(
        old, n, round(clock / half_life * _DECAY_SCALE), backend),
}


# The policy a bounded TableConfig gets when it names none: the only one within 5 points of hit rate of the best
# online policy on every trace measured (benchmarks/eviction.py; docs/tables.md "Choosing an eviction policy").
DEFAULT_BOUNDED = EvictionPolicy.DECAYED_LFU
