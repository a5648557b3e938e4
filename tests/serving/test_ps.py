"""ParameterServer and lookup layers against the training-side lookups, with real Redis/LMDB/RocksDB tiers."""

import json
import threading
import time

import pytest
import torch

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.functional import embedding_lookup, embedding_lookup_sparse
from dynemb.serving import LookupLayer, ParameterServer, ServerConfig, SparseLookupLayer

D = 8
KEYS = torch.tensor([0, -1, 2**63 - 1, -(2**63)] + list(range(10, 410)), dtype=torch.int64)


def trained_table(seed=0):
    emb = dynemb.DynamicEmbedding(D, seed=seed, initializer="normal")
    emb(KEYS)
    emb.insert_or_assign(KEYS[:50], torch.randn(50, D) * 2)  # some rows with norms above max_norm
    return emb.eval()


def server(root, volatile=None, persistent=None, seed=0, **model_fields):
    model = {"model": "ctr", "sparse_files": [str(root)], "embedding_table_names": ["embedding"],
             "embedding_vecsize_per_table": [D], **model_fields}
    config = {"models": [model], "volatile_db": volatile or {"type": "memory"}, "persistent_db": persistent}
    ps = ParameterServer.from_config(config, seed=seed)
    ps.load("ctr", progress=False)
    return ps


@pytest.fixture
def exported(tmp_path):
    emb = trained_table()
    export_for_serving(tmp_path / "export", emb)
    return emb, tmp_path / "export"


@pytest.mark.parametrize("combiner", ["sum", "mean", "sqrtn"])
@pytest.mark.parametrize("max_norm", [None, 0.1, 10.0])
@pytest.mark.parametrize("weighted", [False, True])
def test_layers_equal_training_lookups(exported, combiner, max_norm, weighted):
    emb, root = exported
    ps = server(root, cache_fraction=0.1)
    g = torch.Generator().manual_seed(0)
    ids = KEYS[torch.randint(0, len(KEYS), (60,), generator=g)]
    offsets = torch.tensor([0, 5, 5, 17, 30, 59])
    weights = torch.rand(60, generator=g) + 0.1 if weighted else None
    for _ in range(2):  # cold cache, then warm
        got = SparseLookupLayer("ctr", "embedding", ps=ps)(ids, offsets, weights, combiner=combiner,
                                                           max_norm=max_norm)
        want = embedding_lookup_sparse(emb, ids, offsets, weights, combiner=combiner, max_norm=max_norm)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    plain = LookupLayer("ctr", "embedding", ps=ps)(ids.view(6, 10), max_norm=max_norm)
    torch.testing.assert_close(plain, embedding_lookup(emb, ids.view(6, 10), max_norm=max_norm))
    ps.close()


def test_missing_keys_get_the_default_row(exported):
    emb, root = exported
    unknown = torch.tensor([123456789, -5])
    ps = server(root, default_value_for_each_table=[0.25])
    assert torch.equal(ps.lookup("ctr", "embedding", unknown), torch.full((2, D), 0.25))
    ps.close()
    ps = server(root, default_value_for_each_table=["initializer"])
    assert torch.equal(ps.lookup("ctr", "embedding", unknown), emb.find(unknown))  # what eval training reads
    ps.close()


@pytest.mark.parametrize("persistent", ["lmdb", "rocksdb"])
def test_tiers_fill_the_cache_and_hit_rate_grows(exported, tmp_path, redis_address, persistent):
    emb, root = exported
    ps = server(root, volatile={"type": "redis", "address": redis_address},
                persistent={"type": persistent, "path": str(tmp_path / persistent)}, cache_fraction=0.2,
                hit_rate_threshold=1.0)
    hot = KEYS[:40]
    for _ in range(20):
        assert torch.equal(ps.lookup("ctr", "embedding", hot), emb.find(hot))
    stats = ps.stats("ctr")["tables"]["embedding"]
    assert stats["volatile"] == 40 and stats["lookups"] == 800 and stats["hit_rate"] > 0.9
    assert stats["cache_rows"] <= stats["cache_capacity"]
    ps.close()


