"""KeyValueTable: each public method's hit / miss / full behaviour, growth, bounds, errors and device moves."""

from __future__ import annotations

import pytest
import torch

from dynemb.table import KeyValueTable, Rows


def _table(key_dtype, device, dim=4, **kw) -> KeyValueTable:
    kw.setdefault("init_capacity", 4)
    return KeyValueTable(dim, key_dtype=key_dtype, device=device, **kw)


def _k(values, key_dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=key_dtype, device=device)


def _init_rows(t: KeyValueTable, keys: torch.Tensor) -> torch.Tensor:
    return t.initializer(keys.reshape(-1), t.dim, t.dtype, t.seed).view(*keys.shape, t.dim)


def _evictions(store: list):
    def hook(keys, values, scores):
        store.append((keys.cpu(), values.cpu(), scores.cpu()))

    return hook


def _check_consistent(t: KeyValueTable) -> None:
    rows = t.export()
    assert torch.equal(t.find_rows(rows.keys), torch.arange(t.size(), device=t.device))
    assert t.size() == len(t) == t.inserted - t.removed - t.evicted


# ------------------------------------------------------------------------------------------------------ find_or_insert
def test_find_or_insert_hits_misses_and_duplicates(key_dtype, device, extreme_keys):
    t = _table(key_dtype, device)
    keys = extreme_keys.to(device)
    rows, found = t.find_or_insert(torch.cat([keys, keys[:3]]))
    assert not found.any()
    assert rows[: keys.numel()].unique().numel() == keys.numel()
    assert torch.equal(rows[keys.numel() :], rows[:3])
    assert t.size() == keys.numel() and t.inserted == keys.numel()
    assert torch.equal(t.values[rows[: keys.numel()]], _init_rows(t, keys))
    rows2, found2 = t.find_or_insert(keys.flip(0))
    assert found2.all()
    assert torch.equal(rows2, rows[: keys.numel()].flip(0))
    _check_consistent(t)


def test_find_or_insert_keeps_key_shape(key_dtype, device):
    t = _table(key_dtype, device)
    keys = _k([[1, 2, 3], [3, 2, 9]], key_dtype, device)
    rows, found = t.find_or_insert(keys)
    assert rows.shape == found.shape == (2, 3)
    assert found.tolist() == [[False] * 3] * 2
    assert t.size() == 4
    assert torch.equal(t.row_keys[rows], keys)


def test_find_or_insert_empty_batch(key_dtype, device):
    t = _table(key_dtype, device)
    rows, found = t.find_or_insert(_k([], key_dtype, device))
    assert rows.numel() == found.numel() == 0 and t.size() == 0


def test_growth_keeps_every_row(key_dtype, device):
    t = _table(key_dtype, device, init_capacity=2)
    keys = torch.randperm(5000, generator=torch.Generator().manual_seed(0)).to(key_dtype).to(device) - 2500
    for chunk in keys.split(700):
        t.find_or_insert(chunk)
    assert t.size() == 5000 and t.capacity >= 5000
    values, found = t.find(keys)
    assert found.all()
    assert torch.equal(values, _init_rows(t, keys))
    _check_consistent(t)


# ---------------------------------------------------------------------------------------------------------------- find
def test_find_hit_miss_inserts_nothing(key_dtype, device, extreme_keys):
    t = _table(key_dtype, device)
    keys = extreme_keys.to(device)
    t.insert_or_assign(keys[:4], torch.ones(4, 4, device=device))
    before = t.clock
    values, found = t.find(keys.view(2, 4))
    assert values.shape == (2, 4, 4) and found.shape == (2, 4)
    assert found.view(-1).tolist() == [True] * 4 + [False] * 4
    assert torch.equal(values.view(8, 4)[:4], torch.ones(4, 4, device=device))
    assert torch.equal(values.view(8, 4)[4:], _init_rows(t, keys[4:]))
    assert t.size() == 4 and t.clock == before


def test_find_into_out(key_dtype, device):
    t = _table(key_dtype, device)
    t.insert_or_assign(_k([5], key_dtype, device), torch.full((1, 4), 2.0, device=device))
    out = torch.empty(2, 4, device=device)
    values, found = t.find(_k([5, 6], key_dtype, device), out=out)
    assert values.data_ptr() == out.data_ptr()
    assert torch.equal(out[0], torch.full((4,), 2.0, device=device))
    assert found.tolist() == [True, False]


