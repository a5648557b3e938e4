"""Model-parallel sharded embeddings over torch.distributed (gloo on CPU, NCCL on CUDA).

This package holds the communication primitives and the sharding specs; the sharded executor itself is part of
:mod:`dynemb.collection`, so the local and sharded paths share one collection class.
"""

from .comm import DistributedError
from .plan import Sharding, ShardingKind, auto_plan, mod_partitioner

__all__ = ["DistributedEmbeddingCollection", "All2AllDenseEmbedding", "DistributedError", "Sharding",
           "ShardingKind", "auto_plan", "mod_partitioner"]


def __getattr__(name):
    # The modules build on dynemb.collection, which itself uses this package's comm and plan: import them late.
    if name == "DistributedEmbeddingCollection":
        from .collection import DistributedEmbeddingCollection

        return DistributedEmbeddingCollection
    if name == "All2AllDenseEmbedding":
        from .sok import All2AllDenseEmbedding

        return All2AllDenseEmbedding
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