def test_lookups_survive_redis_going_away(exported, tmp_path, redis_server, redis_address):
    emb, root = exported
    ps = server(root, volatile={"type": "redis", "address": redis_address, "timeout_s": 0.5},
                persistent={"type": "lmdb", "path": str(tmp_path / "lmdb")}, cache_fraction=0.05)
    g = torch.Generator().manual_seed(1)
    answered = 0
    for step in range(60):
        if step == 20:
            redis_server.kill()
        keys = KEYS[torch.randint(0, len(KEYS), (32,), generator=g)]
        start = time.monotonic()
        assert torch.equal(ps.lookup("ctr", "embedding", keys), emb.find(keys))  # from cache or LMDB
        assert time.monotonic() - start < 5
        answered += 1
    assert answered == 60 and ps.stats("ctr")["errors"]["volatile"] >= 1
    redis_server.start()
    ps.close()


def test_concurrent_updates_never_tear_rows(tmp_path):
    emb = dynemb.DynamicEmbedding(D, seed=0, initializer=0.0)
    emb.insert_or_assign(KEYS, torch.zeros(len(KEYS), D))
    root = tmp_path / "export"
    export_for_serving(root, emb)
    ps = server(root, cache_fraction=0.5)
    torn, stop = [], threading.Event()

    def reader(seed):
        g = torch.Generator().manual_seed(seed)
        while not stop.is_set():
            rows = ps.lookup("ctr", "embedding", KEYS[torch.randint(0, len(KEYS), (64,), generator=g)])
            mixed = (rows != rows[:, :1]).any(1)  # every version writes rows of one repeated value
            if bool(mixed.any()):
                torn.append(rows[mixed])

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for version in range(1, 9):
        emb.insert_or_assign(KEYS, torch.full((len(KEYS), D), float(version)))
        ps.apply_update(export_for_serving(root, emb, incremental=True))
    stop.set()
    for t in threads:
        t.join()
    assert not torn
    assert torch.equal(ps.lookup("ctr", "embedding", KEYS), torch.full((len(KEYS), D), 8.0))
    assert ps.stats("ctr")["version"] == 9
    ps.close()


def test_delta_removes_deleted_keys(exported):
    emb, root = exported
    ps = server(root)
    ps.lookup("ctr", "embedding", KEYS[:10])  # cached
    emb.erase(KEYS[:5])
    ps.apply_update(export_for_serving(root, emb, incremental=True))
    assert torch.equal(ps.lookup("ctr", "embedding", KEYS[:5]), emb.find(KEYS[:5]))  # the initializer rows
    ps.close()


def test_unseen_ids_serve_the_initializer_row_by_default(exported):
    emb, root = exported
    unseen = torch.tensor([123456789, -5, 2**40])
    ps = server(root)
    assert torch.equal(ps.lookup("ctr", "embedding", unseen), emb(unseen))  # the trained model's eval lookup
    assert ps.stats("ctr")["tables"]["embedding"]["default"] == 3
    ps.close()


def test_a_callable_initializer_serves_zero_rows_by_default_with_a_warning(tmp_path):
    emb = dynemb.DynamicEmbedding(D, initializer=lambda n, dim: torch.ones(n, dim))
    emb(KEYS[:3])
    export_for_serving(tmp_path, emb)
    with pytest.warns(UserWarning, match="cannot be rebuilt for default rows; unseen ids get zero rows"):
        ps = server(tmp_path)
    assert torch.equal(ps.lookup("ctr", "embedding", torch.tensor([99])), torch.zeros(1, D))
    ps.close()
    with pytest.raises(ValueError, match="cannot be rebuilt for default rows"):
        server(tmp_path, default_value_for_each_table=["initializer"])