def test_find_rows_and_contains(key_dtype, device, extreme_keys):
    t = _table(key_dtype, device)
    keys = extreme_keys.to(device)
    rows, _ = t.find_or_insert(keys[::2])
    assert torch.equal(t.find_rows(keys[::2]), rows)
    assert t.find_rows(keys[1::2]).eq(-1).all()
    assert t.contains(keys.view(2, 4)).tolist() == [[True, False, True, False], [True, False, True, False]]


# ---------------------------------------------------------------------------------------------------- insert_or_assign
def test_insert_or_assign_last_duplicate_wins(key_dtype, device, extreme_keys):
    t = _table(key_dtype, device, dim=2)
    keys = extreme_keys.to(device)
    t.find_or_insert(keys[:2])
    batch = torch.cat([keys[:4], keys[:4]])
    vals = torch.arange(16, dtype=torch.float32, device=device).view(8, 2)
    t.insert_or_assign(batch, vals)
    got, found = t.find(keys[:4])
    assert found.all()
    assert torch.equal(got, vals[4:])
    assert t.size() == 4 and t.inserted == 4
    _check_consistent(t)


def test_insert_or_assign_any_key_shape(key_dtype, device):
    t = _table(key_dtype, device, dim=3)
    keys = _k([[1, 2], [3, 4]], key_dtype, device)
    vals = torch.randn(2, 2, 3, device=device)
    t.insert_or_assign(keys, vals)
    assert torch.equal(t.find(keys)[0], vals)


def test_insert_or_assign_empty_batch(key_dtype, device):
    t = _table(key_dtype, device)
    t.insert_or_assign(_k([], key_dtype, device), torch.empty(0, 4, device=device))
    assert t.size() == 0


# --------------------------------------------------------------------------------------------------------------- accum
def test_accum_present_absent_and_removed_meanwhile(key_dtype, device):
    t = _table(key_dtype, device, dim=2, initializer="zeros")
    a, b, c = 1, -1, torch.iinfo(key_dtype).max
    t.insert_or_assign(_k([a, b], key_dtype, device), torch.tensor([[1.0, 1.0], [2.0, 2.0]], device=device))
    old, exists = t.find(_k([a, b, c], key_dtype, device))
    t.erase(_k([b], key_dtype, device))  # b is removed between the read and the accum
    new = old + torch.tensor([[0.5, 1.0], [3.0, 3.0], [4.0, 8.0]], device=device)
    t.accum(_k([a, b, c], key_dtype, device), old, new, exists)
    values, found = t.find(_k([a, b, c], key_dtype, device))
    assert found.tolist() == [True, False, True]
    assert values[0].tolist() == [1.5, 2.0]  # present: + (new - old)
    assert values[2].tolist() == [4.0, 8.0]  # absent and never seen: inserted with new
    assert t.size() == 2 and t.inserted == 3 and t.removed == 1


# TFRA's accum, one row per (exists when read, present now); see KeyValueTable.accum.
ACCUM_TRUTH_TABLE = {
    "read_present_now_present": (True, True, "added"),
    "read_present_now_absent": (True, False, "unchanged"),  # removed meanwhile: not revived
    "read_absent_now_present": (False, True, "unchanged"),  # inserted meanwhile: that insert wins
    "read_absent_now_absent": (False, False, "inserted"),
}


