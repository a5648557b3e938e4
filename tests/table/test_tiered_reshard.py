"""A tiered table's checkpoint from one process loads into 2 gloo ranks (a row-sharded and a table-sharded table,
tiered there too), and training on there equals the same run with untiered tables, bit for bit; also with three
levels (fast tier over host memory over row files) on both sides."""

from __future__ import annotations

import json
import os

import pytest
import numpy as np
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import load, save, tiered_stream
from dynemb.distributed.comm import all_gather_varsize
from dynemb.table import Tiers

from distributed.harness import run


#: a directory: tiered tables get three levels, 6 fast rows over 4 host rows over row files there
THREE = None


def build(world: int, tiered: bool) -> EmbeddingCollection:
    three = {} if THREE is None else {"host_capacity": 4, "slow": THREE}
    tiers = Tiers(fast_capacity=6, **three) if tiered else None
    tables = [TableConfig(name="user", dim=4, optimizer=dynemb.optim.Adagrad(lr=0.1), seed=1, tiers=tiers),
              TableConfig(name="tag", dim=4, key_dtype=torch.int32, optimizer=dynemb.optim.Adam(lr=0.05), seed=2,
                          tiers=tiers)]
    plan = None if world == 1 else {"user": "row", "tag": ("table", 1)}
    return EmbeddingCollection(tables, [FeatureConfig(name=t.name, table=t.name) for t in tables], plan=plan)


def train(ec: EmbeddingCollection, steps) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(1000 * i + ec.rank)
        batch = {"user": torch.randint(-40, 40, (16,), generator=g),
                 "tag": torch.randint(-20, 20, (16,), generator=g, dtype=torch.int32)}
        sum(o.square().sum() for o in ec(batch).values()).backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()


def rows(ec: EmbeddingCollection) -> dict:
    """Every table's rows from all ranks (keys, values, scores, slots), sorted by key, and its slow-tier rows."""
    out = {}
    for name, shard in ec.logical_tables().items():
        if shard.module is not None:
            r = shard.table.export()
            cols = {"keys": shard.user_keys(r.keys).to(torch.int64), "values": r.values, "scores": r.scores,
                    **r.slots}
            below = getattr(shard.table, "levels", ())  # rows below the fast tier, in every level; in row files
            slow = torch.tensor([sum(level.size() for level in below), below[-1].size() if len(below) > 1 else 0])
        else:
            opt = shard.config.optimizer  # the same columns as the rank that holds the table, in order
            slots = {opt.slot_key(s): torch.empty(0, w) for s, (w, _) in opt.slot_widths(shard.config.dim).items()}
            cols = {"keys": torch.empty(0, dtype=torch.int64), "values": torch.empty(0, 4),
                    "scores": torch.empty(0, dtype=torch.int64), **slots}
            slow = torch.tensor([0, 0])
        if ec.sharded:
            cols = {k: torch.cat(all_gather_varsize(v, ec.group)) for k, v in cols.items()}
            slow = torch.cat(all_gather_varsize(slow, ec.group))
        order = cols["keys"].argsort()
        out.update({f"{name}/{k}": v[order].numpy() for k, v in cols.items()})
        out[f"{name}/slow_rows"], out[f"{name}/files_slow_rows"] = slow.view(-1, 2).sum(0).numpy()
    return out


def _two_ranks(rank, world, root):
    result = {}
    for tiered in (True, False):
        ec = build(world, tiered)
        load(root, ec)
        train(ec, range(4, 8))
        result.update({f"{tiered}/{k}": v for k, v in rows(ec).items()})
    return result if rank == 0 else None


@pytest.mark.slow
def test_a_tiered_checkpoint_reshards_and_trains_as_untiered(tmp_path):
    ec = build(1, tiered=True)
    train(ec, range(4))
    assert ec.embeddings["user"].table.slow.size() > 0
    save(tmp_path / "ckpt", ec, step=4)
    out = tmp_path / "out"
    out.mkdir()
    got = run(_two_ranks, 2, out, tmp_path / "ckpt")
    assert got is not None, [p.read_text() for p in out.glob("*.err")]
    assert got["True/user/slow_rows"] > 0 and got["True/tag/slow_rows"] > 0
    for key, value in got.items():
        if key.startswith("True/") and not key.endswith("slow_rows"):
            np.testing.assert_array_equal(value, got["False/" + key[5:]], err_msg=key)


def _two_ranks_in_chunks(rank, world, root):
    tiered_stream.CHUNK_ROWS = 7  # several chunks per file, of the full checkpoint and of the delta
    return _two_ranks(rank, world, root)


@pytest.mark.slow
def test_an_incremental_tiered_chain_reshards_a_chunk_at_a_time(tmp_path):
    """The chain (a full checkpoint and a delta with deleted keys) streams into 2 tiered ranks, equal to the same
    chain applied in memory for 2 untiered ranks."""
    ec = build(1, tiered=True)
    train(ec, range(4))
    save(tmp_path / "ckpt", ec, step=4)
    train(ec, range(4, 6))
    assert ec.embeddings["user"].table.erase(torch.arange(-40, -20)) > 0
    delta = save(tmp_path / "ckpt", ec, step=6, incremental=True)
    assert json.loads((delta / "manifest.json").read_text())["kind"] != "full"
    out = tmp_path / "out"
    out.mkdir()
    got = run(_two_ranks_in_chunks, 2, out, tmp_path / "ckpt")
    assert got is not None, [p.read_text() for p in out.glob("*.err")]
    assert got["True/user/slow_rows"] > 0
    for key, value in got.items():
        if key.startswith("True/") and not key.endswith("slow_rows"):
            np.testing.assert_array_equal(value, got["False/" + key[5:]], err_msg=key)


def _two_ranks_three_levels(rank, world, root):
    global THREE
    THREE = os.path.join(os.path.dirname(str(root)), "rows")
    return _two_ranks_in_chunks(rank, world, root)


@pytest.mark.slow
def test_an_incremental_chain_of_three_levels_reshards_a_chunk_at_a_time(tmp_path, monkeypatch):
    """As above, with three levels saving and loading: rows in the files on both sides."""
    monkeypatch.setitem(globals(), "THREE", str(tmp_path / "rows"))
    ec = build(1, tiered=True)
    train(ec, range(4))
    assert ec.embeddings["user"].table.disk.size() > 0
    save(tmp_path / "ckpt", ec, step=4)
    train(ec, range(4, 6))
    assert ec.embeddings["user"].table.erase(torch.arange(-40, -20)) > 0
    save(tmp_path / "ckpt", ec, step=6, incremental=True)
    out = tmp_path / "out"
    out.mkdir()
    got = run(_two_ranks_three_levels, 2, out, tmp_path / "ckpt")
    assert got is not None, [p.read_text() for p in out.glob("*.err")]
    assert got["True/user/slow_rows"] > 0 and got["True/user/files_slow_rows"] > 0
    for key, value in got.items():
        if key.startswith("True/") and not key.endswith("slow_rows"):
            np.testing.assert_array_equal(value, got["False/" + key[5:]], err_msg=key)
