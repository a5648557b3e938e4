"""Repository-wide pytest set-up: the optional Triton kernel modules are not collected (for their doctests) where
triton is not installed; their tests skip themselves (tests/kernels/test_triton_*.py)."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["src/dynemb/kernels/triton_*.py"]