@pytest.mark.parametrize("case", sorted(ACCUM_TRUTH_TABLE))
def test_accum_truth_table(case, key_dtype, device, extreme_keys, leaves_unchanged):
    exists_then, present_now, outcome = ACCUM_TRUTH_TABLE[case]
    t = _table(key_dtype, device, dim=2, initializer="zeros")
    keys = extreme_keys.to(device)[:3]  # min, max and -1
    stored = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], device=device)
    if present_now:
        t.insert_or_assign(keys, stored)
    # Old values far from the new ones: old + (new - old) rounds to another float32 than new.
    old = torch.full((3, 2), 1e8, device=device)
    new = torch.tensor([[1.0, 0.5], [-2.0, 0.25], [3.0, 7.0]], device=device)
    exists = torch.full((3,), exists_then, device=device)
    if outcome == "unchanged":
        with leaves_unchanged(t, clock=False):
            t.accum(keys, old, new, exists)
        return
    t.accum(keys, old, new, exists)
    values, found = t.find(keys)
    if outcome == "added":
        assert torch.equal(values, stored + (new - old))
        assert t.size() == 3 and t.inserted == 3
    else:
        assert found.all() and torch.equal(values, new)  # exactly new_values, as TFRA inserts them
        assert t.size() == 3 and t.inserted == 3
    _check_consistent(t)


def test_accum_applies_duplicates_in_order(key_dtype, device):
    """Occurrences of a key apply one after the other, each by the truth table against the table as the earlier
    occurrences left it (TFRA's table does them one at a time)."""
    t = _table(key_dtype, device, dim=1, initializer="zeros")
    t.insert_or_assign(_k([7], key_dtype, device), torch.tensor([[10.0]], device=device))
    keys = _k([7, 7, 8, 8, 8, 9, 9, 6], key_dtype, device)
    old = torch.tensor([[10.0], [10.0], [0.0], [1.0], [2.0], [0.0], [0.0], [0.0]], device=device)
    new = torch.tensor([[11.0], [12.0], [5.0], [3.0], [2.5], [4.0], [6.0], [1.0]], device=device)
    exists = torch.tensor([False, True, True, False, True, False, False, True], device=device)
    t.accum(keys, old, new, exists)
    values, found = t.find(_k([7, 8, 9, 6], key_dtype, device))
    # 7: present; only the occurrence read as existing adds (+2). 8: absent; the first (exists) is ignored, the
    # second inserts its new value 3, the third then adds 0.5. 9: the first inserts 4, the second (read as
    # absent) finds it present and is ignored. 6: read as existing, absent now: not revived.
    assert found.tolist() == [True, True, True, False]
    assert values.view(-1).tolist()[:3] == [12.0, 3.5, 4.0]
    assert t.size() == 3 and t.inserted == 3
    _check_consistent(t)


# --------------------------------------------------------------------------------------------------------------- erase
def test_erase_counts_unique_present_keys(key_dtype, device, extreme_keys):
    t = _table(key_dtype, device)
    keys = extreme_keys.to(device)
    t.insert_or_assign(keys, torch.arange(32, dtype=torch.float32, device=device).view(8, 4))
    gone = torch.cat([keys[1:6:2], keys[1:6:2], _k([12345], key_dtype, device)])
    assert t.erase(gone) == 3
    assert t.size() == 5 and t.removed == 3
    kept = torch.tensor([0, 2, 4, 6, 7])
    values, found = t.find(keys[kept.to(device)])
    assert found.all()
    assert torch.equal(values, torch.arange(32, dtype=torch.float32, device=device).view(8, 4)[kept.to(device)])
    assert t.erase(gone) == 0
    assert t.erase(_k([], key_dtype, device)) == 0
    _check_consistent(t)


def test_erase_everything_then_reinsert(key_dtype, device):
    t = _table(key_dtype, device)
    keys = torch.arange(100, dtype=key_dtype, device=device)
    t.find_or_insert(keys)
    assert t.erase(keys) == 100 and t.size() == 0
    t.find_or_insert(keys[:10])
    assert t.size() == 10
    _check_consistent(t)


# ---------------------------------------------------------------------------------------------------- evict / restrict
def test_evict_lowest_scores_and_reports(key_dtype, device):
    got: list = []
    t = _table(key_dtype, device, eviction="custom", on_evict=_evictions(got))
    keys = _k([10, 20, 30, 40], key_dtype, device)
    t.find_or_insert(keys, scores=torch.tensor([4, 1, 3, 2], device=device))
    values_before = t.find(keys)[0]
    out = t.evict(2)
    assert isinstance(out, Rows)
    assert sorted(out.keys.tolist()) == [20, 40]
    assert sorted(out.scores.tolist()) == [1, 2]
    assert len(got) == 1 and sorted(got[0][0].tolist()) == [20, 40]
    order = [[10, 20, 30, 40].index(k) for k in out.keys.tolist()]
    assert torch.equal(out.values, values_before[order])
    assert t.contains(keys).tolist() == [True, False, True, False]
    assert t.evicted == 2
    assert t.evict(0).keys.numel() == 0 and len(got) == 1
    assert t.evict(99).keys.numel() == 2 and t.size() == 0
    _check_consistent(t)


