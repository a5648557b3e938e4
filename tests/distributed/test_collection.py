"""Sharded training on 2 and 4 gloo processes equals single-process training on the same global batch."""

import os
import time

import numpy as np
import pytest
import torch

import dynemb
from dynemb import (All2AllDenseEmbedding, DistributedEmbeddingCollection, EmbeddingCollection, FeatureConfig,
                    TableConfig)
from dynemb.distributed import DistributedError

from .harness import run

STEPS = 5
SPLITS = {2: [16, 8], 4: [10, 0, 8, 6]}  # uneven batches; a rank with no samples at all


def configs(opt_name, policy=None):
    opt = {"sgd": dynemb.optim.SGD(lr=0.5), "adam": dynemb.optim.Adam(lr=0.05)}[opt_name]
    # lfu with admission: occurrence counts must reach the owners for N ranks to equal one process
    # a bound no rank reaches: max_capacity is per rank, so tables that evict would not compare
    bounded = {"eviction": policy, "admission": 2, "max_capacity": 1 << 16} if policy else {}
    tables = [
        TableConfig(name="user", dim=4, optimizer=opt, seed=1, **bounded),  # dynamic, row
        TableConfig(name="item", dim=6, optimizer=opt, seed=2, combiner="sum", **bounded),  # dynamic, table plan
        TableConfig(name="cat", dim=4, vocabulary_size=13, optimizer=opt, seed=3),  # static, data
        TableConfig(name="geo", dim=3, vocabulary_size=40, optimizer=opt, seed=4),  # static, row
    ]
    features = [FeatureConfig(name="uid", table="user"), FeatureConfig(name="hist", table="item"),
                FeatureConfig(name="clicks", table="item", combiner="mean"),
                FeatureConfig(name="cat", table="cat"), FeatureConfig(name="geo", table="geo")]
    plan = {"user": "row", "item": ("table", 1), "cat": "data", "geo": "row"}
    return tables, features, plan


def global_batch(step, n=24):
    g = torch.Generator().manual_seed(100 + step)
    uid = torch.randint(-(2**63), 2**63 - 1, (6,), generator=g)[torch.randint(0, 6, (n,), generator=g)]
    hist_len = torch.randint(0, 4, (n,), generator=g)
    hist = torch.randint(-50, 50, (int(hist_len.sum()),), generator=g)
    return {"uid": uid, "hist": (hist, hist_len), "clicks": torch.randint(0, 2**40, (n, 3), generator=g),
            "cat": torch.randint(0, 13, (n,), generator=g), "geo": torch.randint(0, 40, (n,), generator=g),
            "r": torch.randn(n, 4 + 6 + 6 + 4 + 3, generator=g)}


def slice_batch(batch, lo, hi):
    hist, lens = batch["hist"]
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    ids = hist[starts[lo]: starts[hi]]
    offsets = lens[lo:hi].cumsum(0) - lens[lo:hi]
    out = {k: batch[k][lo:hi] for k in ("uid", "clicks", "cat", "geo", "r")}
    out["hist"] = (ids, offsets)
    return out


def loss_of(out, r):
    parts = [out["uid"], out["hist"], out["clicks"], out["cat"], out["geo"]]
    return (torch.cat(parts, 1) * r).sum()


def train(ec, lo_hi, steps=STEPS):
    for step in range(steps):
        b = global_batch(step)
        b = slice_batch(b, *(lo_hi or (0, b["uid"].numel())))
        r = b.pop("r")
        loss_of(ec(b), r).backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()


SCENARIOS = [("sgd", False, None), ("adam", False, None), ("adam", True, None), ("sgd", False, "lfu")]
"""(optimizer, fused, eviction policy): run one after another in the same ranks, which start once (a start costs
more than a scenario)."""


def _sharded_scenarios(rank, world, scenarios):
    result = {}
    for i, scenario in enumerate(scenarios):
        found = _sharded(rank, world, *scenario)
        result.update({f"{i}/{k}": v for k, v in (found or {}).items()})
    return result if rank == 0 else None


