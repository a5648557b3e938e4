"""The in-process store: bounded memory, overflow policies, memory overhead, thread safety."""

from __future__ import annotations

import threading

import pytest
import torch

from dynemb.serving.stores import MemoryStore, MemoryStoreConfig, StoreFullError


def bounded(max_rows: int, **fields) -> MemoryStore:
    store = MemoryStore(MemoryStoreConfig(max_rows_per_table=max_rows, **fields))
    store.create_table("t", dim=2)
    return store


def test_evict_lru_drops_least_recently_used():
    store = bounded(4)
    store.put("t", torch.arange(4), torch.ones(4, 2))
    store.get("t", torch.tensor([0, 1]))  # reads count as accesses
    store.put("t", torch.tensor([10, 11]), torch.ones(2, 2))
    assert store.size("t") == 4 and store.evicted("t") == 2
    assert store.get("t", torch.tensor([0, 1, 2, 3, 10, 11]))[1].tolist() == [True, True, False, False, True, True]


def test_evict_lfu_drops_least_frequently_used():
    store = bounded(3, eviction="lfu")
    store.put("t", torch.arange(3), torch.ones(3, 2))
    for _ in range(3):
        store.get("t", torch.tensor([0, 2]))
    store.put("t", torch.tensor([7]), torch.ones(1, 2))
    assert store.get("t", torch.tensor([0, 1, 2, 7]))[1].tolist() == [True, False, True, True]


def test_refuse_raises_and_writes_nothing():
    store = bounded(3, overflow="refuse")
    store.put("t", torch.arange(2), torch.ones(2, 2))
    with pytest.raises(StoreFullError, match="holds 2 rows; 2 new would exceed max_rows_per_table=3"):
        store.put("t", torch.tensor([1, 5, 6]), torch.full((3, 2), 9.0))
    assert store.size("t") == 2
    assert store.get("t", torch.tensor([1]))[0].tolist() == [[1.0, 1.0]]
    store.put("t", torch.tensor([1, 5]), torch.full((2, 2), 9.0))  # overwrites need no room
    assert store.size("t") == 3


def test_memory_within_1_5x_raw_bytes():
    dim, rows = 64, 50_000
    raw = rows * (8 + 4 * dim)
    store = MemoryStore(MemoryStoreConfig(max_rows_per_table=rows))
    store.create_table("t", dim=dim)
    for start in range(0, 2 * rows, 10_000):  # fill past the bound: eviction keeps it full
        store.put("t", torch.arange(start, start + 10_000), torch.zeros(10_000, dim))
    assert store.size("t") == rows
    assert store.nbytes() <= 1.5 * raw, store.nbytes() / raw


def test_concurrent_readers_and_writers():
    store = bounded(1000)
    errors = []

    def work(seed: int) -> None:
        try:
            for i in range(50):
                keys = torch.arange(seed * 100, seed * 100 + 20) + i
                store.put("t", keys, keys.float().unsqueeze(1).expand(-1, 2).contiguous())
                values, found = store.get("t", keys)
                assert found.all() and torch.equal(values[:, 0], keys.float())
        except Exception as error:  # surfaced in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