def test_the_server_takes_a_dict_a_server_config_or_a_path(exported, tmp_path):
    emb, root = exported
    config = {"models": [{"model": "ctr", "sparse_files": [str(root)], "embedding_table_names": ["embedding"],
                          "embedding_vecsize_per_table": [D]}]}
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(config))
    for source in (config, ServerConfig.load(config), path, str(path)):
        ps = ParameterServer(source)
        ps.load("ctr", progress=False)
        assert torch.equal(ps.lookup("ctr", "embedding", KEYS[:4]), emb.find(KEYS[:4]))
        ps.close()
    with pytest.raises(TypeError, match="parameter server config must be a JSON object, got int"):
        ParameterServer(3)


def test_config_errors_name_the_problem(exported, tmp_path):
    _, root = exported
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['gpu_cache'\]"):
        ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(root)], "gpu_cache": True,
                                                 "embedding_table_names": ["embedding"],
                                                 "embedding_vecsize_per_table": [D]}]})
    with pytest.raises(ValueError, match="has dim 8"):
        server(root, embedding_vecsize_per_table=[16])
    with pytest.raises(ConnectionError, match="127.0.0.1:1"):
        server(root, volatile={"type": "redis", "address": "127.0.0.1:1"})
    path = tmp_path / "ps.json"
    path.write_text(json.dumps({"models": [{"model": "m", "sparse_files": [str(root)],
                                            "embedding_table_names": ["nope"], "embedding_vecsize_per_table": [D]}]}))
    ps = ParameterServer.from_config(path)
    with pytest.raises(ValueError, match="'nope' is not in the export"):
        ps.load("m", progress=False)
    ps.close()


def test_static_tables_are_exported_and_served(tmp_path):
    ec = dynemb.EmbeddingCollection(
        [dynemb.TableConfig(name="s", dim=D, vocabulary_size=10, seed=1), dynemb.TableConfig(name="d", dim=D, seed=2)],
        [dynemb.FeatureConfig(name="s", table="s"), dynemb.FeatureConfig(name="d", table="d")])
    ec({"s": torch.tensor([1, 2]), "d": torch.tensor([5, 6])})
    export_for_serving(tmp_path, ec)
    ps = ParameterServer.from_config({"models": [{
        "model": "m", "sparse_files": [str(tmp_path)], "embedding_table_names": ["s", "d"],
        "embedding_vecsize_per_table": [D, D]}]})
    ps.load("m", progress=False)
    assert torch.equal(ps.lookup("m", "s", torch.arange(10)), ec.embeddings["s"].table.values)
    assert torch.equal(ps.lookup("m", "d", torch.tensor([6])), ec.embeddings["d"].find(torch.tensor([6])))
    ps.close()


@pytest.mark.parametrize("volatile", ["memory", "redis"])
def test_lookup_many_equals_per_table_and_training_lookups(tmp_path, request, volatile):
    tables = {name: dynemb.DynamicEmbedding(D, seed=i, initializer="normal") for i, name in enumerate(["a", "b"])}
    model = torch.nn.ModuleDict(tables)
    for emb in tables.values():
        emb(KEYS)
    export_for_serving(tmp_path, model)
    store = {"type": "memory"} if volatile == "memory" else {
        "type": "redis", "address": request.getfixturevalue("redis_address")}
    ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(tmp_path)],
                                                  "embedding_table_names": ["a", "b"],
                                                  "embedding_vecsize_per_table": [D, D], "cache_fraction": 0.05}],
                                      "volatile_db": store})
    ps.load("m", progress=False)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = {name: KEYS[torch.randint(0, len(KEYS), (4, 16), generator=g)] for name in tables}
        got = ps.lookup_many("m", ids)
        for name, emb in tables.items():
            assert torch.equal(got[name], emb.eval().find(ids[name]))
            assert torch.equal(got[name], ps.lookup("m", name, ids[name]))
    ps.close()