def _sharded(rank, world, opt_name, fused, policy=None):
    tables, features, plan = configs(opt_name, policy)
    if fused:
        tables = [TableConfig(**{**t.__dict__, "optimizer": type(t.optimizer)(**t.optimizer.defaults, fused=True)})
                  for t in tables]
    ec = DistributedEmbeddingCollection(tables, features, plan=plan, timeout=60)
    splits = SPLITS[world]
    lo = sum(splits[:rank])
    train(ec, (lo, lo + splits[rank]))
    result = {}
    for t in tables:
        keys, values = ec.gather_export(t.name)
        result[t.name + ".keys"], result[t.name + ".values"] = keys.numpy(), values.numpy()
    return result if rank == 0 else None


def _single(opt_name, policy=None):
    tables, features, _ = configs(opt_name, policy)
    ec = EmbeddingCollection(tables, features)
    train(ec, None)
    return {t.name: ec.export(t.name) for t in tables}


def _sorted(keys, values):
    order = np.argsort(keys, kind="stable")
    return keys[order], values[order]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_sharded_training_equals_single_process(tmp_path, world):
    got = run(_sharded_scenarios, world, tmp_path, SCENARIOS)
    assert got is not None, [p.read_text() for p in tmp_path.glob("*.err")]
    for i, (opt_name, fused, policy) in enumerate(SCENARIOS):
        scenario = f"{opt_name}, fused={fused}, policy={policy}"
        for name, (keys, values) in _single(opt_name, policy).items():
            gk, gv = _sorted(got[f"{i}/{name}.keys"], got[f"{i}/{name}.values"])
            wk, wv = _sorted(keys.numpy(), values.numpy())
            np.testing.assert_array_equal(gk, wk, err_msg=f"{scenario}: table {name}")
            assert np.linalg.norm(gv - wv) <= 1e-5 * np.linalg.norm(wv), f"{scenario}: table {name}"


def _sok(rank, world, use_hashtable, dynamic_input):
    layer = All2AllDenseEmbedding(8, 4, slot_num=2, nnz_per_slot=3, dynamic_input=dynamic_input,
                                  use_hashtable=use_hashtable, seed=9, timeout=60)
    g = torch.Generator().manual_seed(rank)
    high = 8 * world if not use_hashtable else 2**62
    ids = torch.randint(0, high, (5 * rank, 2, 3) if not dynamic_input else (7 + rank,), generator=g)
    out = layer(ids)
    table = TableConfig(name="sok", dim=4, vocabulary_size=None if use_hashtable else 8 * world, seed=9)
    ref = EmbeddingCollection([table], [FeatureConfig(name="ids", table="sok", combiner="none")])
    want = ref({"ids": ids})["ids"]
    assert out.shape == ids.shape + (4,)
    return {"max_err": np.array(float((out - want).abs().max()) if out.numel() else 0.0)}


SOK_CASES = [(True, False), (True, True), (False, False), (False, True)]  # (use_hashtable, dynamic_input)


def _sok_cases(rank, world):
    return {f"{h}/{d}": _sok(rank, world, h, d)["max_err"] for h, d in SOK_CASES}


@pytest.mark.slow
def test_all2all_dense_embedding_matches_single_process(tmp_path):
    got = run(_sok_cases, 2, tmp_path)  # the cases in the same two ranks, which start once
    assert got is not None, [p.read_text() for p in tmp_path.glob("*.err")]
    assert {case: float(err) for case, err in got.items()} == {f"{h}/{d}": 0.0 for h, d in SOK_CASES}


def _out_of_range(rank, world):
    layer = All2AllDenseEmbedding(4, 2, use_hashtable=False, dynamic_input=True, timeout=60)
    try:
        layer(torch.tensor([8 * world]))
    except ValueError as e:
        return {"msg": np.array(str(e))}
    return {"msg": np.array("no error")}


@pytest.mark.slow
def test_static_sok_rejects_out_of_range_keys(tmp_path):
    got = run(_out_of_range, 2, tmp_path)
    assert "[0, 8)" in str(got["msg"])


def _mismatch(rank, world):
    dim = 4 if rank == 0 else 5
    try:
        DistributedEmbeddingCollection([TableConfig(name="t", dim=dim)], [FeatureConfig(name="f", table="t")],
                                       timeout=30)
    except DistributedError as e:
        return {"msg": np.array(str(e))}
    return {"msg": np.array("no error")}


