"""unique_by_hash: distinct keys in hash order, each key's last position, and the inverse map."""

from __future__ import annotations

import torch

from dynemb.table.hashing import key_hash, unique_by_hash


def test_matches_torch_unique(key_dtype, extreme_keys):
    gen = torch.Generator().manual_seed(0)
    info = torch.iinfo(key_dtype)
    pool = torch.cat([extreme_keys, torch.randint(info.min, info.max, (40,), generator=gen).to(key_dtype)])
    keys = pool[torch.randint(0, pool.numel(), (500,), generator=gen)]
    unique, hashes, last, inverse = unique_by_hash(keys)
    assert unique.dtype == key_dtype
    assert sorted(unique.tolist()) == torch.unique(keys).tolist()
    assert torch.equal(hashes, key_hash(unique)) and bool((hashes[1:] > hashes[:-1]).all())
    assert torch.equal(unique[inverse], keys)
    for i, key in enumerate(unique.tolist()):
        positions = (keys == key).nonzero().squeeze(1)
        assert last[i].item() == positions.max().item()


def test_empty_and_single():
    unique, hashes, last, inverse = unique_by_hash(torch.empty(0, dtype=torch.int64))
    assert unique.numel() == hashes.numel() == last.numel() == inverse.numel() == 0
    unique, _, last, inverse = unique_by_hash(torch.tensor([-1, -1, -1]))
    assert unique.tolist() == [-1] and last.tolist() == [2] and inverse.tolist() == [0, 0, 0]