@pytest.mark.parametrize(
    "size,num_reserved,trigger,left",
    [(6, 4, None, 4), (6, 6, None, 6), (6, 4, 6, 6), (6, 4, 5, 4), (6, 0, None, 0), (0, 0, None, 0)],
)
def test_restrict_keeps_highest_scores_above_trigger(key_dtype, device, size, num_reserved, trigger, left):
    got: list = []
    t = _table(key_dtype, device, eviction="custom", on_evict=_evictions(got))
    keys = torch.arange(size, dtype=key_dtype, device=device)
    t.find_or_insert(keys, scores=torch.arange(size, device=device) * 10)
    out = t.restrict(num_reserved, trigger)
    assert t.size() == left
    assert sorted(t.export().keys.tolist()) == list(range(size - left, size))
    assert sorted(out.keys.tolist()) == list(range(size - left))
    assert t.evicted == size - left == sum(k.numel() for k, _, _ in got)
    _check_consistent(t)


def test_restrict_and_evict_argument_errors(key_dtype, device, fails_cleanly):
    t = _table(key_dtype, device)
    t.find_or_insert(_k([1, 2, 3], key_dtype, device))
    with fails_cleanly(t, ValueError, "trigger"):
        t.restrict(3, trigger=2)
    with fails_cleanly(t, ValueError, "num_reserved"):
        t.restrict(-1)
    with fails_cleanly(t, ValueError, "num_reserved"):
        t.restrict(1.5)
    with fails_cleanly(t, ValueError, "n must be"):
        t.evict(-1)


# ------------------------------------------------------------------------------------------------------ bounded tables
def test_bounded_table_evicts_lowest_and_never_pinned(key_dtype, device):
    got: list = []
    t = _table(key_dtype, device, max_capacity=4, eviction="custom", on_evict=_evictions(got))
    t.find_or_insert(_k([1, 2, 3, 4], key_dtype, device), scores=torch.tensor([1, 2, 3, 4], device=device))
    # Key 1 has the lowest score but is used by this call, so 2 and 3 go instead.
    rows, found = t.find_or_insert(_k([1, 5, 6], key_dtype, device))
    assert found.tolist() == [True, False, False] and rows.ge(0).all()
    assert sorted(torch.cat([k for k, _, _ in got]).tolist()) == [2, 3]
    assert sorted(t.export().keys.tolist()) == [1, 4, 5, 6]
    assert (t.size(), t.inserted, t.evicted) == (4, 6, 2)
    _check_consistent(t)


class HookError(Exception):
    pass


def _raise_on_evict(keys, values, scores):
    raise HookError(f"on_evict saw {keys.numel()} keys")


# Every call that can evict, on a full table (max_capacity 4, keys 1..4 stored): what it is given, and that it evicts.
EVICTING_CALLS = {
    "find_or_insert": lambda t, k: t.find_or_insert(k([1, 5, 6])),
    "find_or_insert_over_capacity": lambda t, k: t.find_or_insert(k([5, 6, 7, 8, 9, 10])),
    "insert_or_assign": lambda t, k: t.insert_or_assign(k([2, 5]), torch.full((2, 2), 9.0, device=t.device)),
    "accum": lambda t, k: t.accum(k([1, 5, 1]), torch.zeros(3, 2, device=t.device), torch.ones(3, 2, device=t.device),
                                  torch.tensor([True, False, True], device=t.device)),
    "evict": lambda t, k: t.evict(2),
    "restrict": lambda t, k: t.restrict(1),
}


