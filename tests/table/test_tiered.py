"""TieredTable through the layers above it: training through EmbeddingCollection and sparse optimizers equals
training with every row in the fast tier, bit for bit; checkpoints move rows between tiered and untiered tables;
stats, budgets, prefetch and errors."""

from __future__ import annotations

import os

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import load, save
from dynemb.table import TieredTable, Tiers
from dynemb.table.budget import index_bytes

STEPS = 20


def _where(slow: str, tmp_path) -> str:
    return "host" if slow == "host" else str(tmp_path / "slow")


def _collection(tiered: bool, where: str = "host", optimizer=None, host: int | None = None) -> EmbeddingCollection:
    """Two tables: int64 keys under lru with a fast tier of 40 rows, and int32 keys under lfu with admission (from
    the second sighting) and a fast tier given in bytes. ``host``: three levels, host memory for that many user rows
    (and a byte budget for about as many item rows) over row files in ``where``."""
    opt = optimizer or dynemb.optim.Adagrad(lr=0.1)
    user_host = {} if host is None else {"host_capacity": host}
    item_host = {} if host is None else {"host_bytes": host * 72}
    user = Tiers(fast_capacity=40, slow=where, **user_host) if tiered else None
    item = Tiers(fast_bytes=4000, slow=where, **item_host) if tiered else None
    # lfu ranks the item rows the tiers move down; untiered, a bound no test reaches keeps the same scores (a
    # policy needs a bound or tiers)
    bound = None if tiered else 1_000_000
    tables = [TableConfig(name="user", dim=8, optimizer=opt, seed=1, tiers=user),
              TableConfig(name="item", dim=4, key_dtype=torch.int32, eviction="lfu", seed=2, tiers=item,
                          max_capacity=bound, optimizer=dynemb.optim.Adam(lr=0.05), admission=2)]
    return EmbeddingCollection(tables, [FeatureConfig(name="user", table="user"),
                                        FeatureConfig(name="item", table="item", combiner="sum")])


def _batch(i: int) -> dict:
    """Power-law ids (many repeats of a few hot ids, a long tail), so rows go cold and come back."""
    g = torch.Generator().manual_seed(i)
    hot = lambda n, top: (torch.rand(n, generator=g) ** 3 * top).long()  # noqa: E731
    return {"user": hot(48, 300).view(12, 4) - 150, "item": hot(24, 120).to(torch.int32).view(12, 2)}


def _step(ec: EmbeddingCollection, i: int) -> dict:
    out = ec(_batch(i))
    sum(o.square().sum() for o in out.values()).backward()
    ec.optimizer.step()
    ec.optimizer.zero_grad()
    return out


def _sorted_rows(table):
    rows = table.export()
    order = torch.argsort(rows.keys)
    return (rows.keys[order], rows.values[order], rows.scores[order],
            {name: slot[order] for name, slot in sorted(rows.slots.items())})


def assert_same_table(a, b) -> None:
    """Same keys, and bit-identical values, scores, slots and counters (row order aside)."""
    ka, va, sa, slots_a = _sorted_rows(a)
    kb, vb, sb, slots_b = _sorted_rows(b)
    assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(sa, sb)
    assert slots_a.keys() == slots_b.keys() and all(torch.equal(slots_a[n], slots_b[n]) for n in slots_a)
    for counter in ("clock", "epoch", "inserted", "removed", "evicted", "_init_calls"):
        assert getattr(a, counter) == getattr(b, counter), counter


def erase_evict_and_reinsert(*tables) -> None:
    """The same growth, erasures, eviction and re-insertion on each table (the tiered-vs-untiered checks)."""
    for table in tables:
        for start in range(0, 60, 6):
            table.find_or_insert(torch.arange(start, start + 9))
        table.erase(torch.tensor([1, 20, 55, 1000]))
        table.evict(5)
        table.find_or_insert(torch.arange(0, 12))


def assert_same_collections(a: EmbeddingCollection, b: EmbeddingCollection) -> None:
    for name in ("user", "item"):
        assert_same_table(a.embeddings[name].table, b.embeddings[name].table)


@pytest.mark.parametrize("slow", ["host", "disk"])
@pytest.mark.parametrize("optimizer", [dynemb.optim.Adagrad(lr=0.1), dynemb.optim.SGD(lr=0.1, momentum=0.9)],
                         ids=["adagrad", "sgd-momentum"])
