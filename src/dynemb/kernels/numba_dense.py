"""Numba kernels for the dense part of scoring on CPU: the DLRM's pair selection and the dense features' rule.

Both replace several small torch ops that each pass over a block (a served request's 256 rows cost ~10 us an op
in dispatch alone) with one pass, doing the same float32 operations in the same order, so the same bits:

- :func:`select_pairs`: the interaction's ``[b, D + P]`` input of the top MLP, the dense vector then the ``P``
  pairwise dots picked out of ``bmm``'s ``[b, n * n]`` (torch's ``index_select`` then ``cat``: two passes and a
  temporary; the ``bmm`` stays torch's, so its sums keep their order).
- :func:`normalize_dense`: ``(sign(x) * log1p(|x|) - mean) / std`` with the non-finite rule's replacements, given
  torch's ``log1p(|x|)`` (numba's ``log1p`` rounds differently from torch's vectorized one in ~3% of values).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from . import numba_cache  # noqa: F401  (first: it sets the cache directory of the kernels below)

__all__ = ["select_pairs", "normalize_dense", "takes"]


def takes(*tensors: torch.Tensor) -> bool:
    """Whether these kernels may take ``tensors`` as numpy arrays: plain float32 CPU tensors outside autograd and
    tracing (``torch.export``'s fake tensors are subclasses)."""
    return all(type(t) is torch.Tensor and t.is_cpu and t.dtype == torch.float32 and not t.requires_grad
               for t in tensors) and not torch.compiler.is_compiling()


@numba.njit(nogil=True, cache=True, boundscheck=False)
def select_pairs(dots, dense, pairs, out):
    """``out[:, :D] = dense``, ``out[:, D + p] = dots[:, pairs[p]]``.

    ``dots``: float32 ``[b, n * n]``; ``dense``: float32 ``[b, D]`` (any strides: a slice of the stacked input);
    ``pairs``: int64 ``[P]``, each in ``[0, n * n)`` (the caller's, made once); ``out``: float32 ``[b, D + P]``."""
    width = dense.shape[1]
    for b in range(dots.shape[0]):
        for d in range(width):
            out[b, d] = dense[b, d]
        for p in range(pairs.shape[0]):
            out[b, width + p] = dots[b, pairs[p]]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def normalize_dense(x, logs, mean, std, nan, inf, ninf, out):
    """``out = (z - mean) / std`` with ``z = sign(x) * logs`` (``logs``: torch's ``log1p(|x|)``), a NaN ``z`` read as
    ``nan``, ``+inf`` as ``inf`` and ``-inf`` as ``ninf`` (per column), in float32 as torch computes it.

    ``x``, ``logs``, ``out``: float32 ``[B, K]``; the rest float32 ``[K]``."""
    for i in range(x.shape[0]):
        for k in range(x.shape[1]):
            v = x[i, k]
            z = logs[i, k]
            if v < 0:
                z = -z
            elif v == 0:
                z = np.float32(0.0)
            if z != z:
                z = nan[k]
            elif z == np.inf:
                z = inf[k]
            elif z == -np.inf:
                z = ninf[k]
            out[i, k] = (z - mean[k]) / std[k]
