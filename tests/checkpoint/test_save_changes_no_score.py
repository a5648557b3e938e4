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
