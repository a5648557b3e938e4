"""What sharding needs below the collection: communication primitives over torch.distributed (gloo on CPU, NCCL on
CUDA), the sharding specs, and the launcher of local worker processes.

======================  ============================================================================
module                  job
======================  ============================================================================
``comm``                all-to-all, all-gather and config agreement; a failed collective raises DistributedError
``sharding``            Sharding, ShardingKind, auto_plan: which tables are row-, table- or data-sharded
``launch``              start N local processes on a free port (tests, examples, benchmarks)
======================  ============================================================================

The sharded executor itself is part of :mod:`dynemb.collection` (so the local and sharded paths share one
collection class), as are :class:`~dynemb.DistributedEmbeddingCollection` and SOK's
:class:`~dynemb.All2AllDenseEmbedding`, which build on it; this package imports nothing of the collection.
"""

from .comm import DistributedError
from .sharding import Sharding, ShardingKind, auto_plan, mod_partitioner

__all__ = ["DistributedError", "Sharding", "ShardingKind", "auto_plan", "mod_partitioner"]
