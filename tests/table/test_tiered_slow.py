"""SlowStore on its own: rows keep every column through growth (new row files), slots added to rows already
stored, a cast, exchanges and erases; one file per column remains."""

from __future__ import annotations

import os
import resource
import time

import pytest
import torch

from dynemb.table import KeyValueTable, Rows
from dynemb.table import slow
from dynemb.table.slow import SlowStore, _PageToucher


def _rows(keys: torch.Tensor, dim: int) -> Rows:
    values = keys.float().unsqueeze(1).expand(-1, dim) + torch.arange(dim)
    return Rows(keys, values, keys * 3, {"m": values * 2})


@pytest.mark.parametrize("where", ["host", "disk"])
def test_rows_survive_growth_slots_casts_and_exchanges(where, tmp_path):
    table = KeyValueTable(3)
    table.add_slot("m", 3)
    store = SlowStore(table, "host" if where == "host" else str(tmp_path), init_capacity=16)
    keys = torch.randperm(5000)[:3000] - 2500
    for part in keys.split(700):  # grows 16 -> past 3000 rows: several new files per column
        store.put(_rows(part, 3), part + 1)
    store.add_slot("v", 2, init=0.5)
    store.cast(torch.float16)
    store.cast(torch.float16)  # a no-op
    new = _rows(torch.arange(10_000, 10_050), 3)  # rows as the (cast) fast tier would send them down
    new = Rows(new.keys, new.values.half(), new.scores, {"m": new.slots["m"], "v": torch.zeros(50, 2)})
    taken, versions = store.exchange(keys[:100], new, torch.zeros(50, dtype=torch.int64))
    assert torch.equal(taken.keys, keys[:100]) and torch.equal(versions, keys[:100] + 1)
    assert torch.equal(taken.values, _rows(keys[:100], 3).values.half())
    assert torch.equal(taken.slots["m"], _rows(keys[:100], 3).slots["m"]) and bool((taken.slots["v"] == 0.5).all())
    assert torch.equal(store.erase(torch.cat([keys[100:110], torch.tensor([99_999])])).sort().values,
                       keys[100:110].sort().values)
    everything, _ = store.export()
    expected = torch.cat([keys[110:], torch.arange(10_000, 10_050)])
    assert store.size() == expected.numel() and torch.equal(everything.keys.sort().values, expected.sort().values)
    order = torch.argsort(everything.keys)
    want = _rows(everything.keys[order], 3)
    assert torch.equal(everything.scores[order], want.scores)
    assert torch.equal(everything.values[order], want.values.half())
    if where == "disk":
        (directory,) = os.listdir(tmp_path)
        (name,) = os.listdir(tmp_path / directory)  # one file: a row of every column side by side
        assert name.endswith(".rows")
    store.close()


def _written_back(store: SlowStore) -> None:
    """The kernel writes the row file's dirty pages back and marks them read-only, as its flusher does."""
    fd = os.open(store._path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _faults_storing(store: SlowStore) -> int:
    """Minor faults of this thread while one byte of every live row's page is stored to (same value)."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    first = store._mapped[: store._size, 0]
    first.copy_(first.clone())
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.skipif(not _PageToucher.enabled, reason="no madvise/mincore here (Linux only)")
def test_page_toucher_makes_written_back_pages_writable(tmp_path):
    """After a write-back, storing to a row file's page faults once a page; a pass of the page toucher first makes
    them writable without changing a byte (no fault after it), and reads back the rows as they were."""
    table = KeyValueTable(64)
    store = SlowStore(table, str(tmp_path))
    keys = torch.arange(20_000)
    store.put(Rows(keys, torch.randn(20_000, 64), keys, {}), keys)
    before = store.export()[0].values.clone()
    pages = store._size * store._mapped.shape[1] // 4096
    _written_back(store)
    if _faults_storing(store) < pages // 2:
        pytest.skip("this filesystem does not write-protect written-back pages (tmpfs, say)")
    _written_back(store)
    assert _PageToucher.touch(store)
    if _faults_storing(store) > pages // 20:  # EINVAL: before Linux 5.14
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert torch.equal(store.export()[0].values, before)
    empty = SlowStore(table, str(tmp_path))  # no live rows: nothing to do
    assert _PageToucher.touch(empty)


@pytest.mark.skipif(not _PageToucher.enabled, reason="no madvise/mincore here (Linux only)")
def test_page_toucher_thread_answers_a_wave_of_faults(tmp_path):
    """The thread notices faults past TOUCH_FAULTS in a period and makes the row files writable: a second store
    to every page after a write-back, a moment later, faults far less than the first."""
    table = KeyValueTable(64)
    store = SlowStore(table, str(tmp_path))
    keys = torch.arange(40_000)
    store.put(Rows(keys, torch.randn(40_000, 64), keys, {}), keys)
    assert _PageToucher._thread is not None and _PageToucher._thread.is_alive()
    pages = store._size * store._mapped.shape[1] // 4096
    _written_back(store)
    half = store._size // 2
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    store._mapped[:half, 0].copy_(store._mapped[:half, 0].clone())  # faults: the thread sees them
    first = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
    if first < pages // 4:
        pytest.skip("this filesystem does not write-protect written-back pages (tmpfs, say)")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(slow.TOUCH_PERIOD * 4)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        rest = store._mapped[half: store._size, 0]
        rest.copy_(rest.clone())
        if resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before < pages // 20:
            return
        _written_back(store)
    pytest.fail("the page toucher left the written-back pages read-only for 10 s")