@pytest.mark.parametrize("call", sorted(EVICTING_CALLS))
@pytest.mark.parametrize("initializer", ["normal", "callable"])
def test_on_evict_that_raises_leaves_the_table_as_it_was(call, initializer, key_dtype, device, fails_cleanly):
    init = (lambda n, dim: torch.randn(n, dim)) if initializer == "callable" else initializer
    t = _table(key_dtype, device, dim=2, max_capacity=4, initializer=init, eviction="lfu")
    t.find_or_insert(_k([1, 1, 2, 3, 4, 4, 4], key_dtype, device))
    t.add_slot("opt.m", 2, init=0.5)
    t.slot("opt.m")[:4] = torch.arange(8.0, device=device).view(4, 2)
    t.track_deletions()
    t.erase(_k([3], key_dtype, device))
    t.insert_or_assign(_k([3], key_dtype, device), torch.ones(1, 2, device=device))
    clock = t.clock
    before = (t.changes_since(clock - 2), t._init_calls)
    t.on_evict = _raise_on_evict
    with fails_cleanly(t, HookError, "on_evict saw"):
        EVICTING_CALLS[call](t, lambda keys: _k(keys, key_dtype, device))
    rows, deleted = t.changes_since(clock - 2)
    assert torch.equal(rows, before[0][0]) and torch.equal(deleted, before[0][1])  # versions and deletion log
    assert t._init_calls == before[1]
    _check_consistent(t)
    t.on_evict = None  # the same call then succeeds and evicts
    EVICTING_CALLS[call](t, lambda keys: _k(keys, key_dtype, device))
    assert t.evicted > 0
    _check_consistent(t)


def test_call_with_more_new_keys_than_max_capacity(key_dtype, device):
    got: list = []
    t = _table(key_dtype, device, dim=2, max_capacity=3, on_evict=_evictions(got))
    keys = _k([10, 11, 12, 13, 14, 10], key_dtype, device)
    rows, found = t.find_or_insert(keys)
    assert not found.any()
    assert set(keys[rows >= 0].tolist()) == set(t.export().keys.tolist()) and t.size() == 3  # which: unspecified
    assert rows[0] == rows[5]  # a key twice: one row, or -1 twice
    reported = torch.cat([k for k, _, _ in got])
    assert reported.numel() == 2
    assert set(reported.tolist()) == set(keys.tolist()) - set(t.export().keys.tolist())
    assert rows[torch.isin(keys, reported.to(device))].eq(-1).all()
    # Reported rows carry the values they would have had.
    assert torch.equal(torch.cat([v for _, v, _ in got]), _init_rows(t, reported).cpu())
    assert (t.size(), t.inserted, t.evicted) == (3, 5, 2)
    _check_consistent(t)


@pytest.mark.parametrize("initializer", ["normal", "callable"])
def test_values_do_not_depend_on_whether_someone_listens_to_evictions(initializer, key_dtype, device):
    # Without a listener the dropped keys' rows are never drawn; the draws after them must not shift.
    init = (lambda n, dim: torch.randn(n, dim)) if initializer == "callable" else initializer
    listened = _table(key_dtype, device, dim=2, max_capacity=3, initializer=init, on_evict=_evictions([]))
    silent = _table(key_dtype, device, dim=2, max_capacity=3, initializer=init)
    for batch in ([10, 11, 12, 13, 14, 10], [20], [30, 31, 32, 33]):
        a, b = (t.find_or_insert(_k(batch, key_dtype, device))[0] for t in (listened, silent))
        assert torch.equal(a, b)
        assert torch.equal(listened.values[a[a >= 0]], silent.values[b[b >= 0]])
    assert listened._init_calls == silent._init_calls


def test_bounded_insert_or_assign_reports_dropped_values(key_dtype, device):
    got: list = []
    t = _table(key_dtype, device, dim=1, max_capacity=1, on_evict=_evictions(got))
    t.insert_or_assign(_k([1, 2], key_dtype, device), torch.tensor([[1.0], [2.0]], device=device))
    (kept,) = t.export().keys.tolist()
    (dropped,) = torch.cat([k for k, _, _ in got]).tolist()
    assert {kept, dropped} == {1, 2}
    assert torch.cat([v for _, v, _ in got]).item() == float(dropped)
    assert t.find(_k([kept], key_dtype, device))[0].item() == float(kept)