def test_servers_draw_write_back_sizes_from_their_own_generators(exported):
    # Write-back batch sizes are drawn at random. Two servers of one seed draw the same sizes, however their draws
    # interleave; a shared generator would hand them alternate draws.
    _, root = exported
    servers = [server(root), server(root), server(root, seed=1)]
    pending = [ps._tables["ctr"]["embedding"].pending for ps in servers]
    drawn = []
    for _ in range(8):
        drawn.append(tuple(p.flush_at for p in pending))
        for p in pending:
            p.clear()
    assert all(a == b for a, b, _ in drawn) and len({a for a, _, _ in drawn}) > 1
    assert any(a != c for a, _, c in drawn)  # another seed, other sizes
    with pytest.raises(ValueError, match="seed must be an int >= 0, got -1"):
        server(root, seed=-1)
    for ps in servers:
        ps.close()


@pytest.mark.parametrize("volatile", ["memory", "redis"])
def test_tables_are_served_by_the_users_names_and_keys(tmp_path, volatile, request):
    """Two int32 tables of one dim and optimizer (version 0.1 stacked them into one) each serve their own rows for
    their own int32 ids; names that stores cannot hold as they are (braces, 200 bytes) are served too."""
    names = ["tag_a", "tag_b", "a{b}c", "x" * 200]
    tables = [dynemb.TableConfig(name=n, dim=D, key_dtype=torch.int32, seed=i,
                                 optimizer=dynemb.optim.Adagrad(lr=0.1)) for i, n in enumerate(names)]
    ec = dynemb.EmbeddingCollection(tables, [dynemb.FeatureConfig(name=n, table=n) for n in names])
    ids = torch.tensor([-1, 0, 5, 2**31 - 1, -(2**31)], dtype=torch.int32)
    sum(o.sum() for o in ec({n: ids for n in names}).values()).backward()
    ec.optimizer.step()
    export_for_serving(tmp_path, ec)
    store = {"type": "memory"} if volatile == "memory" else \
        {"type": "redis", "address": request.getfixturevalue("redis_address")}
    ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(tmp_path)],
                                                  "embedding_table_names": names,
                                                  "embedding_vecsize_per_table": [D] * len(names)}],
                                      "volatile_db": store})
    ps.load("m", progress=False)
    for name in names:
        want = ec.embeddings[name].find(ids)
        assert torch.equal(ps.lookup("m", name, ids), want), name  # int32 ids
        assert torch.equal(ps.lookup("m", name, ids.to(torch.int64)), want), name  # int64 ids, as HPS passes
    assert not torch.equal(ps.lookup("m", "tag_a", ids), ps.lookup("m", "tag_b", ids))
    ps.close()


def test_bad_keys_roots_and_sparse_files_are_named_errors(tmp_path):
    """An int32 table names its own key dtype for float ids and refuses int64 ids beyond int32 (training does);
    a missing export root says so; sparse_files as one path is that root (not one root per character)."""
    ec = dynemb.EmbeddingCollection([dynemb.TableConfig(name="t", dim=D, key_dtype=torch.int32)],
                                    [dynemb.FeatureConfig(name="t", table="t")])
    ids = torch.tensor([-(2**31), 0, 2**31 - 1], dtype=torch.int32)
    ec({"t": ids})
    export_for_serving(tmp_path / "e", ec)

    def config(files):
        return {"models": [{"model": "m", "sparse_files": files, "embedding_table_names": ["t"],
                            "embedding_vecsize_per_table": [D]}]}

    ps = ParameterServer.from_config(config(str(tmp_path / "e")))
    ps.load("m", progress=False)
    try:
        with pytest.raises(TypeError, match=r"keys of table 't' must be an int64 or int32 tensor \(the table's key "
                                            r"dtype is torch.int32\), got torch.float32 tensor"):
            ps.lookup("m", "t", torch.tensor([1.0]))
        for bad in (2**31, -(2**31) - 1):
            with pytest.raises(ValueError, match=rf"table 't': {bad} is outside the int32 range"):
                ps.lookup("m", "t", torch.tensor([1, bad]))
        assert ps.stats("m")["tables"]["t"]["lookups"] == 0  # refused before anything was looked up
        assert torch.equal(ps.lookup("m", "t", ids.to(torch.int64)), ec.embeddings["t"].find(ids))
    finally:
        ps.close()
    (tmp_path / "empty").mkdir()
    for root, what in [(tmp_path / "nope", "no such directory"),
                       (tmp_path / "empty", r"no serving export there \(no 'latest' version\)")]:
        ps = ParameterServer.from_config(config([str(root)]))
        with pytest.raises(ValueError, match=f"export root {root}: {what}; write one with `dynemb export`"):
            ps.load("m", progress=False)
        ps.close()
    with pytest.raises(ValueError, match=r"sparse_files must be a list of export roots .* got 7"):
        ParameterServer.from_config(config(7))


