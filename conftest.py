"""Repository-wide pytest set-up for the optional Triton kernels (``src/dynemb/kernels/triton_*.py``).

- Without a GPU their tests run under Triton's interpreter: triton reads ``TRITON_INTERPRET`` when a kernel is
  decorated (the first import of a ``triton_*`` module), so it is set here, before anything is collected. Only
  the triton backend reads it; other tests behave as before.
- Where triton is not installed, the modules are not collected (for doctests); their tests skip themselves.
"""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["src/dynemb/kernels/triton_*.py"]
