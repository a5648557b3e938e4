"""The user's model (TableConfig, FeatureConfig) and EmbeddingCollection, with the execution plan behind it.

======================  ============================================================================
module                  job
======================  ============================================================================
``config``              TableConfig, FeatureConfig: every field validated when the config is built
``features``            a batch's features validated and normalized (PreparedFeature, BagSet)
``plan``                ExecutionPlan: each logical table's shard on this rank; builds the tables
``local``, ``sharded``  the two executors: whole tables here, or input_dist -> compute -> output_dist
``collection``          EmbeddingCollection, the module users hold
``distributed``         DistributedEmbeddingCollection: an EmbeddingCollection with ``plan="auto"``
``sok``                 All2AllDenseEmbedding: SOK's model-parallel layer over one row-sharded table
======================  ============================================================================
"""

from .collection import EmbeddingCollection
from .config import FeatureConfig, TableConfig, split_max_bytes
from .distributed import DistributedEmbeddingCollection
from .features import Bags, Jagged, PreparedFeature
from .plan import ExecutionPlan, TableShard
from .sok import All2AllDenseEmbedding

__all__ = ["EmbeddingCollection", "DistributedEmbeddingCollection", "All2AllDenseEmbedding", "TableConfig",
           "FeatureConfig", "split_max_bytes", "Bags", "Jagged", "PreparedFeature", "ExecutionPlan", "TableShard"]
