"""``ParameterServer.lookup_concat``: a request as one id tensor, its plan kept between requests, answers bit-equal to
the per-table path and to the training tables, with every tier (memory, Redis, LMDB) and across updates."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.serving import ParameterServer
from dynemb.table.initializers import Uniform

KEYS = torch.tensor([0, -1, 2**63 - 1, -(2**63)] + list(range(10, 410)), dtype=torch.int64)
UNSEEN = torch.tensor([2**40, 2**40 + 1, -7], dtype=torch.int64)
# dim-8 tables of different initializers and seeds (one group cache); "w" has another width
SPECS = {"a": (8, "normal", 0), "b": (8, "normal", 1), "d": (8, "zeros", 3), "u": (8, "uniform", 2),
         "w": (4, "uniform", 4)}


def _tables():
    tables = {n: dynemb.DynamicEmbedding(d, seed=s, initializer=i) for n, (d, i, s) in SPECS.items()}
    for emb in tables.values():
        emb(KEYS)
    return tables


def _server(root, volatile, persistent=None, grouped=True) -> ParameterServer:
    ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(root)],
                                                  "embedding_table_names": list(SPECS),
                                                  "embedding_vecsize_per_table": [d for d, _, _ in SPECS.values()],
                                                  "cache_fraction": 0.05, "hit_rate_threshold": 0.5}],
                                      "volatile_db": volatile, "persistent_db": persistent})
    ps.load("m", progress=False)
    ps.grouped = grouped
    return ps


def _requests():
    """``(tables, sizes, ids)`` of requests: runs of repeated tables, empty runs, a one-id and an empty request."""
    g = torch.Generator().manual_seed(3)
    out = [(["a"], [1], KEYS[:1]), (["a", "b"], [0, 0], KEYS[:0]), (["a", "b", "d"], [0, 1, 0], UNSEEN[:1])]
    for k in range(8):
        tables = ["a", "b", "a", "d", "u"] if k % 2 else ["u", "d", "b", "a"]
        sizes = [int(n) for n in torch.randint(0, 60, (len(tables),), generator=g)]
        ids = torch.cat([torch.cat([KEYS, UNSEEN])[torch.randint(0, len(KEYS) + 3, (n,), generator=g)]
                         for n in sizes])
        out.append((tables, sizes, ids))
    return out


@pytest.mark.parametrize("tiers", ["memory", "redis", "memory+lmdb", "redis+lmdb"])
def test_lookup_concat_answers_as_the_per_table_path_and_the_tables(tmp_path, request, tiers):
    tables = _tables()
    export_for_serving(tmp_path / "export", torch.nn.ModuleDict(tables))
    volatile = ({"type": "redis", "address": request.getfixturevalue("redis_address")} if "redis" in tiers
                else {"type": "memory"})
    servers = []
    for grouped in (True, False):
        persistent = {"type": "lmdb", "path": str(tmp_path / f"lmdb{grouped}")} if "lmdb" in tiers else None
        if "redis" in tiers and not grouped:  # two servers in one Redis would share their tables' rows
            volatile = {"type": "memory"}
        servers.append(_server(tmp_path / "export", volatile, persistent, grouped))
    if "lmdb" in tiers:  # rows only the persistent tier has
        for ps in servers:
            ps.volatile.store.delete(ps._table("m", "a").store_name, KEYS[100:300])
    try:
        for tables_, sizes, ids in _requests() * 2:  # cold caches, then warmer ones
            got = [ps.lookup_concat("m", tables_, ids, sizes) for ps in servers]
            want = torch.cat([tables[t].eval().find(run) for t, run in zip(tables_, ids.split(sizes))])
            assert got[0].shape == (ids.numel(), 8)
            assert torch.equal(got[0], want) and torch.equal(got[1], want)
            many = servers[0].lookup_many("m", {t: run for t, run in zip(tables_, ids.split(sizes))
                                                if tables_.count(t) == 1})
            for t, run in zip(tables_, ids.split(sizes)):
                if t in many:
                    assert torch.equal(many[t], tables[t].find(run))
        for ps in servers:
            ps.flush()
        stats = [ps.stats("m")["tables"] for ps in servers]
        for n in ("a", "b", "d", "u"):
            for field in ("lookups", "default"):
                assert stats[0][n][field] >= stats[1][n][field] > 0  # the first also served lookup_many
            assert sum(stats[0][n][t] for t in ("cache", "volatile", "persistent", "default")) == \
                stats[0][n]["lookups"]
        if "lmdb" in tiers:
            assert stats[0]["a"]["persistent"] > 0
    finally:
        for ps in servers:
            ps.close()


def test_the_plan_is_kept_and_made_again_when_the_model_is_loaded_again(tmp_path):
    tables = _tables()
    root = tmp_path / "export"
    export_for_serving(root, torch.nn.ModuleDict(tables))
    ps = _server(root, {"type": "memory"})
    try:
        ids = torch.cat([KEYS[:5], KEYS[:3]])
        ps.lookup_concat("m", ["a", "b"], ids, [5, 3])
        plan = ps._plan("m", ("a", "b"))
        ps.lookup_concat("m", ["a", "b"], ids, [5, 3])
        assert ps._plan("m", ("a", "b")) is plan  # kept between requests
        # an update (a delta) changes rows in place: the plan stays, the answer follows the update
        for emb in tables.values():
            emb.insert_or_assign(KEYS[:5], torch.full((5, emb.dim), 7.0))
        export_for_serving(root, torch.nn.ModuleDict(tables), incremental=True)
        ps.apply_update(root)
        assert ps._plan("m", ("a", "b")) is plan
        assert torch.equal(ps.lookup_concat("m", ["a", "b"], ids, [5, 3]),
                           torch.cat([tables["a"].find(KEYS[:5]), tables["b"].find(KEYS[:3])]))
        ps.load("m", progress=False)  # loaded again: new table states, a new plan
        assert ps._plan("m", ("a", "b")) is not plan
        assert torch.equal(ps.lookup_concat("m", ["a", "b"], ids, [5, 3]),
                           torch.cat([tables["a"].find(KEYS[:5]), tables["b"].find(KEYS[:3])]))
    finally:
        ps.close()


def test_a_group_s_tables_share_one_stats_lock_and_count_each_table(tmp_path):
    # the dim-8 tables share a group cache and one stats lock, taken once a request; "w" (dim 4) has its own
    export_for_serving(tmp_path / "export", torch.nn.ModuleDict(_tables()))
    ps = _server(tmp_path / "export", {"type": "memory"})
    try:
        served = ps._tables["m"]
        lock = served["a"].stats_lock
        assert all(served[n].stats_lock is lock for n in "abdu") and served["w"].stats_lock is not lock
        assert ps._plan("m", ("a", "b", "d")).groups[0].stats_lock is lock
        ps.lookup_concat("m", ["a", "b", "a", "d"], torch.cat([KEYS[:5], UNSEEN, KEYS[:2], KEYS[:0]]), [5, 3, 2, 0])
        stats = ps.stats("m")["tables"]
        assert [stats[n]["lookups"] for n in "abdu"] == [7, 3, 0, 0]
        assert stats["b"]["default"] == 3 and stats["a"]["default"] == 0
        assert not lock.locked()
    finally:
        ps.close()


def test_lookup_concat_refuses_bad_requests_before_looking_anything_up(tmp_path):
    export_for_serving(tmp_path / "export", torch.nn.ModuleDict(_tables()))
    ps = _server(tmp_path / "export", {"type": "memory"})
    try:
        ids = torch.tensor([1, 2, 3])
        for args, error, match in [
                ((["a", "w"], ids, [1, 2]), ValueError, r"share one row width .* use lookup_many"),
                ((["a", "b"], ids, [1]), ValueError, r"sizes must give the ids of each of the 2 runs"),
                ((["a", "b"], ids, [1, -2]), ValueError, r"sizes must give the ids"),
                ((["a", "b"], ids, [1, 1]), ValueError, r"sizes sum to 2, but ids has 3 entries"),
                ((["a"], ids.to(torch.int32), [3]), TypeError, r"ids must be a 1-D int64 tensor, got torch.int32"),
                ((["a"], ids.view(3, 1), [3]), TypeError, r"ids must be a 1-D int64 tensor"),
                ((["nope"], ids, [3]), ValueError, r"table 'nope' is not served by model 'm'"),
                (([], ids[:0], []), ValueError, r"tables must name at least one table")]:
            with pytest.raises(error, match=match):
                ps.lookup_concat("m", *args)
        assert all(t["lookups"] == 0 for t in ps.stats("m")["tables"].values())
        assert ps.lookup_concat("m", ["a", "b"], ids[:0], [0, 0]).shape == (0, 8)
    finally:
        ps.close()


@settings(max_examples=60, deadline=None)
@given(data=st.data(), n=st.integers(0, 60), tables=st.integers(1, 4))
def test_the_misses_pairs_in_one_pass_are_the_torch_codes(data, n, tables):
    # numba_find_many.miss_pairs against request_lookup's torch code: the same distinct (table, key) pairs in the
    # same order (by table, then cache key), counts, inverse and misses a table, keys of two tables that meet too
    from dynemb.kernels.numba_find_many import miss_pairs
    from dynemb.serving.ps.request_lookup import _unique_pairs
    from dynemb.table.hashing import mix64

    salts = mix64(torch.arange(1, tables + 1, dtype=torch.int64))
    pool = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=8))
    pool = torch.tensor(pool, dtype=torch.int64)
    tid = torch.tensor(data.draw(st.lists(st.integers(0, tables - 1), min_size=n, max_size=n)), dtype=torch.int64)
    keys = pool[torch.tensor(data.draw(st.lists(st.integers(0, len(pool) - 1), min_size=n, max_size=n)),
                             dtype=torch.int64)]
    if n and tables > 1 and data.draw(st.booleans()):  # a key of table 1 on the cache key of one of table 0
        keys[0], tid[0] = keys[-1] ^ salts[0] ^ salts[1], 1
        tid[-1] = 0
    found = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool)
    miss_at, utid, ukey, inverse, counts, missed = miss_pairs(found, keys, tid, salts, tables)
    want_at = (~found).nonzero().squeeze(1)
    assert torch.equal(miss_at, want_at)
    assert missed.tolist() == torch.bincount(tid[want_at], minlength=tables).tolist()
    assert torch.equal(utid[inverse], tid[want_at]) and torch.equal(ukey[inverse], keys[want_at])
    assert torch.equal(counts, torch.bincount(inverse, minlength=len(ukey)))
    if want_at.numel():
        ref = _unique_pairs(tid[want_at], keys[want_at], salts)
        assert sorted(zip(utid.tolist(), ukey.tolist(), counts.tolist())) == \
            sorted(zip(ref[0].tolist(), ref[1].tolist(), ref[3].tolist()))
        assert bool((utid[1:] >= utid[:-1]).all())  # by table
        cache_keys = ukey ^ salts[utid]
        same = utid[1:] == utid[:-1]
        assert bool((cache_keys[1:][same] > cache_keys[:-1][same]).all())  # then by cache key


# dim-8 tables whose default rows the fused path computes in its kernel: uniform initializers of other bounds and
# seeds, zeros, and (through the config) a constant; "n" (normal) makes torch compute its group's default rows.
FUSED_SPECS = {"u": (8, "uniform", 2), "v": (8, Uniform(-0.3, 0.7), 9), "z": (8, "zeros", 3),
               "k": (8, "uniform", 4)}


@pytest.mark.parametrize("tiers", ["memory", "redis", "memory+lmdb", "redis+lmdb"])
def test_the_fused_path_answers_as_the_per_table_path_bit_for_bit(tmp_path, request, tiers):
    # one float32 cache on the CPU: lookup_concat, lookup_many and lookup_stacked take the fused path (two numba
    # calls); the same rows (default rows kernel-computed, "k" a constant 0.25 from the config) and counts as the
    # per-table path, the grouped path without it (ps.fused = False) and the tables; a -0.0 kept by lookup_concat
    # and summed to +0.0 by lookup_stacked
    tables = {n: dynemb.DynamicEmbedding(d, seed=s, initializer=i) for n, (d, i, s) in FUSED_SPECS.items()}
    for emb in tables.values():
        emb(KEYS)
    tables["u"].insert_or_assign(KEYS[4:6], torch.tensor([[-0.0] * 8, [0.0, -0.0] * 4]))
    export_for_serving(tmp_path / "export", torch.nn.ModuleDict(tables))
    volatile = ({"type": "redis", "address": request.getfixturevalue("redis_address")} if "redis" in tiers
                else {"type": "memory"})
    servers = []
    for k, (grouped, fused) in enumerate([(True, True), (False, True), (True, False)]):  # fused, per table, not fused
        persistent = {"type": "lmdb", "path": str(tmp_path / f"lmdb{k}")} if "lmdb" in tiers else None
        if "redis" in tiers and k:  # two servers in one Redis would share their tables' rows
            volatile = {"type": "memory"}
        ps = ParameterServer.from_config({"models": [{
            "model": "m", "sparse_files": [str(tmp_path / "export")], "embedding_table_names": list(FUSED_SPECS),
            "embedding_vecsize_per_table": [8] * 4, "cache_fraction": 0.05, "hit_rate_threshold": 0.5,
            "default_value_for_each_table": ["initializer", "initializer", "initializer", 0.25]}],
            "volatile_db": volatile, "persistent_db": persistent})
        ps.load("m", progress=False)
        ps.grouped, ps.fused = grouped, fused
        servers.append(ps)
    assert servers[0]._plan("m", tuple(FUSED_SPECS)).fused
    assert servers[0]._plan("m", tuple(FUSED_SPECS)).groups[0].kernel_defaults
    if "lmdb" in tiers:  # rows only the persistent tier has
        for ps in servers:
            ps.volatile.store.delete(ps._table("m", "u").store_name, KEYS[100:300])
    g = torch.Generator().manual_seed(11)
    pool = torch.cat([KEYS, UNSEEN])
    unseen = torch.isin(pool, KEYS, invert=True)

    def want(t: str, ids: torch.Tensor) -> torch.Tensor:
        rows = tables[t].eval().find(ids)
        if t == "k":  # the config's constant for ids no tier holds
            rows[torch.isin(ids, KEYS, invert=True)] = 0.25
        return rows

    try:
        assert unseen.any()
        for k in range(10):  # cold caches, then warmer ones; batches of 0, 1 and up to 300 rows
            b = [0, 1, 300][k] if k < 3 else int(torch.randint(0, 120, (), generator=g))
            names = ["u", "v", "z", "k", "u"] if k % 2 else ["k", "z", "v", "u"]
            ids = torch.cat([pool[torch.randint(0, len(pool), (b,), generator=g)] for _ in names])
            if names[0] == "u" and b >= 2:  # the rows holding -0.0
                ids[:2] = KEYS[4:6]
            expect = torch.cat([want(t, run) for t, run in zip(names, ids.split(b))]) if b else torch.zeros(0, 8)
            got = [ps.lookup_concat("m", names, ids, [b] * len(names)) for ps in servers]
            for rows in got:
                assert torch.equal(rows, expect)
                assert torch.equal(torch.signbit(rows), torch.signbit(got[1]))  # a stored -0.0 stays -0.0
            for ps in servers:
                stacked = ps.lookup_stacked("m", names, ids, b)
                assert stacked.shape == (b, len(names), 8) and stacked.is_contiguous()
                summed = torch.nn.functional.embedding_bag(torch.arange(ids.numel()), got[1],
                                                           torch.arange(ids.numel()), mode="sum")
                want_stacked = summed.view(len(names), b, 8).transpose(0, 1)
                assert torch.equal(stacked, want_stacked) and not torch.signbit(stacked[stacked == 0]).any()
                # into a slice of a [B, F + 1, D] buffer (the served DLRM's input): the same rows, slot 0 untouched
                whole = torch.full((b, len(names) + 1, 8), 7.0)
                assert ps.lookup_stacked("m", names, ids, b, out=whole[:, 1:]).data_ptr() == whole[:, 1:].data_ptr()
                assert torch.equal(whole[:, 1:], want_stacked) and bool((whole[:, 0] == 7.0).all())
            if b:  # the fused probe stamps every cache row it finds as kv.find does (LRU: the access clock, the clock)
                kv = servers[0]._tables["m"]["u"].cache.group.kv
                probe = kv.clock + 1  # the probe's clock (a cold insert after it moves the clock again)
                for ps in servers:  # all of them: the statistics are compared below
                    ps.lookup_stacked("m", names, ids, b)
                scores, versions = kv._cols["score"], kv._cols["version"]
                stamped = scores == probe - kv.save_ticks
                assert bool((versions[stamped] == probe).all()) and (k < 3 or int(stamped.sum()) > 0)
            for ps in servers:
                many = ps.lookup_many("m", {"z": ids[:b], "k": ids[b:2 * b]} if names[0] != "u" else {"u": ids[:b]})
                for t, rows in many.items():
                    assert torch.equal(rows, want(t, ids[:b] if t in ("z", "u") else ids[b:2 * b]))
        for ps in servers:
            ps.flush()
        stats = [ps.stats("m")["tables"] for ps in servers]
        for n in FUSED_SPECS:
            for field in ("lookups", "default"):  # the tiers' shares depend on when background write-backs land
                assert stats[0][n][field] == stats[1][n][field] == stats[2][n][field] > 0
            assert sum(stats[0][n][t] for t in ("cache", "volatile", "persistent", "default")) == \
                stats[0][n]["lookups"]
        if "lmdb" in tiers:
            assert stats[0]["u"]["persistent"] > 0
        with pytest.raises(ValueError, match=r"rows must be an int in \[0, models\['m'\].max_batch_size=65536\], "
                                             r"got -1"):
            servers[0].lookup_stacked("m", ["u"], KEYS[:0], -1)
        with pytest.raises(ValueError, match=r"out must be a tensor of shape \[2, 2, 8\] .* got a "
                                             r"strided tensor of shape \(2, 2, 8\)"):
            servers[0].lookup_stacked("m", ["u", "v"], KEYS[:4], 2, out=torch.empty(2, 8, 2).transpose(1, 2))
    finally:
        for ps in servers:
            ps.close()
