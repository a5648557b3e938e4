"""8-bit rows (int8 row-wise scale and bias, float8 E4M3 / E5M2 row-wise scale): the codec's error bounds, and the
parameter server serving them packed in every tier (memory, Redis, LMDB, RocksDB, the cache) and dequantized in the
lookup, equal to the codec's own round trip of the trained rows, with updates and default rows."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynemb
from dynemb.checkpoint import export_for_serving, read_export
from dynemb.checkpoint.row_codec import QUANTIZED, decode_rows, encode_rows, packed_width
from dynemb.serving import ParameterServer

KINDS = list(QUANTIZED)
D = 64
PATHS = [(True, True), (True, False), (False, False)]  # (grouped, fused): the fused, grouped and per-table paths
KEYS = torch.tensor([0, -1, 2**63 - 1, -(2**63)] + list(range(10, 610)), dtype=torch.int64)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5), dim=st.integers(1, 9), scale=st.sampled_from([0.0, 1e-3, 1.0, 300.0]),
       seed=st.integers(0, 2**16), kind=st.sampled_from(KINDS))
def test_the_codec_round_trip_is_within_its_bounds(n, dim, scale, seed, kind):
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)) * scale
    packed = encode_rows(x, kind)
    assert packed.dtype == torch.uint8 and packed.shape == (n, packed_width(kind, dim))
    y = decode_rows(packed, kind, dim)
    assert y.shape == (n, dim) and y.dtype == torch.float32
    assert torch.equal(decode_rows(packed.view(torch.float16), kind, dim), y)  # as the parameter server stores it
    if not n:
        return
    if kind == "int8":  # within half a step of the row's range / 255
        step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 255
        assert bool(((y - x).abs() <= step / 2 * 1.001 + 1e-6 * x.abs().amax(1, keepdim=True) + 1e-30).all())
    else:  # relative to the row's largest magnitude: the format's spacing at its top, and its smallest normals
        rel = 2.0**-4 if kind == "float8_e4m3fn" else 2.0**-3
        amax = x.abs().amax(1, keepdim=True)
        assert bool(((y - x).abs() <= rel * x.abs() + amax * 2.0**-9 + 1e-30).all())


def test_a_constant_row_decodes_exactly_and_a_dim_64_row_is_under_0_3x_its_fp32_bytes():
    rows = torch.full((3, D), 0.25)
    rows[1] = 0
    for kind in KINDS:
        assert torch.equal(decode_rows(encode_rows(rows, kind), kind, D), rows)
        assert packed_width(kind, D) <= 0.3 * 4 * D  # 72 or 68 bytes of 256


@pytest.fixture
def trained():
    emb = dynemb.DynamicEmbedding(D, seed=0, initializer="normal")
    emb(KEYS)
    emb.insert_or_assign(KEYS[:50], torch.randn(50, D) * 3)
    return emb.eval()


def server(root, volatile, persistent):
    ps = ParameterServer.from_config({"models": [{"model": "ctr", "sparse_files": [str(root)],
                                                  "embedding_table_names": ["embedding"],
                                                  "embedding_vecsize_per_table": [D], "cache_fraction": 0.1}],
                                      "volatile_db": volatile, "persistent_db": persistent})
    ps.load("ctr", progress=False)
    return ps


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tiers", ["memory", "redis+lmdb", "memory+rocksdb"])
def test_every_tier_serves_the_packed_rows_dequantized(trained, tmp_path, request, kind, tiers):
    root = tmp_path / "export"
    export_for_serving(root, trained, dtype=QUANTIZED[kind])
    manifest, payload = read_export(root)
    assert manifest["tables"]["embedding"]["dtype"] == kind and manifest["tables"]["embedding"]["dim"] == D
    assert payload["embedding"]["values"].dtype == torch.uint8
    volatile = {"type": "memory"} if tiers.startswith("memory") else {
        "type": "redis", "address": request.getfixturevalue("redis_address")}
    persistent = None if "+" not in tiers else {"type": tiers.split("+")[1], "path": str(tmp_path / "p")}
    ps = server(root, volatile, persistent)
    try:
        store = ps.volatile.store
        name = ps._table("ctr", "embedding").store_name  # "ctr@<model id>.embedding"
        schema = store.schema(name)  # packed in the tier: 16-bit words of the row's bytes
        assert schema.row_bytes == packed_width(kind, D)
        if persistent:  # rows only the persistent tier has
            store.delete(name, KEYS[200:400])
        unseen = torch.tensor([2**40, -5], dtype=torch.int64)
        g = torch.Generator().manual_seed(1)
        for grouped in (True, False, True):  # cold, then warm caches
            ps.grouped = grouped
            ids = torch.cat([KEYS[torch.randint(0, len(KEYS), (300,), generator=g)], unseen])
            got = ps.lookup("ctr", "embedding", ids.view(2, -1))
            want = decode_rows(encode_rows(trained.find(ids), kind), kind, D)
            assert got.shape == (2, ids.numel() // 2, D)
            assert torch.equal(got.view(-1, D), want)
        stats = ps.stats("ctr")["tables"]["embedding"]
        assert stats["cache"] > 0 and stats["volatile"] > 0 and stats["default"] > 0
        assert stats["persistent"] > 0 or not persistent
        # A delta (packed too) replaces the rows in every tier and in the cache.
        trained.insert_or_assign(KEYS[:20], torch.randn(20, D))
        delta = export_for_serving(root, trained, dtype=QUANTIZED[kind], incremental=True)
        assert read_export(delta)[0]["kind"] == "delta"
        ps.apply_update(delta)
        got = ps.lookup("ctr", "embedding", KEYS[:30])
        assert torch.equal(got, decode_rows(encode_rows(trained.find(KEYS[:30]), kind), kind, D))
    finally:
        ps.close()


def test_tables_of_two_dims_serve_8_bit_rows_through_lookup_many(tmp_path):
    tables = {"user": dynemb.DynamicEmbedding(16, seed=1), "item": dynemb.DynamicEmbedding(7, seed=2)}  # odd dim
    ids = torch.arange(100)
    for emb in tables.values():
        emb(ids)
    export_for_serving(tmp_path, torch.nn.ModuleDict(tables), dtype=torch.float8_e4m3fn)
    ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(tmp_path)],
                                                  "embedding_table_names": ["user", "item"],
                                                  "embedding_vecsize_per_table": [16, 7]}]})
    ps.load("m", progress=False)
    asked = {"user": ids[:10], "item": torch.cat([ids[5:9], torch.tensor([10**6])])}
    got = ps.lookup_many("m", asked)
    for name, emb in tables.items():
        want = decode_rows(encode_rows(emb.eval().find(asked[name]), "float8_e4m3fn"), "float8_e4m3fn", emb.dim)
        assert torch.equal(got[name], want), name
    ps.close()


@pytest.mark.parametrize("tiers", ["memory", "redis", "redis+lmdb", "memory+rocksdb"])
def test_a_full_version_of_another_dtype_is_served_in_its_own_as_a_fresh_server_would(trained, tmp_path, request,
                                                                                      tiers):
    """int8 -> float32 -> float8 -> a float8 delta, applied to a running server: each full version answers what a
    server started on it answers, bit for bit (it was converted into the dtype first loaded), and the delta applies
    on top (an incremental export of another dtype is written full); a server started again on the same Redis /
    persistent store (tables left in another dtype by the earlier version) loads it (it failed: 'already exists with
    another schema')."""
    root = tmp_path / "export"
    volatile = {"type": "memory"} if tiers.startswith("memory") else {
        "type": "redis", "address": request.getfixturevalue("redis_address")}
    persistent = None if "+" not in tiers else {"type": tiers.split("+")[1], "path": str(tmp_path / "p")}
    export_for_serving(root, trained, dtype=torch.int8)
    ps = server(root, volatile, persistent)
    ids = torch.cat([KEYS, torch.tensor([2**40, -5])])  # unseen ids too: their initializer rows
    try:
        ps.lookup("ctr", "embedding", ids)  # the cache holds int8 rows now
        for dtype in (torch.float32, torch.float8_e4m3fn):
            v = export_for_serving(root, trained, dtype=dtype)
            ps.apply_update(v)
            assert ps.stats("ctr")["version"] == read_export(v)[0]["version"]
            fresh = server(root, {"type": "memory"}, None)  # a server started on this version
            try:
                assert torch.equal(ps.lookup("ctr", "embedding", ids), fresh.lookup("ctr", "embedding", ids))
            finally:
                fresh.close()
        trained.insert_or_assign(KEYS[:20], torch.randn(20, D))
        delta = export_for_serving(root, trained, dtype=torch.float8_e4m3fn, incremental=True)
        assert read_export(delta)[0]["kind"] == "delta"
        ps.apply_update(delta)
        kind = "float8_e4m3fn"
        assert torch.equal(ps.lookup("ctr", "embedding", KEYS[:30]),
                           decode_rows(encode_rows(trained.find(KEYS[:30]), kind), kind, D))
    finally:
        ps.close()
    if volatile["type"] == "redis" or persistent:
        export_for_serving(root, trained)  # float32 again, over the float8 tables the stores hold
        again = server(root, volatile, persistent)
        try:
            assert torch.equal(again.lookup("ctr", "embedding", KEYS[:30]), trained.find(KEYS[:30]))
        finally:
            again.close()


def test_two_servers_on_one_redis_follow_a_dtype_change_in_turn(trained, tmp_path, redis_address):
    """Two servers of one export on one Redis: the first to apply a float32 version over the int8 one drops and
    recreates the shared tables; the other answers 503 (not another dtype's rows) until it applies that version too,
    then both answer what a fresh server does."""
    from dynemb.serving.ps import TierUnavailableError

    root = tmp_path / "export"
    export_for_serving(root, trained, dtype=torch.int8)
    volatile = {"type": "redis", "address": redis_address}
    first, second = server(root, volatile, None), server(root, volatile, None)
    ids = torch.cat([KEYS, torch.tensor([2**40, -5])])
    try:
        assert torch.equal(first.lookup("ctr", "embedding", ids), second.lookup("ctr", "embedding", ids))
        v2 = export_for_serving(root, trained, dtype=torch.float32)
        first.apply_update(v2)
        assert torch.equal(first.lookup("ctr", "embedding", KEYS), trained.find(KEYS))
        with pytest.raises(TierUnavailableError, match="another server's version"):
            second.lookup("ctr", "embedding", torch.tensor([2**41]))  # a miss of its cache: Redis holds version 2
        second.apply_update(v2)
        assert second.ready() == (True, "")  # the marker holds its version again: ready as the update ends
        fresh = server(root, {"type": "memory"}, None)
        try:
            want = fresh.lookup("ctr", "embedding", ids)
        finally:
            fresh.close()
        assert torch.equal(first.lookup("ctr", "embedding", ids), want)
        assert torch.equal(second.lookup("ctr", "embedding", ids), want)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("tiers", ["memory", "redis"])
def test_a_dtype_change_in_one_root_of_a_two_root_model_leaves_the_other_as_it_was(trained, tmp_path, request, tiers):
    """A model served from two export roots (one table each), both int8: a float32 full version of one root, applied
    to a running server, is served in float32 while the other root's table keeps its int8 rows; every path (fused,
    grouped, per table) answers what a server started on both roots as they are now answers, bit for bit."""
    other = dynemb.DynamicEmbedding(D, seed=1, initializer="uniform")
    other(KEYS[::2])
    other.eval()
    roots = {"a": tmp_path / "a", "b": tmp_path / "b"}
    export_for_serving(roots["a"], torch.nn.ModuleDict({"a": trained}), dtype=torch.int8)
    export_for_serving(roots["b"], torch.nn.ModuleDict({"b": other}), dtype=torch.int8)
    volatile = {"type": "memory"} if tiers == "memory" else {"type": "redis", "address": request.getfixturevalue(
        "redis_address")}

    def two_roots(volatile):
        ps = ParameterServer.from_config({"models": [{"model": "ctr", "sparse_files": [str(roots["a"]),
                                                                                         str(roots["b"])],
                                                      "embedding_table_names": ["a", "b"],
                                                      "embedding_vecsize_per_table": [D, D]}],
                                          "volatile_db": volatile})
        ps.load("ctr", progress=False)
        return ps

    ids = torch.cat([KEYS, torch.tensor([2**40, -5])])
    ps = two_roots(volatile)
    try:
        before_b = ps.lookup("ctr", "b", ids)
        ps.apply_update(export_for_serving(roots["a"], torch.nn.ModuleDict({"a": trained}), dtype=torch.float32))
        fresh = two_roots({"type": "memory"})
        try:
            want = {t: fresh.lookup("ctr", t, ids) for t in ("a", "b")}
        finally:
            fresh.close()
        assert torch.equal(want["a"][:50], trained.find(KEYS[:50]))  # float32 rows: exact
        assert torch.equal(want["b"], before_b)  # the other root's int8 rows, as they were
        for path in PATHS:
            ps.grouped, ps.fused = path
            for t in ("a", "b"):
                assert torch.equal(ps.lookup("ctr", t, ids), want[t]), (path, t)
    finally:
        ps.close()
