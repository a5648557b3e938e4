"""Bijective 64-bit mixing over torch int64 tensors.

torch has no unsigned 64-bit arithmetic, so right shifts are made logical by masking and multiplier constants are
stored as their signed two's-complement values. Multiplication wraps modulo 2**64 exactly like uint64.

Because ``mix64`` is a bijection on 64-bit words, two keys collide in hash space only if they are equal: sorting by
hash therefore deduplicates keys *and* groups them by bucket in one pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.dispatch import Backend, kernels_for

__all__ = ["mix64", "key_hash", "unique_by_hash", "UniqueKeys", "GOLDEN"]


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_M1 = _signed(0xBF58476D1CE4E5B9)
_M2 = _signed(0x94D049BB133111EB)
GOLDEN = _signed(0x9E3779B97F4A7C15)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer: an avalanche bijection on int64 words. Returns a new int64 tensor."""
    x = x ^ _shr(x, 30)
    x = x * _M1
    x = x ^ _shr(x, 27)
    x = x * _M2
    return x ^ _shr(x, 31)


def key_hash(keys: torch.Tensor) -> torch.Tensor:
    """Hash int32/int64 keys to int64 words; injective on the key values (int32 keys are sign-extended)."""
    return mix64(keys.to(torch.int64))


class UniqueKeys(NamedTuple):
    """The distinct keys of a batch in hash order (which is the index's bucket order)."""

    keys: torch.Tensor  # [U] distinct keys, by ascending hash
    hashes: torch.Tensor  # [U] key_hash of each, ascending
    last: torch.Tensor  # [U] int64: position in the batch of each key's last occurrence
    inverse: torch.Tensor  # [N] int64: index into ``keys`` of each batch key


def unique_by_hash(keys: torch.Tensor, backend: Backend | str | None = None) -> UniqueKeys:
    """Deduplicate ``[N]`` keys with one sort of their hashes (injective, so equal hashes mean equal keys).

    ``backend`` (the table's; None: the process default) picks the index family's ``unique_by_hash`` kernel where
    one serves (:mod:`dynemb.kernels.dispatch`): the same four tensors, bit for bit.

    Example:
        >>> u = unique_by_hash(torch.tensor([5, -1, 5]))
        >>> sorted(u.keys.tolist()), u.keys[u.inverse].tolist(), u.last[u.keys == 5].tolist()
        ([-1, 5], [5, -1, 5], [2])
    """
    fast = kernels_for(backend, keys.device).index.unique_by_hash  # optional in the index family
    if fast is not None:
        return UniqueKeys(*fast(keys))
    hashes, order = key_hash(keys).sort(stable=True)
    ends = torch.ones_like(hashes, dtype=torch.bool)  # last of a run of equal hashes; stable: last occurrence
    ends[:-1] = hashes[1:] != hashes[:-1]
    at = ends.nonzero().squeeze(1)
    group = ends.cumsum(0) - ends.long()  # runs that ended before each position = its unique index
    last = order.index_select(0, at)
    inverse = torch.empty_like(order).index_copy_(0, order, group)
    return UniqueKeys(keys.index_select(0, last), hashes.index_select(0, at), last, inverse)