def test_max_capacity_caps_allocation(key_dtype, device):
    t = _table(key_dtype, device, init_capacity=1000, max_capacity=10)
    t.find_or_insert(torch.arange(50, dtype=key_dtype, device=device))
    assert t.size() == 10 and t.capacity <= 10


# ---------------------------------------------------------------------------------------------------------------- bulk
def test_export_returns_copies_with_scores_and_slots(key_dtype, device):
    t = _table(key_dtype, device, dim=2, eviction="lfu")
    t.add_slot("m", 3, init=0.5)
    keys = _k([4, 5, 4], key_dtype, device)
    t.find_or_insert(keys)
    rows = t.export()
    assert sorted(rows.keys.tolist()) == [4, 5]
    assert dict(zip(rows.keys.tolist(), rows.scores.tolist())) == {4: 2, 5: 1}
    assert rows.slots["m"].shape == (2, 3) and rows.slots["m"].eq(0.5).all()
    rows.values.fill_(99.0)
    rows.keys.fill_(0)
    assert t.find(_k([4, 5], key_dtype, device))[1].all()
    assert not t.find(_k([4, 5], key_dtype, device))[0].eq(99.0).any()


def test_clear(key_dtype, device, extreme_keys):
    t = _table(key_dtype, device)
    keys = extreme_keys.to(device)
    t.find_or_insert(keys)
    capacity = t.capacity
    t.clear()
    assert t.size() == len(t) == 0 and t.removed == keys.numel()
    assert not t.contains(keys).any()
    assert t.capacity == capacity
    t.find_or_insert(keys[:3])
    assert t.size() == 3
    _check_consistent(t)


def test_replace_loads_exactly(key_dtype, device, extreme_keys):
    src = _table(key_dtype, device, eviction="custom")
    keys = extreme_keys.to(device)
    src.find_or_insert(keys, scores=torch.arange(8, device=device) - 4)
    dst = _table(key_dtype, device, eviction="custom", seed=5)
    dst.find_or_insert(_k([1000, 1001], key_dtype, device))
    dst.replace(src.export())
    a, b = src.export(), dst.export()
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and torch.equal(a.scores, b.scores)
    assert not dst.contains(_k([1000, 1001], key_dtype, device)).any()
    _check_consistent(dst)


def test_replace_rejects_bad_rows(key_dtype, device, fails_cleanly):
    t = _table(key_dtype, device, dim=2, max_capacity=3)
    t.find_or_insert(_k([1, 2], key_dtype, device))
    keys = _k([5, 6], key_dtype, device)
    vals = torch.zeros(2, 2, device=device)
    scores = torch.zeros(2, dtype=torch.int64, device=device)
    with fails_cleanly(t, ValueError, "unique"):
        t.replace(Rows(_k([5, 5], key_dtype, device), vals, scores, {}))
    with fails_cleanly(t, ValueError, "max_capacity"):
        t.replace(Rows(torch.arange(4, dtype=key_dtype, device=device), torch.zeros(4, 2, device=device), None, {}))
    with fails_cleanly(t, ValueError, "values"):
        t.replace(Rows(keys, torch.zeros(2, 3, device=device), scores, {}))
    with fails_cleanly(t, (TypeError, ValueError), "scores"):
        t.replace(Rows(keys, vals, torch.zeros(3, dtype=torch.int64, device=device), {}))
    with fails_cleanly(t, (TypeError, ValueError), "scores"):
        t.replace(Rows(keys, vals, torch.zeros(2, device=device), {}))
    with fails_cleanly(t, ValueError, "slots"):
        t.replace(Rows(keys, vals, scores, {"nope": torch.zeros(2, 1)}))


