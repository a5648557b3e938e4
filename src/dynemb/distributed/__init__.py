"""What sharding needs below the collection: communication primitives over torch.distributed (gloo on CPU, NCCL on
CUDA), the sharding specs, and the launcher of local worker processes.

======================  ============================================================================
module                  job
======================  ============================================================================
``comm``                all-to-all, all-gather and config agreement; a failed collective raises DistributedError
``sharding``            Sharding, ShardingKind, auto_plan: the sharding specs and today's rule-of-thumb plan
``strategy``            ShardingStrategy: the interface every kind implements, its exchange records, the registry
``shard_row``, ...      one module per kind: shard_row, shard_table, shard_table_row, shard_column, shard_data
``planner``             plan_tables: a kind per table balancing memory and step time, from configs or a checkpoint
``launch``              start N local processes on a free port (tests, examples, benchmarks)
======================  ============================================================================

The sharded executor itself is part of :mod:`dynemb.collection` (so the local and sharded paths share one
collection class), as are :class:`~dynemb.DistributedEmbeddingCollection` and SOK's
:class:`~dynemb.All2AllDenseEmbedding`, which build on it; this package imports nothing of the collection.
"""

from . import shard_column, shard_data, shard_row, shard_table, shard_table_row  # noqa: F401  (they register)
from .comm import DistributedError
from .planner import PlanError, TablePlan, plan_tables
from .sharding import Sharding, ShardingKind, auto_plan, mod_partitioner
from .strategy import ShardingStrategy, strategy_for

__all__ = ["DistributedError", "Sharding", "ShardingKind", "ShardingStrategy", "auto_plan", "mod_partitioner",
           "strategy_for", "plan_tables", "TablePlan", "PlanError"]
