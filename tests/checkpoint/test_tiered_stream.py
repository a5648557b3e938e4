"""A tiered table far bigger than its fast tier (200k rows of dim 64, a 5% fast tier) saves, loads and exports
a chunk at a time, equal to the same table untiered; and the memory a save or a load needs stays bounded by the
chunk, not the table."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dynemb
from dynemb.checkpoint import export_for_serving, load, read_export, save
from dynemb.checkpoint import tiered_stream
from dynemb.checkpoint.tensorfile import read_tensors
from dynemb.table import KeyValueTable, TieredTable, Tiers
from dynemb.table.slow import SlowStore

from ckpt_util import COUNTERS

ROWS, DIM, FAST = 200_000, 64, 10_000
BATCH = 5_000


def model(tiered: bool, rows: int = ROWS, slow="host", host: int | None = None) -> dynemb.DynamicEmbedding:
    """``host``: three levels, that many rows in host memory over row files under ``slow``."""
    three = {} if host is None else {"host_capacity": host}
    emb = dynemb.DynamicEmbedding(DIM, seed=3, tiers=Tiers(fast_capacity=max(1, rows // 20), slow=slow, **three)
                                  if tiered else None)
    emb.table.add_slot("m", 8)
    return emb


def fill(emb: dynemb.DynamicEmbedding, rows: int = ROWS) -> None:
    """The same rows in any table: ``rows`` spread keys (-1, 0 and the int64 extremes among them), values,
    slot rows, and a second touch of some rows (scores differ)."""
    g = torch.Generator().manual_seed(7)
    keys = torch.randperm(4 * rows, generator=g)[:rows] * 7919 - 3 * rows
    keys[:4] = torch.tensor([-1, 0, torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max])
    t = emb.table
    for i in range(0, rows, BATCH):
        k = keys[i : i + BATCH]
        t.insert_or_assign(k, torch.randn(k.numel(), DIM, generator=g))
        t.slot("m")[t.find_rows(k)] = torch.randn(k.numel(), 8, generator=g)
    t.find(keys[::97], update_scores=True)


def state(t) -> dict:
    """Every row (sorted by key) and the counters of a table, tiered or not."""
    r = t.export()
    order = r.keys.argsort()
    return {"keys": r.keys[order], "values": r.values[order], "scores": r.scores[order],
            **{f"slot.{n}": s[order] for n, s in r.slots.items()}, **{c: getattr(t, c) for c in COUNTERS}}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        if isinstance(a[name], torch.Tensor):
            assert torch.equal(a[name], b[name]), name
        else:
            assert a[name] == b[name], name


def file_rows(directory) -> dict:
    (path,) = glob.glob(f"{directory}/tables/*.safetensors")
    cols, _ = read_tensors(path)
    order = cols["keys"].argsort()
    return {name: col[order] if col.shape[:1] == cols["keys"].shape else col.sort().values
            for name, col in cols.items()}


@pytest.fixture(scope="module")
def twins():
    tiered, flat = model(True), model(False)
    fill(tiered)
    fill(flat)
    assert tiered.table.stats()["tiers"]["slow"]["rows"] >= 0.9 * ROWS  # many times the fast tier
    return tiered, flat


@pytest.mark.slow
def test_save_load_export_equal_untiered(twins, tmp_path, monkeypatch):
    tiered, flat = twins
    monkeypatch.setattr(tiered_stream, "CHUNK_ROWS", 16_384)
    a, b = save(tmp_path / "a", tiered, step=1), save(tmp_path / "b", flat, step=1)
    assert_same(file_rows(a), file_rows(b))  # the tiers never show in the file
    for source in ("a", "b"):
        for into in (True, False):
            fresh = model(into)
            load(tmp_path / source, fresh)
            assert_same(state(fresh.table), state(flat.table))
            if into:
                assert fresh.table.stats()["tiers"]["fast"]["rows"] <= ROWS // 20
    ea, eb = export_for_serving(tmp_path / "ea", tiered), export_for_serving(tmp_path / "eb", flat)
    (ra,), (rb,) = read_export(ea)[1].values(), read_export(eb)[1].values()
    oa, ob = ra["keys"].argsort(), rb["keys"].argsort()
    assert torch.equal(ra["keys"][oa], rb["keys"][ob]) and torch.equal(ra["values"][oa], rb["values"][ob])


def test_incremental_save_and_load_equal_untiered(twins, tmp_path, monkeypatch):
    tiered, flat = twins
    monkeypatch.setattr(tiered_stream, "CHUNK_ROWS", 16_384)
    save(tmp_path / "a", tiered, step=1)
    save(tmp_path / "b", flat, step=1)
    g = torch.Generator().manual_seed(11)
    old = flat.table.export().keys
    changed = old[torch.randperm(old.numel(), generator=g)[:3000]]
    new = torch.arange(5 * ROWS, 5 * ROWS + 2000)
    for emb in twins:  # change slow-tier rows, add rows, erase rows (some only in the slow tier)
        emb.table.insert_or_assign(changed, torch.full((3000, DIM), 2.5))
        emb.table.insert_or_assign(new, torch.ones(2000, DIM))
        emb.table.erase(old[1000:1500])
    a = save(tmp_path / "a", tiered, step=2, incremental=True)
    b = save(tmp_path / "b", flat, step=2, incremental=True)
    da, db = file_rows(a), file_rows(b)
    da.pop("order"), db.pop("order")  # the key order is each table's own row order
    assert_same(da, db)
    kept = int((~torch.isin(changed, old[1000:1500])).sum())
    assert da["keys"].numel() == kept + 2000 and da["deleted_keys"].numel() == 500
    for into in (True, False):
        fresh = model(into)
        load(tmp_path / "a", fresh)
        assert_same(state(fresh.table), state(flat.table))


def chunk_bound(rows: int, monkeypatch, tmp_path, three: bool = False) -> int:
    """The largest chunk a save and a load of a ``rows``-row tiered table materialize, with no whole-table
    export, no whole-file read and no load of more than a chunk at once through the fast tier. ``three``: three
    levels, a tenth of the rows in host memory, the rest past the fast tier in row files."""
    levels = {"slow": str(tmp_path.with_name(tmp_path.name + "-rows")), "host": rows // 10} if three else {}
    emb = model(True, rows, **levels)
    fill(emb, rows)

    def whole(*args):
        raise AssertionError("a whole-table export during a streamed save or load")

    monkeypatch.setattr(TieredTable, "export", whole)
    monkeypatch.setattr(SlowStore, "export", whole)
    monkeypatch.setattr("dynemb.checkpoint.loader.read_tensors", whole)
    replace = KeyValueTable.replace

    def bounded(self, rows_):
        assert rows_.keys.numel() <= tiered_stream.CHUNK_ROWS
        replace(self, rows_)

    monkeypatch.setattr(KeyValueTable, "replace", bounded)
    tiered_stream.largest_chunk(reset=True)
    save(tmp_path, emb, step=1)
    emb.table.insert_or_assign(torch.arange(3), torch.zeros(3, DIM))
    save(tmp_path, emb, step=2, incremental=True)
    clock = emb.table.clock
    export_for_serving(tmp_path / "serving", emb, dtype=torch.float16)
    fresh = model(True, rows, **levels)
    load(tmp_path, fresh)  # the full checkpoint and the delta after it
    assert fresh.table.size() == emb.table.size() and fresh.table.clock == clock
    if three:
        tiers = fresh.table.stats()["tiers"]
        assert tiers["slow"]["rows"] == rows // 10 and tiers["disk"]["rows"] > rows // 2
    return tiered_stream.largest_chunk()


@pytest.mark.parametrize("three", [False, True], ids=["two-levels", "three-levels"])
def test_chunks_do_not_grow_with_the_table(three, monkeypatch, tmp_path):
    monkeypatch.setattr(tiered_stream, "CHUNK_ROWS", 1000)
    small = chunk_bound(20_000, monkeypatch, tmp_path / "small", three)
    big = chunk_bound(80_000, monkeypatch, tmp_path / "big", three)
    assert 0 < small == big <= 1000 * DIM * 4


def test_three_levels_save_load_and_export_equal_untiered(tmp_path, monkeypatch):
    """A three-level table (5% fast, 10% host, the rest in row files) streams its full and incremental
    checkpoints and its serving export, each equal to the untiered table's."""
    monkeypatch.setattr(tiered_stream, "CHUNK_ROWS", 4096)
    rows = 30_000
    three, flat = model(True, rows, str(tmp_path / "rows"), host=rows // 10), model(False, rows)
    fill(three, rows), fill(flat, rows)
    assert three.table.stats()["tiers"]["disk"]["rows"] > rows // 2
    a, b = save(tmp_path / "a", three, step=1), save(tmp_path / "b", flat, step=1)
    assert_same(file_rows(a), file_rows(b))
    keys = flat.table.export().keys
    for emb in (three, flat):  # rows in every level change; new rows; erasures
        emb.table.insert_or_assign(keys[::7], torch.full((keys[::7].numel(), DIM), 2.5))
        emb.table.insert_or_assign(torch.arange(10 * rows, 10 * rows + 500), torch.ones(500, DIM))
        emb.table.erase(keys[1::11])
    save(tmp_path / "a", three, step=2, incremental=True), save(tmp_path / "b", flat, step=2, incremental=True)
    for source in ("a", "b"):
        fresh = model(True, rows, str(tmp_path / f"rows-{source}"), host=rows // 10)
        load(tmp_path / source, fresh)
        assert_same(state(fresh.table), state(flat.table))
    ea, eb = export_for_serving(tmp_path / "ea", three), export_for_serving(tmp_path / "eb", flat)
    (ra,), (rb,) = read_export(ea)[1].values(), read_export(eb)[1].values()
    oa, ob = ra["keys"].argsort(), rb["keys"].argsort()
    assert torch.equal(ra["keys"][oa], rb["keys"][ob]) and torch.equal(ra["values"][oa], rb["values"][ob])


@pytest.mark.slow
def test_peak_memory_of_save_and_load_is_bounded(tmp_path):
    """Measured in a fresh process (RssAnon sampled every millisecond, slow tier on disk): a save and a load of
    a 200k-row table (105 MiB of rows) need a few MiB beyond the table, where one whole-table export needs more
    than the rows' bytes (the control, showing the probe sees such allocations)."""
    probe = Path(__file__).with_name("tiered_rss_probe.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(dynemb.__file__).parents[1])}
    out = subprocess.run([sys.executable, str(probe), str(ROWS), str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    table = got["rows"] * got["row_bytes"]
    assert got["export"] > table, got
    # a bounded chunk (a few MiB) plus allocator and numba noise, which reached 9-11 MiB on a loaded guest: an
    # eighth of the rows keeps the bound far from any whole-table copy without failing on that noise
    bound = table // 8
    assert got["save"] < bound, got
    assert got["load"] < bound + got["slow_index"], got  # the slow tier's index stays in RAM by design


def test_corrupt_file_fails_before_the_tiered_table_changes(tmp_path):
    emb = model(True, 3000)
    fill(emb, 3000)
    directory = save(tmp_path, emb, step=1)
    (path,) = glob.glob(f"{directory}/tables/*.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 1  # a byte of the last column's rows
    open(path, "wb").write(bytes(data))
    other = model(True, 3000)
    other.table.insert_or_assign(torch.arange(500), torch.ones(500, DIM))
    before = state(other.table)
    with pytest.raises(dynemb.checkpoint.CheckpointError, match="checksum mismatch"):
        load(tmp_path, other)
    assert_same(state(other.table), before)
