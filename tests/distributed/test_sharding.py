"""Sharding specs print as the plan entries a user writes (docs/distributed.md prints them)."""

import torch

from dynemb.distributed import Sharding, ShardingKind


def by_high_bits(keys: torch.Tensor, world: int) -> torch.Tensor:
    return torch.remainder(keys >> 32, world)


def test_a_sharding_prints_as_its_plan_entry():
    assert [repr(s) for s in (Sharding("row"), Sharding("data"), Sharding("table", 3))] == \
        ["Sharding('row')", "Sharding('data')", "Sharding('table', owner=3)"]
    assert repr(Sharding("row", partitioner=by_high_bits)) == "Sharding('row', partitioner=by_high_bits)"
    assert repr({"user": Sharding("row")}) == "{'user': Sharding('row')}"


def test_a_sharding_kind_prints_as_its_name_and_equals_it():
    kind = Sharding("table", 0).kind
    assert (str(kind), f"{kind}", f"{kind:>6}", kind) == ("table", "table", " table", "table")
    assert kind is ShardingKind.TABLE and repr(kind) == "<ShardingKind.TABLE: 'table'>"