# ----------------------------------------------------------------------------------------------------- slots, versions
def test_slots_follow_their_rows(key_dtype, device):
    t = _table(key_dtype, device, dim=1)
    t.add_slot("acc", 2, init=1.0)
    assert t.slot_names == ["acc"]
    rows, _ = t.find_or_insert(_k([1, 2, 3], key_dtype, device))
    t.slot("acc")[rows] = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], device=device)
    t.erase(_k([1], key_dtype, device))  # compaction moves a row into the hole
    rows = t.find_rows(_k([2, 3], key_dtype, device))
    assert t.slot("acc")[rows].tolist() == [[2.0, 2.0], [3.0, 3.0]]
    t.add_slot("acc", 2, init=1.0)  # same width: contents kept
    assert t.slot("acc")[rows].tolist() == [[2.0, 2.0], [3.0, 3.0]]
    with pytest.raises(ValueError, match="acc"):
        t.add_slot("acc", 3)
    new_rows, _ = t.find_or_insert(_k([9], key_dtype, device))
    assert t.slot("acc")[new_rows].tolist() == [[1.0, 1.0]]


def test_changes_since(key_dtype, device):
    t = _table(key_dtype, device)
    t.track_deletions()
    t.find_or_insert(_k([1, 2, 3], key_dtype, device))
    mark = t.clock
    t.insert_or_assign(_k([2], key_dtype, device), torch.ones(1, 4, device=device))
    t.erase(_k([3], key_dtype, device))
    rows, deleted = t.changes_since(mark)
    assert t.row_keys[rows].tolist() == [2]
    assert deleted.tolist() == [3]
    t.forget_deletions(t.clock)
    assert t.changes_since(mark)[1].numel() == 0


def test_stats_and_nbytes(key_dtype, device):
    t = _table(key_dtype, device, max_capacity=100)
    t.find_or_insert(torch.arange(10, dtype=key_dtype, device=device))
    stats = t.stats()
    assert (stats["size"], stats["inserted"], stats["removed"], stats["evicted"]) == (10, 10, 0, 0)
    assert stats["max_capacity"] == 100
    assert stats["bytes"] == t.nbytes() > t.capacity * 4 * 4


# -------------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"dim": 0}, ValueError, "dim"),
        ({"dim": 2.0}, ValueError, "dim"),
        ({"dim": True}, ValueError, "dim"),
        ({"key_dtype": torch.float32}, TypeError, "key_dtype"),
        ({"key_dtype": torch.int16}, TypeError, "key_dtype"),
        ({"dtype": torch.int64}, TypeError, "dtype"),
        ({"dtype": torch.float64}, TypeError, "dtype"),
        ({"init_capacity": 0}, ValueError, "init_capacity"),
        ({"max_capacity": 0}, ValueError, "max_capacity"),
        ({"max_capacity": 2**31}, ValueError, "max_capacity"),
        ({"eviction": "fifo"}, ValueError, "eviction"),
        ({"initializer": "gaussian"}, ValueError, "initializer"),
        ({"initializer": object()}, TypeError, "initializer"),
        ({"seed": "1"}, TypeError, "seed"),
        ({"on_evict": 3}, TypeError, "on_evict"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, exc, match):
    args = {"dim": 4, **kwargs}
    with pytest.raises(exc, match=match) as info:
        KeyValueTable(args.pop("dim"), **args)
    assert "got" in str(info.value)


def test_key_errors_name_argument_and_change_nothing(key_dtype, device, fails_cleanly):
    t = _table(key_dtype, device, eviction="lfu")
    t.find_or_insert(_k([1, 2], key_dtype, device))
    other = torch.int64 if key_dtype == torch.int32 else torch.uint64  # wider: refused, never narrowed
    wrong = torch.tensor([3], dtype=other, device=device)
    vals = torch.zeros(1, 4, device=device)
    calls = [
        lambda k: t.find_or_insert(k),
        lambda k: t.find(k),
        lambda k: t.find_rows(k),
        lambda k: t.contains(k),
        lambda k: t.insert_or_assign(k, vals),
        lambda k: t.accum(k, vals, vals, torch.tensor([False], device=device)),
        lambda k: t.erase(k),
    ]
    for call in calls:
        with fails_cleanly(t, TypeError, rf"keys must have dtype {key_dtype}.*got {other}"):
            call(wrong)
        with fails_cleanly(t, TypeError, "keys must be a torch.Tensor.*got list"):
            call([3])
        with fails_cleanly(t, ValueError, "keys must be on the table's device"):
            call(torch.tensor([3], dtype=key_dtype, device="meta"))


