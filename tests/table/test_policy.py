"""Eviction policies: what each score means, what updates it, and which rows eviction takes first."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.kernels import use_backend
from dynemb.table import EvictionPolicy, KeyValueTable
from dynemb.table.policy import touch_scores

LOW32 = 0xFFFFFFFF


def _table(policy, key_dtype, device, **kw) -> KeyValueTable:
    return KeyValueTable(2, key_dtype=key_dtype, device=device, eviction=policy, init_capacity=4, **kw)


def _k(values, key_dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=key_dtype, device=device)


def _scores(t: KeyValueTable, keys) -> list[int]:
    rows = t.export()
    by_key = dict(zip(rows.keys.tolist(), rows.scores.tolist()))
    return [by_key[k] for k in keys]


# ------------------------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("name", ["lru", "lfu", "epoch_lru", "epoch_lfu", "decayed_lfu", "custom"])
def test_parse_names_and_members(name):
    assert EvictionPolicy.parse(name) is EvictionPolicy(name)
    assert EvictionPolicy.parse(EvictionPolicy(name)) is EvictionPolicy(name)


def test_parse_default_and_errors():
    assert EvictionPolicy.parse(None) is EvictionPolicy.LRU
    with pytest.raises(ValueError, match=r"eviction must be one of 'lru', 'lfu'.*got 'LRU'"):
        EvictionPolicy.parse("LRU")
    with pytest.raises(ValueError, match="policy must be one of .*got 3"):
        EvictionPolicy.parse(3, name="policy")


# -------------------------------------------------------------------------------------------------------- touch_scores
@pytest.mark.parametrize(
    "policy,before,expected",
    [
        (EvictionPolicy.LRU, [5, 5, 5, 5], [5, 9, 9, 5]),
        (EvictionPolicy.LFU, [5, 5, 5, 5], [5, 7, 6, 5]),
        (EvictionPolicy.EPOCH_LRU, [5, 5, 5, 5], [5, (3 << 32) | 9, (3 << 32) | 9, 5]),
        # Counts from an older epoch restart; counts of the current epoch go on.
        (EvictionPolicy.EPOCH_LFU, [5, (3 << 32) | 4, 7, 5], [5, (3 << 32) | 6, (3 << 32) | 1, 5]),
        (EvictionPolicy.CUSTOM, [5, 5, 5, 5], [5, -2, 40, 5]),
    ],
)
def test_touch_scores(policy, before, expected, device):
    scores = torch.tensor(before, device=device)
    rows = torch.tensor([1, 2, 1], device=device)
    custom = torch.tensor([10, 40, -2], device=device)  # duplicates: the last occurrence wins
    touch_scores(policy, scores, rows, clock=9, epoch=3, custom=custom)
    assert scores.tolist() == expected


def test_touch_scores_custom_without_scores_changes_nothing(device):
    scores = torch.tensor([1, 2], device=device)
    touch_scores(EvictionPolicy.CUSTOM, scores, torch.tensor([0, 1], device=device), clock=3, epoch=0)
    assert scores.tolist() == [1, 2]


def test_touch_scores_checks_counts_shape(device):
    scores = torch.tensor([1, 2], device=device)
    with pytest.raises(ValueError, match=r"counts must have the shape of rows \(2,\), got \(3,\)"):
        touch_scores(EvictionPolicy.LFU, scores, torch.tensor([0, 1], device=device), clock=3, epoch=0,
                     counts=torch.ones(3, dtype=torch.int64, device=device))
    assert scores.tolist() == [1, 2]


# ----------------------------------------------------------------------------------------------------------------- lru
def test_lru_score_is_clock_of_last_access(key_dtype, device):
    t = _table("lru", key_dtype, device)
    t.find_or_insert(_k([1, 2], key_dtype, device))
    first = t.clock
    assert _scores(t, [1, 2]) == [first, first]
    t.find_or_insert(_k([2], key_dtype, device))
    assert t.clock > first and _scores(t, [1, 2]) == [first, t.clock]
    t.find(_k([1], key_dtype, device))  # a plain read is not an access
    assert _scores(t, [1]) == [first]
    t.find(_k([1], key_dtype, device), update_scores=True)
    assert _scores(t, [1]) == [t.clock]
    t.insert_or_assign(_k([2], key_dtype, device), torch.zeros(1, 2, device=device))
    assert _scores(t, [2]) == [t.clock]
    old, exists = t.find(_k([1], key_dtype, device))
    t.accum(_k([1], key_dtype, device), old, old + 1, exists)
    assert _scores(t, [1]) == [t.clock]


def test_lru_evicts_least_recent(key_dtype, device):
    got = []
    t = _table("lru", key_dtype, device, max_capacity=3, on_evict=lambda k, v, s: got.extend(k.tolist()))
    for key in (1, 2, 3):
        t.find_or_insert(_k([key], key_dtype, device))
    t.find_or_insert(_k([1], key_dtype, device))
    t.find_or_insert(_k([4], key_dtype, device))
    t.find_or_insert(_k([5], key_dtype, device))
    assert got == [2, 3]
    assert sorted(t.export().keys.tolist()) == [1, 4, 5]


# ----------------------------------------------------------------------------------------------------------------- lfu
def test_lfu_counts_every_occurrence(key_dtype, device):
    t = _table("lfu", key_dtype, device)
    t.find_or_insert(_k([1, 1, 2], key_dtype, device))
    assert _scores(t, [1, 2]) == [2, 1]
    t.insert_or_assign(_k([2, 2, 3], key_dtype, device), torch.zeros(3, 2, device=device))
    assert _scores(t, [1, 2, 3]) == [2, 3, 1]
    t.find(_k([3, 3], key_dtype, device))
    assert _scores(t, [3]) == [1]
    t.find(_k([3, 3, 9], key_dtype, device), update_scores=True)
    assert _scores(t, [3]) == [3] and not t.contains(_k([9], key_dtype, device)).item()
    vals = torch.zeros(2, 2, device=device)
    t.accum(_k([1, 4], key_dtype, device), vals, vals, torch.tensor([True, False], device=device))
    assert _scores(t, [1, 4]) == [3, 1]


def test_lfu_evicts_least_frequent(key_dtype, device):
    t = _table("lfu", key_dtype, device, max_capacity=3)
    t.find_or_insert(_k([1, 1, 1, 2, 3, 3], key_dtype, device))
    t.find_or_insert(_k([4], key_dtype, device))
    assert sorted(t.export().keys.tolist()) == [1, 3, 4]
    out = t.restrict(1)
    assert sorted(out.keys.tolist()) == [3, 4] and t.export().keys.tolist() == [1]


# -------------------------------------------------------------------------------------------------------------- epochs
def test_epoch_lru_orders_by_epoch_then_clock(key_dtype, device):
    t = _table("epoch_lru", key_dtype, device)
    t.find_or_insert(_k([1, 2], key_dtype, device))
    t.find_or_insert(_k([2], key_dtype, device))
    t.epoch = 1
    t.find_or_insert(_k([3], key_dtype, device))
    s1, s2, s3 = _scores(t, [1, 2, 3])
    assert s3 >> 32 == 1 and s3 & LOW32 == t.clock
    assert s1 >> 32 == 0 and s1 < s2 < s3
    assert sorted(t.restrict(1).keys.tolist()) == [1, 2]


def test_epoch_lfu_counts_restart_in_a_new_epoch(key_dtype, device):
    t = _table("epoch_lfu", key_dtype, device)
    t.find_or_insert(_k([1, 1, 1, 1, 2], key_dtype, device))
    assert _scores(t, [1, 2]) == [4, 1]
    t.epoch = 2
    t.find_or_insert(_k([2, 3, 3], key_dtype, device))
    assert _scores(t, [1, 2, 3]) == [4, (2 << 32) | 1, (2 << 32) | 2]
    t.find_or_insert(_k([2], key_dtype, device))
    assert _scores(t, [2]) == [(2 << 32) | 2]
    # Key 1 was used most, but only in the old epoch: it goes first.
    assert t.evict(1).keys.tolist() == [1]


# --------------------------------------------------------------------------------------------------------- decayed_lfu
def _decayed(accesses, half_life) -> float:
    """Reference decayed_lfu score in doublings: log2 of the phantom access at clock 0 plus each (clock, n)."""
    terms = [0.0] + [math.log2(n) + clock / half_life for clock, n in accesses]
    top = max(terms)
    return top + math.log2(sum(2 ** (x - top) for x in terms))


@settings(max_examples=40, deadline=None)
@given(batches=st.lists(st.lists(st.integers(-3, 3), min_size=1, max_size=6), min_size=1, max_size=12),
       half_life=st.integers(1, 50), counted=st.booleans(), start=st.sampled_from([0, 10**9]))
def test_decayed_lfu_scores_match_the_float_reference(batches, half_life, counted, start):
    """Every row's score is ``2**16 * log2(1 + sum(n * 2**(t / half_life)))`` over its accesses, to rounding
    (under two units per access), with duplicates and ``counts`` adding up; ``find`` without update is no access."""
    t = KeyValueTable(1, eviction="decayed_lfu", half_life=half_life, initializer="zeros")
    t.clock = start  # a long-running table: scores far from 0
    model: dict[int, list] = {}
    for i, batch in enumerate(batches):
        keys = torch.tensor(batch)
        counts = torch.arange(1, len(batch) + 1) if counted else None
        t.find_or_insert(keys, counts=counts)
        if i % 3 == 2:
            t.find(keys)  # a plain read: no access, but the clock is unchanged and scores too
        for j, k in enumerate(batch):
            model.setdefault(k, []).append((t.clock, j + 1 if counted else 1))
    got = t.export()
    for key, score in zip(got.keys.tolist(), got.scores.tolist()):
        expected = _decayed(model[key], half_life) * 65536
        assert abs(score - expected) <= 2 * len(model[key])  # rounding: under 2 fixed-point units per access


def test_decayed_lfu_lets_new_keys_replace_stale_frequent_ones(key_dtype, device):
    """The churn lfu has: old keys with big counts stay forever and every new key is the next victim. Under
    decayed_lfu the stale counts fade and the newest keys are kept."""
    kept = {}
    for policy in ("lfu", "decayed_lfu"):
        t = _table(policy, key_dtype, device, max_capacity=4, **({"half_life": 2} if policy == "decayed_lfu" else {}))
        t.find_or_insert(_k([1, 2, 3, 4], key_dtype, device), counts=torch.full((4,), 10, device=device))
        for key in range(100, 130):
            t.find_or_insert(_k([key], key_dtype, device))
        kept[policy] = sorted(t.export().keys.tolist())
    assert len(set(kept["lfu"]) & {1, 2, 3, 4}) == 3  # lfu: three stale keys stay, new keys churn through one row
    assert kept["decayed_lfu"] == [126, 127, 128, 129]


def test_decayed_lfu_keeps_a_frequent_recent_row_over_a_newer_single_use(key_dtype, device):
    t = _table("decayed_lfu", key_dtype, device, max_capacity=2, half_life=100)
    t.find_or_insert(_k([1, 1, 1, 2], key_dtype, device))
    t.find_or_insert(_k([2], key_dtype, device))  # 2: two accesses, the latest; 1: three, one tick older
    t.find_or_insert(_k([3], key_dtype, device))
    assert sorted(t.export().keys.tolist()) == [1, 3]  # lru would have evicted 1
    t.find_or_insert(_k([4], key_dtype, device))
    assert sorted(t.export().keys.tolist()) == [1, 4]  # 3 and 4 both seen once: the older goes


def test_half_life_is_checked():
    with pytest.raises(ValueError, match="half_life must be an int >= 1, got 0"):
        KeyValueTable(2, eviction="decayed_lfu", half_life=0)


# -------------------------------------------------------------------------------------------------------------- custom
def test_custom_scores_come_from_the_caller(key_dtype, device):
    t = _table("custom", key_dtype, device)
    t.find_or_insert(_k([1, 2, 1], key_dtype, device), scores=torch.tensor([10, 20, 30], device=device))
    assert _scores(t, [1, 2]) == [30, 20]  # duplicates: the last occurrence wins
    t.find_or_insert(_k([1, 3], key_dtype, device))  # no scores: kept, and new keys start at 0
    assert _scores(t, [1, 2, 3]) == [30, 20, 0]
    t.find(_k([2], key_dtype, device), update_scores=True)
    assert _scores(t, [2]) == [20]
    extremes = torch.tensor([-(2**63), 2**63 - 1], device=device)
    t.insert_or_assign(_k([2, 3], key_dtype, device), torch.zeros(2, 2, device=device), scores=extremes)
    assert _scores(t, [2, 3]) == [-(2**63), 2**63 - 1]
    assert sorted(t.restrict(2).keys.tolist()) == [2]


def test_custom_bounded_keeps_highest_scores(key_dtype, device):
    t = _table("custom", key_dtype, device, max_capacity=2)
    t.find_or_insert(_k([1, 2], key_dtype, device), scores=torch.tensor([5, 1], device=device))
    t.find_or_insert(_k([3], key_dtype, device), scores=torch.tensor([3], device=device))
    assert sorted(t.export().keys.tolist()) == [1, 3]


@pytest.mark.parametrize("policy", ["lru", "lfu", "epoch_lru", "epoch_lfu", "decayed_lfu", "custom"])
def test_every_policy_evicts_the_lowest_score(policy, key_dtype, device):
    got = []
    t = _table(policy, key_dtype, device, max_capacity=8, on_evict=lambda k, v, s: got.append((k.cpu(), s.cpu())))
    gen = torch.Generator().manual_seed(0)
    for step in range(30):
        keys = torch.randint(0, 20, (5,), generator=gen).to(key_dtype).to(device)
        scores = torch.randint(-5, 5, (5,), generator=gen).to(device) if policy == "custom" else None
        t.epoch = step // 10
        before = t.export()
        before_scores = dict(zip(before.keys.tolist(), before.scores.tolist()))
        got.clear()
        t.find_or_insert(keys, scores=scores)
        pinned = set(keys.tolist())
        survivors = [s for k, s in before_scores.items() if k not in pinned and t.contains(_k([k], key_dtype, device))]
        for k, s in got:
            for key, score in zip(k.tolist(), s.tolist()):
                if key in before_scores:
                    assert key not in pinned
                    assert score == before_scores[key]
                    assert all(score <= other for other in survivors)
        assert t.size() <= 8 and t.size() == t.inserted - t.evicted


# ------------------------------------------------------------------------------------------------------------ defaults
def test_bounded_table_config_gets_the_measured_default():
    from dynemb.cli import EVICTIONS
    from dynemb.collection.config import TableConfig
    from dynemb.table.policy import DEFAULT_BOUNDED

    assert DEFAULT_BOUNDED is EvictionPolicy.DECAYED_LFU
    assert TableConfig(name="t", dim=2, max_capacity=10).eviction is DEFAULT_BOUNDED
    assert TableConfig(name="t", dim=2, max_capacity=10, eviction="lru").eviction is EvictionPolicy.LRU
    assert TableConfig(name="t", dim=2).eviction is None  # unbounded: nothing is evicted, the table's lru
    assert TableConfig(name="t", dim=2, vocabulary_size=5).eviction is None  # static tables have no policy
    assert set(EVICTIONS) == {p.value for p in EvictionPolicy} - {"custom"}  # the CLI offers every policy


def test_half_life_is_configured_through_table_config_and_module():
    import dynemb
    from dynemb import EmbeddingCollection, FeatureConfig, TableConfig

    ec = EmbeddingCollection([TableConfig(name="u", dim=2, max_capacity=8, half_life=4)],
                             [FeatureConfig(name="u", table="u")])
    table = ec.embeddings["u"].table
    assert (table.policy.value, table.half_life) == ("decayed_lfu", 4)
    assert dynemb.DynamicEmbedding(2, eviction="decayed_lfu", half_life=3, max_capacity=8).config()["half_life"] == 3
    with pytest.raises(ValueError, match="half_life"):
        TableConfig(name="u", dim=2, half_life=0)


def test_half_life_with_another_policy_is_an_error():
    import dynemb
    from dynemb import TableConfig

    with pytest.raises(ValueError, match="half_life applies to eviction='decayed_lfu' only"):
        KeyValueTable(2, half_life=8)
    with pytest.raises(ValueError, match="half_life applies to eviction='decayed_lfu' only"):
        dynemb.DynamicEmbedding(2, eviction="lfu", half_life=8, max_capacity=8)
    with pytest.raises(ValueError, match=r"TableConfig\('u'\).half_life applies"):
        TableConfig(name="u", dim=2, max_capacity=10, eviction="lru", half_life=3)


@pytest.mark.parametrize("policy", ["lru", "epoch_lru", "decayed_lfu"])
def test_large_lookups_stamp_the_same_scores_and_versions_on_every_path(policy):
    """Batches past the kernels' threshold (4096 rows) write both stamps in one pass on the numba path (score and
    version share a cache line); the torch path writes them one after the other. Same scores, same versions, same
    changes, through growth of the table, and the two columns stay interleaved as the table grows."""
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(-(2**62), 2**62, (n,), generator=g) for n in (5000, 9000, 7000)]
    batches.append(torch.cat([batches[0][:3000], batches[2][:3000]]))  # hits only
    pytest.importorskip("numba")
    tables = {b: KeyValueTable(4, eviction=policy, init_capacity=1024, backend=b) for b in ("torch", "numba")}
    for step, keys in enumerate(batches):
        for backend, t in tables.items():
            t.epoch = step // 2
            with use_backend(backend):  # the column kernels follow the process default
                t.find_or_insert(keys)
            assert t.scores.stride() == (2,) and t._cols["version"].data_ptr() == t.scores.data_ptr() + 8
        a, b = (tables[k].export() for k in ("torch", "numba"))
        assert torch.equal(a.keys, b.keys) and torch.equal(a.scores, b.scores)
        versions = [t._cols["version"][: t.size()] for t in tables.values()]  # the same keys in the same rows
        assert torch.equal(*versions) and int(versions[0].max()) == step + 1
        for since in (-1, 0, 2):
            assert torch.equal(tables["torch"].changes_since(since)[0], tables["numba"].changes_since(since)[0])
    assert tables["numba"].capacity > 1024


def _interleaved(t) -> bool:
    return t.scores.stride() == (2,) and t._cols["version"].data_ptr() == t.scores.data_ptr() + 8


def test_stamps_stay_interleaved_when_a_byte_budget_or_a_fast_tier_resizes_the_columns():
    """Growth, the shrink to a byte budget (a slot added) and a tiered table's resize of its fast tier all go through
    ``RowStore._resize_columns``: the scores and versions come through intact and stay interleaved."""
    from dynemb.table import Tiers, TieredTable

    g = torch.Generator().manual_seed(5)
    keys = torch.randint(-(2**62), 2**62, (3000,), generator=g)
    t = KeyValueTable(8, max_bytes=200_000, init_capacity=64)
    t.find_or_insert(keys[:2000])
    t.find_or_insert(keys[:500])
    before = t.export()
    t.add_slot("m", 32)  # the bound shrinks: lowest scores evicted, columns cut to the new capacity
    after = t.export()
    assert _interleaved(t) and t.capacity == t.max_capacity < before.keys.numel() == 2000
    kept = dict(zip(before.keys.tolist(), before.scores.tolist()))
    assert all(kept[k] == s for k, s in zip(after.keys.tolist(), after.scores.tolist()))
    for tiers in (Tiers(fast_bytes=1 << 16), Tiers(fast_capacity=1000)):
        tiered = TieredTable(4, tiers=tiers, seed=0)
        assert _interleaved(tiered)
        tiered.find_or_insert(keys)  # past the fast tier: rows move down, the fast tier is sized to its budget
        assert _interleaved(tiered)
        assert sorted(tiered.export().keys.tolist()) == sorted(keys.unique().tolist())


def test_decayed_lfu_evicts_the_same_key_on_both_backends_whatever_the_dedup_order():
    """Wide-span (hashed) ids: the numba dedup orders a batch's keys by first occurrence, the torch one ascending,
    so a key sits at different positions of the score arithmetic. Found by review: a score one unit apart, and a
    different key evicted."""
    import dynemb
    from dynemb.functional import embedding_lookup_sparse
    from dynemb.table.rows import Rows

    first = 2**62  # the largest key of the batch, which comes first: last in ascending order
    batch = torch.tensor([first] + [-(2**62) + 7 * i for i in range(16)])
    results = []
    for backend in ("numba", "torch"):
        with use_backend(backend):
            emb = dynemb.DynamicEmbedding(2, seed=1, eviction="decayed_lfu", half_life=16, max_capacity=64)
            dynemb.optim.SGD([emb], lr=0.1, fused=True)
            keys = torch.cat([torch.tensor([5]), batch])  # 5: not in the batch, scored just above the first key
            scores = torch.tensor([4442440, 4439985] + [4600000] * 16)
            emb.table.replace(Rows(keys, torch.zeros(18, 2), scores, {}))
            emb.table.clock = 999
            embedding_lookup_sparse(emb, batch, torch.tensor([0]), combiner="sum").sum().backward()
            got = emb.table.export()
            results.append((got.keys.tolist(), got.scores.tolist(), emb.table.evict(1).keys.tolist()))
    assert results[0] == results[1]
