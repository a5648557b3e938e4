"""TieredTable.replace_chunks and load_chunk, the streamed load of a checkpoint: against replace() and a dict
model, and bad chunks rejected with the table unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.table import KeyValueTable, Rows, TieredTable, Tiers

INT64 = torch.iinfo(torch.int64)


def table(fast: int = 3) -> TieredTable:
    t = TieredTable(2, tiers=Tiers(fast_capacity=fast), initializer="zeros", eviction="lfu")
    t.add_slot("m", 1)
    return t


def rows(keys, base: float = 0.0) -> Rows:
    k = torch.tensor(keys, dtype=torch.int64)
    v = torch.stack([k.double() + base, -k.double()], 1).float()
    return Rows(k, v, torch.remainder(k, 97) + 7 + int(base), {"m": v[:, :1] * 2})


def content(t) -> dict:
    r = t.export()
    return {int(k): (r.values[i].tolist(), int(r.scores[i]), r.slots["m"][i].tolist()) for i, k in enumerate(r.keys)}


def test_chunks_equal_one_replace():
    keys = [INT64.min, -1, 0, INT64.max] + list(range(5, 40))
    chunks = [rows(keys[i : i + 5]) for i in range(0, len(keys), 5)]
    t, ref = table(), KeyValueTable(2, initializer="zeros", eviction="lfu")
    ref.add_slot("m", 1)
    t.clock = ref.clock = 4
    t.replace_chunks(chunks, total=len(keys))
    ref.replace(rows(keys))
    assert content(t) == content(ref) and t.size() == len(keys) == t.inserted
    assert t.stats()["tiers"]["fast"]["rows"] <= 5 and bool((t.slow._cols["version"][: t.slow.size()] == 4).all())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(-8, 8), unique=True, max_size=6),
                          st.lists(st.integers(-8, 8), unique=True, max_size=6)), max_size=5))
def test_load_chunk_matches_dict_model(deltas):
    t = table(2)
    t.replace_chunks([rows([1, 2, 3]), rows([4, 5, -1])])
    model = content(t)
    for n, (deleted, upserted) in enumerate(deltas):
        t.load_chunk(rows(upserted, base=n), deleted=torch.tensor(deleted, dtype=torch.int64))
        for k in deleted:
            model.pop(k, None)
        model.update(content_of(rows(upserted, base=n)))
        assert content(t) == model


def content_of(r: Rows) -> dict:
    return {int(k): (r.values[i].tolist(), int(r.scores[i]), r.slots["m"][i].tolist()) for i, k in enumerate(r.keys)}


@pytest.mark.parametrize("bad, match", [
    (Rows(torch.tensor([9, 9]), torch.zeros(2, 2), None, {}), "unique"),
    (Rows(torch.tensor([9], dtype=torch.uint64), torch.zeros(1, 2), None, {}), "keys must have dtype"),
    (Rows(torch.tensor([9]), torch.zeros(1, 3), None, {}), "values must have shape"),
    (Rows(torch.tensor([9]), torch.zeros(1, 2), None, {"v": torch.zeros(1, 1)}), "not defined"),
])
def test_bad_chunk_leaves_table_unchanged(bad, match):
    t = table()
    t.replace_chunks([rows([1, 2, 3]), rows([4, 5])])
    before = content(t)
    with pytest.raises((TypeError, ValueError), match=match):
        t.load_chunk(bad, deleted=torch.tensor([1, 4]))
    assert content(t) == before
    with pytest.raises(ValueError, match="unique"):  # a key loaded by an earlier chunk
        t.replace_chunks([rows([1, 2]), rows([2, 3])])