def test_training_tiered_equals_all_in_fast_tier(slow, optimizer, tmp_path):
    tiered, flat = _collection(True, _where(slow, tmp_path), optimizer), _collection(False, optimizer=optimizer)
    for i in range(STEPS):
        a, b = _step(tiered, i), _step(flat, i)
        assert all(torch.equal(a[k], b[k]) for k in a), f"step {i}"
    assert_same_collections(tiered, flat)
    user = tiered.embeddings["user"].table
    stats = user.stats()["tiers"]
    assert stats["slow"]["rows"] > 0 and stats["slow"]["hit_rate"] > 0, "the test must move rows between tiers"
    assert stats["fast"]["rows"] <= 48  # a call's keys stay resident; then the budget of 40 holds
    # eval reads cold rows where they are, inserting nothing
    tiered.eval(), flat.eval()
    cold = {"user": user.slow.row_keys[:12].clone().view(-1, 1), "item": _batch(0)["item"]}
    with torch.no_grad():
        a, b = tiered(cold), flat(cold)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert_same_collections(tiered, flat)


def test_prefetch_moves_rows_up_and_changes_no_result():
    tiered, flat = _collection(True), _collection(False)
    for i in range(STEPS):
        tiered.prefetch(_batch(i))
        _step(tiered, i), _step(flat, i)
    assert_same_collections(tiered, flat)
    user = tiered.embeddings["user"].table
    nxt = _batch(STEPS)["user"].view(-1)
    stored = user.index.find(nxt) >= 0  # the one index of both tiers
    assert bool((user.slow.find(nxt) >= 0).any()), "the test must prefetch rows from the slow tier"
    tiered.prefetch({"user": nxt.view(12, 4)})
    assert not bool((user.slow.find(nxt) >= 0).any()), "prefetched keys must be in the fast tier"
    assert bool((user.index.find(nxt) >= 0)[stored].all())
    hits = dict(user.hits)
    user.prefetch(nxt)
    assert user.hits == hits, "prefetch is not counted as a lookup"


def test_checkpoint_moves_between_tiered_and_untiered(tmp_path):
    tiered, flat = _collection(True), _collection(False)
    for i in range(10):
        _step(tiered, i), _step(flat, i)
    save(tmp_path / "tiered", tiered, step=10)
    save(tmp_path / "flat", flat, step=10)  # a save ticks the clock: both are saved to stay alike
    loaded = _collection(False)
    load(tmp_path / "tiered", loaded)
    assert_same_collections(loaded, flat)
    for i in range(10, 15):
        _step(tiered, i), _step(flat, i)
    save(tmp_path / "tiered", tiered, step=15, incremental=True)  # rows changed in either tier since step 10
    save(tmp_path / "flat", flat, step=15, incremental=True)
    again = _collection(False)
    load(tmp_path / "tiered", again)
    assert_same_collections(again, flat)
    back = _collection(True)  # the untiered checkpoint goes into tiers: past the fast budget, rows go down
    load(tmp_path / "flat", back)
    assert_same_collections(back, flat)
    assert back.embeddings["user"].table.slow.size() > 0
    for i in range(15, 20):
        _step(back, i), _step(flat, i), _step(again, i)
    assert_same_collections(back, flat)
    assert_same_collections(again, flat)


def test_state_dict_shows_no_tiers():
    tiered, flat = _collection(True), _collection(False)
    for i in range(5):
        _step(tiered, i), _step(flat, i)
    a, b = tiered.state_dict(), flat.state_dict()
    assert a.keys() == b.keys()
    assert a["tables.user._extra_state"]["config"] == b["tables.user._extra_state"]["config"]


