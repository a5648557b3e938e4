"""HashIndex: key -> row mapping, spills, removal without tombstones, rehash; every int value is a key."""

from __future__ import annotations

import pytest
import torch

from dynemb.table import HashIndex

pytestmark = pytest.mark.usefixtures("probe_path")


def _index(key_dtype, device, capacity=16) -> HashIndex:
    return HashIndex(key_dtype, device, capacity=capacity)


def _rows(n, device) -> torch.Tensor:
    return torch.arange(n, device=device)


def test_empty_index_finds_nothing(key_dtype, device, extreme_keys):
    idx = _index(key_dtype, device)
    assert idx.find(extreme_keys.to(device)).tolist() == [-1] * extreme_keys.numel()
    assert idx.find(torch.empty(0, dtype=key_dtype, device=device)).numel() == 0


def test_extreme_keys_map_to_their_rows(key_dtype, device, extreme_keys):
    idx = _index(key_dtype, device)
    keys = extreme_keys.to(device)
    idx.insert(keys, _rows(keys.numel(), device))
    assert idx.find(keys).tolist() == list(range(keys.numel()))
    assert idx.find(keys.flip(0)).tolist() == list(reversed(range(keys.numel())))


def test_fill_key_is_absent_until_inserted(key_dtype, device):
    # Free slots hold the fill value; finding that value must not hit a free slot.
    idx = _index(key_dtype, device)
    fill = torch.tensor([0x5851F42D], dtype=key_dtype, device=device)
    idx.insert(torch.tensor([1, 2], dtype=key_dtype, device=device), _rows(2, device))
    assert idx.find(fill).tolist() == [-1]
    assert idx.find_slots(fill).tolist() == [-1]
    idx.insert(fill, torch.tensor([7], device=device))
    assert idx.find(fill).tolist() == [7]
    idx.remove(idx.find_slots(fill))
    assert idx.find(fill).tolist() == [-1]


def test_duplicate_queries(key_dtype, device):
    idx = _index(key_dtype, device)
    idx.insert(torch.tensor([5, -5], dtype=key_dtype, device=device), _rows(2, device))
    query = torch.tensor([5, 5, 6, -5, 5, 6], dtype=key_dtype, device=device)
    assert idx.find(query).tolist() == [0, 0, -1, 1, 0, -1]


@pytest.mark.parametrize("where", ["first", "last"])
def test_colliding_keys_spill_and_stay_findable(key_dtype, device, colliding_keys, where):
    keys = colliding_keys(key_dtype, where, 24).to(device)
    idx = _index(key_dtype, device, capacity=64)
    idx.insert(keys, _rows(24, device))
    assert idx.find(keys).tolist() == list(range(24))
    slots = idx.find_slots(keys)
    assert torch.unique(slots >> 3).numel() > 1  # they really spilled past one bucket
    assert torch.unique(slots).numel() == 24
    assert torch.equal(idx.rows_at(slots), _rows(24, device))


