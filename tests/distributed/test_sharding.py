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


def test_table_alone_spreads_whole_tables_over_the_ranks():
    # "table" without an owner once put every such table on rank 0, leaving the other ranks idle
    from dynemb import TableConfig
    from dynemb.distributed.sharding import resolve_plan

    tables = [TableConfig(name=n, dim=8) for n in "abcde"]
    plan = resolve_plan(tables, 3, {n: "table" for n in "abcde"})
    assert [plan[n].owner for n in "abcde"] == [0, 1, 2, 0, 1]
    # owners given count: "c" on rank 0 already, so the first unowned table goes to rank 1
    plan = resolve_plan(tables, 3, {"c": ("table", 0), "a": "table", "b": "table"})
    assert (plan["c"].owner, plan["a"].owner, plan["b"].owner) == (0, 1, 2)
    # by bytes where known: the large static table alone on one rank, the two small ones together
    sized = [TableConfig(name="big", dim=64, vocabulary_size=10_000), TableConfig(name="s1", dim=8, vocabulary_size=10),
             TableConfig(name="s2", dim=8, vocabulary_size=10)]
    plan = resolve_plan(sized, 2, {n: "table" for n in ("s1", "s2", "big")})
    assert (plan["big"].owner, plan["s1"].owner, plan["s2"].owner) == (0, 1, 1)
    assert resolve_plan(tables, 1, {"a": "table"})["a"] == Sharding("table", owner=0)


def test_a_disagreement_names_its_cause_first():
    """Ranks' configurations are compared in the caller's order: a table renamed on one rank is named as the
    table's name, not as a feature that refers to it (which differs too)."""
    from dynemb.distributed.comm import _first_difference

    mine = {"world": 2, "tables": [{"name": "a"}, {"name": "b"}], "features": ["F(a)", "F(b)"]}
    other = {"world": 2, "tables": [{"name": "a"}, {"name": "c"}], "features": ["F(a)", "F(c)"]}
    assert _first_difference(mine, other, order=list(mine)) == "tables[1].name"
    assert _first_difference(mine, other) == "features[1]"  # sorted keys alone: the effect first
    assert _first_difference({"x": 1, "y": {"z": 2}}, {"x": 1, "y": {"z": 3}}, order=["y"]) == "y.z"
