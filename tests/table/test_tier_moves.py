"""How rows move between tiers (``dynemb.table.tier_moves``): the device link's logic, run on CPU with its
device-specific steps (pinning, the side stream, its events) stood in for, trains, checkpoints and exports as an
untiered table, bit for bit; the numba swap equals the torch reference; one index serves both tiers."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb.checkpoint import load, save
from dynemb.table import TieredTable, Tiers
from dynemb.table.tier_moves import SLOW_BASE, HostLink, StagedLink, VictimQueue

from test_tiered import _batch, _collection, _step, assert_same_collections, assert_same_table, \
    erase_evict_and_reinsert

STEPS = 20


class CountingLink(StagedLink):
    """A stand-in staged link that counts its device-specific steps."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), stand_in=True)
        self.calls = {"staging": 0, "upload": 0, "download": 0, "fence": 0, "finish": 0}

    def staging(self, *args):
        self.calls["staging"] += 1
        return super().staging(*args)

    def upload(self, host):
        self.calls["upload"] += 1
        return super().upload(host)

    def download(self, rows, out):
        self.calls["download"] += 1
        return super().download(rows, out)

    def fence(self, wait_for_device):
        self.calls["fence"] += 1
        return super().fence(wait_for_device)

    def finish(self):
        self.calls["finish"] += 1
        return super().finish()


def _staged(ec) -> list[CountingLink]:
    links = []
    for module in ec.embeddings.values():
        module.table.link = CountingLink()
        links.append(module.table.link)
    return links


@pytest.mark.parametrize("where", ["host", "disk"])
def test_the_staged_link_trains_checkpoints_and_exports_as_untiered(where, tmp_path):
    slow = "host" if where == "host" else str(tmp_path / "slow")
    tiered, flat = _collection(True, slow), _collection(False)
    links = _staged(tiered)
    for i in range(STEPS // 2):
        if i % 3 == 0:
            tiered.prefetch(_batch(i + 1))  # batch i+1's moves, ahead of it
        _step(tiered, i), _step(flat, i)
    assert_same_collections(tiered, flat)
    for link in links:  # one fence and one staged copy each way per column a call, never a row at a time
        assert link.calls["upload"] == link.calls["download"] == link.calls["fence"] > 0
        assert link.calls["finish"] > 0
    save(tmp_path / "tiered", tiered, step=10)
    save(tmp_path / "flat", flat, step=10)
    back = _collection(True, slow)
    _staged(back)
    load(tmp_path / "tiered", back)
    assert_same_collections(back, flat)
    for i in range(STEPS // 2, STEPS):
        _step(back, i), _step(flat, i)
    assert_same_collections(back, flat)
    for name in ("user", "item"):
        assert back.embeddings[name].table.slow.size() > 0


def test_staging_buffers_are_reused_and_grow():
    link = StagedLink(torch.device("cpu"))
    assert link.stand_in  # no CUDA here: the device steps are stood in for
    a = link.staging("up", (4, 3), torch.float32)
    b = link.staging("up", (2, 3), torch.float32)
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 3)
    c = link.staging("up", (9, 3), torch.float32)
    assert c.shape == (9, 3) and link.staging("up", (16, 3), torch.float32).shape == (16, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_host_link_moves_equal_the_reference(backend, dtype):
    g = torch.Generator().manual_seed(0)
    fast, slow = torch.randn(50, 6, generator=g).to(dtype), torch.randn(80, 6, generator=g).to(dtype)
    pair = torch.randint(0, 100, (50, 2), generator=g)  # a strided column, as the fast tier's stamps
    stamps, slow_stamps = pair[:, 0], torch.randint(0, 100, (80,), generator=g)
    victims, up_from = torch.tensor([3, 7, 11, 40]), torch.tensor([5, 60, 2])
    fast_dest = victims[:3]  # three pairs swap; the fourth victim goes down to a row of its own
    slow_dest = torch.tensor([5, 60, 2, 79])
    for a, b in ((fast, slow), (stamps, slow_stamps)):
        want_a, want_b = a.clone(), b.clone()
        want_a[fast_dest] = b[up_from]
        want_b[slow_dest] = a[victims]
        HostLink(backend).move(a, fast_dest, victims, b, slow_dest, up_from)
        assert torch.equal(a, want_a) and torch.equal(b, want_b)


def test_one_index_serves_both_tiers_and_keys_keep_their_slots():
    t = TieredTable(2, tiers=Tiers(fast_capacity=4), initializer="zeros")
    t.find_or_insert(torch.arange(4))
    t.find_or_insert(torch.arange(10, 14))  # 0..3 move down
    keys = torch.cat([torch.arange(4), torch.arange(10, 14)])
    slots = t.index.find_slots(keys)
    assert bool((t.index.find(torch.arange(4)) >= SLOW_BASE).all())
    assert torch.equal(t.slow.find(torch.arange(4)).sort().values, torch.arange(4))
    t.find_or_insert(torch.arange(2))  # come back up, into the rows two others leave
    assert torch.equal(t.index.find_slots(keys), slots)  # an exchange rewrites row ids only
    assert bool((t.index.find(torch.arange(2)) < SLOW_BASE).all()) and t.size() == 8


def test_victims_are_valid_rows_outside_the_call():
    t = TieredTable(1, tiers=Tiers(fast_capacity=64), initializer="zeros")
    t.find_or_insert(torch.arange(64))
    queue = VictimQueue(16)
    pinned = torch.arange(0, 64, 2)
    taken = queue.take(t, 10, pinned)
    assert taken.numel() == 10 and torch.unique(taken).numel() == 10
    assert not bool(torch.isin(taken, pinned).any()) and bool((taken < t.size()).all())
    again = queue.take(t, 40, pinned)  # more than the queue holds: a new scan; only unpinned rows exist
    assert again.numel() == 32 and not bool(torch.isin(again, pinned).any())


def test_a_tiered_table_equals_untiered_through_erase_evict_and_replace():
    tiered = TieredTable(3, tiers=Tiers(fast_capacity=8), seed=1)
    flat = dynemb.table.KeyValueTable(3, seed=1)
    erase_evict_and_reinsert(tiered, flat)
    assert_same_table(tiered, flat)
    tiered.replace(flat.export())
    flat.replace(flat.export())
    assert_same_table(tiered, flat)
