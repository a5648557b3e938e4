"""Export lineage in the parameter server: updates go only forward on their own model, a full export replaces the
tables in every tier, a restart follows a chain of deltas, and rollback returns to a kept full version."""

import pytest
import torch

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.serving import LineageError, ParameterServer

D = 4
KEYS = torch.arange(-60, 60)
UNSEEN = torch.tensor([10**12, -(10**9)])


def training_table(seed=0):
    emb = dynemb.DynamicEmbedding(D, seed=seed, initializer="normal")
    emb(KEYS)
    return emb


def step(emb, value):
    """A training step: some rows written, some keys removed."""
    emb.insert_or_assign(KEYS[::7] + int(value), torch.full((len(KEYS[::7]), D), float(value)))
    emb.erase(KEYS[int(value) % 5::11])


def expected(emb):
    """What serving must return: the trained table's eval lookups (unknown keys: the initializer row)."""
    emb.eval()
    try:
        return emb(torch.cat([KEYS, UNSEEN]))
    finally:
        emb.train()


def served(ps):
    return ps.lookup("ctr", "embedding", torch.cat([KEYS, UNSEEN]))


def make_server(root, tmp_path, volatile):
    config = {"models": [{"model": "ctr", "sparse_files": [str(root)],
                          "embedding_table_names": ["embedding"], "embedding_vecsize_per_table": [D],
                          "default_value_for_each_table": ["initializer"], "cache_fraction": 0.5}],
              "volatile_db": volatile,
              "persistent_db": {"type": "lmdb", "path": str(tmp_path / "lmdb")}}
    ps = ParameterServer.from_config(config)
    ps.load("ctr", progress=False)
    return ps


@pytest.fixture(params=["memory", "redis"])
def volatile(request):
    if request.param == "memory":
        return {"type": "memory"}
    return {"type": "redis", "address": request.getfixturevalue("redis_address")}


def snapshot(ps):
    """Everything a refused update must leave alone: lookups, each tier's rows, the cache and the version."""
    t = ps._tables["ctr"]["embedding"]
    tiers = [tier.store.get(t.store_name, KEYS) for tier in (ps.volatile, ps.persistent)]
    cache = t.cache.export()
    order = torch.argsort(cache.keys)
    return served(ps), tiers, (cache.keys[order], cache.values[order]), ps.stats("ctr")["version"]


def assert_same(a, b):
    assert torch.equal(a[0], b[0]) and a[3] == b[3]
    for (va, fa), (vb, fb) in zip(a[1], b[1]):
        assert torch.equal(va, vb) and torch.equal(fa, fb)
    assert torch.equal(a[2][0], b[2][0]) and torch.equal(a[2][1], b[2][1])


def test_refused_updates_change_nothing(tmp_path, volatile):
    root, other_root = tmp_path / "export", tmp_path / "other"
    emb = training_table()
    export_for_serving(root, emb, model_name="ctr")
    ps = make_server(root, tmp_path, volatile)
    served(ps)  # warm the cache, so that a wrong update would have rows to change there too
    step(emb, 1)
    v2 = export_for_serving(root, emb, incremental=True)
    step(emb, 2)
    v3 = export_for_serving(root, emb, incremental=True)
    other = training_table(seed=5)
    export_for_serving(other_root, other, model_name="other")
    step(other, 3)
    other_delta = export_for_serving(other_root, other, incremental=True)

    before = snapshot(ps)
    with pytest.raises(LineageError, match=r"holds version 1 of model 'ctr' \(digest .*\); version 3 of model "
                                           r"'ctr' is a delta of version 2 .*: a gap"):
        ps.apply_update(v3)
    assert_same(snapshot(ps), before)
    with pytest.raises(LineageError, match="it is version 2 of model 'other', but model 'ctr' serves table "
                                           "'embedding' from version 1 of model 'ctr': another model's export"):
        ps.apply_update(other_delta)
    assert_same(snapshot(ps), before)

    ps.apply_update(v2)
    ps.apply_update(v3)
    assert torch.equal(served(ps), expected(emb)) and ps.stats("ctr")["version"] == 3
    before = snapshot(ps)
    for old in (v2, v3):  # older, and equal
        with pytest.raises(LineageError, match=f"holds version 3 of model 'ctr'; version {old.name[-1]} of model "
                                               "'ctr' is not newer"):
            ps.apply_update(old)
        assert_same(snapshot(ps), before)
    ps.close()


