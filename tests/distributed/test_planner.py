"""The planner: balanced plans without starting ranks, pins, the can't-fit error, printed plans, plans from what a
checkpoint observed (and older checkpoints' rows), `dynemb plan`, and sharding specs that round-trip as configs."""

import json
import re

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import save
from dynemb.checkpoint.planning import observed_tables, plan_from_checkpoint
from dynemb.cli import main
from dynemb.distributed.planner import PlanError, plan_tables
from dynemb.distributed.sharding import Sharding, resolve_plan
from dynemb.serialization import from_dict

# the 26 categorical features of Criteo's Kaggle display-advertising data set (public cardinalities)
CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def criteo(big: int = 0):
    tables = [TableConfig(name=f"c{i}", dim=128, vocabulary_size=v) for i, v in enumerate(CRITEO_KAGGLE)]
    return tables + [TableConfig(name=f"big{i}", dim=128, vocabulary_size=10**8) for i in range(big)]


@pytest.mark.parametrize("world", [8, 64])
@pytest.mark.parametrize("big", [0, 4])
def test_criteo_plans_balance_within_the_budget(world, big):
    budget = 80 << 30
    plan = plan_tables(criteo(big), world, memory_per_rank=budget, ranks_per_node=8)
    sizes = [t.bytes for t in plan.rank_totals()]
    assert max(sizes) <= 1.1 * (sum(sizes) / world) and max(sizes) <= budget
    total = sum(s.rows * s.row_bytes for s in plan.stats.values())
    assert sum(sizes) >= total  # every row is on some rank (replicas more than once)
    assert set(plan.shardings) == {t.name for t in criteo(big)}


def test_pins_are_kept_and_a_plan_that_cannot_fit_names_the_table_and_by_how_much():
    tables = [TableConfig(name="user", dim=64, max_capacity=10**6), TableConfig(name="item", dim=256,
                                                                                   vocabulary_size=10**5)]
    plan = plan_tables(tables, 4, pins={"item": "column", "user": ("table", 2)})
    assert plan.shardings == {"user": Sharding("table", owner=2), "item": Sharding("column")}
    assert sorted(plan.loads[2]) == ["item", "user"] and sorted(plan.loads[0]) == ["item"]
    with pytest.raises(PlanError, match=r"table 'user' \(table\) does not fit: rank 2 would hold .* over "
                                        r"memory_per_rank"):
        plan_tables(tables, 4, pins={"user": ("table", 2)}, memory_per_rank=50 << 20)
    with pytest.raises(PlanError, match="table 'free': its rows are unknown"):
        plan_tables([TableConfig(name="free", dim=8)], 2)
    with pytest.raises(ValueError, match="pins name table 'nope'"):
        plan_tables(tables, 2, pins={"nope": "row"})


def test_pin_errors_name_the_pin_can_t_fit_advice_applies_and_tight_memory_spreads_tables():
    tables = [TableConfig(name="user", dim=64, max_capacity=10**6), TableConfig(name="item", dim=256,
                                                                                   vocabulary_size=10**5)]
    with pytest.raises(ValueError, match=r"pins\['user'\]: sharding kind must be one of .* got 'colum'"):
        plan_tables(tables, 2, pins={"user": "colum"})
    with pytest.raises(ValueError, match=r"pins\['user'\] owner 9 is not a rank of a world of size 2"):
        plan_tables(tables, 2, pins={"user": ("table", 9)})
    # 'row' already spreads over every rank: "pin a wider kind" would be no help
    with pytest.raises(PlanError, match=r"table 'user' \(row\) does not fit: .* already spread over all 4 ranks: "
                                        r"give more ranks or memory \(the tables need at least .* a rank\)$"):
        plan_tables(tables, 4, memory_per_rank=10 << 20)
    with pytest.raises(PlanError, match=r"it is pinned to Sharding\('table', owner=2\): pin a kind that spreads"):
        plan_tables(tables, 4, pins={"user": ("table", 2)}, memory_per_rank=50 << 20)
    # replicas that overflow a rank give way to kinds that spread the tables: the plan fits when it can
    small = [TableConfig(name=f"t{i}", dim=16, vocabulary_size=v) for i, v in enumerate([40, 16, 15, 9, 7, 5, 2])]
    roomy = plan_tables(small, 2)
    budget = int(max(t.bytes for t in roomy.rank_totals()) * 0.7)
    assert set(roomy.shardings.values()) == {Sharding("data")}
    tight = plan_tables(small, 2, memory_per_rank=budget)
    assert max(t.bytes for t in tight.rank_totals()) <= budget
    assert Sharding("data") not in tight.shardings.values()
    with pytest.raises(PlanError, match=r"already spread over all 2 ranks"):
        plan_tables(small, 2, memory_per_rank=budget // 3)
    # the kind alone: the planner picks the owner (the least loaded rank), not rank 0
    plan = plan_tables(tables, 2, pins={"item": ("table", 0), "user": "table"})
    assert plan.shardings["user"] == Sharding("table", owner=1)


def test_a_printed_plan_shows_every_table_and_rank():
    text = str(plan_tables(criteo(), 8, memory_per_rank=80 << 30))
    assert text.splitlines()[0].split()[:3] == ["table", "kind", "ranks"]
    assert all(f"c{i} " in text for i in range(26))
    assert "lookups/step" in text and "x the mean" in text


@pytest.mark.parametrize("sharding", [Sharding("row"), Sharding("table", owner=3), Sharding("data"),
                                      Sharding("column", ranks=(1, 0), columns=(3, 5)),
                                      Sharding("table_row", ranks=(4, 5, 6, 7))])
def test_sharding_specs_round_trip_as_configs(sharding):
    data = sharding.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert from_dict(data) == sharding and Sharding.from_dict(data) == sharding


def test_bad_sharding_specs_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="Sharding.ranks must not repeat"):
        Sharding("column", ranks=(0, 0))
    with pytest.raises(ValueError, match="Sharding.columns .* needs ranks of the same length"):
        Sharding("column", ranks=(0, 1), columns=(4,))
    with pytest.raises(ValueError, match="Sharding.ranks applies to 'column' and 'table_row', not 'row'"):
        Sharding("row", ranks=(0, 1))


