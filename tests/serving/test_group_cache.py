"""The group cache: tables that share one cache never answer with each other's rows, keys that meet included."""

from types import SimpleNamespace

import torch
from hypothesis import given, settings, strategies as st

from dynemb.serving.ps.group_cache import GroupCache, TableCache
from dynemb.serving.ps.request_lookup import _insert_cold, _Part

DIM = 3


def _row(table: int, keys: torch.Tensor) -> torch.Tensor:
    """Each (table, key)'s own row: a function of both, so a row answered for the wrong table shows."""
    k = keys.to(torch.float64).view(-1, 1)
    return torch.cat([k * 0 + table, (k % 1000), (k // 1000) % 997], 1).to(torch.float32)


keys_st = st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=12, unique=True)


@settings(max_examples=60, deadline=None)
@given(a=keys_st, b=keys_st, meet=st.lists(st.integers(0, 11), max_size=6), capacity=st.integers(1, 16),
       batched=st.booleans(), fused=st.booleans())
def test_two_tables_whose_keys_meet_never_answer_with_each_others_rows(a, b, meet, capacity, batched, fused):
    group = GroupCache(DIM, torch.float32, "cpu", capacity, tables=2)
    group._fused = fused and group._fused  # the one-pass kernel, or the table's find and a check of the keys
    caches = [TableCache(group, 0, capacity), TableCache(group, 1, capacity)]
    keys = [torch.tensor(a, dtype=torch.int64), torch.tensor(b, dtype=torch.int64)]
    if a:  # keys of table 1 on the cache key of one of table 0: k1 ^ salt1 == k0 ^ salt0
        met = keys[0][torch.tensor([m % len(a) for m in meet], dtype=torch.int64)] ^ group.salts[0] ^ group.salts[1]
        keys[1] = torch.unique(torch.cat([keys[1], met]))
    if batched:  # both tables in one insert, as a request's cold tables are (request_lookup._insert_cold)
        sizes = [k.numel() for k in keys]
        part = _Part(group, [SimpleNamespace(epoch=0), SimpleNamespace(epoch=0)], [0, 1], sizes, None, [0, 0],
                     sizes)
        part.ukey = torch.cat(keys)
        part.utid = torch.repeat_interleave(torch.arange(2), torch.tensor(sizes))
        part.rows = torch.cat([_row(0, keys[0]), _row(1, keys[1])])
        part.salts = group.salts
        at = torch.arange(part.ukey.numel())
        _insert_cold(part, [(k, s) for k, s in enumerate(at.split(sizes)) if s.numel()])
    else:
        for t in (0, 1):
            caches[t].insert_or_assign(keys[t], _row(t, keys[t]))
    for t in (0, 1):
        # asked for its own keys and for the other table's: a found row is always this table's row of that key
        asked = torch.cat(keys)
        rows, found = caches[t].find(asked)
        assert torch.equal(rows[found], _row(t, asked[found]))
        assert not bool(rows[~found].any())
        held = caches[t].keys()
        assert set(held.tolist()) <= set(keys[t].tolist())
        assert torch.equal(caches[t].export().values, _row(t, caches[t].export().keys))
    assert caches[0].size() + caches[1].size() == group.kv.size() <= capacity


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=40), asks=st.lists(
    st.lists(st.integers(0, 45), max_size=30), min_size=1, max_size=4), capacity=st.integers(1, 24),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_the_one_pass_find_is_the_tables_find(keys, asks, capacity, dtype):
    # the same rows, found flags and LRU stamps (so the same evictions after) as KeyValueTable.find and a check
    # of the carried keys, for every row dtype (the key is carried in 2 or 4 columns)
    keys = torch.tensor(keys, dtype=torch.int64).unique()
    groups = [GroupCache(DIM, dtype, "cpu", capacity, tables=2) for _ in range(2)]
    groups[1]._fused = False
    for group in groups:
        TableCache(group, 0, capacity).insert_or_assign(keys[: len(keys) // 2], _row(0, keys[: len(keys) // 2]))
        TableCache(group, 1, capacity).insert_or_assign(keys, _row(1, keys))
    pool = torch.cat([keys, torch.tensor([5, -5, 2**62], dtype=torch.int64)])
    for ask in asks:
        asked = pool[torch.tensor([i % len(pool) for i in ask], dtype=torch.int64)]
        for t in (0, 1):
            (rows, found), (ref_rows, ref_found) = (TableCache(g, t, capacity).find(asked) for g in groups)
            assert torch.equal(found, ref_found) and torch.equal(rows.view(torch.int16), ref_rows.view(torch.int16))
        TableCache(groups[0], 0, capacity).insert_or_assign(asked[:3], _row(0, asked[:3]))
        TableCache(groups[1], 0, capacity).insert_or_assign(asked[:3], _row(0, asked[:3]))
    n = groups[0].kv.size()
    assert n == groups[1].kv.size()
    assert torch.equal(groups[0].kv.scores[:n], groups[1].kv.scores[:n])
    assert torch.equal(groups[0].kv.row_keys[:n], groups[1].kv.row_keys[:n])
