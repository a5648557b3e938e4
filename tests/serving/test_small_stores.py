"""Tables of 0, 1 and 2 rows through serving: every store (memory, Redis, LMDB, RocksDB) on its own, and the parameter
server over each, fed by a serving export, a delta and a full export replacing it. Every exported key reads its
exported row (bit for bit, in the export's dtype), every other key the default row, cold and warm.
``serve_bench`` measures such an export."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.data.traces import zipf_ranks
from dynemb.serving import ParameterServer
from dynemb.serving.bench import serve_bench
from dynemb.serving.stores import TableSchema, make_store
from dynemb.serving.stores.row_bytes import decode_keys, decode_rows, encode_keys, encode_rows

from small_tables import VALUE_DTYPES, apply_changes, bits, change_lists, edge_keys, edge_spec, keys_of, table_specs

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
STORES = ["memory", "redis", "lmdb", "rocksdb"]


def _store_config(kind: str, redis_server, tmp: str, **fields) -> dict:
    """A store of ``kind`` on the session's redis-server (emptied) or in ``tmp``."""
    if kind == "redis":
        if not redis_server.running():
            redis_server.start()
        redis_server.resume()
        redis_server.client().flushall()
        fields["address"] = redis_server.address
    if kind in ("lmdb", "rocksdb"):
        fields["path"] = str(Path(tmp) / kind)
    return {"type": kind, **fields}


# --------------------------------------------------------------------------------------------------- stores
@st.composite
def store_cases(draw):
    """Rows of one table (0-2 keys, the int64 extremes among them), a dtype, and keys to delete then."""
    keys = draw(st.lists(keys_of(torch.int64), max_size=2, unique=True))
    dim, dtype = draw(st.integers(1, 3)), draw(st.sampled_from(VALUE_DTYPES))
    seed = draw(st.integers(0, 1000))
    deleted = draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
    return keys, dim, dtype, seed, deleted


@pytest.mark.parametrize("kind", STORES)
@SETTINGS
@example(case=([], 1, torch.float32, 0, []))
@example(case=([-(2**63)], 1, torch.bfloat16, 0, [-(2**63)]))
@example(case=([2**63 - 1, -1], 3, torch.float16, 0, [-1]))
@given(case=store_cases())
def test_store_round_trips_tables_of_0_1_2_rows(kind, case, redis_server):
    keys, dim, dtype, seed, deleted = case
    keys = torch.tensor(keys, dtype=torch.int64)
    # rows as a strided view (every other column of a wider tensor): stores must not assume dense memory
    values = torch.randn(keys.numel(), 2 * dim, generator=torch.Generator().manual_seed(seed)).to(dtype)[:, ::2]
    absent = torch.tensor([k for k in edge_keys(torch.int64) if k not in keys.tolist()][:2], dtype=torch.int64)
    with tempfile.TemporaryDirectory() as tmp, make_store(_store_config(kind, redis_server, tmp)) as store:
        store.create_table("t", dim=dim, dtype=dtype)
        store.put("t", keys, values)
        assert store.size("t") == keys.numel()
        assert sorted(store.keys("t").tolist()) == sorted(keys.tolist())
        got, found = store.get("t", torch.cat([keys.flip(0), absent]))
        assert found.tolist() == [True] * keys.numel() + [False] * absent.numel()
        assert got.dtype == dtype and torch.equal(bits(got[: keys.numel()]), bits(values.flip(0)))
        assert not got[keys.numel():].any()
        gone = torch.tensor(deleted, dtype=torch.int64)
        assert store.delete("t", torch.cat([gone, gone, absent])) == gone.numel()
        kept = ~torch.isin(keys, gone)
        assert store.size("t") == int(kept.sum())
        assert sorted(store.keys("t").tolist()) == sorted(keys[kept].tolist())
        got, found = store.get("t", keys)
        assert torch.equal(found, kept) and torch.equal(bits(got[kept]), bits(values[kept]))


@settings(max_examples=40, deadline=None)
@example(case=([], 1, torch.float32, 0, []))
@example(case=([-(2**63)], 1, torch.bfloat16, 0, []))
@given(case=store_cases())
def test_row_bytes_round_trips_0_1_2_rows(case):
    """The byte encoding every out-of-process store shares, on its own (the stores skip empty batches)."""
    keys, dim, dtype, seed, _ = case
    keys = torch.tensor(keys, dtype=torch.int64)
    values = torch.randn(keys.numel(), dim, 2, generator=torch.Generator().manual_seed(seed)).to(dtype)[..., 0]
    prefix = np.frombuffer(b"t\x00", dtype=np.uint8)
    names = encode_keys(keys, prefix)
    assert all(name[:2] == b"t\x00" for name in names) and torch.equal(decode_keys([n[2:] for n in names]), keys)
    got, found = decode_rows(encode_rows(values), TableSchema(dim=dim, dtype=dtype))
    assert bool(found.all()) and got.shape == values.shape and torch.equal(bits(got), bits(values))