def test_stats_report_rows_bytes_and_hit_rate_per_tier():
    t = TieredTable(4, tiers=Tiers(fast_capacity=16), seed=0)
    t.find_or_insert(torch.arange(64))  # 64 misses; one call's keys all stay in the fast tier
    t.find_or_insert(torch.arange(64, 128))  # 64 misses; 0..63 move down
    t.find_or_insert(torch.arange(8))  # come back from the slow tier
    t.find_or_insert(torch.arange(8))  # fast hits
    s = t.stats()
    fast, slow = s["tiers"]["fast"], s["tiers"]["slow"]
    assert fast["rows"] + slow["rows"] == s["size"] == 128
    assert fast["rows"] <= 16 and slow["rows"] >= 112
    assert (fast["hit_rate"], slow["hit_rate"], s["tiers"]["miss_rate"]) == (8 / 144, 8 / 144, 128 / 144)
    looked, moved = s["tiers"]["looked_up"], s["tiers"]["moved"]
    assert looked == {"fast": 8, "slow": 8, "miss": 128}
    row = 8 + 4 * 4 + 16  # key, values, score and version stamp
    assert moved["rows_up"] == 8 and moved["bytes_up"] == 8 * row and moved["bytes_down"] == moved["rows_down"] * row
    assert moved["rows_down"] >= 112
    index = s["tiers"]["index"]["bytes"]  # one index of both tiers' keys, beside the fast tier
    assert fast["bytes"] > 0 and slow["bytes"] > 0 and s["bytes"] == fast["bytes"] + slow["bytes"] + index == t.nbytes()


def test_fast_bytes_holds_the_fast_tier_in_budget():
    budget = 50_000
    t = TieredTable(16, tiers=Tiers(fast_bytes=budget), seed=0)
    t.add_slot("sum", 16)  # the row bound shrinks to fit the slot
    for start in range(0, 2000, 100):
        t.find_or_insert(torch.arange(start, start + 100))
    fast = t.stats()["tiers"]["fast"]
    used = fast["bytes"] + index_bytes(fast["capacity"], torch.int64)  # the rows and an index sized for them
    assert used <= budget and used >= 0.9 * budget
    assert fast["rows"] <= fast["capacity"] and t.size() == 2000


def test_slow_tier_files_live_in_a_private_directory_removed_on_close(tmp_path):
    t = TieredTable(4, tiers=Tiers(fast_capacity=4, slow=str(tmp_path)), seed=0)
    t.find_or_insert(torch.arange(100))
    (directory,) = os.listdir(tmp_path)
    assert any(name.endswith(".rows") for name in os.listdir(tmp_path / directory))
    t.slow.close()
    assert os.listdir(tmp_path) == []


def test_rows_of_a_call_larger_than_the_fast_tier_all_stay_valid():
    t = TieredTable(2, tiers=Tiers(fast_capacity=4), initializer="zeros")
    keys = torch.arange(10)
    t.insert_or_assign(keys, torch.arange(20.0).view(10, 2))
    t.find_or_insert(torch.arange(100, 110))  # moves 0..9 down
    rows, found = t.find_or_insert(keys)
    assert bool(found.all()) and torch.equal(t.values[rows], torch.arange(20.0).view(10, 2))


def test_errors():
    with pytest.raises(ValueError, match="fast_capacity .rows. or fast_bytes, got neither"):
        Tiers()
    with pytest.raises(ValueError, match="got both"):
        Tiers(fast_capacity=1, fast_bytes=10)
    with pytest.raises(ValueError, match="Tiers.fast_capacity"):
        Tiers(fast_capacity=0)
    with pytest.raises(ValueError, match="Tiers.slow"):
        Tiers(fast_capacity=1, slow="")
    with pytest.raises(TypeError, match="tiers must be a dynemb.table.Tiers"):
        TieredTable(2, tiers={"fast_capacity": 1})
    with pytest.raises(ValueError, match="not max_capacity=5"):
        TieredTable(2, tiers=Tiers(fast_capacity=1), max_capacity=5)
    with pytest.raises(ValueError, match="Tiers.fast_bytes=10 is too small for one row"):
        TieredTable(2, tiers=Tiers(fast_bytes=10))
    with pytest.raises(ValueError, match="at most one of max_capacity, max_bytes and tiers"):
        TableConfig(name="t", dim=2, max_capacity=4, tiers=Tiers(fast_capacity=1))
    with pytest.raises(ValueError, match="dynamic tables only"):
        TableConfig(name="t", dim=2, vocabulary_size=4, tiers=Tiers(fast_capacity=1))
    with pytest.raises(TypeError, match="tiers must be None or a dynemb.table.Tiers"):
        TableConfig(name="t", dim=2, tiers=1)


def test_index_bytes_matches_the_index():
    for key_dtype in (torch.int32, torch.int64):
        for capacity in (1, 7, 100, 5000):
            index = dynemb.table.HashIndex(key_dtype, "cpu", capacity)
            assert index.nbytes() == index_bytes(capacity, key_dtype)


