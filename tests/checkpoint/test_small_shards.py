"""Ranks whose shards hold 0, 1 or 2 rows: a 2-rank sharded collection saves (full and delta), loads under 2 ranks
bit-exactly and under one process (resharding) and back, and exports from 2 ranks what one process exports.

Rank 0 sends every id and rank 1 none (a rank may have no ids); keys are owned by ``key % 2``, so:

======  ===================  ==========================  =======  ========================================
table   keys                 config                      rank 0   rank 1
======  ===================  ==========================  =======  ========================================
one     3                    int64, Adam                 0        1
split   int32 min, -1        int32, bfloat16, lfu, bound  1        1
pair    int64 max, -3        int64, Adagrad              0        1 (int64 max, deleted, then -3)
two     5, -7                dim 1, decayed_lfu, bound   0        2
none    (none)               int64                       0        0
tiered  int64 min            fast tier of one row        1        0
tiny    0                    static, vocabulary 1        1        none of it (it owns no id; a phantom row
                                                                  for id 1 was saved and exported here)
======  ===================  ==========================  =======  ========================================

Fixed cases, not hypothesis: each world of processes takes seconds to start.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import export_for_serving, load, read_export, save
from dynemb.collection.features import Bags
from dynemb.table import Tiers

from distributed.harness import run
from small_tables import bits

I64, I32 = torch.iinfo(torch.int64), torch.iinfo(torch.int32)
IDS = [  # per step: the ids rank 0 sends (rank 1 sends none)
    {"one": [3], "split": [I32.min], "pair": [I64.max], "two": [5, -7], "none": [], "tiered": [I64.min], "tiny": [0]},
    {"one": [3], "split": [-1, I32.min], "pair": [-3], "two": [-7], "none": [], "tiered": [I64.min], "tiny": [0]},
]
# rows of each shard saved, in rank order, at the end (rank 1 holds no shard of "tiny")
ROWS = {"one": [0, 1], "split": [1, 1], "pair": [0, 1], "two": [0, 2], "none": [0, 0], "tiered": [1, 0], "tiny": [1]}


def build(world: int) -> EmbeddingCollection:
    tables = [TableConfig(name="one", dim=3, optimizer=dynemb.optim.Adam(lr=0.1), seed=1),
              TableConfig(name="split", dim=2, key_dtype=torch.int32, dtype=torch.bfloat16, eviction="lfu",
                          max_capacity=8, optimizer=dynemb.optim.SGD(lr=0.1), seed=2),
              TableConfig(name="pair", dim=2, optimizer=dynemb.optim.Adagrad(lr=0.1), seed=3),
              TableConfig(name="two", dim=1, eviction="decayed_lfu", max_capacity=8, optimizer=dynemb.optim.SGD(lr=0.1),
                          seed=7),
              TableConfig(name="none", dim=2, seed=4),
              TableConfig(name="tiered", dim=2, optimizer=dynemb.optim.Adam(lr=0.1), seed=5,
                          tiers=Tiers(fast_capacity=1, slow="host")),
              TableConfig(name="tiny", dim=2, vocabulary_size=1, optimizer=dynemb.optim.SGD(lr=0.1), seed=6)]
    features = [FeatureConfig(name=t.name, table=t.name) for t in tables]
    return EmbeddingCollection(tables, features, plan=None if world == 1 else {t.name: "row" for t in tables})


def train_step(ec: EmbeddingCollection, step: int) -> None:
    batch = {}
    for name, ids in IDS[step].items():
        dtype = ec.table_configs[name].key_dtype
        ids = torch.tensor(ids if ec.rank == 0 else [], dtype=dtype)
        batch[name] = Bags(ids, lengths=torch.tensor([ids.numel()]))
    sum(out.square().sum() for out in ec(batch).values()).backward()
    ec.optimizer.step()
    ec.optimizer.zero_grad()


def rank_state(ec: EmbeddingCollection) -> dict:
    """This rank's rows of every table as it holds them (row order, scores, slots, counters), as numpy arrays."""
    state = {}
    for name, shard in ec.logical_tables().items():
        t = shard.table
        if t is None:
            continue
        rows = t.export()
        order = rows.keys.argsort() if name == "tiered" else torch.arange(rows.keys.numel())  # tiers reorder
        cols = {"keys": rows.keys, "values": rows.values, "scores": rows.scores, **rows.slots}
        state.update({f"{name}/{k}": bits(v[order]).numpy() for k, v in cols.items()})
        counters = ("clock", "epoch", "inserted", "removed", "evicted")  # a static table has a clock only
        state[f"{name}/counters"] = np.array([getattr(t, c, -1) for c in counters])
    return state


