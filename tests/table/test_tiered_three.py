"""Three-level tiered tables (a fast tier over host memory over row files; ``Tiers(host_capacity=...)``), the fast
tier's link to the host run with the device steps stood in for (``StagedLink(stand_in=True)``, as a CUDA table
moves rows): training with new keys, erasures and evictions, checkpoints (full and incremental, streamed), loads
and exports equal an untiered table bit for bit, and every level keeps to its budget."""

from __future__ import annotations

import os

import pytest
import torch

import dynemb
from dynemb.checkpoint import export_for_serving, load, read_export, save
from dynemb.table import KeyValueTable, TieredTable, Tiers, tier_traffic
from dynemb.table.tier_moves import DISK_BASE, SLOW_BASE, HostLink

from test_tier_moves import _staged
from test_tiered import _batch, _collection, _step, assert_same_collections, assert_same_table, \
    erase_evict_and_reinsert

STEPS = 20
HOST = 30


def _three(tmp_path, host: int = HOST):
    """The collection of ``test_tiered`` with three levels, its fast tiers moving rows through stand-in links."""
    ec = _collection(True, str(tmp_path / "rows"), host=host)
    return ec, _staged(ec)


def _levels(table) -> list[int]:
    tiers = table.stats()["tiers"]
    return [tiers[level]["rows"] for level in ("fast", "slow", "disk")]


def test_three_levels_train_checkpoint_and_export_as_untiered(tmp_path):
    tiered, links = _three(tmp_path)
    flat = _collection(False)
    for i in range(STEPS):
        if i % 3 == 0:
            tiered.prefetch(_batch(i + 1))
        a, b = _step(tiered, i), _step(flat, i)
        assert all(torch.equal(a[k], b[k]) for k in a), f"step {i}"
        if i == 8:  # new keys beyond every batch's range, erasures reaching every level
            for ec in (tiered, flat):
                ec.embeddings["user"].table.insert_or_assign(torch.arange(5000, 5040), torch.ones(40, 8))
                ec.embeddings["user"].table.erase(torch.arange(-150, -100))
        if i == 9:
            at10 = save(tmp_path / "tiered", tiered, step=10), save(tmp_path / "flat", flat, step=10)
    assert_same_collections(tiered, flat)
    for link in links:  # the fast tier's moves went through the staged link, batched
        assert link.calls["upload"] == link.calls["download"] == link.calls["fence"] > 0
    for name in ("user", "item"):
        table = tiered.embeddings[name].table
        fast, host, disk = _levels(table)
        assert disk > 0 and table.hits["disk"] > 0, "the test must move rows to and from the row files"
        assert host <= table.host_capacity and fast + host + disk == table.size()
        assert table.moved_disk["rows_up"] > 0 and table.moved_disk["rows_down"] > 0
    # incremental saves see rows changed in every level; loads into three levels and untiered equal the original
    save(tmp_path / "tiered", tiered, step=20, incremental=True)
    save(tmp_path / "flat", flat, step=20, incremental=True)
    for source in ("tiered", "flat"):
        back, _ = _three(tmp_path / f"back-{source}")
        load(tmp_path / source, back)
        assert_same_collections(back, flat)
        assert _levels(back.embeddings["user"].table)[2] > 0
        untiered = _collection(False)
        load(tmp_path / source, untiered)
        assert_same_collections(untiered, flat)
    # resumed from the step-10 checkpoint, three levels train on as untiered
    resumed, again = _three(tmp_path / "resumed")[0], _collection(False)
    load(at10[0], resumed)
    load(at10[1], again)
    for i in range(10, STEPS):
        _step(resumed, i), _step(again, i)
    assert_same_collections(resumed, again)
    ea = export_for_serving(tmp_path / "ea", tiered)
    eb = export_for_serving(tmp_path / "eb", flat)
    for (ra, rb) in zip(read_export(ea)[1].values(), read_export(eb)[1].values()):
        oa, ob = ra["keys"].argsort(), rb["keys"].argsort()
        assert torch.equal(ra["keys"][oa], rb["keys"][ob]) and torch.equal(ra["values"][oa], rb["values"][ob])


def test_three_levels_equal_untiered_through_erase_evict_and_replace(tmp_path):
    tiered = TieredTable(3, tiers=Tiers(fast_capacity=8, host_capacity=6, slow=str(tmp_path)), seed=1)
    flat = KeyValueTable(3, seed=1)
    erase_evict_and_reinsert(tiered, flat)
    assert_same_table(tiered, flat)
    assert _levels(tiered)[2] > 0
    tiered.replace(flat.export())
    flat.replace(flat.export())
    assert_same_table(tiered, flat)
    assert _levels(tiered) == [8, 6, flat.size() - 14]