@pytest.mark.parametrize("persistent", [None, "lmdb"])
def test_the_grouped_request_path_answers_as_the_per_table_path(tmp_path, persistent):
    # Tables of two row shapes (two group caches), initializers differing in kind and seed, ids of every tier and
    # ids nowhere, repeats, an empty and a one-id request, and keys of two tables that meet on one cache key.
    from dynemb.table.hashing import mix64

    specs = {"a": (8, "normal", 0), "b": (8, "normal", 1), "c": (4, "uniform", 2), "d": (8, "zeros", 3)}
    tables = {n: dynemb.DynamicEmbedding(d, seed=s, initializer=i) for n, (d, i, s) in specs.items()}
    for emb in tables.values():
        emb(KEYS)
    export_for_serving(tmp_path / "export", torch.nn.ModuleDict(tables))
    store = None if persistent is None else {"type": persistent, "path": str(tmp_path / persistent)}
    servers = []
    for grouped in (True, False):
        ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(tmp_path / "export")],
                                                      "embedding_table_names": list(specs),
                                                      "embedding_vecsize_per_table": [d for d, _, _ in specs.values()],
                                                      "cache_fraction": 0.05, "hit_rate_threshold": 0.5}],
                                          "persistent_db": store and {**store, "path": f"{store['path']}{grouped}"}})
        ps.load("m", progress=False)
        ps.grouped = grouped
        servers.append(ps)
    # "a" and "b" are tables 0 and 1 of the dim-8 group: this key of "b" has the cache key of KEYS[5] in "a".
    salts = mix64(torch.tensor([1, 2]))
    met = KEYS[5] ^ salts[0] ^ salts[1]
    unseen = torch.tensor([2**40, 2**40 + 1, -7], dtype=torch.int64)
    g = torch.Generator().manual_seed(5)
    requests = [{"a": KEYS[:0], "b": KEYS[:1], "c": KEYS[:0], "d": KEYS[:1]},
                {"a": unseen, "b": unseen.flip(0), "c": KEYS[:2], "d": KEYS[:2]}]  # one call, two seeds
    for _ in range(6):
        requests.append({n: torch.cat([KEYS[torch.randint(0, len(KEYS), (40,), generator=g)], unseen,
                                       KEYS[:3]]) for n in specs})
        requests[-1]["a"] = torch.cat([requests[-1]["a"], KEYS[5:6]])
        requests[-1]["b"] = torch.cat([requests[-1]["b"], met.view(1), KEYS[5:6]])
    if persistent:  # rows only the persistent tier has: the volatile one lost them
        for ps in servers:
            ps.volatile.store.delete(ps._table("m", "a").store_name, KEYS[100:300])
    for ids in requests:
        got = [ps.lookup_many("m", ids) for ps in servers]
        for n, emb in tables.items():
            want = emb.eval().find(ids[n])
            assert torch.equal(got[0][n], want), n
            assert torch.equal(got[1][n], want), n
    for ps in servers:
        ps.flush()
    stats = [ps.stats("m")["tables"] for ps in servers]
    for n in specs:
        assert stats[0][n]["lookups"] == stats[1][n]["lookups"] == sum(r[n].numel() for r in requests)
        assert stats[0][n]["default"] > 0
        assert sum(stats[0][n][t] for t in ("cache", "volatile", "persistent", "default")) == stats[0][n]["lookups"]
    if persistent:
        assert stats[0]["a"]["persistent"] > 0
    for ps in servers:
        ps.close()