def test_column_widths_without_ranks_are_one_per_rank_of_the_world():
    # docs/distributed.md: ranks default to every rank, columns= the widths
    tables = [TableConfig(name="wide", dim=8, vocabulary_size=100)]
    sharding = Sharding("column", columns=(3, 5))
    assert resolve_plan(tables, 2, {"wide": sharding})["wide"] == sharding
    assert plan_tables(tables, 2, pins={"wide": sharding}).shardings["wide"] == sharding
    with pytest.raises(ValueError, match=r"plan\['wide'\] columns \(3, 5\) need one width per rank: .* or 4 widths"):
        resolve_plan(tables, 4, {"wide": sharding})


def _trained_checkpoint(path):
    ec = EmbeddingCollection([TableConfig(name="user", dim=8, optimizer=dynemb.optim.Adagrad(lr=0.1)),
                              TableConfig(name="cat", dim=4, vocabulary_size=100,
                                          optimizer=dynemb.optim.SGD(lr=0.1))],
                             [FeatureConfig(name="u", table="user"), FeatureConfig(name="c", table="cat")])
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        out = ec({"u": torch.randint(0, 1000, (64,), generator=g), "c": torch.randint(0, 100, (64,), generator=g)})
        sum(o.sum() for o in out.values()).backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()
    save(path, ec, step=3)
    return ec