def test_one_index_holds_three_ranges_and_keys_keep_their_slots(tmp_path):
    t = TieredTable(2, tiers=Tiers(fast_capacity=4, host_capacity=4, slow=str(tmp_path)), initializer="zeros")
    for start in (0, 10, 20):
        t.find_or_insert(torch.arange(start, start + 4))
    keys = torch.cat([torch.arange(s, s + 4) for s in (0, 10, 20)])
    slots = t.index.find_slots(keys)
    rows = t.index.find(keys)
    assert int((rows < SLOW_BASE).sum()) == 4 and int((rows >= DISK_BASE).sum()) == 4
    t.find_or_insert(torch.arange(0, 4))  # from the files, through the host, to the fast tier
    assert bool((t.index.find(torch.arange(4)) < SLOW_BASE).all())
    assert torch.equal(t.index.find_slots(keys), slots)  # moves between any two levels rewrite row ids only
    assert _levels(t) == [4, 4, 4] and t.size() == 12


def test_stats_and_traffic_count_the_row_files(tmp_path):
    t = TieredTable(2, tiers=Tiers(fast_capacity=2, host_capacity=2, slow=str(tmp_path)), initializer="zeros")
    for start in range(0, 12, 2):
        t.find_or_insert(torch.arange(start, start + 2))
    before = tier_traffic([t])["counts"]
    t.find(torch.tensor([0, 1]))  # in the files: up two levels
    step = tier_traffic([t], before)
    assert step["tier_disk_hit_rate"] == 1.0 and step["tier_fast_hit_rate"] == 0.0
    row = 8 + 8 + 16  # key, value, score and version: 32 bytes a row, every move counted
    assert step["tier_bytes_moved"] == 4 * 2 * row  # up to the host, up to the fast tier, and down twice
    tiers = t.stats()["tiers"]
    assert tiers["disk"]["rows"] == 8 and tiers["slow"]["capacity"] == 2 and tiers["disk"]["where"].startswith(
        str(tmp_path))
    assert tiers["disk"]["moved"]["rows_up"] == 2


def test_host_bytes_budget(tmp_path):
    t = TieredTable(4, tiers=Tiers(fast_capacity=4, host_bytes=10 * 40, slow=str(tmp_path)), initializer="zeros")
    assert t.host_capacity == 10  # key, 4 floats, score, version: 40 bytes a host row
    t.add_slot("m", 4)  # wider rows: fewer fit
    assert t.host_capacity == 7
    t.find_or_insert(torch.arange(100))
    t.find_or_insert(torch.arange(100, 104))
    assert _levels(t)[1] <= 7
    with pytest.raises(ValueError, match="host_bytes=8 is too small"):
        TieredTable(4, tiers=Tiers(fast_capacity=4, host_bytes=8, slow=str(tmp_path)))


def test_three_level_errors(tmp_path):
    with pytest.raises(ValueError, match="slow must be their directory, got 'host'"):
        Tiers(fast_capacity=4, host_capacity=4)
    with pytest.raises(ValueError, match="host_capacity.*or host_bytes.*got both"):
        Tiers(fast_capacity=4, host_capacity=4, host_bytes=400, slow=str(tmp_path))
    with pytest.raises(ValueError, match="Tiers.host_capacity"):
        Tiers(fast_capacity=4, host_capacity=0, slow=str(tmp_path))
    assert Tiers.from_dict(Tiers(fast_capacity=4, host_capacity=9, slow=str(tmp_path)).to_dict()).host_capacity == 9


def test_the_row_files_are_private_and_removed_on_close(tmp_path):
    t = TieredTable(2, tiers=Tiers(fast_capacity=2, host_capacity=2, slow=str(tmp_path)), initializer="zeros")
    t.find_or_insert(torch.arange(10))
    t.find_or_insert(torch.arange(10, 12))
    (private,) = os.listdir(tmp_path)
    assert t.disk.directory == str(tmp_path / private) and t.slow.directory is None  # the host level is memory
    t.disk.close()
    assert os.listdir(tmp_path) == []


def test_the_host_to_files_link_is_in_place(tmp_path):
    t = TieredTable(2, tiers=Tiers(fast_capacity=2, host_capacity=2, slow=str(tmp_path)))
    assert isinstance(t.disk_link, HostLink)
    emb = dynemb.DynamicEmbedding(2, tiers=Tiers(fast_capacity=2, host_capacity=2, slow=str(tmp_path)))
    assert emb.table.disk is not None
