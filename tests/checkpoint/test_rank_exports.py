"""``export_for_serving`` from N gloo ranks: each rank writes its own shard files of each table (no gather to rank
0) and rank 0 the one manifest; a parameter server loading that chain (a full export, then a delta) serves exactly
the rows a parameter server loading the one-process export of the same step serves."""

import json

import pytest
import torch
from test_distributed import build, step

from dynemb.checkpoint import export_for_serving, load, read_export, save
from dynemb.serving import ParameterServer

from distributed.harness import run

DIMS = {"user": 4, "item": 6, "cat": 4}


def _train_and_export(rank, world, root, export):
    ec = build()
    for i in range(3):
        step(ec, i, rank)
    save(root, ec, ec.optimizer, step=3)
    export_for_serving(export, ec, dtype=torch.float16)
    for i in range(3, 6):
        step(ec, i, rank)
        if i == 4:
            ec.embeddings["item"].erase(torch.arange(-99, 99, 5))  # deleted keys in the delta
    save(root, ec, ec.optimizer, step=6)
    export_for_serving(export, ec, dtype=torch.float16, incremental=True)


def _served(export) -> ParameterServer:
    ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(export)],
                                                  "embedding_table_names": list(DIMS),
                                                  "embedding_vecsize_per_table": list(DIMS.values())}]})
    ps.load("m", progress=False)
    return ps


@pytest.mark.slow
def test_an_export_from_two_ranks_serves_the_rows_of_a_one_process_export(tmp_path):
    (tmp_path / "out").mkdir()
    run(_train_and_export, 2, tmp_path / "out", tmp_path / "ckpt", tmp_path / "export-2")
    assert not list((tmp_path / "out").glob("*.err"))

    manifests = [json.loads((tmp_path / "export-2" / f"version-0000000{v}" / "manifest.json").read_text())
                 for v in (1, 2)]
    assert [m["kind"] for m in manifests] == ["full", "delta"]
    for manifest in manifests:  # row-sharded tables: one file per rank, named by it; the table-sharded one: one
        for name in ("user", "item"):
            shards = manifest["tables"][name]["shards"]
            assert [s["rank"] for s in shards] == [0, 1], name
            assert [s["file"].rsplit(".", 2)[1] for s in shards] == ["rank-00000-of-00002", "rank-00001-of-00002"]
            assert manifest["tables"][name]["rows"] == sum(s["rows"] for s in shards)
        assert len(manifest["tables"]["cat"]["shards"]) == 1
    assert manifests[1]["tables"]["item"]["deleted"] > 0

    for steps, version in ((3, 1), (6, 2)):  # the same step in one process, exported whole
        one = build(sharded=False)
        load(tmp_path / "ckpt" / f"step-0000000{steps}", one, one.optimizer)
        export_for_serving(tmp_path / f"export-1-{steps}", one, dtype=torch.float16)
        _, whole = read_export(tmp_path / f"export-1-{steps}")
        _, parts = read_export(tmp_path / "export-2" / f"version-0000000{version}")
        if version == 1:  # a full export: the same rows, in another order
            for name, cols in whole.items():
                a, b = cols["keys"].argsort(), parts[name]["keys"].argsort()
                assert torch.equal(cols["keys"][a], parts[name]["keys"][b]), name
                assert torch.equal(cols["values"][a], parts[name]["values"][b]), name
    # the server replays the 2-rank chain (full, then delta) up to step 6; the other loads step 6 exported whole
    served, want = _served(tmp_path / "export-2"), _served(tmp_path / "export-1-6")
    try:
        for name, cols in whole.items():
            keys = torch.cat([cols["keys"].to(torch.int64), torch.tensor([2**62, -(2**62), 123456789])])
            keys = keys.to(cols["keys"].dtype)
            assert torch.equal(served.lookup("m", name, keys), want.lookup("m", name, keys)), name
    finally:
        served.close()
        want.close()
