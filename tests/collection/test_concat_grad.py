"""A model that concatenates tables' pooled outputs hands each table a column block of one gradient; backward reads
that block in place (``functional.pooling.pooled_grad_rows``) instead of copying it. Training must be
bit-identical to the same upstream gradient handed to each table as its own contiguous tensor: equal dims, mixed
dims whose blocks do and do not line up with a row of the view, two features on one table, a ``mean`` feature,
static tables, step and fused optimizers, on every CPU backend."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig, optim
from dynemb.functional.pooling import pooled_grad_rows
from dynemb.kernels import use_backend




def _collection(dims, static, fused, combiner):
    tables = [TableConfig(name=f"t{i}", dim=d, seed=i, vocabulary_size=50 if static else None,
                          optimizer=optim.RowWiseAdagrad(lr=0.3, fused=fused) if i % 2 else
                          optim.SGD(lr=0.5, fused=fused))
              for i, d in enumerate(dims)]
    features = [FeatureConfig(name=f"f{i}", table=f"t{i}", combiner=combiner if i == 0 else "sum")
                for i in range(len(dims))]
    features.append(FeatureConfig(name="shared", table="t0"))  # a second feature of t0: its split stays
    return EmbeddingCollection(tables, features)


def _train(dims, static, fused, combiner, concatenated):
    ec = _collection(dims, static, fused, combiner)
    g = torch.Generator().manual_seed(0)
    names = [f"f{i}" for i in range(len(dims))] + ["shared"]
    width = sum(dims) + dims[0]
    for _ in range(3):
        batch = {n: (torch.randint(0, 50, (12,), generator=g), torch.tensor([0, 3, 3, 7])) for n in names}
        upstream = torch.randn(4, width, generator=g)
        out = ec(batch)
        if concatenated:
            torch.cat([out[n] for n in names], dim=1).backward(upstream)
        else:
            blocks = [b.contiguous() for b in upstream.split([*dims, dims[0]], dim=1)]  # each its own tensor
            torch.autograd.backward([out[n] for n in names], blocks)
        if not fused:
            ec.optimizer.step()
            ec.optimizer.zero_grad()
    return {name: ec.export(name) for name in ec.tables} if hasattr(ec, "tables") else \
        {f"t{i}": ec.export(f"t{i}") for i in range(len(dims))}


@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("dims", [(4, 4, 4), (2, 4, 2), (3, 4, 5)])
@pytest.mark.parametrize("static,fused,combiner", [(False, True, "sum"), (False, False, "sum"),
                                                   (False, True, "mean"), (True, True, "sum")])
def test_concatenated_outputs_train_like_separate_gradients(backend, dims, static, fused, combiner):
    if backend == "numba":
        pytest.importorskip("numba")
    with use_backend(backend):
        a = _train(dims, static, fused, combiner, concatenated=True)
        b = _train(dims, static, fused, combiner, concatenated=False)
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert torch.equal(x, y), (name, backend)


def test_column_blocks_are_read_in_place_and_others_copied():
    base = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    offsets, n = torch.tensor([0, 1, 1, 3]), 5
    expect_bag = torch.tensor([0, 2, 2, 3, 3])  # bag 1 is empty
    for lo, hi, in_place in [(0, 2, True), (2, 6, True), (6, 8, True), (1, 4, False), (0, 8, True)]:
        block = base[:, lo:hi]
        rows, bag = pooled_grad_rows(block, offsets, n, None)
        assert rows.is_contiguous() and torch.equal(rows[bag], block[expect_bag])
        assert (rows.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()) == in_place
    rows, bag = pooled_grad_rows(base[1:3, 2:4], torch.tensor([0, 1]), 2, None)  # rows of a row slice
    assert torch.equal(rows[bag], base[1:3, 2:4])
    divided, bag = pooled_grad_rows(base[:, 2:4], offsets, n, torch.full((4,), 2.0))
    assert torch.equal(divided[bag], base[:, 2:4][expect_bag] / 2)
