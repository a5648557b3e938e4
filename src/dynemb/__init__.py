"""dynemb: dynamic, sharded, trainable embedding tables for PyTorch recommenders.

The public names below are imported on first use (PEP 562): ``import dynemb`` alone imports neither torch nor the
package's modules, so that the ``dynemb`` command starts its work (``--help``, the cycle collector paused for
``predict``) before torch's import, and a module of the package imports only what it uses.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers and editors
    from . import checkpoint, functional, optim, table
    from .collection import (All2AllDenseEmbedding, Bags, DistributedEmbeddingCollection, EmbeddingCollection,
                             FeatureConfig, TableConfig)
    from .embedding import DynamicEmbedding, StaticEmbedding
    from .optim import OptimizerWrapper
    from .table import EvictionPolicy, KeyValueTable

# public name -> the module that defines it ("" for a subpackage of that name)
_PUBLIC = {
    "DynamicEmbedding": ".embedding",
    "StaticEmbedding": ".embedding",
    "EmbeddingCollection": ".collection",
    "DistributedEmbeddingCollection": ".collection",
    "All2AllDenseEmbedding": ".collection",
    "TableConfig": ".collection",
    "FeatureConfig": ".collection",
    "Bags": ".collection",
    "KeyValueTable": ".table",
    "EvictionPolicy": ".table",
    "OptimizerWrapper": ".optim",
    "checkpoint": "",
    "functional": "",
    "optim": "",
    "table": "",
}

__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'dynemb' has no attribute {name!r}")
    module = where or f".{name}"
    value = importlib.import_module(module, __name__)
    value = value if where == "" else getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted({*globals(), *_PUBLIC})
