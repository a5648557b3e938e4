"""unique_by_hash: distinct keys in hash order, each key's last position, and the inverse map; the numba kernel
returns exactly what the torch sort returns."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from dynemb.kernels import numba_available
from dynemb.table.hashing import key_hash, unique_by_hash

BACKENDS = ["torch"] + (["numba"] if numba_available() else [])
_M64 = (1 << 64) - 1


def _unmix64(h: int) -> int:
    """The key whose ``mix64`` is ``h`` (each step of splitmix64's finalizer inverted), as a signed int."""
    h ^= (h >> 31) ^ (h >> 62)
    h = (h * pow(0x94D049BB133111EB, -1, 1 << 64)) & _M64
    h ^= (h >> 27) ^ (h >> 54)
    h = (h * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & _M64
    h ^= (h >> 30) ^ (h >> 60)
    return h - (1 << 64) if h >> 63 else h


def _check(keys: torch.Tensor, backend: str):
    """unique_by_hash on ``backend`` against its definition and against the torch path, tensor for tensor."""
    got = unique_by_hash(keys, backend)
    unique, hashes, last, inverse = got
    assert unique.dtype == keys.dtype and hashes.dtype == last.dtype == inverse.dtype == torch.int64
    assert sorted(unique.tolist()) == torch.unique(keys).tolist()
    assert torch.equal(hashes, key_hash(unique)) and bool((hashes[1:] > hashes[:-1]).all())
    assert torch.equal(unique[inverse], keys)
    for i, key in enumerate(unique.tolist()):
        assert last[i].item() == (keys == key).nonzero().max().item()
    for mine, reference in zip(got, unique_by_hash(keys, "torch")):
        assert torch.equal(mine, reference)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_unique(key_dtype, extreme_keys, backend):
    gen = torch.Generator().manual_seed(0)
    info = torch.iinfo(key_dtype)
    pool = torch.cat([extreme_keys, torch.randint(info.min, info.max, (40,), generator=gen).to(key_dtype)])
    _check(pool[torch.randint(0, pool.numel(), (500,), generator=gen)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_single(backend):
    unique, hashes, last, inverse = unique_by_hash(torch.empty(0, dtype=torch.int64), backend)
    assert unique.numel() == hashes.numel() == last.numel() == inverse.numel() == 0
    unique, _, last, inverse = unique_by_hash(torch.tensor([-1, -1, -1]), backend)
    assert unique.tolist() == [-1] and last.tolist() == [2] and inverse.tolist() == [0, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shared,repeated", [(3, 1), (16, 0), (17, 0), (12, 5), (400, 40)])
def test_keys_whose_hashes_share_their_top_bits(backend, shared, repeated):
    """The kernel sorts on the hashes' top bits, then orders keys that share them by insertion (runs of up to 16) or
    a merge sort: ``shared`` keys crafted to share their top 40 bits, ``repeated`` of them twice, make runs of
    ``shared + repeated`` on both sides of that limit."""
    gen = torch.Generator().manual_seed(shared)
    low = torch.randint(0, 1 << 24, (shared,), generator=gen).tolist()
    crafted = [_unmix64((0x5A5A5A5A5A << 24) | x) for x in low]
    plain = torch.randint(-(2**63), 2**63 - 1, (300,), generator=gen).tolist()
    keys = torch.tensor(crafted + plain + crafted[:repeated])
    _check(keys[torch.randperm(keys.numel(), generator=gen)], backend)


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=300), repeat=st.integers(0, 300),
       key_dtype=st.sampled_from([torch.int64, torch.int32]))
def test_every_backend_returns_the_torch_tensors(keys, repeat, key_dtype):
    info = torch.iinfo(key_dtype)
    keys = torch.tensor([min(max(k, info.min), info.max) for k in keys], dtype=key_dtype)
    if keys.numel():  # duplicates, each key's last position then matters
        keys = torch.cat([keys, keys[torch.randint(0, keys.numel(), (repeat,), generator=torch.Generator())]])
    for backend in BACKENDS:
        _check(keys, backend)
