"""Kernels: the one dispatch point for hot operations and their optional implementations.

The batched-torch code is the reference and runs on every device; it lives beside the data structure it serves
(:class:`~dynemb.table.HashIndex`). Optional kernels live here, the ``numba_*`` modules for CPU and the
``triton_*`` modules for CUDA (each imported on first use: the package imports without numba or triton), and
:mod:`~dynemb.kernels.dispatch` decides, from an explicit backend and the device, which one runs.
"""

from . import dispatch
from .dispatch import FAMILIES, Backend, Family, Kernels, get_default_backend, index_kernels, init_kernels, kernels_for
from .dispatch import numba_available, optim_kernels
from .dispatch import pool_kernels, resolve_backend, table_kernels, triton_available
from .dispatch import set_default_backend, use_backend

__all__ = list(dispatch.__all__)
