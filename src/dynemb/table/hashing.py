"""Bijective 64-bit mixing over torch int64 tensors.

torch has no unsigned 64-bit arithmetic, so right shifts are made logical by masking and multiplier constants are
stored as their signed two's-complement values. Multiplication wraps modulo 2**64 exactly like uint64.

Because ``mix64`` is a bijection on 64-bit words, two keys collide in hash space only if they are equal: sorting by
hash therefore deduplicates keys *and* groups them by bucket in one pass.
"""

from __future__ import annotations

import torch

__all__ = ["mix64", "key_hash", "GOLDEN"]


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
