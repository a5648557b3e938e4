"""The Triton hash-index kernels against HashIndex's torch path: probe, place, erase, find_or_insert (atomic CAS,
duplicates in a batch) and find_gather, over extreme keys, keys sharing a bucket and repeated keys.

Without a GPU they run under Triton's interpreter on CPU tensors (the repository's conftest.py sets it up)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from dynemb.kernels import triton_index as ti  # noqa: E402  (after the skip: triton is optional)
from dynemb.table import HashIndex  # noqa: E402
from dynemb.table.initializers import Constant, Uniform  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _pool(pools, key64: bool) -> tuple[torch.dtype, torch.Tensor]:
    dtype = torch.int64 if key64 else torch.int32
    return dtype, pools[dtype].to(DEVICE)


def _picks(pool_size: int, most: int):
    return st.lists(st.integers(0, pool_size - 1), max_size=most)


def _pair(dtype, capacity=64):
    return (HashIndex(dtype, DEVICE, capacity=capacity, backend="torch"),
            HashIndex(dtype, DEVICE, capacity=capacity, backend="triton"))


def _insert(indexes, keys: torch.Tensor, base: int = 0) -> None:
    """Insert unique ``keys`` with rows ``base, base + 1, ...`` into every index of ``indexes``."""
    for idx in indexes:
        idx.insert(keys, torch.arange(base, base + keys.numel(), device=DEVICE))


def _occupancy(idx: HashIndex) -> torch.Tensor:
    return (idx.bucket_rows >= 0).sum(1)


def _same_semantics(ref: HashIndex, kern: HashIndex, query: torch.Tensor) -> None:
    assert torch.equal(ref.find(query), kern.find(query))
    assert torch.equal(ref.overflow, kern.overflow)
    assert torch.equal(_occupancy(ref), _occupancy(kern))


@SETTINGS
@given(data=st.data(), key64=st.booleans())
@pytest.mark.slow
def test_place_and_probe_equal_the_torch_path(pools, data, key64):
    dtype, pool = _pool(pools, key64)
    first = torch.unique(pool[data.draw(_picks(pool.numel(), 60), "first")])
    second = pool[data.draw(_picks(pool.numel(), 60), "second")]
    second = torch.unique(second[~torch.isin(second, first)])
    ref, kern = _pair(dtype)
    _insert((ref, kern), first)
    _insert((ref, kern), second, 100)  # the second insert fills around the first
    query = pool[data.draw(_picks(pool.numel(), 80), "query")]
    _same_semantics(ref, kern, query)
    # The interpreter runs programs one after another and a batch this small is one program: same layout.
    if DEVICE.type == "cpu":
        assert torch.equal(ref._buckets, kern._buckets)
    slots, rows = ti.probe(ref._buckets.view(dtype), ref._key_cols, ref.overflow, query, ref._shift)
    want_slots, want_rows = ref.lookup(query)
    assert torch.equal(slots, want_slots) and torch.equal(rows.long(), want_rows)


@SETTINGS
@given(data=st.data(), key64=st.booleans())
@pytest.mark.slow
def test_erase_then_reinsert(pools, data, key64):
    dtype, pool = _pool(pools, key64)
    keys = torch.unique(pool[data.draw(_picks(pool.numel(), 70))])
    gone = keys[data.draw(st.lists(st.integers(0, max(keys.numel() - 1, 0)), max_size=30))] if keys.numel() else keys
    ref, kern = _pair(dtype)
    _insert((ref, kern), keys)
    freed = ti.erase(kern._buckets.view(dtype), kern._key_cols, kern.overflow, gone, kern._shift)
    assert torch.equal(freed, ref.find_slots(gone))
    ref.remove(torch.unique(ref.find_slots(gone)))
    if DEVICE.type == "cpu":  # same layout under the interpreter (see above)
        assert torch.equal(ref._buckets, kern._buckets)
    _same_semantics(ref, kern, pool)
    _insert((ref, kern), torch.unique(gone), 500)
    _same_semantics(ref, kern, pool)


@SETTINGS
@given(data=st.data(), key64=st.booleans())
@pytest.mark.slow
def test_find_or_insert_resolves_duplicates_to_one_row(pools, data, key64):
    dtype, pool = _pool(pools, key64)
    present = torch.unique(pool[data.draw(_picks(pool.numel(), 40), "present")])
    batch = pool[data.draw(_picks(pool.numel(), 90), "batch")]
    batch = torch.cat([batch, batch[: data.draw(st.integers(0, batch.numel()), "repeats")]])  # duplicates
    ref, kern = _pair(dtype)
    _insert((ref, kern), present)
    counter = torch.tensor([1000], dtype=torch.int32, device=DEVICE)
    slots, rows, new = ti.find_or_insert(kern._buckets.view(dtype), kern._key_cols, kern.overflow, batch,
                                         kern._shift, counter)
    absent = torch.unique(batch[~torch.isin(batch, present)])
    assert int(counter) == 1000 + absent.numel() and int(new.sum()) == absent.numel()
    assert torch.equal(torch.sort(batch[new]).values, absent)  # one creating position per new key
    assert torch.equal(torch.sort(rows[new]).values.long(), torch.arange(1000, 1000 + absent.numel(), device=DEVICE))
    # every copy of a key has its one row and slot, and the index agrees
    assert torch.equal(kern.find(batch), rows.long())
    assert torch.equal(kern.find_slots(batch), slots)
    assert torch.equal(kern.find(present), torch.arange(present.numel(), device=DEVICE))
    ref.insert(absent, kern.find(absent))
    _same_semantics(ref, kern, pool)


@pytest.mark.slow
def test_place_across_programs_keeps_semantics(colliding_keys):
    """More keys than one program holds, many sharing buckets: programs contend for slots through CAS."""
    keys = torch.unique(torch.cat([colliding_keys(torch.int64, "last", 24), colliding_keys(torch.int64, "first", 24),
                                   torch.randint(-2**63, 2**63 - 1, (700,), generator=torch.Generator().manual_seed(3),
                                                 dtype=torch.int64)])).to(DEVICE)
    ref, kern = _pair(torch.int64, capacity=keys.numel())
    _insert((ref, kern), keys)
    _same_semantics(ref, kern, torch.cat([keys, keys + 1]))


def test_full_index_is_reported():
    idx = HashIndex(torch.int64, DEVICE, capacity=10, backend="triton")  # 4 buckets of 5 slots
    assert idx.slots == 20
    keys = torch.arange(21, device=DEVICE)
    with pytest.raises(RuntimeError, match="HashIndex is full"):
        idx.insert(keys, keys)
    idx.clear()
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    _, rows, new = ti.find_or_insert(idx._buckets.view(torch.int64), idx._key_cols, idx.overflow, keys, idx._shift,
                                     counter)
    assert int(new.sum()) == 20 and int((rows < 0).sum()) == 1 and int(counter) == 20


@pytest.mark.parametrize("init", [None, ("uniform", (-0.05, 0.05)), ("uniform", (-1.5, 0.25)), ("constant", (0.1,))])
@pytest.mark.parametrize("dim,dtype,key_dtype", [(8, torch.float32, torch.int64), (300, torch.float32, torch.int32),
                                                 (5, torch.float16, torch.int64), (7, torch.bfloat16, torch.int32)])
def test_find_gather_reads_rows_or_initializer_rows(pools, init, dim, dtype, key_dtype):
    keys = pools[key_dtype].to(DEVICE)
    stored = keys[::2]
    idx = HashIndex(key_dtype, DEVICE, capacity=64, backend="torch")
    idx.insert(stored, torch.arange(stored.numel(), device=DEVICE).flip(0))
    values = torch.randn(stored.numel(), dim, device=DEVICE).to(dtype)
    query = torch.cat([keys, keys[:9]])
    rows, out = ti.find_gather(idx._buckets.view(key_dtype), idx._key_cols, idx.overflow, query, idx._shift,
                               values, init, seed=42)
    want_rows = idx.find(query)
    assert torch.equal(rows.long(), want_rows)
    hit = want_rows >= 0
    assert torch.equal(out[hit], values[want_rows[hit]])
    if init is None:
        want_missing = torch.zeros(int((~hit).sum()), dim, dtype=dtype, device=DEVICE)
    else:
        initializer = Uniform(*init[1]) if init[0] == "uniform" else Constant(*init[1])
        want_missing = initializer(query[~hit], dim, dtype, 42)
    assert torch.equal(out[~hit], want_missing)  # bit for bit: the counter-based values of the CPU path


def test_bad_init_spec_is_a_value_error():
    idx = HashIndex(torch.int64, DEVICE, capacity=8, backend="torch")
    with pytest.raises(ValueError, match="init must be one of"):
        ti.find_gather(idx._buckets.view(torch.int64), idx._key_cols, idx.overflow, torch.tensor([1], device=DEVICE),
                       idx._shift, torch.zeros(1, 4, device=DEVICE), ("normal", (0.0, 1.0)))


@SETTINGS
@given(data=st.data())
@pytest.mark.slow
def test_a_table_on_the_triton_index_equals_one_on_torch(pools, data):
    """KeyValueTable end to end (find_or_insert with duplicates, erase, growth by rehash) over each backend."""
    from dynemb.table import KeyValueTable

    pool = pools[torch.int64].to(DEVICE)
    tables = [KeyValueTable(3, device=DEVICE, init_capacity=8, seed=1, backend=b) for b in ("torch", "triton")]
    for _ in range(data.draw(st.integers(1, 4), "rounds")):
        batch = pool[data.draw(_picks(pool.numel(), 50), "batch")]
        gone = pool[data.draw(_picks(pool.numel(), 10), "gone")]
        results = [(t.find_or_insert(batch), t.erase(gone)) for t in tables]
        assert torch.equal(results[0][0][0], results[1][0][0]) and results[0][1] == results[1][1]
    want, got = (t.find(pool) for t in tables)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_copies_of_a_key_in_different_programs_get_one_row():
    """1,000 new keys, each 4 times at random positions of a 4,000-key batch (about 32 programs)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(-2**63, 2**63 - 1, (1000,), generator=gen, dtype=torch.int64).unique()
    batch = keys.repeat(4)[torch.randperm(4 * keys.numel(), generator=gen)].to(DEVICE)
    idx = HashIndex(torch.int64, DEVICE, capacity=keys.numel(), backend="triton")
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    slots, rows, new = ti.find_or_insert(idx._buckets.view(torch.int64), idx._key_cols, idx.overflow, batch,
                                         idx._shift, counter)
    assert int(counter) == keys.numel() and int(new.sum()) == keys.numel()
    order = torch.argsort(batch, stable=True)
    assert torch.equal(rows[order].view(-1, 4).amin(1), rows[order].view(-1, 4).amax(1))  # one row per key
    assert torch.equal(slots[order].view(-1, 4).amin(1), slots[order].view(-1, 4).amax(1))
    assert torch.equal(idx.find(batch), rows.long())


