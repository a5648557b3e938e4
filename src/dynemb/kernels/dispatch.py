"""Which implementation runs a hot operation: chosen from an explicit backend and the device, never from the
environment.

=========  ============================================================  ====================================
backend    runs                                                          where
=========  ============================================================  ====================================
``auto``   numba on CPU when numba is importable, torch everywhere else  any device (the process default)
``torch``  the batched-torch reference                                   any device
``numba``  the numba kernels of :mod:`dynemb.kernels.numba_index`        CPU only, with numba installed
=========  ============================================================  ====================================

Every backend gives identical results (the tests hold each kernel equal to the torch reference); they differ in
speed. Tables and indexes take ``backend=``; ``None`` (their default) means the process default, read at each
call. The process default is ``auto`` until it is set explicitly, with :func:`set_default_backend` or, for a
block of code (tests, benchmarks), :func:`use_backend`. Nothing in the library reads an environment variable for
this: the ``dynemb`` command alone maps ``DYNEMB_NUMBA=0`` to ``set_default_backend("torch")`` at startup.

A CUDA backend (``triton``) would be one more member of :class:`Backend` and one more branch here.

Example:
    >>> resolve_backend("auto", "cuda")
    <Backend.TORCH: 'torch'>
    >>> with use_backend("torch"):
    ...     resolve_backend(None, "cpu")
    <Backend.TORCH: 'torch'>
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib.util
from types import ModuleType
from typing import Iterator

import torch

__all__ = [
    "Backend",
    "resolve_backend",
    "get_default_backend",
    "set_default_backend",
    "use_backend",
    "numba_available",
    "index_kernels",
]


class Backend(str, enum.Enum):
    """A kernel backend, or ``AUTO`` to let :func:`resolve_backend` pick by device (see the module's table)."""

    AUTO = "auto"
    TORCH = "torch"
    NUMBA = "numba"

    @classmethod
    def parse(cls, value: "Backend | str", name: str = "backend") -> "Backend":
        """``value`` as a Backend; a ``ValueError`` naming ``name`` and the choices if it is none of them."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(b.value) for b in cls)
            raise ValueError(f"{name} must be one of {choices} or a Backend, got {value!r}") from None


_default = Backend.AUTO


@functools.cache
def numba_available() -> bool:
    """Whether numba is installed (numba itself is imported only when a kernel first runs: it loads slowly)."""
    return importlib.util.find_spec("numba") is not None


def get_default_backend() -> Backend:
    """The process default: what ``backend=None`` means. ``Backend.AUTO`` unless set."""
    return _default


def set_default_backend(backend: Backend | str) -> Backend:
    """Make ``backend`` the process default for every table and index created with ``backend=None``, from their
    next call on. Returns the previous default.

    Raises:
        ValueError: ``backend`` is not a backend name, or it is ``numba`` and numba is not installed.
    """
    global _default
    previous, _default = _default, _available(Backend.parse(backend))
    return previous


@contextlib.contextmanager
def use_backend(backend: Backend | str) -> Iterator[Backend]:
    """``with use_backend("torch"): ...`` runs the block under that process default and then restores the previous
    one, also when the block raises."""
    previous = set_default_backend(backend)
    try:
        yield _default
    finally:
        set_default_backend(previous)


def resolve_backend(backend: Backend | str | None, device: torch.device | str | None = None) -> Backend:
    """The backend that runs an operation on ``device`` (default CPU): never ``AUTO``.

    ``None`` is the process default; ``auto`` picks numba on CPU when numba is installed, else torch.

    Raises:
        ValueError: ``backend`` is not a backend name; or it is ``numba`` and numba is not installed or ``device``
            is not a CPU.
    """
    requested = _default if backend is None else backend if isinstance(backend, Backend) else Backend.parse(backend)
    on_cpu = (device.type if isinstance(device, torch.device) else torch.device(device or "cpu").type) == "cpu"
    if requested is Backend.AUTO:
        return Backend.NUMBA if on_cpu and numba_available() else Backend.TORCH
    if requested is Backend.NUMBA and not on_cpu:
        raise ValueError(f"backend 'numba' runs on CPU only, got device {device}; use 'auto' or 'torch'")
    return _available(requested)


def index_kernels(backend: Backend | str | None, device: torch.device | str | None) -> ModuleType | None:
    """The kernels that run :class:`~dynemb.table.HashIndex`'s probe and placement for one call on ``device``: a
    module with ``probe`` and ``place`` (:mod:`dynemb.kernels.numba_index`), or None for the index's own torch
    reference."""
    return _numba_index() if resolve_backend(backend, device) is Backend.NUMBA else None


@functools.cache
def _numba_index() -> ModuleType:
    from . import numba_index  # imported on first use: numba takes a while to load

    return numba_index


def _available(backend: Backend) -> Backend:
    if backend is Backend.NUMBA and not numba_available():
        raise ValueError("backend 'numba' needs the numba package, which is not installed; use 'auto' or 'torch'")
    return backend
