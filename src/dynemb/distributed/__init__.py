"""Model-parallel sharded embeddings over torch.distributed (gloo on CPU, NCCL on CUDA)."""

from .collection import DistributedEmbeddingCollection
from .comm import DistributedError
from .plan import Sharding, auto_plan, mod_partitioner
from .sok import All2AllDenseEmbedding

__all__ = ["DistributedEmbeddingCollection", "All2AllDenseEmbedding", "DistributedError", "Sharding", "auto_plan",
           "mod_partitioner"]
