"""Row files written as a log (LogStore): rows going down are appended with ``pwrite``, rows going up leave holes,
the ring is cleaned from its tail. A tiered table over it stays equal to an untiered table, bit for bit, through
turns of the ring, erases, slots added and casts; the mapping is never written in the steady state."""

from __future__ import annotations

import os

import torch

import pytest

from dynemb.table import KeyValueTable, Rows, TieredTable, Tiers, tiered
from dynemb.table.slow import LogStore


@pytest.fixture(autouse=True)
def _as_log(monkeypatch):
    monkeypatch.setattr(tiered, "ROW_FILES_AS_LOG", True)  # off by default (see its comment)


def _rows(keys: torch.Tensor, dim: int) -> Rows:
    values = keys.float().unsqueeze(1).expand(-1, dim) + torch.arange(dim)
    return Rows(keys, values, keys * 3, {"m": values * 2})


def _same(a, b) -> None:
    x, y = a.export(), b.export()
    ox, oy = torch.argsort(x.keys), torch.argsort(y.keys)
    assert torch.equal(x.keys[ox], y.keys[oy]) and torch.equal(x.values[ox], y.values[oy])
    assert torch.equal(x.scores[ox], y.scores[oy])
    assert x.slots.keys() == y.slots.keys()
    for name in x.slots:
        assert torch.equal(x.slots[name][ox], y.slots[name][oy])


def test_a_log_store_keeps_rows_through_growth_slots_casts_and_exchanges(tmp_path):
    table = KeyValueTable(3)
    table.add_slot("m", 3)
    store = LogStore(table, str(tmp_path), init_capacity=16)
    keys = torch.randperm(5000)[:3000] - 2500
    for part in keys.split(700):
        store.put(_rows(part, 3), part + 1)
    taken, versions = store.exchange(keys[:100], None, None)
    assert torch.equal(taken.keys, keys[:100]) and torch.equal(versions, keys[:100] + 1)
    store.add_slot("v", 2, init=0.5)  # packs the ring first
    store.cast(torch.float16)
    assert torch.equal(store.erase(torch.cat([keys[100:110], torch.tensor([99_999])])).sort().values,
                       keys[100:110].sort().values)
    everything, stamps = store.export()
    order = torch.argsort(everything.keys)
    rest = keys[110:].sort().values
    assert torch.equal(everything.keys[order], rest) and torch.equal(stamps[order], rest + 1)
    assert torch.equal(everything.values[order], _rows(rest, 3).values.half())
    assert bool((everything.slots["v"] == 0.5).all()) and store.size() == rest.numel()
    store.close()
    assert not os.path.exists(store.directory)


def test_a_tiered_table_over_a_log_equals_an_untiered_one_through_turns_of_the_ring(tmp_path, monkeypatch):
    monkeypatch.setattr(LogStore, "_CLEAN_MIN", 8)  # a small ring: many turns, cleaning a few rows at a time
    torch.manual_seed(3)
    tiered = TieredTable(4, tiers=Tiers(fast_capacity=40, slow=str(tmp_path)), initializer="normal", seed=5)
    flat = KeyValueTable(4, initializer="normal", seed=5)
    for t in (tiered, flat):
        t.add_slot("m", 4)
    log = tiered.slow
    assert isinstance(log, LogStore)
    cleaned = False
    for step in range(400):
        keys = torch.randint(0, 600, (30,)).unique()
        if step % 7 == 3:
            for t in (tiered, flat):
                t.erase(keys[:5])
        elif step % 5 == 1:
            values = torch.randn(keys.numel(), 4)
            for t in (tiered, flat):
                t.insert_or_assign(keys, values)
        else:
            rows = [t.find_or_insert(keys)[0] for t in (tiered, flat)]
            grad = torch.randn(keys.numel(), 4)
            for t, r in zip((tiered, flat), rows):
                t.values[r] += grad  # as an optimizer updates the rows a lookup returned, in place
                t.slot("m")[r] += grad * 2
        cleaned |= log._tail > 0
        if step == 200:
            for t in (tiered, flat):
                t.add_slot("v", 2, init=0.25)
    assert cleaned, "the ring was never cleaned"
    assert tiered.size() == flat.size()
    _same(tiered, flat)
    changed = tiered.changes_since(0)[0].numel()
    assert changed == flat.changes_since(0)[0].numel()


def test_rows_going_down_never_write_through_the_mapping(tmp_path):
    """The steady state's moves write the files with pwrite only: the mapped pages stay clean (no store faults
    after the kernel writes them back). Checked by making the mapping read-only once the table is warm."""
    tiered = TieredTable(8, tiers=Tiers(fast_capacity=64, slow=str(tmp_path)), initializer="zeros")
    tiered.find_or_insert(torch.arange(1000))
    log = tiered.slow
    log._reserve(4000)  # room for the rest, so no rewrite maps a new file below
    view = log._buf
    for _ in range(50):
        keys = torch.randint(0, 1000, (48,)).unique()
        log._sync()  # the appends in flight landed (the writer thread's)
        before = view.clone()
        tiered.find_or_insert(keys)
        log._sync()
        changed = (view != before).any(1).nonzero().squeeze(1)
        # every byte that changed came from a pwrite: rows appended at the head (positions the ring handed out)
        assert bool(log._holds[changed].all())
    assert log._buf is view
