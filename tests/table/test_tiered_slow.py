"""SlowStore on its own: rows keep every column through growth (new row files), slots added to rows already
stored, a cast, exchanges and erases; one file per column remains."""

from __future__ import annotations

import os

import pytest
import torch

from dynemb.table import KeyValueTable, Rows
from dynemb.table.slow import SlowStore


def _rows(keys: torch.Tensor, dim: int) -> Rows:
    values = keys.float().unsqueeze(1).expand(-1, dim) + torch.arange(dim)
    return Rows(keys, values, keys * 3, {"m": values * 2})


@pytest.mark.parametrize("where", ["host", "disk"])
def test_rows_survive_growth_slots_casts_and_exchanges(where, tmp_path):
    table = KeyValueTable(3)
    table.add_slot("m", 3)
    store = SlowStore(table, "host" if where == "host" else str(tmp_path), init_capacity=16)
    keys = torch.randperm(5000)[:3000] - 2500
    for part in keys.split(700):  # grows 16 -> past 3000 rows: several new files per column
        store.put(_rows(part, 3), part + 1)
    store.add_slot("v", 2, init=0.5)
    store.cast(torch.float16)
    store.cast(torch.float16)  # a no-op
    new = _rows(torch.arange(10_000, 10_050), 3)  # rows as the (cast) fast tier would send them down
    new = Rows(new.keys, new.values.half(), new.scores, {"m": new.slots["m"], "v": torch.zeros(50, 2)})
    taken, versions = store.exchange(keys[:100], new, torch.zeros(50, dtype=torch.int64))
    assert torch.equal(taken.keys, keys[:100]) and torch.equal(versions, keys[:100] + 1)
    assert torch.equal(taken.values, _rows(keys[:100], 3).values.half())
    assert torch.equal(taken.slots["m"], _rows(keys[:100], 3).slots["m"]) and bool((taken.slots["v"] == 0.5).all())
    assert torch.equal(store.erase(torch.cat([keys[100:110], torch.tensor([99_999])])).sort().values,
                       keys[100:110].sort().values)
    everything, _ = store.export()
    expected = torch.cat([keys[110:], torch.arange(10_000, 10_050)])
    assert store.size() == expected.numel() and torch.equal(everything.keys.sort().values, expected.sort().values)
    order = torch.argsort(everything.keys)
    want = _rows(everything.keys[order], 3)
    assert torch.equal(everything.scores[order], want.scores)
    assert torch.equal(everything.values[order], want.values.half())
    if where == "disk":
        (directory,) = os.listdir(tmp_path)
        (name,) = os.listdir(tmp_path / directory)  # one file: a row of every column side by side
        assert name.endswith(".rows")
    store.close()