# ------------------------------------------------------------------------------------------- parameter server
TIERS = {  # (volatile, persistent): the volatile store bounded to one row makes two-row tables read LMDB too
    "memory": ({"type": "memory"}, None),
    "redis": ({"type": "redis"}, None),
    "memory+lmdb": ({"type": "memory", "max_rows_per_table": 1}, {"type": "lmdb"}),
    "redis+rocksdb": ({"type": "redis"}, {"type": "rocksdb"}),
}


def _server(root: Path, dim: int, tiers: str, redis_server, tmp: str) -> ParameterServer:
    volatile, persistent = (dict(part) if part else None for part in TIERS[tiers])
    config = {"models": [{"model": "m", "sparse_files": [str(root)], "embedding_table_names": ["embedding"],
                          "embedding_vecsize_per_table": [dim], "cache_fraction": 0.5}],
              "volatile_db": _store_config(volatile.pop("type"), redis_server, tmp, **volatile),
              "persistent_db": None if persistent is None else _store_config(persistent["type"], None, tmp)}
    return ParameterServer(config)


def _assert_serves(ps, emb, dtype, absent: torch.Tensor) -> None:
    """Every stored key of ``emb`` reads its row cast to ``dtype``; ``absent`` keys read the row training would
    create for them (its initializer, in ``dtype``), twice: the second time from the cache."""
    rows = emb.table.export()
    fresh = dynemb.DynamicEmbedding(emb.dim, key_dtype=emb.table.key_dtype, dtype=dtype, seed=emb.table.seed)
    want = torch.cat([rows.values.to(dtype), fresh.find(absent)])
    for _ in range(2):
        got = ps.lookup("m", "embedding", torch.cat([rows.keys, absent]))
        assert got.dtype == dtype and torch.equal(bits(got), bits(want)), (got, want)


@pytest.mark.parametrize("tiers", list(TIERS))
@SETTINGS
@example(data=None, spec=edge_spec(0, dim=2), dtype=torch.float32)
@example(data=None, spec=edge_spec(1, torch.int32, dim=2), dtype=torch.bfloat16)
@example(data=None, spec=edge_spec(2, dim=2), dtype=torch.float16)
@given(data=st.data(), spec=table_specs(), dtype=st.sampled_from(VALUE_DTYPES))
@pytest.mark.slow
def test_parameter_server_serves_exports_of_0_1_2_rows(tiers, data, spec, dtype, redis_server):
    if data is None:
        changes, more = [("erase", [0])], [("clear",)]
    else:
        changes, more = (data.draw(change_lists(spec.key_dtype), label=label) for label in ("changes", "more"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "export"
        emb = spec.filled()
        export_for_serving(root, emb, dtype=dtype)
        absent = torch.tensor([k for k in edge_keys(spec.key_dtype) if k not in spec.keys][:2], dtype=spec.key_dtype)
        ps = _server(root, spec.dim, tiers, redis_server, tmp)
        try:
            ps.load("m", progress=False)
            _assert_serves(ps, emb, dtype, absent)
            for step, incremental in ((changes, True), (more, False)):  # a delta, then a full export replacing all
                before = emb.table.export().keys
                apply_changes(emb, step)
                ps.apply_update(export_for_serving(root, emb, dtype=dtype, incremental=incremental))
                now = emb.table.export().keys
                gone = torch.cat([absent[~torch.isin(absent, now)], before[~torch.isin(before, now)]])
                _assert_serves(ps, emb, dtype, gone)
        finally:
            ps.close()


# ------------------------------------------------------------------------------------------------ serve-bench
def test_serve_bench_measures_an_export_with_tables_of_0_1_2_rows(tmp_path):
    """A table exported without rows gets no traffic (its power law has no rank to draw: it crashed the bench);
    the others are measured, and keys/s counts the ids sent."""
    tables = torch.nn.ModuleDict({f"t{n}": edge_spec(n).filled() for n in (0, 1, 2)})
    export_for_serving(tmp_path / "export", tables)
    result = serve_bench(tmp_path / "export", persistent="none", batch_size=8, batches=3, warmup=2)
    assert result["requests"] == 3 and result["tables"] == 3 and result["hit_rate"] == 1.0
    ids_per_request = 2 * 8  # t1 and t2
    assert result["keys_per_s"] == pytest.approx(result["qps"] * ids_per_request)
    with pytest.raises(ValueError, match=r"n \(ranks to draw from\) must be an int >= 1, got 0"):
        zipf_ranks(0, 4, 1.2, torch.Generator())