def test_lanes_past_the_bucket_are_never_claimed():
    """An int64 bucket has 5 slots; lanes 5-7 of a ``[K, 8]`` tile lie on the bucket's spare word and the next
    bucket's first key. Key 0 into its full home bucket, the next bucket holding a key whose low word is -1 (what a
    free slot's row word holds): the kernels must spill to the next bucket's free slot, as the torch path does."""
    from dynemb.table.hashing import key_hash

    ref, kern = _pair(torch.int64, capacity=640)
    placed = HashIndex(torch.int64, DEVICE, capacity=640, backend="triton")  # key 0 by place, not find_or_insert
    nb = kern.num_buckets
    home = int(kern._home(key_hash(torch.zeros(1, dtype=torch.int64))))
    cand = torch.randint(-(2**30), 2**30, (1 << 18,), generator=torch.Generator().manual_seed(3)) << 32
    cand = torch.cat([cand[cand != 0], cand - 1])  # the second half: low word 0xFFFFFFFF
    at = kern._home(key_hash(cand))
    full = cand[(at == home) & (cand != 0)][:5]
    below = cand[(at == (home + 1) % nb) & (cand & 0xFFFFFFFF == 0xFFFFFFFF)][:1]
    assert full.numel() == 5 and below.numel() == 1
    _insert((ref, kern, placed), below.to(DEVICE))
    _insert((ref, kern, placed), full.to(DEVICE), base=1)
    zero = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    for idx in (ref, placed):
        idx.insert(zero, torch.full((1,), 6, device=DEVICE))
    counter = torch.full((1,), 6, dtype=torch.int32, device=DEVICE)
    _, rows, new = ti.find_or_insert(kern._buckets.view(torch.int64), kern._key_cols, kern.overflow, zero,
                                     kern._shift, counter)
    assert rows.tolist() == [6] and new.tolist() == [1]
    for idx in (kern, placed):
        assert torch.equal(ref._buckets, idx._buckets) and torch.equal(ref.overflow, idx.overflow)
    assert int(ref.find_slots(zero)) >> 3 == (home + 1) % nb
