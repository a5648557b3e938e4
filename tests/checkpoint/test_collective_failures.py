"""A sharded model's load where one rank cannot read the checkpoint it was given (a path that its file system lacks,
a relative path from another working directory): every rank raises the same CheckpointError naming that rank and
the path, at once. Before, that rank raised alone and its peers waited in the arguments' check (a collective) for
the whole timeout, then got a DistributedError naming no checkpoint (2 gloo ranks)."""

import os
import time

import numpy as np
import pytest
import torch

import dynemb
from dynemb import DistributedEmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import CheckpointError, export_for_serving, load, save

from distributed.harness import run

TIMEOUT = 30


def _step(ec, rank: int) -> None:
    ec({"f": torch.arange(8) + 4 * rank})["f"].sum().backward()
    ec.optimizer.step()


def _trained(rank: int) -> DistributedEmbeddingCollection:
    """A one-table sharded collection after one training step of this rank's ids."""
    ec = DistributedEmbeddingCollection([TableConfig(name="t", dim=4, optimizer=dynemb.optim.SGD(lr=0.1), seed=0)],
                                        [FeatureConfig(name="f", table="t")], timeout=TIMEOUT)
    _step(ec, rank)
    return ec


def _timed(call) -> tuple[str, float]:
    """``(the error call() raised, as "Type: message", or "", seconds it took)``."""
    start, error = time.monotonic(), ""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - which error, on which rank
        error = f"{type(e).__name__}: {e}"
    return error, time.monotonic() - start


def _run(fn, tmp_path):
    """``fn`` on 2 gloo ranks with a fresh directory ``tmp_path/out`` (returned) to write in."""
    root = tmp_path / "out"
    root.mkdir()
    run(fn, 2, tmp_path, str(root))
    return root


def _ranks(tmp_path, world: int = 2):
    """Each rank's saved results, with its ``error`` as text."""
    for rank in range(world):
        got = dict(np.load(tmp_path / f"rank{rank}.npz"))
        yield rank, got, str(got.get("error", ""))


def _load_and_report(ec, path: str, named: bool = True) -> dict:
    """Load ``path`` into ``ec``: the error this rank got (a CheckpointError's message; with ``named`` False, after
    its type, as any other error is), how long it took, and whether the table is unchanged."""
    before = ec.export("t")
    start, error = time.monotonic(), ""
    try:
        load(path, ec)
    except CheckpointError as e:
        error = str(e) if named else f"CheckpointError: {e}"
    except Exception as e:  # noqa: BLE001 - what the peer got instead
        error = f"{type(e).__name__}: {e}"
    after = ec.export("t")
    return {"error": np.array(error), "seconds": np.array(time.monotonic() - start),
            "unchanged": np.array(torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]))}


def _one_rank_cannot_read(rank, world, root):
    ec = _trained(rank)
    save(os.path.join(root, "ckpt"), ec, step=1)
    return _load_and_report(ec, os.path.join(root, "ckpt" if rank == 0 else "nowhere"))


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_checkpoint_fails_every_rank_at_once(tmp_path):
    run(_one_rank_cannot_read, 2, tmp_path, str(tmp_path))
    for rank, got, error in _ranks(tmp_path):
        assert "nowhere" in error and "rank 1" in error, (rank, error)
        assert float(got["seconds"]) < TIMEOUT / 2, (rank, float(got["seconds"]), error)
        assert got["unchanged"]


def _one_rank_refuses_its_arguments(rank, world, root):
    ec = _trained(rank)
    out = {}
    calls = {  # rank 1's own metric is NaN (extra must be finite JSON); rank 1's model name is empty
        "save": lambda: save(os.path.join(root, "ckpt"), ec, step=1, extra={"loss": float("nan") if rank else 0.5}),
        "export": lambda: export_for_serving(os.path.join(root, "export"), ec, model_name="" if rank else "m"),
    }
    for what, call in calls.items():
        error, seconds = _timed(call)
        out[what], out[what + "_seconds"] = np.array(error), np.array(seconds)
    out["written"] = np.array(sorted(os.listdir(root)))
    return out


@pytest.mark.slow
def test_a_rank_that_refuses_its_arguments_fails_every_rank_at_once(tmp_path):
    _run(_one_rank_refuses_its_arguments, tmp_path)
    for rank, got, _ in _ranks(tmp_path):
        for what, argument in (("save", "extra"), ("export", "model_name")):
            error = str(got[what])
            assert argument in error and (rank == 1 or "rank 1" in error), (rank, error)
            assert float(got[what + "_seconds"]) < TIMEOUT / 2, (rank, what, float(got[what + "_seconds"]), error)
        assert got["written"].tolist() == []


def _one_rank_cannot_list_the_root(rank, world, root):
    from pathlib import Path

    ec = _trained(rank)
    os.makedirs(os.path.join(root, "ckpt"), exist_ok=True)
    if rank == 1:  # its view of the shared root is not readable (another user's mount, say)
        def iterdir(self):
            raise PermissionError(13, "Permission denied", str(self))
        Path.iterdir = iterdir
    error, seconds = _timed(lambda: save(os.path.join(root, "ckpt"), ec, step=1))
    return {"error": np.array(error), "seconds": np.array(seconds)}


@pytest.mark.slow
def test_a_rank_that_cannot_list_the_root_fails_every_rank_at_once(tmp_path):
    root = _run(_one_rank_cannot_list_the_root, tmp_path)
    for rank, got, error in _ranks(tmp_path):
        assert "Permission denied" in error and "ckpt" in error, (rank, error)
        assert float(got["seconds"]) < TIMEOUT / 2, (rank, float(got["seconds"]), error)
    assert os.listdir(root / "ckpt") == []


def _one_rank_reads_a_corrupt_shard(rank, world, root):
    import glob

    from dynemb.checkpoint.tables import shard_file

    ec = _trained(rank)
    directory = save(os.path.join(root, "ckpt"), ec, step=1)
    torch.distributed.barrier()
    if rank == 1:  # its own shard (each rank reads only its own when the world size is unchanged)
        (path,) = glob.glob(os.path.join(directory, shard_file(0, "t", 1, 2)))
        data = bytearray(open(path, "rb").read())
        data[-5] ^= 1
        open(path, "wb").write(bytes(data))
    torch.distributed.barrier()
    _step(ec, rank)
    return _load_and_report(ec, os.path.join(root, "ckpt"), named=False)


@pytest.mark.slow
def test_a_rank_whose_shard_is_corrupt_fails_every_rank_before_any_changes(tmp_path):
    _run(_one_rank_reads_a_corrupt_shard, tmp_path)
    for rank, got, error in _ranks(tmp_path):
        assert "CheckpointError" in error and "checksum" in error and "rank-00001" in error, (rank, error)
        assert got["unchanged"], (rank, error)  # rank 0 loaded its part while rank 1 failed: ranks out of step
        assert float(got["seconds"]) < TIMEOUT / 2, (rank, float(got["seconds"]), error)
