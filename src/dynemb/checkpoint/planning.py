"""Plan the next run from the last checkpoint: each table's rows and accesses as training observed them.

A checkpoint's manifest records, per table, ``observed``: the rows it held (all ranks together) and the ids,
unique ids and steps training looked up (saved since dynemb 0.3; an older checkpoint gives the rows only, from its
shards). :func:`plan_from_checkpoint` turns them into a plan for ``world_size`` ranks with
:func:`~dynemb.distributed.planner.plan_tables`; loading the checkpoint into a collection built with that plan
reshards it (:func:`~dynemb.checkpoint.load` reads every saved rank's part and keeps this rank's).

Example (shell)::

    dynemb plan --checkpoint runs/ckpt --world 8 --memory-per-rank 80e9
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ..distributed.planner import TablePlan, plan_tables
from ..distributed.strategy import TableStats
from ..serialization import parse_dtype
from .manifest import chain, resolve
from .shard_tensors import canonical_config

__all__ = ["plan_from_checkpoint", "observed_tables"]


def observed_tables(path) -> list[TableStats]:
    """Each table of the checkpoint at ``path`` (a root or one checkpoint) as the planner sees it: dim, bytes a
    row (values, key, score and slots), rows, and unique ids a step (0 where not recorded)."""
    directory = resolve(path)
    manifest = chain(directory)[-1][1]
    out = []
    for name, entry in manifest.get("tables", {}).items():
        config = canonical_config(entry["config"])
        size = torch.empty(0, dtype=parse_dtype(config["dtype"])).element_size()
        key_size = torch.empty(0, dtype=parse_dtype(config["key_dtype"])).element_size()
        slots = sum(s["dim"] * torch.empty(0, dtype=parse_dtype(s["dtype"])).element_size()
                    for s in config.get("slots", {}).values())
        row_bytes = config["dim"] * size + key_size + 8 + slots
        seen = entry.get("observed") or {}
        rows = config.get("vocabulary_size") or seen.get("rows")
        if rows is None:  # an older checkpoint: its shards' rows, as its layout counts them
            rows = _saved_rows(entry.get("shards", []))
        steps = seen.get("steps") or 0
        ids = seen.get("unique_accesses") or seen.get("accesses") or 0
        columnar = sum(s["dim"] * torch.empty(0, dtype=parse_dtype(s["dtype"])).element_size()
                       for s in config.get("slots", {}).values() if s["dim"] == config["dim"]) // config["dim"]
        out.append(TableStats(name, config["dim"], int(rows), ids / steps if steps else 0.0, row_bytes, size,
                              "rowwiseadagrad.sum" in config.get("slots", {}), size + columnar))
    return out


def _saved_rows(shards: list) -> int:
    kinds = {(s.get("sharding") or {}).get("kind") for s in shards}
    rows = [s.get("rows", 0) for s in shards]
    if kinds <= {None, "data"}:
        return int(rows[0]) if rows else 0
    if kinds == {"column"}:
        return int(max(rows))
    return int(sum(rows))


def plan_from_checkpoint(path, world_size: int, *, memory_per_rank: Optional[int] = None,
                         ranks_per_node: Optional[int] = None, pins: Optional[Mapping] = None,
                         **options) -> TablePlan:
    """A plan for ``world_size`` ranks of the tables of the checkpoint at ``path``, from what training observed
    (see :func:`observed_tables`; the other arguments are :func:`~dynemb.distributed.planner.plan_tables`')."""
    return plan_tables(observed_tables(path), world_size, memory_per_rank=memory_per_rank,
                       ranks_per_node=ranks_per_node, pins=pins, **options)