def all_rows(ec: EmbeddingCollection) -> dict:
    """Every rank's (key, value, slots) rows of every table, sorted by key (a collective when sharded)."""
    from dynemb.distributed.comm import all_gather_varsize

    result = {}
    for name, shard in ec.logical_tables().items():
        if shard.module is None:  # this rank holds none of it ("tiny" has no slots)
            cols = {"keys": torch.empty(0, dtype=torch.int64), "values": torch.empty(0, shard.config.dim)}
        else:
            rows = shard.table.export()
            cols = {"keys": shard.user_keys(rows.keys).to(torch.int64), "values": rows.values, **rows.slots}
        if ec.sharded:
            cols = {k: torch.cat(all_gather_varsize(v, ec.group)) for k, v in cols.items()}
        order = cols["keys"].argsort()
        result.update({f"{name}/{k}": bits(v[order]).numpy() for k, v in cols.items()})
    return result


def _first(rank, world, root, export):
    ec = build(world)
    train_step(ec, 0)
    save(root, ec, step=1)
    if rank == 1:  # the delta deletes the one row this shard held, and adds another
        ec.logical_tables()["pair"].table.erase(torch.tensor([I64.max]))
    train_step(ec, 1)
    save(root, ec, step=2, incremental=True)
    state = rank_state(ec)  # as saved (an export ticks the clock)
    export_for_serving(export, ec)
    return {**state, **{f"all:{k}": v for k, v in all_rows(ec).items()}}


def _second(rank, world, root, export):
    exact = build(world)
    load(root / "step-00000002", exact)  # the 2-rank checkpoint: each rank reads its own shards
    resharded = build(world)
    load(root, resharded)  # latest: the one-process checkpoint, spread over 2 ranks
    export_for_serving(export, resharded)
    save(root, resharded, step=4)
    return {**rank_state(exact), **{f"all:{k}": v for k, v in all_rows(resharded).items()}}


def _assert_same(got: dict, want: dict, prefix: str, what: str) -> None:
    keys = [k for k in want if k.startswith(prefix)]
    assert keys == [k for k in got if k.startswith(prefix)], what
    for key in keys:
        np.testing.assert_array_equal(got[key], want[key], err_msg=f"{what}: {key}")


def _assert_export(root, want: dict) -> None:
    _, tables = read_export(root)
    assert sorted(tables) == sorted(ROWS)
    for name, cols in tables.items():
        order = cols["keys"].argsort()
        np.testing.assert_array_equal(cols["keys"][order].to(torch.int64).numpy(), want[f"all:{name}/keys"])
        trained = torch.bfloat16 if name == "split" else torch.float32  # exported as float32: exact
        np.testing.assert_array_equal(bits(cols["values"][order].to(trained)).numpy(), want[f"all:{name}/values"],
                                      err_msg=name)


def _rank_results(out, n: int) -> list[dict]:
    results = []
    for rank in range(n):
        path = out / f"rank{rank}.npz"
        assert path.exists(), [p.read_text() for p in out.glob("*.err")]
        results.append(dict(np.load(path)))
    return results


@pytest.mark.slow
def test_shards_of_0_1_2_rows_save_load_reshard_and_export(tmp_path):
    root = tmp_path / "ckpt"
    (tmp_path / "a").mkdir()
    run(_first, 2, tmp_path / "a", root, tmp_path / "export-2")
    first = _rank_results(tmp_path / "a", 2)
    manifest = json.loads((root / "step-00000002" / "manifest.json").read_text())
    assert {name: [s["rows"] for s in entry["shards"]] for name, entry in manifest["tables"].items()} == ROWS
    full = json.loads((root / "step-00000001" / "manifest.json").read_text())
    assert [s["rows"] for s in full["tables"]["one"]["shards"]] == [0, 1]  # the shard that crashed the save
    _assert_export(tmp_path / "export-2", first[0])

    single = build(1)  # 2 ranks -> one process
    load(root, single)
    _assert_same({f"all:{k}": v for k, v in all_rows(single).items()}, first[0], "all:", "loaded into one process")
    save(root, single, step=3)
    export_for_serving(tmp_path / "export-1", single)
    _assert_export(tmp_path / "export-1", first[0])

    (tmp_path / "b").mkdir()
    run(_second, 2, tmp_path / "b", root, tmp_path / "export-2b")
    second = _rank_results(tmp_path / "b", 2)
    for rank in range(2):  # same world and plan: each rank's rows, scores, slots and counters as they were saved
        for name in ROWS:
            _assert_same(second[rank], first[rank], f"{name}/", f"rank {rank}, 2 ranks -> 2 ranks")
    _assert_same(second[0], first[0], "all:", "one process -> 2 ranks")
    _assert_export(tmp_path / "export-2b", first[0])
    back = build(1)  # and the checkpoint those 2 ranks wrote, back into one process
    load(root, back)
    _assert_same({f"all:{k}": v for k, v in all_rows(back).items()}, first[0], "all:", "2 ranks -> one process")
