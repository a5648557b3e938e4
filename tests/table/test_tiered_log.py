"""Row files written as a log (LogStore): rows going down are appended with ``pwrite``, rows going up leave holes,
the ring is cleaned from its tail. A tiered table over it stays equal to an untiered table, bit for bit, through
turns of the ring, erases, slots added and casts; the mapping is never written in the steady state."""

from __future__ import annotations

import os

import torch

import pytest

from dynemb.table import KeyValueTable, Rows, TieredTable, Tiers, tiered
from dynemb.kernels import numba_tiers
from dynemb.table.slow import LogStore, SlowStore


@pytest.fixture(autouse=True)
def _as_log(monkeypatch):
    monkeypatch.setattr(tiered, "ROW_FILES_AS_LOG", True)  # the default, whatever a test before set


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


@pytest.mark.parametrize("write_behind", [True, False])
@pytest.mark.parametrize("one_pass", [True, False])
def test_a_tiered_table_over_a_log_equals_an_untiered_one_through_turns_of_the_ring(tmp_path, monkeypatch,
                                                                                     write_behind, one_pass):
    monkeypatch.setattr(LogStore, "_CLEAN_MIN", 8)  # a small ring: many turns, cleaning a few rows at a time
    monkeypatch.setattr(LogStore, "WRITE_BEHIND", write_behind)  # appends on the writer thread, or at once
    if not one_pass:  # the column-at-a-time moves (columns the one-pass kernel does not take, torch backends)
        monkeypatch.setattr(numba_tiers, "exchange_with_file", lambda *args: False)
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


def test_the_in_place_row_files_stay_the_fallback(tmp_path, monkeypatch):
    """``tiered.ROW_FILES_AS_LOG = False``: rows written in place through the mapping (a SlowStore), with the same
    results."""
    monkeypatch.setattr(tiered, "ROW_FILES_AS_LOG", False)
    torch.manual_seed(4)
    table = TieredTable(4, tiers=Tiers(fast_capacity=40, slow=str(tmp_path)), initializer="normal", seed=5)
    flat = KeyValueTable(4, initializer="normal", seed=5)
    assert type(table.slow) is SlowStore
    for _ in range(60):
        keys = torch.randint(0, 300, (30,)).unique()
        rows = [t.find_or_insert(keys)[0] for t in (table, flat)]
        grad = torch.randn(keys.numel(), 4)
        for t, r in zip((table, flat), rows):
            t.values[r] += grad
    _same(table, flat)


def test_the_one_pass_kernel_moves_what_the_column_moves_do():
    """``numba_tiers.exchange_with_file`` against the column-at-a-time kernels: the same rows down (pads zeroed),
    the same columns after; paired rows, rows only going down, only coming up; columns it does not take refused."""
    from dynemb.table.tier_moves import _exchange_by_column, _file_columns, _pads
    from dynemb.table.slow import _layout

    torch.manual_seed(0)
    table = KeyValueTable(6, initializer="normal")
    table.add_slot("m", 3)
    table.find_or_insert(torch.arange(50))
    layout, width = _layout({n: (tuple(c.shape[1:]), c.dtype) for n, c in table._cols.items()})
    pads = _pads(layout, width)
    assert pads and width % 8 == 0
    file = torch.randint(0, 255, (80, width), dtype=torch.uint8)
    for v, u in ((10, 10), (10, 4), (3, 9), (0, 5), (7, 0)):
        victims, up_at = torch.randperm(50)[:v], torch.randperm(80)[:u]
        k = min(u, v)
        dest = torch.cat([victims[:k], torch.arange(50, 50 + u - k)])
        results = []
        for one_pass in (True, False):
            cols = {n: torch.cat([c[:50], torch.zeros((20,) + tuple(c.shape[1:]), dtype=c.dtype)])
                    for n, c in table._cols.items() if n not in ("score", "version")}
            stamps = torch.cat([torch.stack([table._cols["score"][:50], table._cols["version"][:50]], 1),
                                torch.zeros(20, 2, dtype=torch.int64)])
            cols = {"key": cols["key"], "value": cols["value"], "score": stamps[:, 0], "version": stamps[:, 1],
                    "slot:m": cols["slot:m"]}
            cols = {n: cols[n] for n in table._cols}  # the table's column order
            down = torch.full((v, width), 7, dtype=torch.uint8)
            if one_pass:
                moves = _file_columns(cols, layout)
                assert len(moves) == len(cols) - 1  # the stamps paired
                assert numba_tiers.exchange_with_file([c for c, _ in moves], [a for _, a in moves], victims, down,
                                                      file, up_at, dest, pads)
            else:
                _exchange_by_column(numba_tiers, cols, layout, _Raw(file), victims, dest, up_at, down, k, u, pads)
            results.append((down, cols))
        (d1, c1), (d2, c2) = results
        assert torch.equal(d1, d2)
        assert all(torch.equal(c1[n], c2[n]) for n in c1)
    half = table.values.to(torch.bfloat16)  # 2-byte rows of 6 values: whole words, but the offsets checked
    assert not numba_tiers.exchange_with_file([half], [2], torch.arange(2), torch.zeros(2, 16, dtype=torch.uint8),
                                              file[:, :16].contiguous(), torch.arange(2), torch.arange(2), [])