def test_a_long_chain_is_walked_several_buckets_a_round(key_dtype, device, colliding_keys):
    """60 keys of one home bucket fill a chain of 8 or 12 buckets; the torch path finds each of them, and misses the
    absent ones, in 2 or 3 rounds (home, then up to 8 buckets a round: each round is a host sync on CUDA)."""
    keys = colliding_keys(key_dtype, "last", 64).to(device)
    stored, absent = keys[:60], keys[60:]
    idx = HashIndex(key_dtype, device, capacity=256 * HashIndex.width_for(key_dtype) // 2, backend="torch")
    idx.insert(stored, _rows(60, device))
    rounds = []
    match = idx._match
    idx._match = lambda *a: rounds.append(1) or match(*a)
    query = torch.cat([stored.flip(0), absent])
    assert idx.find(query).tolist() == list(range(59, -1, -1)) + [-1] * 4
    walked = len(rounds)
    chain = torch.unique(idx.find_slots(stored) >> 3)  # the last bucket and the first ones: it wraps around
    assert chain.numel() == -(-60 // idx.width) and int(idx.overflow[chain].sum()) == chain.numel() - 1
    assert walked == 1 + -(-(chain.numel() - 1) // 8)
    idx.remove(idx.find_slots(stored[20:40]))
    assert idx.find(query).tolist() == list(range(59, 39, -1)) + [-1] * 20 + list(range(19, -1, -1)) + [-1] * 4


def test_remove_in_a_spilled_chain_keeps_the_rest(key_dtype, device, colliding_keys):
    keys = colliding_keys(key_dtype, "last", 24).to(device)
    idx = _index(key_dtype, device, capacity=64)
    idx.insert(keys, _rows(24, device))
    gone = keys[::3]
    idx.remove(idx.find_slots(gone))
    assert idx.find(gone).tolist() == [-1] * gone.numel()
    kept = torch.ones(24, dtype=torch.bool)
    kept[::3] = False
    assert idx.find(keys[kept.to(device)]).tolist() == torch.arange(24)[kept].tolist()
    # Freed slots are reused; spilled keys stay reachable behind them.
    idx.insert(gone, _rows(gone.numel(), device) + 100)
    assert idx.find(gone).tolist() == list(range(100, 100 + gone.numel()))
    assert idx.find(keys[kept.to(device)]).tolist() == torch.arange(24)[kept].tolist()


def test_batch_insert_matches_dict(key_dtype, device):
    gen = torch.Generator().manual_seed(1)
    info = torch.iinfo(key_dtype)
    keys = torch.unique(torch.randint(info.min, info.max, (3000,), generator=gen, dtype=torch.int64).to(key_dtype))
    keys = keys[torch.randperm(keys.numel(), generator=gen)].to(device)
    idx = _index(key_dtype, device, capacity=keys.numel())
    idx.insert(keys[:1000], _rows(1000, device))
    idx.insert(keys[1000:], _rows(keys.numel() - 1000, device) + 1000)
    assert torch.equal(idx.find(keys), _rows(keys.numel(), device))
    absent = torch.tensor([k for k in range(-50, 50) if k not in set(keys.tolist())], dtype=key_dtype)
    assert idx.find(absent.to(device)).eq(-1).all()


def test_set_rows_repoints_slots(key_dtype, device):
    idx = _index(key_dtype, device)
    keys = torch.tensor([3, 4], dtype=key_dtype, device=device)
    idx.insert(keys, _rows(2, device))
    idx.set_rows(idx.find_slots(keys[1:]), torch.tensor([9], device=device))
    assert idx.find(keys).tolist() == [0, 9]


def test_needs_rehash_and_rehash(key_dtype, device, colliding_keys):
    idx = _index(key_dtype, device, capacity=8)
    assert idx.slots == idx.num_buckets * HashIndex.width_for(key_dtype)
    assert not idx.needs_rehash(idx.slots // 2)
    assert idx.needs_rehash(idx.slots // 2 + 1)
    keys = colliding_keys(key_dtype, "first", 24).to(device)
    small = keys[:8]
    idx.insert(small, _rows(8, device))
    idx.rehash(keys, _rows(24, device) + 5, capacity=100)
    assert idx.num_buckets == HashIndex.buckets_for(100, key_dtype)
    assert idx.find(keys).tolist() == list(range(5, 29))
    assert not idx.needs_rehash(100)


def test_a_bucket_is_one_cache_line(key_dtype, device):
    """A probe that finds its key at home reads one 64-byte line: the bucket's keys and row ids together, aligned."""
    idx = _index(key_dtype, device, capacity=1000)
    assert idx._buckets.shape[1] * idx._buckets.element_size() == 64
    assert idx._buckets.data_ptr() % 64 == 0
    bits = torch.iinfo(key_dtype).bits
    assert idx.width == {32: 8, 64: 5}[bits] and idx.width * (bits // 8 + 4) <= 64
    keys = torch.arange(300, dtype=key_dtype, device=device)
    idx.insert(keys, _rows(300, device))
    spare = idx._buckets[:, idx._key_cols + idx.width :]
    assert spare.numel() == 0 or not spare.any()  # the unused word stays 0, so layouts compare equal
    assert int((idx.find_slots(keys) & 7).max()) < idx.width


@pytest.mark.parametrize("capacity", [0, 1, 8, 9, 16, 17, 1000, 2**20 + 1])
def test_buckets_for_is_the_smallest_power_of_two_under_max_load(capacity, key_dtype):
    buckets = HashIndex.buckets_for(capacity, key_dtype)
    per_bucket = HashIndex.width_for(key_dtype) * HashIndex.MAX_LOAD
    assert buckets >= 2 and buckets & (buckets - 1) == 0
    assert buckets * per_bucket >= capacity
    assert buckets == 2 or (buckets // 2) * per_bucket < capacity


def test_clear_and_nbytes(key_dtype, device, extreme_keys):
    idx = _index(key_dtype, device)
    keys = extreme_keys.to(device)
    idx.insert(keys, _rows(keys.numel(), device))
    nbytes = idx.nbytes()
    assert nbytes >= idx.slots * (torch.iinfo(key_dtype).bits // 8 + 4)
    idx.clear()
    assert idx.find(keys).eq(-1).all()
    assert idx.nbytes() == nbytes
    idx.insert(keys[:2], _rows(2, device))
    assert idx.find(keys).tolist() == [0, 1] + [-1] * (keys.numel() - 2)


def test_index_lives_on_its_device(key_dtype, device):
    idx = _index(key_dtype, device)
    assert idx.bucket_keys.device.type == device.type
    assert idx.bucket_keys.dtype == key_dtype
    assert idx.find(torch.tensor([1], dtype=key_dtype, device=device)).device.type == device.type


def test_a_table_that_kept_part_of_an_oversized_batch_does_not_rehash_at_every_call(key_dtype, device):
    """Of more new keys than it has room for, a table keeps some spread over the hash range: the lowest hashes
    would crowd half the buckets, whose overflow flags then asked for a rebuild (at the same size) at every
    call, and lookups of absent keys walked the flagged run."""
    from dynemb.table import KeyValueTable

    t = KeyValueTable(4, key_dtype=key_dtype, device=device, max_capacity=16_384, init_capacity=16_384)
    t.find_or_insert(torch.arange(100_000, device=device).to(key_dtype))
    assert len(t) == 16_384
    assert int(t.index.overflow.count_nonzero()) < 0.1 * t.index.num_buckets
    calls = []
    rehash = t.index.rehash
    t.index.rehash = lambda *a: (calls.append(1), rehash(*a))
    for step in range(6):
        t.find_or_insert(torch.arange(200_000 + 300 * step, 200_300 + 300 * step, device=device).to(key_dtype))
    assert not calls and len(t) == 16_384
