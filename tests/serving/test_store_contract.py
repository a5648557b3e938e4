"""The Store contract, run against every store type (memory, Redis, RocksDB, LMDB) on real backends."""

from __future__ import annotations

import pytest
import torch

from dynemb.serving.stores import StoreError, TableSchema, make_store

EXTREME = torch.tensor([-(2**63), 2**63 - 1, -1, 0, 1, -(2**63) + 1, 2**63 - 2, 0x5851F42D])


def rows(n: int, dim: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_extreme_keys_bit_exact(store, dtype):
    store.create_table("t", dim=5, dtype=dtype)
    values = rows(len(EXTREME), 5, dtype)
    store.put("t", EXTREME, values)
    got, found = store.get("t", EXTREME.flip(0))
    assert found.all()
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), values.flip(0).contiguous().view(torch.uint8))
    assert store.size("t") == len(EXTREME)


def test_missing_keys_are_zero_and_not_found(store):
    store.create_table("t", dim=3)
    store.put("t", torch.tensor([5]), torch.ones(1, 3))
    got, found = store.get("t", torch.tensor([-1, 5, 2**63 - 1, 5]))
    assert found.tolist() == [False, True, False, True]
    assert torch.equal(got, torch.tensor([[0.0] * 3, [1.0] * 3, [0.0] * 3, [1.0] * 3]))