def test_value_errors_name_argument_and_change_nothing(key_dtype, device, fails_cleanly):
    t = _table(key_dtype, device, dim=4)
    t.find_or_insert(_k([1, 2], key_dtype, device))
    keys = _k([1, 9], key_dtype, device)
    ok = torch.zeros(2, 4, device=device)
    no = torch.zeros(2, dtype=torch.bool, device=device)
    with fails_cleanly(t, ValueError, r"values must have shape \(2, 4\).*got .*\(2, 3\)"):
        t.insert_or_assign(keys, torch.zeros(2, 3, device=device))
    with fails_cleanly(t, ValueError, r"values must have shape"):
        t.insert_or_assign(keys, torch.zeros(8, device=device))
    with fails_cleanly(t, TypeError, r"values must have dtype torch.float32.*got torch.float64"):
        t.insert_or_assign(keys, ok.double())
    with fails_cleanly(t, TypeError, "values must be a torch.Tensor"):
        t.insert_or_assign(keys, [[0.0] * 4] * 2)
    with fails_cleanly(t, ValueError, "values must be on the table's device"):
        t.insert_or_assign(keys, ok.to("meta"))
    with fails_cleanly(t, ValueError, "old_values must have shape"):
        t.accum(keys, torch.zeros(1, 4, device=device), ok, no)
    with fails_cleanly(t, TypeError, "new_values must have dtype"):
        t.accum(keys, ok, ok.half(), no)
    with fails_cleanly(t, TypeError, "exists must be a bool tensor"):
        t.accum(keys, ok, ok, no.float())
    with fails_cleanly(t, TypeError, r"exists must be a bool tensor of shape \(2,\)"):
        t.accum(keys, ok, ok, no[:1])
    with fails_cleanly(t, ValueError, r"out must have shape"):
        t.find(keys, out=torch.zeros(3, 4, device=device))


def test_score_errors_name_argument_and_change_nothing(key_dtype, device, fails_cleanly):
    lru = _table(key_dtype, device)
    keys = _k([1, 2], key_dtype, device)
    with fails_cleanly(lru, ValueError, "scores can only be given with eviction='custom'"):
        lru.find_or_insert(keys, scores=torch.zeros(2, dtype=torch.int64, device=device))
    custom = _table(key_dtype, device, eviction="custom")
    custom.find_or_insert(keys, scores=torch.tensor([5, 6], device=device))
    with fails_cleanly(custom, TypeError, r"scores must be an int64 tensor of shape \(2,\)"):
        custom.find_or_insert(keys, scores=torch.zeros(3, dtype=torch.int64, device=device))
    with fails_cleanly(custom, TypeError, "scores must be an int64 tensor"):
        custom.insert_or_assign(keys, torch.zeros(2, 4, device=device), scores=torch.zeros(2, device=device))


# ------------------------------------------------------------------------------------------------------------- devices
def test_to_same_device_is_a_no_op(key_dtype, device):
    t = _table(key_dtype, device)
    assert t.to(device) is t


def test_table_on_default_cuda_device_accepts_its_tensors(key_dtype, cuda_device):
    t = _table(key_dtype, "cuda")  # "cuda" without an index must accept tensors on cuda:0
    keys = _k([1, -1], key_dtype, "cuda")
    t.find_or_insert(keys)
    t.insert_or_assign(keys, torch.ones(2, 4, device="cuda"))
    assert t.find(keys)[1].all()


def test_to_moves_rows_and_index(key_dtype, extreme_keys, cuda_device):
    t = _table(key_dtype, "cpu", eviction="lfu")
    t.find_or_insert(extreme_keys)
    before = t.export()
    t.to("cuda")
    after = t.export()
    assert after.keys.is_cuda and after.values.is_cuda
    assert torch.equal(before.values, after.values.cpu()) and torch.equal(before.scores, after.scores.cpu())
    assert t.find(extreme_keys.cuda())[1].all()
    t.find_or_insert(_k([123], key_dtype, "cuda"))
    t.to("cpu")
    assert t.find(extreme_keys)[1].all() and t.size() == extreme_keys.numel() + 1
    # the score and version stamps moved as one interleaved tensor, both ways
    assert t.scores.stride() == (2,) and t._cols["version"].data_ptr() == t.scores.data_ptr() + 8