def test_a_checkpoint_records_rows_and_accesses_and_plans_the_next_run(tmp_path, capsys):
    ec = _trained_checkpoint(tmp_path)
    manifest = json.loads(next(tmp_path.glob("step-*/manifest.json")).read_text())
    seen = manifest["tables"]["user"]["observed"]
    assert seen == {"rows": len(ec.embeddings["user"].table), "accesses": 192, "unique_accesses": 0, "steps": 3}
    stats = {s.name: s for s in observed_tables(tmp_path)}
    assert stats["user"].rows == seen["rows"] and stats["user"].accesses == 64.0
    assert stats["user"].row_bytes == 8 * 4 + 8 + 8 + 8 * 4  # values, key, score, Adagrad's sum
    plan = plan_from_checkpoint(tmp_path, 4, memory_per_rank=1 << 20)
    assert set(plan.shardings) == {"user", "cat"}
    assert main(["plan", "--checkpoint", str(tmp_path), "--world", "4", "--memory-per-rank", "1e6", "--pin",
                 "user=row", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["user"]["kind"] == "row"  # only the JSON on stdout: it pipes into jq
    assert "lookups/step" in captured.err
    assert main(["plan", "--checkpoint", str(tmp_path), "--world", "2", "--memory-per-rank", "100"]) != 0
    err = capsys.readouterr().err
    assert "does not fit" in err and "--memory-per-rank 100 B" in err and "memory_per_rank" not in err


@pytest.mark.parametrize("options, expected", [
    (["--world", "0"], "--world must be a number of ranks >= 1, got 0"),
    (["--world", "2", "--ranks-per-node", "3"], "--ranks-per-node must be >= 1 and divide --world 2, got 3"),
    (["--world", "2", "--memory-per-rank", "inf"], "--memory-per-rank must be a positive number of bytes .* 'inf'"),
    (["--world", "2", "--memory-per-rank", "8 parsecs"], "--memory-per-rank must be .*, got '8 parsecs'"),
    (["--world", "2", "--memory-per-rank", "-5"], "--memory-per-rank must be .*, got '-5'"),
    (["--world", "2", "--pin", "user"], "--pin must be TABLE=KIND .*, got 'user'"),
    (["--world", "2", "--pin", "user=colum"], "--pin user=colum: KIND must be one of row, .*, got 'colum'"),
    (["--world", "2", "--pin", "user=table:x"], "--pin user=table:x: RANK .* --world 2 .*, got 'x'"),
    (["--world", "2", "--pin", "user=table:2"], "--pin user=table:2: RANK .* \\(0 to 1\\), got '2'"),
    (["--world", "2", "--pin", "user=row", "--pin", "user=data"], "--pin gives table 'user' twice"),
])
def test_dynemb_plan_names_the_option_the_expected_form_and_what_came_in(tmp_path, capsys, options, expected):
    _trained_checkpoint(tmp_path)
    assert main(["plan", "--checkpoint", str(tmp_path), *options]) == 2
    err = capsys.readouterr().err
    assert re.search(expected, err) and len(err.splitlines()) == 1, err


def test_dynemb_plan_reads_byte_units_and_names_a_run_directory_s_checkpoints(tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoint"
    _trained_checkpoint(ckpt)
    assert main(["plan", "--checkpoint", str(ckpt), "--world", "2", "--memory-per-rank", "1GiB"]) == 0
    assert "of 1.0 GiB a rank" in capsys.readouterr().out
    for path, expected in [(tmp_path / "run", f"a directory of checkpoints, not one .* give one of {ckpt}"),
                           (tmp_path / "nope", "no such directory"), (tmp_path, "no checkpoint here")]:
        assert main(["plan", "--checkpoint", str(path), "--world", "2"]) == 2
        assert re.search(f"--checkpoint: {path}: {expected}", capsys.readouterr().err)
    (tmp_path / "run" / "model.json").write_text("{}")  # a `dynemb train` run directory: its last checkpoint
    assert main(["plan", "--checkpoint", str(tmp_path / "run"), "--world", "2", "--json"]) == 0
    from_run = capsys.readouterr().out
    assert main(["plan", "--checkpoint", str(ckpt), "--world", "2", "--json"]) == 0
    assert from_run == capsys.readouterr().out
    # the best checkpoint newer than the last (a run killed between two saves): the one --resume takes
    import shutil

    shutil.copytree(ckpt, tmp_path / "run" / "checkpoint-best")
    (ckpt / "latest").write_text(json.dumps({"name": "step-gone", "step": 0}))
    assert main(["plan", "--checkpoint", str(tmp_path / "run"), "--world", "2", "--json"]) == 0
    assert capsys.readouterr().out == from_run


def test_an_older_checkpoint_gives_rows_only(tmp_path):
    ec = _trained_checkpoint(tmp_path)
    file = next(tmp_path.glob("step-*/manifest.json"))
    manifest = json.loads(file.read_text())
    for entry in manifest["tables"].values():
        del entry["observed"]
    file.write_text(json.dumps(manifest))
    stats = {s.name: s for s in observed_tables(tmp_path)}
    assert stats["user"].rows == len(ec.embeddings["user"].table) and stats["user"].accesses == 0.0
    assert stats["cat"].rows == 100


def test_a_plan_reaches_a_collection_as_printed_json_or_as_the_plan_itself():
    from dynemb.collection.collection import _check_plan_spec

    tables = [TableConfig(name="user", dim=8, max_capacity=1000), TableConfig(name="cat", dim=4, vocabulary_size=9)]
    plan = plan_tables(tables, 2, pins={"cat": ("table", 1)})
    assert _check_plan_spec(plan) == plan.shardings  # the docstring's "a planned one"
    printed = json.loads(json.dumps(plan.to_dict()))  # what `dynemb plan --json` prints
    assert resolve_plan(tables, 2, printed) == plan.shardings
    with pytest.raises(ValueError, match=r"plan\['cat'\]: sharding kind must be one of .* got 'colum'"):
        resolve_plan(tables, 2, {"cat": {"type": "sharding", "kind": "colum"}})


def test_a_dynamic_table_s_observed_rows_come_before_its_bound():
    # docs/distributed.md: a dynamic table's rows are what training observed, else max_capacity
    table = TableConfig(name="user", dim=8, max_capacity=10**6)
    assert plan_tables([table], 2, observed={"user": {"rows": 500}}).stats["user"].rows == 500
    assert plan_tables([table], 2).stats["user"].rows == 10**6
