"""Click-log data: a synthetic generator, Parquet/CSV readers and stable string-id hashing; id traces, and their
replay through a bounded table (:mod:`.replay`, which measures eviction policies).

The readers and :func:`hash_strings` need the ``data`` extra (pyarrow, xxhash); they are imported on first use,
so the synthetic generator works without it.
"""

from __future__ import annotations

import importlib

from .batch import Batch
from .metrics import auc
from .synthetic import SyntheticClickLog

__all__ = ["Batch", "SyntheticClickLog", "auc", "FileReader", "hash_strings", "null_key"]

_LAZY = {"FileReader": "readers", "hash_strings": "string_ids", "null_key": "string_ids"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