class _Raw:
    """A stand-in for a LogStore's raw rows (what the column moves read)."""

    def __init__(self, raw):
        self._buf = raw


def test_a_failed_append_fails_every_later_use_of_the_store(tmp_path, monkeypatch):
    # an append that failed on the writer thread (a full disk) left keys in the index at rows never written: the
    # error was raised once, by whatever call came next, and the store then read those rows as if they were fine
    from dynemb.table import slow

    table = KeyValueTable(3)
    table.add_slot("m", 3)
    store = LogStore(table, str(tmp_path), init_capacity=8192)  # room: the puts append, no rewrite
    store.put(_rows(torch.arange(10), 3), torch.arange(10))
    real = slow._pwrite_bytes

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(slow, "_pwrite_bytes", full)
    try:  # the writer thread's failure may already reach this call (its timing), else the next use
        store.put(_rows(torch.arange(10, 20), 3), torch.arange(10, 20))
    except OSError as e:
        assert "No space left" in str(e)
    monkeypatch.setattr(slow, "_pwrite_bytes", real)
    for _ in range(2):
        with pytest.raises((OSError, RuntimeError), match="No space left"):
            store.export()
    store.close()
    assert not os.path.exists(store.directory)


def test_a_failed_rewrite_leaves_the_store_on_its_file(tmp_path, monkeypatch):
    # a rewrite (growth, pack) that failed writing the new file left the store naming the new file as its own: the
    # next rewrite deleted that one and the store's real file stayed on disk until the table closed
    from dynemb.table import slow

    table = KeyValueTable(3)
    table.add_slot("m", 3)
    store = LogStore(table, str(tmp_path), init_capacity=16)
    store.put(_rows(torch.arange(10), 3), torch.arange(10))
    real = slow._pwrite_all

    def full(fd, raw, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(slow, "_pwrite_all", full)
    with pytest.raises(OSError, match="No space left"):
        store.put(_rows(torch.arange(10, 5000), 3), torch.arange(10, 5000))  # grows: a rewrite
    monkeypatch.setattr(slow, "_pwrite_all", real)
    assert store.size() == 10 and len(os.listdir(store.directory)) == 1
    store.put(_rows(torch.arange(10, 5000), 3), torch.arange(10, 5000))
    assert len(os.listdir(store.directory)) == 1
    everything, stamps = store.export()
    order = torch.argsort(everything.keys)
    assert torch.equal(everything.keys[order], torch.arange(5000)) and torch.equal(stamps[order], torch.arange(5000))
    store.close()
