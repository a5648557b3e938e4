"""TableGroup (the group kernels' find_or_insert over many tables at once) against each table's own find_or_insert
on the torch backend: rows, new rows' order, initial values, slots, stamps, sizes and counters, the index's
answers; batches of 0, 1 and many keys a table, duplicates, extreme keys, keys sharing a bucket, growth ahead of a
call and the one read a group makes.

On the three backends: torch (the group family's torch reference, :mod:`dynemb.table.group_reference`), numba and
Triton (without a GPU under Triton's interpreter on CPU tensors: the repository's conftest.py sets it up)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynemb.table import KeyValueTable
from dynemb.table import group_reference
from dynemb.table.group import TableGroup, refusal

#: every backend's group family (torch: its torch reference), each against the torch backend's own find_or_insert
_TRITON = [pytest.mark.triton, pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                  reason="triton is not installed")]
GROUPED = ["torch", "numba", pytest.param("triton", marks=_TRITON)]
GROUPED_SLOW = ["torch", "numba", pytest.param("triton", marks=[*_TRITON, pytest.mark.slow])]  # > 5 s a test on CPU
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _tables(backend: str, key_dtype, dims=(4, 8, 3), **kwargs) -> list[KeyValueTable]:
    tables = []
    for i, dim in enumerate(dims):
        init = "uniform" if i % 2 == 0 else 0.25  # both kernel initializers
        t = KeyValueTable(dim, key_dtype=key_dtype, backend=backend, seed=7 + i, init_capacity=16, initializer=init,
                          device=DEVICE, **kwargs)
        t.add_slot("state", 1, init=0.5)
        t.add_slot("wide", dim, init=-1.0)
        tables.append(t)
    return tables


def _call(group: TableGroup, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """One grouped find_or_insert of ``batches`` (one a table; empty ones pass nothing); rows cut per table."""
    counts = {t: b.numel() for t, b in enumerate(batches) if b.numel()}
    admitted = group.admit(counts)
    assert sorted(admitted) == sorted(counts)
    keys = torch.cat([b for b in batches if b.numel()]) if counts else batches[0][:0]
    seg = torch.cat([torch.full((b.numel(),), t, device=DEVICE) for t, b in enumerate(batches)])
    starts = torch.tensor([0] + [b.numel() for b in batches], device=DEVICE).cumsum(0)
    rows = group.find_or_insert(keys, seg, starts[seg], counts)
    return [rows[starts[t]:starts[t + 1]] for t in range(len(batches))]


def _same(grouped: KeyValueTable, ref: KeyValueTable) -> None:
    a, b = grouped.export(), ref.export()
    assert grouped.size() == ref.size() and grouped.inserted == ref.inserted and grouped.clock == ref.clock
    for field in ("keys", "values", "scores"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert all(torch.equal(a.slots[s], b.slots[s]) for s in b.slots)
    n = ref.size()
    assert torch.equal(grouped._cols["version"][:n], ref._cols["version"][:n])
    assert torch.equal(grouped.find_rows(b.keys), ref.find_rows(b.keys))


KEYS = {torch.int64: st.integers(-(2**63), 2**63 - 1), torch.int32: st.integers(-(2**31), 2**31 - 1)}


@pytest.mark.parametrize("backend", GROUPED_SLOW)
@pytest.mark.parametrize("key_dtype", [torch.int32, torch.int64])
@given(data=st.data())
@SETTINGS
def test_grouped_find_or_insert_is_each_tables_own(key_dtype, backend, data):
    grouped, ref = _tables(backend, key_dtype), _tables("torch", key_dtype)
    group = TableGroup(grouped, [("state", "wide")] * 3)
    info = torch.iinfo(key_dtype)
    specials = [info.min, info.max, -1, 0, 1, 0x5851F42D]
    for _ in range(data.draw(st.integers(1, 4))):
        batches = []
        for _t in range(3):
            keys = data.draw(st.lists(st.one_of(KEYS[key_dtype], st.sampled_from(specials)), max_size=40))
            batches.append(torch.tensor(keys, dtype=key_dtype, device=DEVICE))
        got = _call(group, batches)
        for t, keys in enumerate(batches):
            if keys.numel():
                want, _ = ref[t].find_or_insert(keys)
                assert torch.equal(got[t], want)
    for g, r in zip(grouped, ref):
        _same(g, r)


@pytest.mark.parametrize("backend", GROUPED)
def test_keys_sharing_a_bucket_spill_and_are_found(colliding_keys, backend):
    for key_dtype in (torch.int32, torch.int64):
        grouped, ref = _tables(backend, key_dtype, dims=(2, 2)), _tables("torch", key_dtype, dims=(2, 2))
        group = TableGroup(grouped, [("state", "wide")] * 2)
        crowd = colliding_keys(key_dtype, "last", 24)
        for batch in (crowd[:10], torch.cat([crowd, crowd[:3]])):
            got = _call(group, [batch, batch.flip(0)])
            assert torch.equal(got[0], ref[0].find_or_insert(batch)[0])
            assert torch.equal(got[1], ref[1].find_or_insert(batch.flip(0))[0])
        for g, r in zip(grouped, ref):
            _same(g, r)


@pytest.mark.parametrize("backend", GROUPED)
def test_sizes_stay_on_the_device_until_asked_and_are_read_once_for_the_group(backend):
    grouped = _tables(backend, torch.int64)
    group = TableGroup(grouped, [("state", "wide")] * 3)
    _call(group, [torch.arange(5, device=DEVICE), torch.arange(3, device=DEVICE), torch.arange(0, device=DEVICE)])
    assert group.pending and [t._live for t in grouped] == [0, 0, 0]  # nothing read back yet
    reads = []
    real = torch.Tensor.tolist
    torch.Tensor.tolist = lambda self: reads.append(1) or real(self)
    try:
        assert [t.size() for t in grouped] == [5, 3, 0]
    finally:
        torch.Tensor.tolist = real
    assert len(reads) == 1 and not group.pending
    assert [t.inserted for t in grouped] == [5, 3, 0]


@pytest.mark.parametrize("backend", GROUPED)
def test_a_group_grows_its_tables_before_a_call_that_might_fill_them(backend):
    grouped, ref = _tables(backend, torch.int64), _tables("torch", torch.int64)
    group = TableGroup(grouped, [("state", "wide")] * 3)
    g = torch.Generator().manual_seed(3)
    for step in range(6):  # 16 rows at first: every table grows, and its index rehashes, several times
        batches = [torch.randint(-(2**40), 2**40, (20 + 7 * t,), generator=g).to(DEVICE) for t in range(3)]
        got = _call(group, batches)
        for t, keys in enumerate(batches):
            assert torch.equal(got[t], ref[t].find_or_insert(keys)[0]), (step, t)
    for g_, r in zip(grouped, ref):
        _same(g_, r)
        assert g_.capacity >= g_.size()


def test_a_bounded_table_that_might_evict_is_left_to_its_own_lookup():
    bounded = KeyValueTable(2, max_capacity=10, init_capacity=10, backend="numba", device=DEVICE)
    free = KeyValueTable(2, backend="numba", device=DEVICE)
    group = TableGroup([bounded, free])
    assert group.admit({0: 8, 1: 8}) == [0, 1]
    assert group.admit({0: 11, 1: 8}) == [1]  # 11 new keys could not all fit in 10 rows
    assert group.admit({0: 8, 1: 4097}) == [0]  # more ids than numba groups for a table: its own lookup
    free.add_slot("unknown", 2)
    assert group.admit({0: 8, 1: 8}) == [0]  # new rows of free would miss a slot the group does not fill


def test_which_tables_a_group_takes():
    assert refusal(KeyValueTable(2, backend="numba")) is None
    assert "admission" in refusal(KeyValueTable(2, backend="numba", admission=2))
    assert "counts accesses" in refusal(KeyValueTable(2, backend="numba", eviction="lfu", max_capacity=8))
    assert "initializer" in refusal(KeyValueTable(2, backend="numba", initializer=lambda n, d: torch.zeros(n, d)))
    assert refusal(KeyValueTable(2, backend="torch")) is None  # torch groups run the family's torch reference
    assert TableGroup([KeyValueTable(2, backend="torch")]).kernels.module is group_reference
    with pytest.raises(ValueError, match="cannot join a kernel group"):
        TableGroup([KeyValueTable(2, backend="torch", admission=2)])
    with pytest.raises(ValueError, match="share device, key dtype and backend"):
        TableGroup([KeyValueTable(2, backend="numba"), KeyValueTable(2, backend="numba", key_dtype=torch.int32)])
