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
       batched=st.booleans())
def test_two_tables_whose_keys_meet_never_answer_with_each_others_rows(a, b, meet, capacity, batched):
    group = GroupCache(DIM, torch.float32, "cpu", capacity, tables=2)
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
