"""An EmbeddingCollection (dynamic, stacked int32 and static tables, per-table sparse optimizers) resumes exactly."""

from __future__ import annotations

import torch
from ckpt_util import assert_same_tables

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import load, save


def _collection(user_seed: int) -> EmbeddingCollection:
    tables = [
        TableConfig(name="user", dim=4, optimizer=dynemb.optim.Adam(lr=0.05), max_capacity=40, seed=user_seed),
        TableConfig(name="a", dim=4, key_dtype=torch.int32, optimizer=dynemb.optim.Adagrad(lr=0.1), seed=1),
        TableConfig(name="b", dim=4, key_dtype=torch.int32, optimizer=dynemb.optim.Adagrad(lr=0.1), seed=2),
        TableConfig(name="static", dim=4, vocabulary_size=10, optimizer=dynemb.optim.SGD(lr=0.1, momentum=0.9),
                    seed=3),
    ]
    return EmbeddingCollection(tables, [FeatureConfig(name=t.name, table=t.name) for t in tables])


def _step(ec: EmbeddingCollection, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    batch = {
        "user": torch.randint(-50, 50, (8, 3), generator=g),
        "a": torch.randint(-5, 5, (8, 2), generator=g, dtype=torch.int32),
        "b": torch.randint(0, 9, (8, 2), generator=g, dtype=torch.int32),
        "static": torch.randint(0, 10, (8, 2), generator=g),
    }
    sum(out.square().sum() for out in ec(batch).values()).backward()
    ec.optimizer.step()
    ec.optimizer.zero_grad()


def test_collection_resumes_exactly(tmp_path):
    straight = _collection(user_seed=0)
    for i in range(6):
        _step(straight, i)
    save(tmp_path, straight, straight.optimizer, step=6)
    for i in range(6, 12):
        _step(straight, i)
    resumed = _collection(user_seed=9)
    load(tmp_path, resumed, resumed.optimizer)
    for i in range(6, 12):
        _step(resumed, i)
    for name, module in straight.embeddings.items():
        other = resumed.embeddings[name]
        if isinstance(module, dynemb.DynamicEmbedding):
            assert_same_tables(module, other)
        else:
            assert torch.equal(module.table.values, other.table.values)
            assert all(torch.equal(module.table.slot(s), other.table.slot(s)) for s in module.table.slot_names)
    assert straight.optimizer.state_dict() == resumed.optimizer.state_dict()


def test_a_half_cast_collection_round_trips(tmp_path):
    ec = _collection(user_seed=0).half()  # the tables' rows become float16; their optimizer slots stay float32
    _step(ec, 0)
    save(tmp_path, ec, ec.optimizer, step=1)
    resumed = _collection(user_seed=9).half()
    load(tmp_path, resumed, resumed.optimizer)
    for name in ec.embeddings:
        assert resumed.embeddings[name].table.dtype == torch.float16
        assert torch.equal(resumed.export(name)[1], ec.export(name)[1])
