"""dynemb: dynamic, sharded, trainable embedding tables for PyTorch recommenders."""

from . import functional, table
from .embedding import DynamicEmbedding
from .table import EvictionPolicy, KeyValueTable

__version__ = "0.1.0"

__all__ = ["DynamicEmbedding", "KeyValueTable", "EvictionPolicy", "functional", "table", "__version__"]
