"""Saving a checkpoint changes no eviction score: a run that saves midway trains exactly like one that does not,
and like one resumed from that save, under every policy (decayed_lfu reads absolute clock differences)."""

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import load, save


def _model(policy):
    tables = [TableConfig(name="u", dim=4, max_capacity=300, eviction=policy, seed=3,
                          optimizer=dynemb.optim.Adagrad(lr=0.1))]
    return EmbeddingCollection(tables, [FeatureConfig(name="u", table="u")])


def _train(ec, steps):
    for step in steps:
        ids = torch.randint(0, 1200, (128,), generator=torch.Generator().manual_seed(step))
        ec({"u": ids})["u"].pow(2).sum().backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()


def _rows(ec):
    keys, values = ec.embeddings["u"].export()
    order = keys.argsort()
    return keys[order], values[order]


@pytest.mark.parametrize("policy", ["lru", "lfu", "decayed_lfu", "epoch_lfu"])
def test_saving_midway_changes_nothing(tmp_path, policy):
    plain, saving = _model(policy), _model(policy)
    _train(plain, range(30))
    _train(saving, range(15))
    save(tmp_path, saving, step=15)
    _train(saving, range(15, 20))
    save(tmp_path, saving, step=20, incremental=True)
    _train(saving, range(20, 30))
    resumed = _model(policy)
    load(tmp_path / "step-00000015", resumed)
    _train(resumed, range(15, 30))
    for other in (saving, resumed):
        for a, b in zip(_rows(plain), _rows(other)):
            assert torch.equal(a, b)
        assert other.embeddings["u"].table.evicted == plain.embeddings["u"].table.evicted


def test_a_different_half_life_is_refused_when_strict(tmp_path):
    from dynemb.checkpoint import CheckpointError

    saved = dynemb.DynamicEmbedding(4, eviction="decayed_lfu", half_life=64, max_capacity=100, seed=0)
    saved(torch.arange(10))
    save(tmp_path, saved, step=1)
    other = dynemb.DynamicEmbedding(4, eviction="decayed_lfu", half_life=4, max_capacity=100, seed=0)
    with pytest.raises(CheckpointError, match="half_life is 64 in the checkpoint but 4 in the model"):
        load(tmp_path, other)
    load(tmp_path, other, strict=False)  # allowed: the scores then decay at the model's rate
    assert len(other) == 10