def test_overwrite_and_duplicate_keys_last_wins(store):
    store.create_table("t", dim=2)
    store.put("t", torch.tensor([1, 2]), torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    store.put("t", torch.tensor([2, 3, 2]), torch.tensor([[5.0, 5.0], [3.0, 3.0], [7.0, 7.0]]))
    got, _ = store.get("t", torch.tensor([1, 2, 3]))
    assert got.tolist() == [[1.0, 1.0], [7.0, 7.0], [3.0, 3.0]]
    assert store.size("t") == 3


def test_delete_counts_and_removes(store):
    store.create_table("t", dim=2)
    store.put("t", EXTREME, rows(len(EXTREME), 2))
    assert store.delete("t", torch.tensor([-(2**63), -(2**63), 12345, 0])) == 2
    found = store.get("t", EXTREME)[1]
    assert found.tolist() == [False, True, True, False, True, True, True, True]
    assert store.size("t") == len(EXTREME) - 2
    assert store.delete("t", torch.empty(0, dtype=torch.int64)) == 0


def test_keys_lists_every_stored_key_of_the_table_only(store):
    store.create_table("a", dim=2)
    store.create_table("ab", dim=2)
    assert store.keys("a").tolist() == []
    store.put("a", EXTREME, rows(len(EXTREME), 2))
    store.put("ab", torch.tensor([7, 8]), rows(2, 2))
    store.delete("a", EXTREME[:2])
    keys = store.keys("a")
    assert keys.dtype == torch.int64 and sorted(keys.tolist()) == sorted(EXTREME[2:].tolist())
    assert sorted(store.keys("ab").tolist()) == [7, 8]


def test_tables_are_separate(store):
    store.create_table("a", dim=2)
    store.create_table("ab", dim=3)
    store.put("a", torch.tensor([1]), torch.ones(1, 2))
    store.put("ab", torch.tensor([1, 2]), torch.full((2, 3), 2.0))
    assert store.tables() == ["a", "ab"]
    assert (store.size("a"), store.size("ab")) == (1, 2)
    assert store.get("a", torch.tensor([1, 2]))[0].tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert store.create_table("a", dim=2) == TableSchema(dim=2)


def test_bulk_100k_rows(store):
    keys = torch.randperm(200_000)[:100_000] * 92_233_720_368_547 - 2**62
    values = rows(100_000, 4)
    store.create_table("bulk", dim=4)
    store.put("bulk", keys, values)
    assert store.size("bulk") == 100_000
    got, found = store.get("bulk", torch.cat([keys.flip(0), keys[:1000] + 1]))
    assert found[:100_000].all() and not found[100_000:].any()
    assert torch.equal(got[:100_000], values.flip(0))


def test_empty_batch(store):
    store.create_table("t", dim=4)
    store.put("t", torch.empty(0, dtype=torch.int64), torch.empty(0, 4))
    got, found = store.get("t", torch.empty(0, dtype=torch.int64))
    assert got.shape == (0, 4) and found.shape == (0,)


def test_bad_arguments_raise_and_change_nothing(store):
    store.create_table("t", dim=2)
    keys = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="keys must have dtype torch.int64"):
        store.get("t", keys.double())
    with pytest.raises(TypeError, match="keys must be a torch.Tensor"):
        store.get("t", [1, 2])
    with pytest.raises(ValueError, match=r"keys must be 1-D \[N\], got shape \(1, 2\)"):
        store.get("t", keys.view(1, 2))
    with pytest.raises(TypeError, match="values must have dtype torch.float32"):
        store.put("t", keys, torch.ones(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"values must have shape \(2, 2\)"):
        store.put("t", keys, torch.ones(2, 3))
    with pytest.raises(ValueError, match="table 'nope' does not exist"):
        store.get("nope", keys)
    with pytest.raises(ValueError, match="already exists with TableSchema"):
        store.create_table("t", dim=3)
    with pytest.raises(ValueError, match="table must be a non-empty str"):
        store.create_table("{x}", dim=3)
    with pytest.raises(TypeError, match="table must be a str"):
        store.create_table(3, dim=3)
    with pytest.raises(ValueError, match="dim must be an int >= 1"):
        store.create_table("u", dim=0)
    assert store.size("t") == 0 and store.tables() == ["t"]


def test_closed_store_raises(store):
    store.create_table("t", dim=2)
    store.close()
    store.close()
    with pytest.raises(StoreError, match="is closed"):
        store.get("t", torch.tensor([1]))


@pytest.mark.parametrize("kind", ["redis", "rocksdb", "lmdb"])
def test_reopen_sees_tables_and_rows(store_config, kind):
    config = store_config(kind)
    with make_store(config) as first:
        first.create_table("t", dim=3, dtype=torch.float16)
        first.put("t", EXTREME, rows(len(EXTREME), 3, torch.float16))
    with make_store(config) as second:
        assert second.tables() == ["t"]
        assert second.schema("t") == TableSchema(dim=3, dtype=torch.float16)
        assert second.size("t") == len(EXTREME)
        assert torch.equal(second.get("t", EXTREME)[0], rows(len(EXTREME), 3, torch.float16))
        second.drop_table("t")
        second.create_table("t", dim=2)
    with make_store(config) as third:  # a dropped table stays dropped; its name holds the new schema
        assert third.schema("t") == TableSchema(dim=2, dtype=torch.float32) and third.size("t") == 0
        assert not third.get("t", EXTREME)[1].any()
    if kind != "redis":
        with make_store({**config, "read_only": True}) as read_only, pytest.raises(StoreError, match="read-only"):
            read_only.drop_table("t")


def test_drop_table_removes_rows_and_schema_so_another_schema_can_take_the_name(store):
    store.create_table("t", dim=3, dtype=torch.float16)
    store.create_table("u", dim=3, dtype=torch.float16)
    store.put("t", EXTREME, rows(len(EXTREME), 3, torch.float16))
    store.put("u", EXTREME[:2], rows(2, 3, torch.float16))
    with pytest.raises(ValueError, match="already exists"):
        store.create_table("t", dim=5, dtype=torch.float32)
    assert store.drop_table("t") and not store.drop_table("t") and not store.drop_table("never")
    assert store.tables() == ["u"] and store.size("u") == 2  # the other table untouched
    with pytest.raises(ValueError, match="does not exist"):
        store.schema("t")
    store.create_table("t", dim=5, dtype=torch.float32)
    assert store.size("t") == 0 and store.keys("t").numel() == 0
    got, found = store.get("t", EXTREME)
    assert not found.any() and got.shape == (len(EXTREME), 5) and got.dtype == torch.float32
    store.put("t", EXTREME[:3], rows(3, 5))
    assert torch.equal(store.get("t", EXTREME[:3])[0], rows(3, 5)) and store.size("t") == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_get_concat_is_get_many_concatenated(store, dtype):
    # several tables of one schema, keys present, absent, repeated and extreme, tables with no keys; again after
    # one table grew past its first allocation (the in-process store keeps the tables' addresses between calls)
    names = ["a", "b", "cc", "dddd"]  # Redis: keys named by prefixes of three lengths
    for k, name in enumerate(names):
        store.create_table(name, dim=5, dtype=dtype)
        store.put(name, torch.cat([EXTREME[k:], torch.arange(100) * (k + 1)]), rows(100 + len(EXTREME) - k, 5, dtype,
                                                                                     seed=k))
    g = torch.Generator().manual_seed(0)
    for grow in (False, True):
        if grow:
            store.put("b", torch.arange(10_000, 12_000), rows(2000, 5, dtype, seed=9))
        for sizes in ([3, 0, 7, 1], [0, 0, 0, 1], [0, 5, 0, 0], [20, 20, 20, 20]):
            keys = torch.cat([torch.cat([EXTREME, torch.arange(0, 400, 3), torch.tensor([11_000])])[
                torch.randint(0, len(EXTREME) + 135, (n,), generator=g)] for n in sizes])
            values, found = store.get_concat(names, keys, sizes)
            want = store.get_many({name: part for name, part in zip(names, keys.split(sizes))})
            assert values.dtype == dtype and values.shape == (keys.numel(), 5)
            assert torch.equal(found, torch.cat([want[name][1] for name in names]))
            assert torch.equal(values.view(torch.int16), torch.cat([want[name][0] for name in names]).view(torch.int16))
            assert not bool(values[~found].any())
    assert store.get_concat(names, torch.zeros(0, dtype=torch.int64), [0, 0, 0, 0])[0].shape == (0, 5)
    for args, match in [((["a", "a"], torch.tensor([1, 2]), [1, 1]), "tables must be distinct"),
                        ((["a", "b"], torch.tensor([1, 2]), [1]), r"sizes must give the keys of each of the 2"),
                        ((["a", "b"], torch.tensor([1, 2]), [2, 1]), r"summing to 2\), got \[2, 1\]"),
                        ((["a", "nope"], torch.tensor([1, 2]), [1, 1]), "table 'nope' does not exist")]:
        with pytest.raises(ValueError, match=match):
            store.get_concat(*args)
    store.create_table("wide", dim=6, dtype=dtype)
    with pytest.raises(ValueError, match="tables must share one schema"):
        store.get_concat(["a", "wide"], torch.tensor([1, 2]), [1, 1])
