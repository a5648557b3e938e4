"""8-bit serving exports (int8 row-wise, float8 E4M3 and E5M2) of column-sharded tables from 2 gloo ranks: the
column shards are joined before the rows are packed, so every served row equals, bit for bit, the row of the
one-process 8-bit export of the same step (the quantization is the same, not merely within its error), for a full
export and for a delta replayed on top of it."""

import numpy as np
import pytest
import torch

from dynemb import EmbeddingCollection
from dynemb.checkpoint import export_for_serving, load, save
from dynemb.serving import ParameterServer, read_export

from .harness import run
from .test_strategies import STEPS, SPLITS, configs, plans, train

KINDS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int8": torch.int8}  # int8
# last: the delta below builds on the export written last
OPTIMIZER = ("adam", False, "lru")  # bounded, with admission: evictions and pending keys in the delta


def _train_and_export(rank, world, root):
    """Column plan (``wide`` dynamic and ``wstat`` static column-sharded, two table-row tables): train, save and
    export at step 1 in every 8-bit kind, then train one more step, erase keys, save, and export int8 as a delta."""
    splits = SPLITS[world]
    lo = sum(splits[:rank])
    tables, features = configs(*OPTIMIZER)
    ec = EmbeddingCollection(tables, features, plan=plans(world)["column"], timeout=60)
    train(ec, (lo, lo + splits[rank]))
    save(f"{root}/ckpt", ec, step=1)
    for kind, dtype in KINDS.items():
        export_for_serving(f"{root}/export-{kind}", ec, dtype=dtype)
    train(ec, (lo, lo + splits[rank]), steps=[STEPS])
    keys, _ = ec.gather_export("wide")
    if "wide" in ec.embeddings:  # the column shards of ``wide`` hold every key: each erases the same ones
        ec.embeddings["wide"].erase(keys[::3])
    save(f"{root}/ckpt", ec, step=2)
    export_for_serving(f"{root}/export-int8", ec, dtype=torch.int8, incremental=True)


def _one_process_export(ckpt, out, dtype):
    """The checkpoint loaded into one process (no sharding) and exported whole in ``dtype``."""
    tables, features = configs(*OPTIMIZER)
    one = EmbeddingCollection(tables, features)
    load(ckpt, one)
    export_for_serving(out, one, dtype=dtype)
    return tables


def _sorted_rows(cols):
    order = np.argsort(cols["keys"].numpy(), kind="stable")
    return cols["keys"].numpy()[order], cols["values"].numpy()[order]


def _server(export, tables) -> ParameterServer:
    ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(export)],
                                                  "embedding_table_names": [t.name for t in tables],
                                                  "embedding_vecsize_per_table": [t.dim for t in tables]}]})
    ps.load("m", progress=False)
    return ps


@pytest.mark.slow
def test_8_bit_exports_of_column_shards_equal_the_one_process_exports_bit_for_bit(tmp_path):
    (tmp_path / "out").mkdir()
    run(_train_and_export, 2, tmp_path / "out", str(tmp_path))
    assert not list((tmp_path / "out").glob("*.err")), [p.read_text() for p in (tmp_path / "out").glob("*.err")]

    for kind, dtype in KINDS.items():  # full exports at step 1: the same packed rows (keys in another order)
        tables = _one_process_export(tmp_path / "ckpt" / "step-00000001", tmp_path / f"one-{kind}", dtype)
        manifest, parts = read_export(tmp_path / f"export-{kind}" / "version-00000001")  # named by its version
        _, whole = read_export(tmp_path / f"one-{kind}")
        assert set(parts) == set(whole) == {t.name for t in tables}
        for name in whole:
            assert manifest["tables"][name]["dtype"] == kind
            got_keys, got_rows = _sorted_rows(parts[name])
            want_keys, want_rows = _sorted_rows(whole[name])
            assert got_rows.dtype == np.uint8 and got_keys.size > 0, (kind, name)
            np.testing.assert_array_equal(got_keys, want_keys, err_msg=f"{kind} {name}")
            np.testing.assert_array_equal(got_rows, want_rows, err_msg=f"{kind} {name}")  # bit for bit

    # served: the 2-rank int8 chain (full at step 1, delta at step 2) against step 2 exported whole in one process
    tables = _one_process_export(tmp_path / "ckpt" / "step-00000002", tmp_path / "one-int8-2", torch.int8)
    manifest, _ = read_export(tmp_path / "export-int8" / "version-00000002")
    assert manifest["kind"] == "delta" and manifest["tables"]["wide"]["deleted"] > 0
    served, want = _server(tmp_path / "export-int8", tables), _server(tmp_path / "one-int8-2", tables)
    try:
        _, whole = read_export(tmp_path / "one-int8-2")
        _, before = read_export(tmp_path / "one-int8")
        for name in whole:
            unknown = torch.tensor([2**62, -(2**62), 123456789]).to(whole[name]["keys"].dtype)
            keys = torch.cat([whole[name]["keys"], before[name]["keys"], unknown])  # erased keys: default rows
            got, expected = served.lookup("m", name, keys), want.lookup("m", name, keys)
            assert torch.equal(got, expected), name
    finally:
        served.close()
        want.close()