@pytest.mark.slow
def test_mismatched_config_is_a_clear_error(tmp_path):
    got = run(_mismatch, 2, tmp_path)
    assert "tables[0].dim" in str(got["msg"])


def _dies(rank, world, out_dir):
    ec = DistributedEmbeddingCollection([TableConfig(name="t", dim=4, optimizer=dynemb.optim.SGD(lr=0.1))],
                                        [FeatureConfig(name="f", table="t")], timeout=10)
    for step in range(10):
        if rank == 1 and step == 2:
            os._exit(17)  # dies mid-training, without a word to the others
        start = time.monotonic()
        try:
            ec({"f": torch.arange(4) + step})["f"].sum().backward()
        except DistributedError as e:
            with open(os.path.join(out_dir, "survivor.txt"), "w") as f:
                f.write(f"{time.monotonic() - start:.1f}\n{e}")
            return None
    return None


@pytest.mark.slow
def test_dead_rank_gives_clear_error_within_timeout(tmp_path):
    ctx = run(_dies, 2, tmp_path, str(tmp_path), join=False)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (tmp_path / "survivor.txt").exists():
        time.sleep(0.5)  # not ctx.join(): it would terminate the survivor as soon as rank 1 exits
    for p in ctx.processes:
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
    text = (tmp_path / "survivor.txt").read_text()
    elapsed, message = text.split("\n", 1)
    assert float(elapsed) <= 10 + 5
    assert "peer rank died or the collective timed out" in message


def _frozen_and_half(rank, world):
    tables, features, plan = configs("sgd")
    ec = DistributedEmbeddingCollection(tables, features, plan=plan, timeout=60)
    first = slice_batch(global_batch(0), rank * 12, rank * 12 + 12)
    first.pop("r")
    ec(first)  # the tables hold this batch's keys before "user" is frozen
    if "user" in ec.embeddings:
        ec.embeddings["user"].requires_grad_(False)
    before = ec.gather_export("user")
    batch = slice_batch(global_batch(1), rank * 12, rank * 12 + 12)
    r = batch.pop("r")
    loss_of(ec(batch), r).backward()  # unseen uids: read, not inserted, and no gradient reaches the frozen table
    ec.optimizer.step()
    after = ec.gather_export("user")
    out = ec.half()(batch)
    return {"before.keys": before[0].numpy(), "after.keys": after[0].numpy(),
            "before.values": before[1].numpy(), "after.values": after[1].numpy(),
            "half": np.array([str(v.dtype) == "torch.float16" for v in out.values()])}


@pytest.mark.slow
def test_frozen_sharded_table_is_read_only_and_half_outputs_half(tmp_path):
    got = run(_frozen_and_half, 2, tmp_path)
    assert got is not None, [p.read_text() for p in tmp_path.glob("*.err")]
    np.testing.assert_array_equal(np.sort(got["after.keys"]), np.sort(got["before.keys"]))
    np.testing.assert_array_equal(*_sorted(got["after.keys"], got["after.values"])[1:],
                                  *_sorted(got["before.keys"], got["before.values"])[1:])
    assert got["half"].all()


def _whole_tables(rank, world):
    tables = [TableConfig(name=n, dim=4, optimizer=dynemb.optim.SGD(lr=0.1), seed=i) for i, n in enumerate("abc")]
    ec = DistributedEmbeddingCollection(tables, [FeatureConfig(name=n, table=n) for n in "abc"],
                                        plan={n: "table" for n in "abc"}, timeout=60)
    out = ec({n: torch.arange(5) + rank for n in "abc"})
    sum(o.sum() for o in out.values()).backward()
    ec.optimizer.step()
    return {"held": np.array(sorted(ec.embeddings)), "rows": np.array([len(ec.gather_export(n)[0]) for n in "abc"])}


@pytest.mark.slow
def test_tables_planned_as_table_alone_spread_over_the_ranks(tmp_path):
    # each of 3 gloo ranks holds one whole table (before, rank 0 held all three and the others none)
    run(_whole_tables, 3, tmp_path)
    got = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(3)]
    assert [g["held"].tolist() for g in got] == [["a"], ["b"], ["c"]]
    assert got[0]["rows"].tolist() == [7, 7, 7]  # keys 0..6 from the three ranks, each table whole