@pytest.mark.parametrize("fused", [False, True])
def test_gradients_reach_rows_moved_down_between_forward_and_backward(fused):
    """Two lookups of one table in a forward: the second moves the first's rows down; backward and step bring
    them back and update them, as an untiered table would."""
    def run(tiers):
        emb = dynemb.DynamicEmbedding(4, seed=3, tiers=tiers)
        opt = dynemb.optim.Adagrad([emb], lr=0.5, fused=fused)
        for i in range(6):
            first, second = torch.arange(8) + 20 * i, torch.arange(100, 108) + 20 * i
            loss = emb(first).sum() + 2 * emb(second).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return emb.table

    tiered = run(Tiers(fast_capacity=8))
    assert tiered.slow.size() > 0
    assert_same_table(tiered, run(None))


def test_serving_export_of_a_tiered_table_equals_the_untiered_one(tmp_path):
    from dynemb.checkpoint import export_for_serving, read_export

    tiered, flat = _collection(True), _collection(False)
    for i in range(8):
        _step(tiered, i), _step(flat, i)
    export_for_serving(tmp_path / "tiered", tiered)
    export_for_serving(tmp_path / "flat", flat)
    _, a = read_export(tmp_path / "tiered")
    _, b = read_export(tmp_path / "flat")
    assert tiered.embeddings["user"].table.slow.size() > 0
    for name in ("user", "item"):
        oa, ob = torch.argsort(a[name]["keys"]), torch.argsort(b[name]["keys"])
        assert torch.equal(a[name]["keys"][oa], b[name]["keys"][ob])
        assert torch.equal(a[name]["values"][oa], b[name]["values"][ob])


def test_erase_and_clear_reach_both_tiers_and_log_deletions():
    t = TieredTable(2, tiers=Tiers(fast_capacity=4), seed=0)
    t.track_deletions()
    t.find_or_insert(torch.arange(8))
    t.find_or_insert(torch.arange(8, 16))  # 0..7 move down
    clock = t.clock
    assert t.erase(torch.tensor([0, 1, 15, 99])) == 3 and t.size() == 13
    assert t.clock == clock + 1
    assert sorted(t.changes_since(clock)[1].tolist()) == [0, 1, 15]
    t.clear()
    assert t.size() == 0 and t.removed == 16 and t.slow.size() == 0
    assert sorted(t.changes_since(clock)[1].tolist()) == list(range(16))  # 3 erased, then 13 cleared (both tiers)


def test_the_fast_tier_shrinks_back_to_its_budget():
    t = TieredTable(8, tiers=Tiers(fast_capacity=100), seed=0)
    budget_bytes = t.stats()["tiers"]["fast"]["bytes"]
    t.find_or_insert(torch.arange(1000))  # one call's rows all stay up: the fast tier grows past its budget
    assert t.capacity >= 1000
    t.find_or_insert(torch.arange(5))
    assert t.capacity == 100 and t.stats()["tiers"]["fast"]["bytes"] == budget_bytes
    rows = t.export()
    t.replace(rows)  # a checkpoint load passes every row through the fast tier, then shrinks it
    assert t.capacity == 100 and t.size() == 1000 and t.stats()["tiers"]["fast"]["bytes"] == budget_bytes


