"""Which rank writes what, and which saved rows a rank takes back: multi-rank saves and resharding loads.

A model holding a :class:`~dynemb.DistributedEmbeddingCollection` is saved collectively: every rank
writes the shards it owns (row- and table-sharded tables; replicated ``data`` tables and the dense state by rank 0
only) into one staging directory, rank 0 gathers the file records, writes the manifest last and publishes the
directory. Loading reads, for each table, the delta chain of every saved rank's shard and keeps the rows the
*current* plan gives this rank, so any saved world size loads into any current one. When the world size is
unchanged each rank reads exactly its own shard, and resume is bit-exact.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..collection import EmbeddingCollection
from ..distributed.comm import all_gather_varsize

__all__ = ["RankContext", "rank_context", "merge_states"]


@dataclasses.dataclass
class RankContext:
    """This process in the group that saves or loads together (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1
    group: Optional[object] = None

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def gather(self, obj) -> list:
        """Every rank's JSON-able ``obj``, in rank order (JSON bytes over the group, never pickle)."""
        if not self.distributed:
            return [obj]
        blob = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else None
        parts = all_gather_varsize(blob.to(device) if device else blob, self.group, "checkpoint metadata exchange")
        return [json.loads(bytes(p.cpu().tolist()).decode()) for p in parts]

    def gather_tensor(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (first dimensions may differ), in rank order."""
        if not self.distributed:
            return [tensor]
        return [p.to(tensor.dtype) for p in all_gather_varsize(tensor, self.group, what)]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def first_problem(self, problem: Optional[str]) -> Optional[tuple[int, str]]:
        """``(rank, problem)`` of the first rank that has one (``problem``: this rank's, or None), the same on every
        rank (a collective when distributed); None when no rank has one. What lets a rank's own failure stop every
        rank at once instead of leaving its peers waiting in their next collective."""
        every = self.gather(problem) if self.distributed else [problem]
        return next(((rank, p) for rank, p in enumerate(every) if p), None)

    def agree(self, call: str, args: dict, refused: Exception | None = None) -> None:
        """Check that every rank passed the same ``args`` (JSON-able) to ``call`` (a collective): each rank raises
        the same ``ValueError`` naming the first argument that differs and two ranks' values. Without it rank 0's
        arguments won silently (another rank's step or path was ignored, or its rows loaded from another
        checkpoint than its peers').

        ``refused``: this rank's error from checking its own arguments (a NaN in its ``extra``, say). It is raised
        here, once the peers know: they raise a ``ValueError`` naming this rank and the error, where they waited
        in this collective for the whole timeout while this rank raised alone."""
        if not self.distributed:
            if refused is not None:
                raise refused
            return
        why = None if refused is None else f"{type(refused).__name__}: {refused}"
        every = self.gather({"args": None if refused is not None else args, "refused": why})
        if refused is not None:
            raise refused
        bad = next(((rank, other["refused"]) for rank, other in enumerate(every) if other["refused"]), None)
        if bad is not None:
            raise ValueError(f"{call}: rank {bad[0]} refused its arguments ({bad[1]}); every rank stops")
        every = [other["args"] for other in every]
        for key in args:
            for rank, other in enumerate(every):
                if other[key] != every[0][key]:
                    raise ValueError(f"{call}: every rank must pass the same {key} (it is one collective call): "
                                     f"rank 0 has {every[0][key]!r}, rank {rank} has {other[key]!r}")


def rank_context(model: nn.Module) -> RankContext:
    """The rank layout of ``model``: from its sharded collection, else the process group, else one process."""
    for _, module in model.named_modules():
        if isinstance(module, EmbeddingCollection) and module.sharded:
            group = module.group
            return RankContext(dist.get_rank(group), dist.get_world_size(group), group)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # Plain data parallelism: every rank holds the same model, rank 0 writes it.
        return RankContext(dist.get_rank(), dist.get_world_size(), None)
    return RankContext()


def merge_states(states: list):
    """Union of per-rank optimizer states: dict entries from every rank (the first rank's value wins on overlap).

    Sparse optimizer state is per table (keyed by table name), so after resharding each rank finds the scalar state
    (step counts) of the tables it now holds in whichever rank saved it.
    """
    first = states[0]
    if not isinstance(first, dict):
        return first
    merged = {}
    for state in states:
        for key, value in state.items():
            merged[key] = merge_states([merged[key], value]) if key in merged else value
    return merged