def _totals(rank, world):
    tables = [TableConfig(name=n, dim=4, optimizer=dynemb.optim.SGD(lr=0.1), seed=i) for i, n in enumerate("abcd")]
    features = [FeatureConfig(name=n, table=n) for n in "abcd"]
    ec = DistributedEmbeddingCollection(tables, features, plan={"a": "row", "b": "data", "c": "column",
                                                                "d": ("table", 1)}, timeout=60)
    local = EmbeddingCollection(tables, features)
    for step in range(3):
        batches = [{n: torch.arange(10 * step + 7 * r, 10 * step + 7 * r + 9) * (i + 1) for i, n in enumerate("abcd")}
                   for r in range(world)]
        ec(batches[rank])
        for b in batches:
            local(b)
    got, want = ec.table_totals(), local.table_totals()
    # what dynemb train reports as table_rows: Trainer.table_stats of a sharded DLRM
    from dynemb.data import SyntheticClickLog
    from dynemb.train import TrainConfig, Trainer, build_dlrm

    data = SyntheticClickLog(num_categorical=2, num_dense=2, batch_size=32, seed=3)
    cfg = TrainConfig(steps=3, dim=4, eval_every=3)
    model = build_dlrm(2, data.categorical_names, cfg)
    trainer = Trainer(model, cfg)
    trainer.fit(data.batches("train", start=rank, step=world), [data.batch(0, "eval")], progress=False)
    held = sum(len(model.embeddings.gather_export(n)[0]) for n in sorted(model.embeddings.logical_tables()))
    return {"rows": np.array([got["rows"], want["rows"]]), "evicted": np.array([got["evicted"], want["evicted"]]),
            "bytes": np.array([got["table_bytes"], sum(t.nbytes() for t in ec.dynemb_tables())]),
            "trainer": np.array([trainer.table_stats()["rows"], trainer.history.steps[-1]["rows"], held])}


@pytest.mark.slow
def test_table_totals_count_the_users_tables_whatever_the_layout(tmp_path):
    # rows as one process counts them (a replica's and a column shard's keys once); before, Trainer.table_stats
    # (dynemb train's "table_rows") gave this rank's rows: rank 0 of 2 reported about half of them
    run(_totals, 2, tmp_path)
    got = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    for g in got:
        assert g["rows"][0] == g["rows"][1] > 0 and g["evicted"].tolist() == [0, 0]
        assert g["trainer"][0] == g["trainer"][1] == g["trainer"][2] > 0
    assert got[0]["bytes"][0] == got[1]["bytes"][0] == got[0]["bytes"][1] + got[1]["bytes"][1]


def _one_rank_in_eval(rank, world, out_dir):
    ec = DistributedEmbeddingCollection([TableConfig(name="t", dim=4, optimizer=dynemb.optim.SGD(lr=0.1))],
                                        [FeatureConfig(name="f", table="t")], timeout=5)
    ec({"f": torch.arange(4)})["f"].sum().backward()
    if rank == 1:
        ec.eval()  # a mistake: rank 1 evaluates while rank 0 trains; its forward needs no backward
        ec({"f": torch.arange(4)})
        time.sleep(15)  # alive, but not in rank 0's backward
        return None
    start = time.monotonic()
    try:
        ec({"f": torch.arange(4)})["f"].sum().backward()
    except DistributedError as e:
        with open(os.path.join(out_dir, "trainer.txt"), "w") as f:
            f.write(f"{time.monotonic() - start:.1f}\n{e}")
    return None


@pytest.mark.slow
def test_a_rank_in_eval_mode_while_others_train_is_a_clear_error_within_the_timeout(tmp_path):
    ctx = run(_one_rank_in_eval, 2, tmp_path, str(tmp_path), join=False)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (tmp_path / "trainer.txt").exists():
        time.sleep(0.5)
    for p in ctx.processes:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    elapsed, message = (tmp_path / "trainer.txt").read_text().split("\n", 1)
    assert float(elapsed) <= 5 + 5
    assert "all-to-all of gradients" in message and "in eval mode or under no_grad" in message
