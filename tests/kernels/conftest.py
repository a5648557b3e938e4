"""The Triton kernels' tests run compiled on a GPU and under Triton's interpreter elsewhere.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when :mod:`dynemb.kernels.triton_index` and the
other ``triton_*`` modules are first imported: that happens only in the triton tests (the CPU default backend is
numba or torch), so setting it here, at collection and only without CUDA, changes no other test.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

