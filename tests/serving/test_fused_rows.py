"""The fused request path (two numba calls a request) with rows of every dtype a serving export has: float32, float16,
bfloat16 and the 8-bit kinds (int8 with row-wise scale and bias, float8 E4M3 / E5M2 with a row-wise scale), decoded to
float32 as they are written. Bit-equal to the grouped path's calls and to the per-table path, in every store, for
cache hits, store reads and default rows; the kernels against torch's decode for any rows, from size 0 and 1."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.checkpoint.row_codec import QUANTIZED, _lut, decode_rows, encode_rows, packed_width
from dynemb.kernels import numba_find_many as k
from dynemb.serving import ParameterServer
from dynemb.serving.ps import server as server_module
from dynemb.serving.ps.group_cache import GroupCache

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, **QUANTIZED}
KEYS = torch.tensor([0, -1, 2**63 - 1, -(2**63)] + list(range(10, 410)), dtype=torch.int64)
UNSEEN = torch.tensor([2**40, 2**40 + 1, -7], dtype=torch.int64)
# dim-8 tables of one group cache: a uniform default (the kernel's for float32 rows, torch's for the others), zeros
# and a constant from the config (the kernel's fixed row, quantized as the table stores it), normal (torch's)
SPECS = {"u": (8, "uniform", 2), "z": (8, "zeros", 3), "n": (8, "normal", 5), "k": (8, "uniform", 4)}


def _servers(tmp_path, request, tiers: str, dtype: torch.dtype, tables: dict) -> list:
    export_for_serving(tmp_path / "export", torch.nn.ModuleDict(tables), dtype=dtype)
    volatile = ({"type": "redis", "address": request.getfixturevalue("redis_address")} if "redis" in tiers
                else {"type": "memory"})
    servers = []
    for i, (grouped, fused) in enumerate([(True, True), (False, True), (True, False)]):  # fused, per table, grouped
        kind = tiers.split("+")[1] if "+" in tiers else None
        persistent = {"type": kind, "path": str(tmp_path / f"{kind}{i}")} if kind else None
        if "redis" in tiers and i:  # two servers in one Redis would share their tables' rows
            volatile = {"type": "memory"}
        ps = ParameterServer.from_config({"models": [{
            "model": "m", "sparse_files": [str(tmp_path / "export")], "embedding_table_names": list(SPECS),
            "embedding_vecsize_per_table": [8] * len(SPECS), "cache_fraction": 0.05, "hit_rate_threshold": 0.5,
            "default_value_for_each_table": ["initializer", "initializer", "initializer", 0.25]}],
            "volatile_db": volatile, "persistent_db": persistent})
        ps.load("m", progress=False)
        ps.grouped, ps.fused = grouped, fused
        servers.append(ps)
    if "+" in tiers:  # rows only the persistent tier has
        for ps in servers:
            ps.volatile.store.delete(ps._table("m", "u").store_name, KEYS[100:300])
    return servers


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tiers", ["memory", "redis", "memory+lmdb", "redis+rocksdb"])
def test_every_dtype_takes_the_fused_path_bit_for_bit(tmp_path, request, monkeypatch, tiers, dtype):
    tables = {n: dynemb.DynamicEmbedding(d, seed=s, initializer=i) for n, (d, i, s) in SPECS.items()}
    for emb in tables.values():
        emb(KEYS)
    tables["u"].insert_or_assign(KEYS[4:6], torch.tensor([[-0.0] * 8, [0.0, -0.0] * 4]))  # -0.0 summed to +0.0
    tables["z"].insert_or_assign(KEYS[6:8], torch.randn(2, 8) * 300)  # large values: float8's scale at work
    servers = _servers(tmp_path, request, tiers, DTYPES[dtype], tables)
    calls = []
    fused = server_module.lookup_fused
    monkeypatch.setattr(server_module, "lookup_fused", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    names = list(SPECS)
    plan = servers[0]._plan("m", tuple(names))
    assert plan.fused and plan.answers_float32 == (dtype not in ("float16", "bfloat16"))
    g = torch.Generator().manual_seed(7)
    pool = torch.cat([KEYS, UNSEEN])
    try:
        for step in range(8):  # cold caches, then warmer ones; batches of 0, 1 and more rows
            b = [0, 1, 200][step] if step < 3 else int(torch.randint(0, 90, (), generator=g))
            order = names if step % 2 else names[::-1]
            ids = torch.cat([pool[torch.randint(0, len(pool), (b,), generator=g)] for _ in order])
            if b >= 4:
                ids[:4] = KEYS[4:8]
            outs = []
            for ps in servers:
                out = torch.full((b, len(order) + 1, 8), 7.0)
                before = len(calls)
                assert ps.lookup_stacked("m", order, ids, b, out=out[:, 1:]).dtype == torch.float32
                assert len(calls) - before == (1 if ps is servers[0] and b else 0)
                assert bool((out[:, 0] == 7.0).all())
                outs.append(out[:, 1:])
            for out in outs[1:]:
                assert torch.equal(outs[0].view(torch.int32), out.view(torch.int32))
            assert not torch.signbit(outs[0][outs[0] == 0]).any()
            concat = [ps.lookup_concat("m", order, ids, [b] * len(order)) for ps in servers]
            for rows in concat[1:]:
                assert rows.dtype == concat[0].dtype
                assert torch.equal(rows.view(torch.int16), concat[0].view(torch.int16))
            if b:  # the stacked rows are the concatenated ones, summed from 0.0
                want = torch.add(concat[1].view(len(order), b, 8).transpose(0, 1), 0.0,
                                 out=torch.empty(b, len(order), 8))
                assert torch.equal(outs[0].view(torch.int32), want.view(torch.int32))
        assert calls
        for ps in servers:
            ps.flush()
        stats = [ps.stats("m")["tables"] for ps in servers]
        for n in SPECS:
            for field in ("lookups", "default"):
                assert stats[0][n][field] == stats[1][n][field] == stats[2][n][field] > 0, (n, field)
            assert sum(stats[0][n][t] for t in ("cache", "volatile", "persistent", "default")) == stats[0][n]["lookups"]
            assert stats[0][n]["cache"] > 0
        if "+" in tiers:
            assert stats[0]["u"]["persistent"] > 0
    finally:
        for ps in servers:
            ps.close()


def test_tables_of_two_dtypes_take_the_grouped_path_with_the_same_rows(tmp_path):
    # two group caches (float32 and int8 rows): no fused path, the grouped path's calls answer
    a, q = dynemb.DynamicEmbedding(8, seed=1), dynemb.DynamicEmbedding(8, seed=2)
    a(KEYS), q(KEYS)
    export_for_serving(tmp_path / "ea", torch.nn.ModuleDict({"a": a}))
    export_for_serving(tmp_path / "eq", torch.nn.ModuleDict({"q": q}), dtype=torch.int8)
    ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(tmp_path / "ea"),
                                                                                  str(tmp_path / "eq")],
                                                  "embedding_table_names": ["a", "q"],
                                                  "embedding_vecsize_per_table": [8, 8]}]})
    ps.load("m", progress=False)
    try:
        assert not ps._plan("m", ("a", "q")).fused
        ids = torch.cat([KEYS[:5], UNSEEN[:1], KEYS[3:9]])
        got = ps.lookup_stacked("m", ["a", "q"], ids, 6)
        want_q = decode_rows(encode_rows(q.eval().find(ids[6:]), "int8"), "int8", 8)
        assert torch.equal(got[:, 0], a.eval().find(ids[:6]) + 0.0) and torch.equal(got[:, 1], want_q + 0.0)
    finally:
        ps.close()


def _stored(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """Float rows ``[N, D]`` as a cache of ``kind`` stores them."""
    if kind in QUANTIZED:
        return encode_rows(rows, kind).view(torch.float16)
    return rows.to(DTYPES[kind])


def _decoded(stored: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    return decode_rows(stored, kind, dim) if kind in QUANTIZED else stored.to(torch.float32)


ROW_KIND = {"float32": k.ROW_FLOAT32, "float16": k.ROW_FLOAT16, "bfloat16": k.ROW_BFLOAT16, "int8": k.ROW_INT8,
            "float8_e4m3fn": k.ROW_FLOAT8_E4M3, "float8_e5m2": k.ROW_FLOAT8_E5M2}


@settings(max_examples=80, deadline=None)
@given(data=st.data(), kind=st.sampled_from(list(DTYPES)), dim=st.integers(1, 9), batch=st.integers(0, 5),
       features=st.integers(1, 3), tables=st.integers(1, 3), pool=st.booleans())
def test_the_kernels_decode_every_row_as_torch_does(data, kind, dim, batch, features, tables, pool):
    # probe_request (cache hits) and finish_request (store rows and fixed default rows) write each id's row decoded
    # to float32 at its place: the codec's decode (8-bit) or torch's cast, summed from 0.0 when pooled
    width = packed_width(kind, dim) // 2 if kind in QUANTIZED else dim
    dtype = torch.float16 if kind in QUANTIZED else DTYPES[kind]
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    keys = torch.tensor(data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6, unique=True)))
    stored = {}  # (table, key) -> stored row; in the cache, in the store, or nowhere (the table's fixed row)
    where = {}
    for t in range(tables):
        for key in keys.tolist():
            row = torch.randn(1, dim, generator=g) * float(torch.rand((), generator=g) * 100)
            if data.draw(st.booleans()):
                row[0, 0] = -0.0
            stored[t, key] = _stored(row, kind)
            where[t, key] = data.draw(st.sampled_from(["cache", "store", "nowhere"]))
    fixed = torch.cat([_stored(torch.full((1, dim), 0.5 * t - 0.25), kind) for t in range(tables)])
    group = GroupCache(width, dtype, "cpu", 64, tables)
    cached = [(t, key) for (t, key), w in where.items() if w == "cache"]
    if cached:
        ck = torch.tensor([key for _, key in cached])
        ct = torch.tensor([t for t, _ in cached])
        group.kv.insert_or_assign(ck ^ group.salts[ct], group.with_keys(ck, torch.cat([stored[p] for p in cached])))
    n = batch * features
    tid = torch.tensor([data.draw(st.integers(0, tables - 1)) for _ in range(features)]).repeat_interleave(batch)
    ids = keys[torch.randint(0, len(keys), (n,), generator=g)]
    out = torch.full((n, dim), 9.0)
    lut = _lut(kind) if kind in QUANTIZED else None
    table, key_cols, overflow, _, shift = group.kv.index._kernel_args(None)
    touched, miss_at, utid, ukey, inverse, counts, missed = k.probe_request(
        table, key_cols, overflow, shift, group.kv.values, ids, tid, group.salts, out, batch, pool, ROW_KIND[kind],
        lut)
    rows = torch.zeros(ukey.numel(), width, dtype=dtype)
    source = torch.zeros(ukey.numel(), dtype=torch.int64)
    for i, (t, key) in enumerate(zip(utid.tolist(), ukey.tolist())):
        if where[t, key] == "store":
            rows[i], source[i] = stored[t, key][0], 1
    consts = torch.full((tables,), k.CONSTANT, dtype=torch.int64)
    served = k.finish_request(torch.zeros(0, len(k.META), dtype=torch.int64), utid, ukey, counts, rows, source, consts,
                              torch.zeros(tables, 2, dtype=torch.float64), torch.zeros(tables, dtype=torch.int64),
                              miss_at, inverse, out, batch, pool, fixed, ROW_KIND[kind], lut)
    want = torch.empty(n, dim)
    for j in range(n):
        t, key = int(tid[j]), int(ids[j])
        row = fixed[t:t + 1] if where[t, key] == "nowhere" else stored[t, key]
        b, f = (j % batch, j // batch) if batch else (0, 0)
        want[b * features + f] = _decoded(row, kind, dim)[0]
    if pool:
        want = torch.add(want, 0.0)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    hits = sum(where[int(t), int(key)] == "cache" for t, key in zip(tid, ids))
    assert int(missed.sum()) == n - hits and int(served.sum()) == n - hits


@pytest.mark.parametrize("kind", ["float8_e4m3fn", "float8_e5m2"])
def test_the_kernels_float8_rounding_is_torchs_cast(kind):
    # every float32 near a code's value and halfway between two codes (ties to even), random ones, subnormals
    import numba

    mbits, bias, top = (3, 7, 448.0) if kind == "float8_e4m3fn" else (2, 15, 57344.0)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(QUANTIZED[kind]).to(torch.float32)
    grid = codes[torch.isfinite(codes) & (codes.abs() <= top)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1]),
                      torch.nextafter(grid, torch.full_like(grid, top))])
    rand = (torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 - 1) * top
    tiny = torch.randn(20_000, generator=torch.Generator().manual_seed(1)) * 2.0 ** (1 - bias)
    x = torch.cat([near, rand, tiny, torch.tensor([0.0, -0.0])]).clamp(-top, top)

    @numba.njit
    def encode(x, out):
        for j in range(x.shape[0]):
            out[j] = k._fp8_code(x[j], mbits, bias)

    got = np.empty(x.numel(), np.uint8)
    encode(x.numpy(), got)
    want = x.to(QUANTIZED[kind]).view(torch.uint8).numpy()
    assert np.array_equal(got, want), x[torch.from_numpy(got != want)][:5]


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["float32", *QUANTIZED]), dim=st.integers(1, 9), n=st.integers(0, 6),
       low=st.sampled_from([-0.05, -1.0, 0.0, 3.0]), span=st.sampled_from([0.0, 1e-3, 0.1, 2.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_the_kernels_uniform_defaults_are_the_quantized_initializer_rows(kind, dim, n, low, span, seed):
    # finish_request's default rows of a uniform initializer: the initializer's float32 rows, quantized for 8-bit
    # rows as the codec's encode_rows does, then decoded: what TableState.default_rows and answer give
    from dynemb.table.hashing import mix64
    from dynemb.table.initializers import Uniform, initial_rows

    width = packed_width(kind, dim) // 2 if kind in QUANTIZED else dim
    dtype = torch.float16 if kind in QUANTIZED else torch.float32
    keys = mix64(torch.arange(seed, seed + n, dtype=torch.int64))
    init = Uniform(low, low + span)
    out = torch.full((n, dim), 9.0)
    lut = _lut(kind) if kind in QUANTIZED else None
    f_low, f_high = init.kernel_spec()[1]
    k.finish_request(torch.zeros(0, len(k.META), dtype=torch.int64), torch.zeros(n, dtype=torch.int64), keys,
                     torch.ones(n, dtype=torch.int64), torch.empty(n, width, dtype=dtype),
                     torch.zeros(n, dtype=torch.int64), torch.tensor([k.UNIFORM]),
                     torch.tensor([[float(f_low), float(f_high) - float(f_low)]], dtype=torch.float64),
                     mix64(torch.tensor([seed], dtype=torch.int64)), torch.arange(n), torch.arange(n), out, n, False,
                     torch.zeros(1, width, dtype=dtype), ROW_KIND[kind], lut)
    rows = initial_rows(init, keys, dim, torch.float32, seed)
    want = _decoded(_stored(rows, kind), kind, dim) if kind in QUANTIZED else rows
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
