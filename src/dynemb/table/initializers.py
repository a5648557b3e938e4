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

from ..kernels.dispatch import kernels_for
from ..serialization import NotSerializableError, Serializable, serializable, type_name
from .hashing import mix64

__all__ = [
    "Initializer",
    "Uniform",
    "Normal",
    "TruncatedNormal",
    "Constant",
    "CallableInitializer",
    "resolve_initializer",
    "InitializerSpec",
    "initial_rows",
]

_U24 = 2.0**-24
_M32 = 0xFFFFFFFF
# A value's 32-bit hash: a Weyl step per column, then Wellons' "lowbias32" bijection (two multiplies).
CELL_STEP, CELL_M1, CELL_M2 = 0x9E3779B9, 0x7FEB352D, 0x846CA68B


def _unit_uniform(keys: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """``[N] -> [N, dim]`` float32 in (0, 1), a pure function of (seed, key, column).

    A key's row is ``mix64(key ^ mix64(seed))`` (64-bit, once a row); column ``c`` is the top 24 bits of the 32-bit
    hash of ``(lo + (c + 1) * CELL_STEP) ^ hi``, ``lo, hi`` the row's halves. 32-bit lanes because a value costs a
    few vector instructions that way: CPUs without AVX-512 and GPUs emulate 64-bit multiplies, and a splitmix64 of
    every value takes 2.5x the time to fill the rows of a CPU ``find_or_insert`` of new keys (AVX2, 65,536 x 64).
    Computed here in int64 lanes masked to 32 bits.
    """
    row = mix64(keys.to(torch.int64) ^ mix64(torch.tensor(seed, dtype=torch.int64, device=keys.device)))
    lo, hi = row & _M32, (row >> 32) & _M32
    cols = torch.arange(1, dim + 1, dtype=torch.int64, device=keys.device) * CELL_STEP
    x = ((lo.unsqueeze(1) + cols) & _M32) ^ hi.unsqueeze(1)
    x = x ^ (x >> 16)
    x = (x * CELL_M1) & _M32  # products past 2**63 wrap as uint64 would: the low 32 bits are exact
    x = x ^ (x >> 15)
    x = (x * CELL_M2) & _M32
    x = x ^ (x >> 16)
    return ((x >> 8).to(torch.float32) + 0.5) * _U24


class Initializer(Serializable):
    """Base class: ``init(keys, dim, dtype, seed) -> [N, dim]`` on ``keys.device``.

    The built-in initializers are configs (:mod:`dynemb.serialization`): ``to_dict()`` and
    ``Initializer.from_dict(d)``, which picks the class by ``d["type"]``.

    Example:
        >>> Normal(std=0.1).to_dict()
        {'type': 'normal', 'mean': 0.0, 'std': 0.1}
        >>> Initializer.from_dict({"type": "uniform", "low": -1.0, "high": 1.0})
        Uniform(low=-1.0, high=1.0)
    """

    def __call__(self, keys: torch.Tensor, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
        raise NotImplementedError

    def kernel_spec(self) -> tuple[str, tuple] | None:
        """``(kind, params)`` of the ``initial_rows`` kernel contract (:mod:`dynemb.kernels.dispatch`) that computes
        the same rows, or None when only this class's torch code does."""
        return None

    def describe(self) -> dict:
        """The record kept in state dicts, checkpoint manifests and serving exports: :meth:`to_dict`, which
        ``Initializer.from_dict`` rebuilds. An initializer that is code, not data (a callable, or a subclass of
        this class that is not registered), is recorded by name, ``{"type": "callable", "name": ...}``, and
        cannot be rebuilt."""
        if type_name(self) in (None, "callable"):
            return {"type": "callable", "name": type(self).__qualname__}
        return self.to_dict()


def _check_floats(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{type(config).__name__}.{name} must be a finite float, got {value!r}")
        object.__setattr__(config, name, float(value))  # Uniform(-1, 1) is Uniform(-1.0, 1.0), saved alike


# Type names: the user's names of resolve_initializer; files of dynemb 0.1 named them by class.
@serializable("uniform", aliases=("Uniform",))
@dataclasses.dataclass(frozen=True)
class Uniform(Initializer):
    """U(low, high). The default initializer is ``Uniform(-0.05, 0.05)``.

    Raises:
        ValueError: ``low`` or ``high`` is not a finite float, or ``low > high``.
    """

    low: float = -0.05
    high: float = 0.05

    def __post_init__(self):
        _check_floats(self, "low", "high")
        if self.low > self.high:
            raise ValueError(f"Uniform needs low <= high, got low={self.low!r}, high={self.high!r}")

    def __call__(self, keys, dim, dtype, seed):
        u = _unit_uniform(keys, dim, seed)
        return (self.low + (self.high - self.low) * u).to(dtype)

    def kernel_spec(self):
        return "uniform", (self.low, self.high)


@serializable("normal", aliases=("Normal",))
@dataclasses.dataclass(frozen=True)
class Normal(Initializer):
    """N(mean, std²), by the inverse normal CDF of a counter-based uniform. ``std`` >= 0, both finite."""

    mean: float = 0.0
    std: float = 0.05

    def __post_init__(self):
        _check_std(self)

    def __call__(self, keys, dim, dtype, seed):
        z = torch.special.ndtri(_unit_uniform(keys, dim, seed))
        return (self.mean + self.std * z).to(dtype)


def _check_std(config) -> None:
    _check_floats(config, "mean", "std")
    if config.std < 0:
        raise ValueError(f"{type(config).__name__}.std must be >= 0, got {config.std!r}")


@serializable("truncated_normal", aliases=("TruncatedNormal",))
@dataclasses.dataclass(frozen=True)
class TruncatedNormal(Initializer):
    """N(mean, std²) truncated to ±2 std (TF's convention), sampled exactly by inverse CDF, no rejection.
    ``std`` >= 0, both finite."""

    mean: float = 0.0
    std: float = 0.05

    def __post_init__(self):
        _check_std(self)

    def __call__(self, keys, dim, dtype, seed):
        lo = 0.5 * math.erfc(2.0 / math.sqrt(2.0))  # Phi(-2)
        u = lo + (1.0 - 2.0 * lo) * _unit_uniform(keys, dim, seed).double()
        return (self.mean + self.std * torch.special.ndtri(u)).to(dtype)


@serializable("constant", aliases=("Constant",))
@dataclasses.dataclass(frozen=True)
class Constant(Initializer):
    """Every element equals ``value`` (a finite float); ``"zeros"`` is ``Constant(0.0)``."""

    value: float = 0.0

    def __post_init__(self):
        _check_floats(self, "value")

    def __call__(self, keys, dim, dtype, seed):
        return torch.full((keys.numel(), dim), self.value, dtype=dtype, device=keys.device)

    def kernel_spec(self):
        return "constant", (self.value,)


@serializable("callable")
class CallableInitializer(Initializer):
    """Wraps a user callable ``fn(n, dim) -> Tensor[n, dim]``; validates what it returns.

    It is no data: ``to_dict`` refuses it, naming the field. Files record it as ``{"type": "callable", "name":
    <the callable's name>}`` (:meth:`describe`), and ``from_dict`` of that record raises
    :class:`~dynemb.serialization.NotSerializableError`.
    """

    def __init__(self, fn: Callable[[int, int], torch.Tensor]) -> None:
        self.fn = fn

    def _config_fields(self) -> dict:
        return {"fn": self.fn}

    @classmethod
    def from_dict(cls, data, where: str | None = None):
        name = data.get("name") if isinstance(data, dict) else None
        raise NotSerializableError(f"{where or 'initializer'} is the Python callable {name!r} (a callable is not "
                                   "data: no file can rebuild it)")

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


_INIT_CHUNK = 1 << 17  # elements a call of an initializer on CPU: its int64 temporaries stay cache-sized


def computed_by_kernel(init: Initializer, dtype: torch.dtype, backend, device) -> bool:
    """Whether :func:`initial_rows` computes ``init``'s rows with a kernel (a built-in initializer, float32, a backend
    with an ``initial_rows`` kernel for ``device``): a pure function of the key that cannot fail, so a table may
    write its rows straight into its storage."""
    return init.kernel_spec() is not None and dtype == torch.float32 and bool(kernels_for(backend, device).init)


def initial_rows(init: Initializer, keys: torch.Tensor, dim: int, dtype: torch.dtype, seed: int, backend=None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, dim]``: ``init``'s rows for ``keys [N]`` under ``seed``, written into ``out`` when given (contiguous,
    ``[N, dim]`` of ``dtype`` on the keys' device). The ``initial_rows`` kernel of ``backend`` computes them where
    one serves (float32, built-in initializers: the same bits in one pass); otherwise the initializer is called a
    chunk of keys at a time on CPU, which gives the same rows (an initializer is a function of the key) with
    temporaries of a chunk: one ``[N, dim]`` call costs about 10x more at dim 64, and builds several int64 tensors
    of ``N x dim``. A callable initializer's rows depend on its calls: call it directly.

    Example:
        >>> initial_rows(Constant(1.0), torch.arange(3), 2, torch.float32, 0).tolist()
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    n = keys.numel()
    spec = init.kernel_spec()
    kernels = kernels_for(backend, keys.device).init if spec is not None and dtype == torch.float32 else None
    if kernels:
        out = torch.empty(n, dim, dtype=dtype, device=keys.device) if out is None else out
        kernels.initial_rows(*spec, keys, seed, out)
        return out
    step = n if keys.device.type != "cpu" else max(1, _INIT_CHUNK // dim)
    if n <= step and out is None:
        return init(keys, dim, dtype, seed)
    out = torch.empty(n, dim, dtype=dtype, device=keys.device) if out is None else out
    for lo in range(0, n, step):
        out[lo: lo + step] = init(keys[lo: lo + step], dim, dtype, seed)
    return out
