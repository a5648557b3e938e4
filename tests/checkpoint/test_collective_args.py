"""save, load and export_for_serving of a sharded model are one call on every rank: ranks that pass different
arguments get the same ValueError naming the argument (2 gloo ranks), and nothing is written or loaded. Before,
rank 0's arguments won silently: rank 1's step or path was ignored, and a rank could load another checkpoint than
its peers."""

import os

import numpy as np
import pytest
import torch

import dynemb
from dynemb import DistributedEmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import export_for_serving, load, save

from distributed.harness import run


def _mismatches(rank, world, root):
    ec = DistributedEmbeddingCollection([TableConfig(name="t", dim=4, optimizer=dynemb.optim.SGD(lr=0.1), seed=0)],
                                        [FeatureConfig(name="f", table="t")], timeout=60)
    ec({"f": torch.arange(8) + 4 * rank})["f"].sum().backward()
    ec.optimizer.step()
    errors = []

    def expect(fn):
        try:
            fn()
            errors.append("")
        except ValueError as e:
            errors.append(str(e))

    expect(lambda: save(os.path.join(root, "ckpt"), ec, step=1 + rank))
    expect(lambda: save(os.path.join(root, f"ckpt{rank}"), ec, step=1))
    expect(lambda: export_for_serving(os.path.join(root, "export"), ec,
                                      dtype=torch.float16 if rank else torch.float32))
    save(os.path.join(root, "ckpt"), ec, step=1)
    before = ec.export("t")
    ec({"f": torch.arange(8) + 4 * rank})["f"].sum().backward()
    ec.optimizer.step()
    save(os.path.join(root, "ckpt"), ec, step=2)
    trained = ec.export("t")
    expect(lambda: load(os.path.join(root, "ckpt", "step-00000001" if rank else "step-00000002"), ec))
    after = ec.export("t")
    unchanged = torch.equal(trained[0], after[0]) and torch.equal(trained[1], after[1])
    load(os.path.join(root, "ckpt", "step-00000001"), ec)  # the same on both: loads
    loaded = ec.export("t")
    return {"errors": np.array(errors), "unchanged": np.array(unchanged),
            "loaded": np.array(torch.equal(loaded[1], before[1])),
            "published": np.array(sorted(os.listdir(os.path.join(root, "ckpt"))))}


@pytest.mark.slow
def test_ranks_that_pass_different_arguments_get_a_clear_error(tmp_path):
    run(_mismatches, 2, tmp_path, str(tmp_path))
    for rank in range(2):
        got = dict(np.load(tmp_path / f"rank{rank}.npz"))
        save_step, save_path, export_dtype, load_other = got["errors"].tolist()
        assert save_step == "save: every rank must pass the same step (it is one collective call): rank 0 has 1, " \
                            "rank 1 has 2"
        assert "save: every rank must pass the same path" in save_path and "ckpt1" in save_path
        assert "export_for_serving: every rank must pass the same dtype" in export_dtype
        assert "load: every rank must pass the same checkpoint" in load_other and "step-00000001" in load_other
        assert got["unchanged"] and got["loaded"]
    assert got["published"].tolist() == ["latest", "step-00000001", "step-00000002"]  # nothing from the failed saves
    assert not (tmp_path / "ckpt1").exists() and not (tmp_path / "export").exists()