def test_full_export_as_an_update_deletes_what_it_lacks_from_every_tier(tmp_path, volatile):
    root = tmp_path / "export"
    emb = training_table()
    export_for_serving(root, emb)
    ps = make_server(root, tmp_path, volatile)
    served(ps)
    gone = KEYS[:10]
    emb.erase(gone)
    emb.insert_or_assign(KEYS[10:12], torch.ones(2, D))
    stats = ps.apply_update(export_for_serving(root, emb))  # a full export
    assert stats["ctr"]["version"] == 2
    t = ps._tables["ctr"]["embedding"]
    assert not t.cache.contains(gone).any()
    for store in (ps.volatile.store, ps.persistent.store):
        assert not store.get(t.store_name, gone)[1].any()
        assert sorted(store.keys(t.store_name).tolist()) == sorted(KEYS[10:].tolist())
    assert torch.equal(served(ps), expected(emb))  # removed keys: their initializer rows again
    ps.close()


def test_a_restarted_server_follows_a_chain_of_deltas(tmp_path, volatile):
    root = tmp_path / "export"
    emb = training_table()
    export_for_serving(root, emb)
    first = make_server(root, tmp_path, volatile)  # fills the persistent store with version 1
    first.close()
    for value in (1, 2, 3):
        step(emb, value)
        export_for_serving(root, emb, incremental=True)
    ps = make_server(root, tmp_path, volatile)  # latest is a delta: version 4
    assert ps.stats("ctr")["version"] == 4
    assert torch.equal(served(ps), expected(emb))  # keys removed since version 1 are gone from LMDB too
    t = ps._tables["ctr"]["embedding"]
    assert sorted(ps.persistent.store.keys(t.store_name).tolist()) == sorted(emb.export()[0].tolist())
    ps.close()


def test_rollback_returns_to_a_kept_full_version(tmp_path):
    root = tmp_path / "export"
    emb = training_table()
    export_for_serving(root, emb)
    at_v1 = expected(emb)
    step(emb, 1)
    v2 = export_for_serving(root, emb, incremental=True)
    step(emb, 2)
    export_for_serving(root, emb)
    step(emb, 3)
    v4 = export_for_serving(root, emb, incremental=True)
    ps = make_server(root, tmp_path, {"type": "memory"})
    assert ps.stats("ctr")["version"] == 4 and torch.equal(served(ps), expected(emb))
    ps.rollback("ctr", 1)
    assert ps.stats("ctr")["version"] == 1 and torch.equal(served(ps), at_v1)
    with pytest.raises(LineageError, match="a gap"):
        ps.apply_update(v4)  # a delta of version 3
    with pytest.raises(ValueError, match=r"to version 2: in .* it is a delta export; roll back to a full one "
                                         r"\(kept: \[1, 3\]\)"):
        ps.rollback("ctr", 2)
    with pytest.raises(ValueError, match=r"to version 9: .* does not keep it \(it keeps versions \[1, 2, 3, 4\]"):
        ps.rollback("ctr", 9)
    assert ps.stats("ctr")["version"] == 1 and torch.equal(served(ps), at_v1)
    ps.apply_update(v2)  # forward again from version 1
    assert ps.stats("ctr")["version"] == 2
    ps.close()


def test_an_update_goes_to_the_models_serving_its_model_only(tmp_path):
    tables = {name: training_table(seed=i) for i, name in enumerate("ab")}
    for name, emb in tables.items():
        export_for_serving(tmp_path / name, emb)
    ps = ParameterServer.from_config({"models": [
        {"model": name, "sparse_files": [str(tmp_path / name)], "embedding_table_names": ["embedding"],
         "embedding_vecsize_per_table": [D], "default_value_for_each_table": ["initializer"]} for name in "ab"]})
    for name in "ab":
        ps.load(name, progress=False)
    step(tables["b"], 1)
    assert list(ps.apply_update(export_for_serving(tmp_path / "b", tables["b"], incremental=True))) == ["b"]
    for name, emb in tables.items():
        assert torch.equal(ps.lookup(name, "embedding", torch.cat([KEYS, UNSEEN])), expected(emb))
    assert (ps.stats("a")["version"], ps.stats("b")["version"]) == (1, 2)
    ps.close()
