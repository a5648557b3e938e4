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
from dynemb.checkpoint import CheckpointError, load, save

from distributed.harness import run

TIMEOUT = 30


def _one_rank_cannot_read(rank, world, root):
    ec = DistributedEmbeddingCollection([TableConfig(name="t", dim=4, optimizer=dynemb.optim.SGD(lr=0.1), seed=0)],
                                        [FeatureConfig(name="f", table="t")], timeout=TIMEOUT)
    ec({"f": torch.arange(8) + 4 * rank})["f"].sum().backward()
    ec.optimizer.step()
    save(os.path.join(root, "ckpt"), ec, step=1)
    before = ec.export("t")
    start, error = time.monotonic(), ""
    try:
        load(os.path.join(root, "ckpt" if rank == 0 else "nowhere"), ec)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - what the peer got instead
        error = f"{type(e).__name__}: {e}"
    after = ec.export("t")
    return {"error": np.array(error), "seconds": np.array(time.monotonic() - start),
            "unchanged": np.array(torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]))}


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_checkpoint_fails_every_rank_at_once(tmp_path):
    run(_one_rank_cannot_read, 2, tmp_path, str(tmp_path))
    for rank in range(2):
        got = dict(np.load(tmp_path / f"rank{rank}.npz"))
        error = str(got["error"])
        assert "nowhere" in error and "rank 1" in error, (rank, error)
        assert float(got["seconds"]) < TIMEOUT / 2, (rank, float(got["seconds"]), error)
        assert got["unchanged"]
