"""All2AllDenseEmbedding: SOK's model-parallel embedding layer, over DistributedEmbeddingCollection."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .config import FeatureConfig, TableConfig
from .distributed import DistributedEmbeddingCollection

__all__ = ["All2AllDenseEmbedding"]


class All2AllDenseEmbedding(nn.Module):
    """Each key lives on rank ``key % world_size``; lookups exchange keys and rows with all-to-all.

    Args:
        max_vocabulary_size_per_rank: with ``use_hashtable`` the rows preallocated per rank (the table still
            grows past it; nothing is evicted); without, the static vocabulary per rank, so keys must be row
            indices in ``[0, max_vocabulary_size_per_rank * world_size)``.
        dim: embedding width ``D``.
        slot_num, nnz_per_slot: the input layout ``[B, slot_num, nnz_per_slot]``.
        dynamic_input: take a flat ``[N]`` of keys instead.
        use_hashtable: dynamic hash table (any key) or static rows.
        key_dtype, initializer, optimizer, seed: as for :class:`dynemb.TableConfig`.

    Shape:
        ``[B, slot_num, nnz_per_slot]`` -> ``[B, slot_num, nnz_per_slot, D]``; dynamic input ``[N]`` -> ``[N, D]``.
    """

    def __init__(self, max_vocabulary_size_per_rank: int, dim: int, slot_num: int = 1, nnz_per_slot: int = 1,
                 dynamic_input: bool = False, use_hashtable: bool = True, key_dtype: torch.dtype = torch.int64,
                 initializer="uniform", optimizer=None, seed: Optional[int] = None, timeout: float = 300.0,
                 device=None) -> None:
        super().__init__()
        for name, value in (("max_vocabulary_size_per_rank", max_vocabulary_size_per_rank), ("slot_num", slot_num),
                            ("nnz_per_slot", nnz_per_slot)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.slot_num, self.nnz_per_slot, self.dynamic_input = slot_num, nnz_per_slot, dynamic_input
        vocab = None if use_hashtable else max_vocabulary_size_per_rank * world
        table = TableConfig(name="sok", dim=dim, vocabulary_size=vocab, key_dtype=key_dtype,
                            initializer=initializer, optimizer=optimizer, seed=seed,
                            init_capacity=max_vocabulary_size_per_rank)
        self.collection = DistributedEmbeddingCollection(
            [table], [FeatureConfig(name="ids", table="sok", combiner="none")], plan={"sok": "row"},
            timeout=timeout, device=device)
        self.optimizer = self.collection.optimizer

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        expected = "[N]" if self.dynamic_input else f"[B, {self.slot_num}, {self.nnz_per_slot}]"
        ok = inputs.dim() == 1 if self.dynamic_input else (
            inputs.dim() == 3 and tuple(inputs.shape[1:]) == (self.slot_num, self.nnz_per_slot))
        if not ok:
            raise ValueError(f"inputs must have shape {expected}, got {tuple(inputs.shape)}")
        return self.collection({"ids": inputs})["ids"]

    def dynemb_tables(self):
        return self.collection.dynemb_tables()
