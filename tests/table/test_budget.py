"""Byte budgets: ``max_bytes`` on KeyValueTable, DynamicEmbedding and TableConfig, and a collection's budget split
across its tables. A full table's ``nbytes()`` (values, slots, scores, version stamps and index) stays within the
budget and uses most of it."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.collection import split_max_bytes
from dynemb.table import KeyValueTable
from dynemb.table.budget import row_bytes, rows_for_bytes, table_bytes


def _fill(table, n: int, batch: int = 500) -> None:
    for start in range(0, n, batch):
        table.find_or_insert(torch.arange(start, start + batch, dtype=table.key_dtype))


@settings(max_examples=25, deadline=None)
@given(dim=st.integers(1, 96), budget=st.integers(2_000, 400_000), slots=st.integers(0, 2),
       key_dtype=st.sampled_from([torch.int32, torch.int64]), dtype=st.sampled_from([torch.float32, torch.float16]))
def test_max_bytes_is_never_exceeded(dim, budget, slots, key_dtype, dtype):
    evicted = []
    t = KeyValueTable(dim, key_dtype=key_dtype, dtype=dtype, max_bytes=budget, init_capacity=16,
                      on_evict=lambda k, v, s: evicted.append(k.numel()))
    _fill(t, 300)
    for i in range(slots):  # an optimizer binding later: the row bound shrinks, the rows past it are evicted
        t.add_slot(f"s{i}", dim)
    _fill(t, 3 * t.max_capacity + 100)
    assert t.nbytes() <= budget
    assert t.size() == t.max_capacity
    assert t.size() + sum(evicted) == t.inserted - t.removed


@pytest.mark.parametrize("key_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_max_bytes_is_honoured_within_5_percent(dim, key_dtype):
    budget = 4 << 20
    t = KeyValueTable(dim, key_dtype=key_dtype, max_bytes=budget)
    t.add_slot("sum", dim)  # Adagrad's
    _fill(t, 3 * t.max_capacity, batch=4096)
    assert 0.95 * budget <= t.nbytes() <= budget


def test_rows_for_bytes_is_the_largest_that_fits():
    for per_row in (20, 88, 536):
        for budget in (800, 10_000, 1 << 20, 3_333_333):
            rows = rows_for_bytes(budget, per_row, torch.int64)
            assert table_bytes(rows, per_row, torch.int64) <= budget < table_bytes(rows + 1, per_row, torch.int64)


def test_cast_rederives_the_bound():
    t = KeyValueTable(8, max_bytes=100_000)
    before = t.max_capacity
    t.cast(torch.float16)
    assert t.max_capacity > before
    _fill(t, 3 * t.max_capacity)
    assert t.nbytes() <= 100_000


def test_dynamic_embedding_and_table_config_take_max_bytes():
    emb = dynemb.DynamicEmbedding(8, max_bytes=50_000, seed=0)
    opt = dynemb.optim.Adagrad([emb], lr=0.1)
    for i in range(30):
        emb(torch.arange(100) + 100 * i).sum().backward()
        opt.step()
        opt.zero_grad()
    assert emb.table.nbytes() <= 50_000 and emb.table.evicted > 0
    ec = EmbeddingCollection([TableConfig(name="t", dim=8, max_bytes=50_000, optimizer=dynemb.optim.Adagrad(lr=.1))],
                             [FeatureConfig(name="f", table="t")])
    for i in range(30):
        sum(o.sum() for o in ec({"f": torch.arange(100).view(50, 2) + 100 * i}).values()).backward()
        ec.optimizer.step()
    assert ec.embeddings["t"].table.nbytes() <= 50_000


def test_a_collection_budget_is_split_by_bytes_per_row():
    tables = [TableConfig(name="a", dim=4, optimizer=dynemb.optim.Adagrad(lr=0.1)),
              TableConfig(name="b", dim=16, optimizer=dynemb.optim.Adam(lr=0.1)),
              TableConfig(name="bounded", dim=4, max_capacity=10),
              TableConfig(name="static", dim=4, vocabulary_size=10)]
    split = split_max_bytes(tables, 1 << 20)
    shares = {t.name: t.max_bytes for t in split}
    assert shares["bounded"] is None and shares["static"] is None
    assert shares["a"] + shares["b"] <= 1 << 20
    rows_a = rows_for_bytes(shares["a"], row_bytes(4, torch.float32, torch.int64, {"sum": (4, torch.float32)}),
                            torch.int64)
    rows_b = rows_for_bytes(shares["b"], row_bytes(16, torch.float32, torch.int64,
                                                   {"m": (16, torch.float32), "v": (16, torch.float32)}), torch.int64)
    assert rows_a >= rows_b and rows_a - rows_b <= 0.1 * rows_b  # as many rows each (the leftover aside)
    ec = EmbeddingCollection(split, [FeatureConfig(name=t.name, table=t.name) for t in split])
    total = 0
    for name in ("a", "b"):
        table = ec.embeddings[name].table
        _fill(table, 4 * table.max_capacity, batch=2048)
        total += table.nbytes()
    assert total <= 1 << 20


def test_errors():
    with pytest.raises(ValueError, match="max_capacity or max_bytes, not both"):
        KeyValueTable(4, max_capacity=10, max_bytes=10_000)
    with pytest.raises(ValueError, match="max_bytes=100 is too small for one row"):
        KeyValueTable(4, max_bytes=100)
    with pytest.raises(ValueError, match="max_bytes must be"):
        KeyValueTable(4, max_bytes=0)
    with pytest.raises(ValueError, match="max_bytes must be None or an int >= 1, got 1500000.0"):
        KeyValueTable(4, max_bytes=1.5e6)
    with pytest.raises(ValueError, match="at most one of max_capacity, max_bytes and tiers"):
        TableConfig(name="t", dim=2, max_capacity=4, max_bytes=10_000)
    with pytest.raises(ValueError, match="dynamic tables only"):
        TableConfig(name="t", dim=2, vocabulary_size=4, max_bytes=10_000)
    with pytest.raises(ValueError, match="none is left to share"):
        split_max_bytes([TableConfig(name="t", dim=2, max_capacity=3)], 10_000)
    t = KeyValueTable(4, max_bytes=300)  # room for one bare row: a slot no longer fits
    with pytest.raises(ValueError, match="too small for one row"):
        t.add_slot("m", 64)


def test_split_max_bytes_argument_mistakes():
    from dynemb.collection import split_max_bytes

    with pytest.raises(TypeError, match="list of TableConfig"):
        split_max_bytes({"a": TableConfig(name="a", dim=4)}, 1 << 20)
    with pytest.raises(TypeError, match="list of TableConfig"):
        split_max_bytes(["a"], 1 << 20)
    with pytest.raises(ValueError, match="tables is empty"):
        split_max_bytes([], 1 << 20)
