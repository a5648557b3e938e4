"""The pipelined training step (dynemb.train.Pipeline) gives bit-identical results to the plain loop: over several
steps with new keys, evictions and a background checkpoint in between, at 1 process and at 2 gloo ranks."""

import numpy as np
import pytest
import torch

from dynemb.data import SyntheticClickLog
from dynemb.train import Pipeline, TrainConfig, Trainer, build_dlrm

from .harness import run

STEPS = 7


def _train(rank, world, root, pipeline):
    torch.manual_seed(0)
    data = SyntheticClickLog(num_categorical=3, num_dense=2, batch_size=48, seed=3)
    cfg = TrainConfig(steps=STEPS, dim=4, max_capacity=60, eviction="lru", eval_every=4,
                      checkpoint_dir=f"{root}/ckpt-{int(pipeline)}", checkpoint_every=3)
    model = build_dlrm(2, data.categorical_names, cfg)
    trainer = Trainer(model, cfg, pipeline=pipeline)
    trainer.fit(data.batches("train", start=rank, step=world), [data.batch(0, "eval")], progress=False)
    ec = model.embeddings
    out = {"hits": np.array(ec.staged_hits), "evicted": np.array(trainer.table_stats()["evicted"]),
           "losses": np.array([row["loss"] for row in trainer.history.steps])}
    for name in sorted(ec.logical_tables()):
        keys, values = ec.gather_export(name)
        order = torch.argsort(keys)
        out[f"{name}.keys"], out[f"{name}.values"] = keys[order].numpy(), values[order].detach().numpy()
    for name, p in model.named_parameters():
        if not name.startswith("embeddings"):
            out[name.replace("module.", "")] = p.detach().numpy()
    return out


def _check_equal(plain, piped):
    assert int(piped["hits"]) == STEPS and int(plain["hits"]) == 0  # every step took its staged stages
    assert int(plain["evicted"]) > 0  # the tables evicted
    assert plain.keys() == piped.keys()
    for k in plain:
        if k != "hits":
            np.testing.assert_array_equal(plain[k], piped[k], err_msg=k)


def test_pipelined_training_is_bit_identical_at_one_process(tmp_path):
    plain, piped = (_train(0, 1, tmp_path, p) for p in (False, True))
    _check_equal(plain, piped)


@pytest.mark.slow
def test_pipelined_training_is_bit_identical_at_two_gloo_ranks(tmp_path):
    plain = run(_train, 2, tmp_path, str(tmp_path), False)
    piped = run(_train, 2, tmp_path, str(tmp_path), True)
    _check_equal(plain, piped)


def test_pipeline_off_yields_the_batches_as_they_are():
    data = SyntheticClickLog(num_categorical=2, num_dense=2, batch_size=8)
    model = build_dlrm(2, data.categorical_names, TrainConfig(dim=4))
    batches = list(data.batches("train", num_batches=3))
    assert list(Pipeline(model, batches, enabled=False)) == batches
    staged = Pipeline(model, batches, enabled=True)
    assert [b is a for a, b in zip(batches, staged)] == [True] * 3
    assert model.embeddings._staged == {}  # a batch never looked up leaves nothing behind