def test_the_training_loop_prefetches_the_next_batch_and_trains_as_untiered(monkeypatch):
    import dynemb.train
    from dynemb.data import SyntheticClickLog
    from dynemb.models import DLRM, dlrm_tables
    from dynemb.train import Trainer, TrainConfig

    data = SyntheticClickLog(num_categorical=2, num_dense=2, batch_size=64, seed=0)
    cfg = TrainConfig(steps=12, dim=4, eval_every=12)

    def run(tiers):
        torch.manual_seed(0)
        tables, features = dlrm_tables(data.categorical_names, 4, optimizer=dynemb.optim.Adagrad(lr=0.1, fused=True),
                                       tiers=tiers)
        model = DLRM(2, EmbeddingCollection(tables, features), 4)
        history = Trainer(model, cfg).fit(data.batches("train"), [data.batch(0, "eval")], progress=False)
        return model, history

    tiered, a = run(Tiers(fast_capacity=50))
    flat, b = run(None)
    with monkeypatch.context() as m:
        m.setattr(dynemb.train, "_ahead", lambda batches, prefetch: batches)
        unprefetched, _ = run(Tiers(fast_capacity=50))
    assert [r["loss"] for r in a.steps] == [r["loss"] for r in b.steps] and a.last_auc == b.last_auc
    for name in data.categorical_names:
        table = tiered.embeddings.embeddings[name].table
        assert_same_table(table, flat.embeddings.embeddings[name].table)
        assert table.slow.size() > 0
        # with prefetch, the slow-tier hits left are the final evaluation's
        assert table.hits["slow"] < unprefetched.embeddings.embeddings[name].table.hits["slow"]
    # each step's tier traffic is in the metrics: a step's, not the run's so far
    moved = [r["tier_bytes_moved"] for r in a.steps]
    assert sum(moved) > 0 and all(m >= 0 for m in moved) and "tier_bytes_moved" not in b.steps[0]
    tables = tiered.embeddings.dynemb_tables()
    total = sum(t.moved["bytes_up"] + t.moved["bytes_down"] for t in tables)
    assert sum(moved) <= total  # the final evaluation moves rows after the last step's row
    assert all(0 <= r["tier_fast_hit_rate"] + r["tier_slow_hit_rate"] <= 1 for r in a.steps)


def test_a_bare_word_for_the_slow_tier_is_an_error_not_a_new_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="'host' or a directory path, got 'disk'"):
        Tiers(fast_capacity=8, slow="disk")
    assert not (tmp_path / "disk").exists()
    assert Tiers(fast_capacity=8, slow="./disk").slow == "./disk"


def test_slow_tier_path_mistakes_are_named_errors(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="a file is there"):
        dynemb.DynamicEmbedding(4, tiers=Tiers(fast_capacity=8, slow=str(tmp_path / "afile")))
    dynemb.DynamicEmbedding(4, tiers=Tiers(fast_capacity=8, slow=str(tmp_path / "new" / "rows")))  # made, as mkdir -p
    assert (tmp_path / "new" / "rows").is_dir()
    dynemb.KeyValueTable(4).prefetch(torch.tensor([1, 2]))  # a no-op on an untiered table


def test_only_a_collection_with_a_tiered_table_prefetches(monkeypatch):
    """Prefetch (and the training loop's read-ahead) costs a pass over every feature: an untiered collection skips
    it; a mixed one brings up the rows of its tiered tables only."""
    import dynemb.train
    from dynemb.data import SyntheticClickLog
    from dynemb.models import DLRM, dlrm_tables
    from dynemb.train import Trainer, TrainConfig

    data = SyntheticClickLog(num_categorical=2, num_dense=2, batch_size=32, seed=1)
    tables, features = dlrm_tables(data.categorical_names, 4)
    flat = EmbeddingCollection(tables, features)
    assert not flat.tiered
    model = DLRM(2, flat, 4)
    calls, real_ahead = [], dynemb.train._ahead
    monkeypatch.setattr(dynemb.train, "_ahead",
                        lambda batches, prefetch: calls.append(1) or real_ahead(batches, prefetch))
    Trainer(model, TrainConfig(steps=3, dim=4, eval_every=3)).fit(data.batches("train"), [data.batch(0, "eval")],
                                                                progress=False)
    assert calls == []

    mixed = EmbeddingCollection([TableConfig(name="a", dim=2, tiers=Tiers(fast_capacity=4)),
                                 TableConfig(name="b", dim=2)],
                                [FeatureConfig(name="fa", table="a"), FeatureConfig(name="fb", table="b")])
    assert mixed.tiered
    a, b = mixed.embeddings["a"].table, mixed.embeddings["b"].table
    a.find_or_insert(torch.arange(10))
    b.find_or_insert(torch.arange(10))
    a.find_or_insert(torch.arange(4))  # the fast tier now holds keys 0..3: 7, 8 and 9 are down
    assert bool((a.slow.find(torch.tensor([7, 8, 9])) >= 0).all())
    slow_hits = a.hits["slow"]
    mixed.prefetch({"fa": torch.tensor([7, 8, 9]), "fb": torch.tensor([7, 8, 9])})
    a.find(torch.tensor([7, 8, 9]))
    assert a.hits["slow"] == slow_hits and a.hits["fast"] > 0 and b.size() == 10
