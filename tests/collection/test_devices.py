"""A collection of static and dynamic tables gives the same results on every device (CUDA runs where present)."""

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig


def build(device) -> EmbeddingCollection:
    tables = [TableConfig(name="cat", dim=4, vocabulary_size=20, seed=1, optimizer=dynemb.optim.Adagrad(lr=0.1)),
              TableConfig(name="cat2", dim=4, vocabulary_size=7, seed=2, optimizer=dynemb.optim.Adagrad(lr=0.1)),
              TableConfig(name="user", dim=4, seed=3, optimizer=dynemb.optim.Adam(lr=0.05))]
    features = [FeatureConfig(name=t.name, table=t.name) for t in tables]
    return EmbeddingCollection(tables, features, device=device)


def train(ec, device, steps=4):
    for i in range(steps):
        g = torch.Generator().manual_seed(i)
        batch = {"cat": torch.randint(0, 20, (8, 3), generator=g), "cat2": torch.randint(0, 7, (8,), generator=g),
                 "user": torch.randint(-(2**40), 2**40, (8, 2), generator=g)}
        out = ec({k: v.to(device) for k, v in batch.items()})
        sum(o.square().sum() for o in out.values()).backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()


@pytest.mark.cuda
def test_static_and_dynamic_tables_on_cuda_equal_cpu(cuda_device):
    ec = build("cuda")  # "cuda" resolves to cuda:<current>, which the tables' device checks must accept
    assert ec.embeddings["cat"].table.values.device.type == "cuda"
    train(ec, cuda_device)
    reference = build("cpu")
    train(reference, "cpu")
    for name in ("cat", "cat2", "user"):
        keys, values = ec.export(name)
        ref_keys, ref_values = reference.export(name)
        order, ref_order = keys.argsort(), ref_keys.argsort()
        assert torch.equal(keys[order].cpu(), ref_keys[ref_order])
        torch.testing.assert_close(values[order].cpu(), ref_values[ref_order], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="device"):
        ec({"cat": torch.tensor([1])})  # CPU ids for CUDA tables: a clear error, nothing changes


def test_static_range_checks_follow_validate():
    ec = build("cpu")
    with pytest.raises(ValueError, match=r"feature 'cat' \(table 'cat'\).*\[0, 20\)"):
        ec({"cat": torch.tensor([20])})
    unchecked = EmbeddingCollection([TableConfig(name="cat", dim=4, vocabulary_size=20)],
                                    [FeatureConfig(name="cat", table="cat")], validate=False)
    assert unchecked.validate is False
    with pytest.raises(TypeError, match="validate"):
        EmbeddingCollection([TableConfig(name="cat", dim=4)], [FeatureConfig(name="cat", table="cat")],
                            validate="yes")


def test_to_moves_every_table():
    ec = build("cpu").to("cpu")
    assert all(m.table.device.type == "cpu" for m in ec.embeddings.values())
