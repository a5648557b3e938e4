"""dynemb: dynamic, sharded, trainable embedding tables for PyTorch recommenders."""

from . import checkpoint, functional, optim, table
from ._version import __version__
from .collection import (All2AllDenseEmbedding, Bags, DistributedEmbeddingCollection, EmbeddingCollection,
                         FeatureConfig, TableConfig)
from .embedding import DynamicEmbedding, StaticEmbedding
from .optim import OptimizerWrapper
from .table import EvictionPolicy, KeyValueTable

__all__ = [
    "DynamicEmbedding",
    "StaticEmbedding",
    "EmbeddingCollection",
    "DistributedEmbeddingCollection",
    "All2AllDenseEmbedding",
    "TableConfig",
    "FeatureConfig",
    "Bags",
    "KeyValueTable",
    "EvictionPolicy",
    "OptimizerWrapper",
    "checkpoint",
    "functional",
    "optim",
    "table",
    "__version__",
]
