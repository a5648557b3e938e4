"""Multi-rank checkpoints (gloo): resharding 4 -> 2 -> 3 -> 1 keeps every (key, value, slots) row, and a resumed
run at the same world size equals an uninterrupted one exactly."""

import numpy as np
import pytest
import torch

import dynemb
from dynemb import DistributedEmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import load, save
from dynemb.distributed.comm import all_gather_varsize

from distributed.harness import run


def build(sharded: bool = True):
    """The three tables, sharded over the process group, or (``sharded=False``) in one process."""
    opt = dynemb.optim.Adam(lr=0.05)
    tables = [TableConfig(name="user", dim=4, optimizer=opt, seed=1),
              TableConfig(name="item", dim=6, optimizer=opt, seed=2, combiner="sum"),
              TableConfig(name="cat", dim=4, vocabulary_size=13, optimizer=opt, seed=3)]
    features = [FeatureConfig(name=t.name, table=t.name) for t in tables]
    if not sharded:
        return dynemb.EmbeddingCollection(tables, features)
    return DistributedEmbeddingCollection(tables, features, timeout=60)


def step(ec, step_index, rank):
    g = torch.Generator().manual_seed(1000 * step_index + rank)
    batch = {"user": torch.randint(-(2**62), 2**62, (7,), generator=g),
             "item": torch.randint(-99, 99, (7,), generator=g), "cat": torch.randint(0, 13, (7,), generator=g)}
    out = ec(batch)
    sum((o * (i + 1)).sum() for i, o in enumerate(out.values())).backward()
    ec.optimizer.step()
    ec.optimizer.zero_grad()


def gathered(ec) -> dict:
    """Every row of every dynamic table (keys, values, Adam slots) from all ranks, sorted by key."""
    result = {}
    for name in ("user", "item"):
        module = ec.embeddings[name] if name in ec.embeddings else None
        rows = module.table.export() if module is not None else None
        cols = {"keys": rows.keys if rows else torch.empty(0, dtype=torch.int64),
                "values": rows.values if rows else torch.empty(0, ec.logical_tables()[name].config.dim)}
        for slot in ("adam.exp_avg", "adam.exp_avg_sq"):
            cols[slot] = rows.slots[slot] if rows else torch.empty(0, ec.logical_tables()[name].config.dim)
        parts = {k: torch.cat(all_gather_varsize(v, ec.group)) for k, v in cols.items()}
        order = parts["keys"].argsort()
        result.update({f"{name}.{k}": v[order].numpy() for k, v in parts.items()})
    result["cat.values"] = ec.embeddings["cat"].table.values.detach().numpy().copy()
    return result


def _train_and_save(rank, world, root):
    ec = build()
    for i in range(3):
        step(ec, i, rank)
    save(root, ec, ec.optimizer, step=3)
    result = gathered(ec)  # a collective: every rank takes part
    return result if rank == 0 else None


def _reload_and_save(rank, world, root, new_step):
    ec = build()
    manifest = load(root, ec, ec.optimizer)
    assert manifest["step"] == new_step - 1
    result = gathered(ec)
    save(root, ec, ec.optimizer, step=new_step)
    return result if rank == 0 else None


@pytest.mark.slow
def test_reshard_4_2_3_1_keeps_every_row(tmp_path):
    root = tmp_path / "ckpt"
    (tmp_path / "w4").mkdir()
    want = run(_train_and_save, 4, tmp_path / "w4", root)
    assert want is not None and want["user.keys"].size > 0
    for n, world in enumerate((2, 3, 1)):
        out = tmp_path / f"w{world}"
        out.mkdir()
        got = run(_reload_and_save, world, out, root, 4 + n)
        assert got is not None, [p.read_text() for p in out.glob("*.err")]
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=f"world {world}: {key}")


def _resume(rank, world, root, interrupted):
    ec = build()
    if interrupted:
        load(root, ec, ec.optimizer)
    else:
        for i in range(3):
            step(ec, i, rank)
    for i in range(3, 6):
        step(ec, i, rank)
    result = gathered(ec)
    return result if rank == 0 else None


@pytest.mark.slow
def test_resume_at_same_world_size_is_exact(tmp_path):
    root = tmp_path / "ckpt"
    (tmp_path / "a").mkdir()
    run(_train_and_save, 2, tmp_path / "a", root)
    for name, _interrupted in (("b", False), ("c", True)):
        (tmp_path / name).mkdir()
    straight = run(_resume, 2, tmp_path / "b", root, False)
    resumed = run(_resume, 2, tmp_path / "c", root, True)
    for key, value in straight.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)


def _background_while_training(rank, world, root):
    import json

    ec = build()
    for i in range(3):
        step(ec, i, rank)
    save(root / "blocking", ec, ec.optimizer, step=3)
    handle = save(root / "background", ec, ec.optimizer, step=3, blocking=False)
    for i in range(3, 8):  # the training group's collectives go on while the save's own group gathers
        step(ec, i, rank)
    assert handle.wait(120) == root / "background" / "step-00000003"
    files = [json.loads((root / kind / "step-00000003" / "manifest.json").read_text())["files"]
             for kind in ("blocking", "background")]
    # every file's checksum (the tables' shards of both ranks, dense, both optimizer files) equals the blocking save's
    return {"same": np.array([files[0] == files[1]]), "count": np.array([len(files[0])])} if rank == 0 else None


@pytest.mark.slow
def test_background_save_at_two_ranks_equals_a_blocking_save(tmp_path):
    (tmp_path / "out").mkdir()
    got = run(_background_while_training, 2, tmp_path / "out", tmp_path)
    assert got is not None, [p.read_text() for p in (tmp_path / "out").glob("*.err")]
    assert got["same"][0] and got["count"][0] >= 5
