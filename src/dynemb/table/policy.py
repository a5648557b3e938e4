"""Eviction policies: what a row's score means, and how an access changes it.

The lowest score is evicted first, by automatic eviction under ``max_capacity`` and by ``restrict``.

============  ====================================================  ========================================
policy        score of a row                                        updated by
============  ====================================================  ========================================
lru           table clock at the last access (one tick per batch)   every access (insert, training lookup)
lfu           number of accesses (each occurrence in a batch)       every access
epoch_lru     ``epoch << 32 | clock & 0xFFFFFFFF``                   every access
epoch_lfu     ``epoch << 32 | accesses within that epoch``          every access; resets when the epoch moves
custom        the caller's ``scores``                               only calls that pass ``scores``
============  ====================================================  ========================================

``epoch`` is set by the caller (``table.epoch = e``), for example once per training day, so that under
``epoch_*`` rows from older epochs always go first.
"""

from __future__ import annotations

import enum

import torch

from .ops import last_occurrence

__all__ = ["EvictionPolicy", "touch_scores"]

_LOW32 = 0xFFFFFFFF


class EvictionPolicy(str, enum.Enum):
    """Score policy of a table. See the module docstring for what each score means."""

    LRU = "lru"
    LFU = "lfu"
    EPOCH_LRU = "epoch_lru"
    EPOCH_LFU = "epoch_lfu"
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
) -> None:
    """Apply one access of ``rows`` (``[N]`` int64, duplicates allowed, all >= 0) to ``scores`` in place.

    ``custom`` (``[N]`` int64) is used by the ``custom`` policy only; duplicates take the last occurrence.
    ``counts`` (``[N]`` int64) is how many accesses each entry stands for under the lfu policies (default 1).
    """
    if rows.numel() == 0:
        return
    if policy is EvictionPolicy.LRU:
        scores.index_fill_(0, rows, clock)
    elif policy is EvictionPolicy.LFU:
        scores.index_add_(0, rows, torch.ones_like(rows) if counts is None else counts)
    elif policy is EvictionPolicy.EPOCH_LRU:
        scores.index_fill_(0, rows, (epoch << 32) | (clock & _LOW32))
    elif policy is EvictionPolicy.EPOCH_LFU:
        current = scores.index_select(0, rows)
        fresh = torch.where((current >> 32) == epoch, current, epoch << 32)
        scores.index_copy_(0, rows, fresh)
        scores.index_add_(0, rows, torch.ones_like(rows) if counts is None else counts)
    elif custom is not None:
        scores.index_copy_(0, *last_occurrence(rows, custom))
