"""Row initializers.

Built-in initializers are *counter-based*: a new row's value is a pure function of ``(seed, key, column)``. A key
therefore gets the same initial row whatever the batch order, the device or the number of ranks, and an eval lookup
of an unseen key returns exactly the row training would create for it. A user callable ``(n, dim) -> Tensor``
is also accepted; its rows are reproducible for the same sequence of calls under the table's seed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Union

import torch

from .hashing import GOLDEN, mix64
from .memory import empty_storage

__all__ = [
    "Initializer",
    "Uniform",
    "Normal",
    "TruncatedNormal",
    "Constant",
    "CallableInitializer",
    "resolve_initializer",
    "InitializerSpec",
    "initialized_storage",
]

_U24 = 2.0**-24


def _unit_uniform(keys: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """``[N] -> [N, dim]`` float32 in (0, 1), a pure function of (seed, key, column)."""
    row = mix64(keys.to(torch.int64) ^ mix64(torch.tensor(seed, dtype=torch.int64, device=keys.device)))
    cols = torch.arange(1, dim + 1, dtype=torch.int64, device=keys.device) * GOLDEN
    bits = mix64(row.unsqueeze(1) + cols)
    return (((bits >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * _U24


class Initializer:
    """Base class: ``init(keys, dim, dtype, seed) -> [N, dim]`` on ``keys.device``."""

    def __call__(self, keys: torch.Tensor, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        raise NotImplementedError

    def kernel_spec(self) -> tuple[str, tuple] | None:
        """``(kind, params)`` of the ``initial_rows`` kernel contract (:mod:`dynemb.kernels.dispatch`) that computes
        the same rows, or None when only this class's torch code does."""
        return None

    def describe(self) -> dict:
        """A JSON-able description, kept in state dicts and checkpoint manifests."""
        return {"type": type(self).__name__, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class Uniform(Initializer):
    """U(low, high). The default initializer is ``Uniform(-0.05, 0.05)``."""

    low: float = -0.05
    high: float = 0.05

    def __call__(self, keys, dim, dtype, seed):
        u = _unit_uniform(keys, dim, seed)
        return (self.low + (self.high - self.low) * u).to(dtype)

    def kernel_spec(self):
        return "uniform", (self.low, self.high)


@dataclasses.dataclass(frozen=True)
class Normal(Initializer):
    """N(mean, std²), by the inverse normal CDF of a counter-based uniform."""

    mean: float = 0.0
    std: float = 0.05

    def __call__(self, keys, dim, dtype, seed):
        z = torch.special.ndtri(_unit_uniform(keys, dim, seed))
        return (self.mean + self.std * z).to(dtype)


@dataclasses.dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """N(mean, std²) truncated to ±2 std (TF's convention), sampled exactly by inverse CDF, no rejection."""

    mean: float = 0.0
    std: float = 0.05

    def __call__(self, keys, dim, dtype, seed):
        lo = 0.5 * math.erfc(2.0 / math.sqrt(2.0))  # Phi(-2)
        u = lo + (1.0 - 2.0 * lo) * _unit_uniform(keys, dim, seed).double()
        return (self.mean + self.std * torch.special.ndtri(u)).to(dtype)


@dataclasses.dataclass(frozen=True)
class Constant(Initializer):
    """Every element equals ``value``; ``"zeros"`` is ``Constant(0.0)``."""

    value: float = 0.0

    def __call__(self, keys, dim, dtype, seed):
        return torch.full((keys.numel(), dim), self.value, dtype=dtype, device=keys.device)

    def kernel_spec(self):
        return "constant", (self.value,)


class CallableInitializer(Initializer):
    """Wraps a user callable ``fn(n, dim) -> Tensor[n, dim]``; validates what it returns."""

    def __init__(self, fn: Callable[[int, int], torch.Tensor]) -> None:
        self.fn = fn

    def __call__(self, keys, dim, dtype, seed):
        n = keys.numel()
        devices = [keys.device] if keys.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed & (2**63 - 1))
            out = self.fn(n, dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (n, dim):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"initializer callable must return a Tensor of shape ({n}, {dim}), got {got}")
        return out.to(device=keys.device, dtype=dtype)

    def describe(self) -> dict:
        return {"type": "callable", "name": getattr(self.fn, "__qualname__", repr(self.fn))}


InitializerSpec = Union[str, float, int, Initializer, Callable[[int, int], torch.Tensor]]

_NAMED = {
    "uniform": Uniform(),
    "normal": Normal(),
    "truncated_normal": TruncatedNormal(),
    "zeros": Constant(0.0),
}


def resolve_initializer(spec: InitializerSpec, name: str = "initializer") -> Initializer:
    """Turn a user spec (name, float constant, Initializer or callable) into an Initializer."""
    if isinstance(spec, Initializer):
        return spec
    if isinstance(spec, bool):
        raise TypeError(f"{name} must be a name, a float, an Initializer or a callable, got bool {spec!r}")
    if isinstance(spec, (int, float)):
        return Constant(float(spec))
    if isinstance(spec, str):
        if spec in _NAMED:
            return _NAMED[spec]
        try:
            return Constant(float(spec))  # SOK accepts a float given as a string, e.g. "13"
        except ValueError:
            raise ValueError(
                f"{name} must be one of {sorted(_NAMED)}, a float constant or a callable (n, dim) -> Tensor, "
                f"got {spec!r}"
            ) from None
    if callable(spec):
        return CallableInitializer(spec)
    raise TypeError(f"{name} must be a name, a float, an Initializer or a callable, got {type(spec).__name__}")


# Rows an initializer computes at a time when it fills a whole table: its int64 [rows, dim] temporaries stay a few
# MB, where one call over a table of 1M x 64 rows builds several of 512 MB.
_FILL_ROWS = 1 << 16


def initialized_storage(init: Initializer, keys: torch.Tensor, dim: int, dtype: torch.dtype,
                        seed: int) -> torch.Tensor:
    """``[N, dim]``: ``init(keys [N], dim, dtype, seed)`` as table storage (:func:`~dynemb.table.memory.empty_storage`).
    A built-in initializer fills it a chunk of keys at a time (the same bits: each row is a function of its key);
    any other is called once, as the table would call it.

    Example:
        >>> initialized_storage(Constant(1.0), torch.arange(3), 2, torch.float32, 0).tolist()
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    out = empty_storage((keys.numel(), dim), dtype, keys.device)
    if type(init) not in (Uniform, Normal, TruncatedNormal, Constant):
        return out.copy_(init(keys, dim, dtype, seed))
    for lo in range(0, keys.numel(), _FILL_ROWS):
        out[lo: lo + _FILL_ROWS] = init(keys[lo: lo + _FILL_ROWS], dim, dtype, seed)
    return out

