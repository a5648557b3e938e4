"""The numba CPU lookup kernel returns exactly what the torch path returns (slots and rows), in every case."""

from __future__ import annotations

import pytest
import torch

from dynemb.kernels import use_backend
from dynemb.table import HashIndex

pytest.importorskip("numba")  # the kernel is optional; without numba the torch path is the only one


def _both_paths(idx: HashIndex, keys: torch.Tensor) -> tuple[list, list]:
    """Look ``keys`` up in the same index under each backend (the index follows the process default); ``find_all``
    (the rows-only kernel pass on CPU) agrees with both."""
    with use_backend("numba"):
        kernel = [t.tolist() for t in idx.lookup(keys)]
        rows, every = idx.find_all(keys)
    with use_backend("torch"):
        reference = [t.tolist() for t in idx.lookup(keys)]
        torch_rows, torch_every = idx.find_all(keys)
    assert rows.dtype == torch_rows.dtype == torch.int64
    assert rows.tolist() == torch_rows.tolist() == reference[1]
    assert every is torch_every is all(row >= 0 for row in reference[1])
    return kernel, reference


def test_extreme_fill_and_absent_keys(key_dtype, extreme_keys):
    idx = HashIndex(key_dtype, "cpu", capacity=64)
    idx.insert(extreme_keys[::2], torch.arange(0, extreme_keys.numel(), 2))
    query = torch.cat([extreme_keys, extreme_keys.flip(0), torch.tensor([7, -7, 7], dtype=key_dtype)])
    kernel, reference = _both_paths(idx, query)
    assert kernel == reference
    assert kernel[1][: extreme_keys.numel()] == [i if i % 2 == 0 else -1 for i in range(extreme_keys.numel())]


@pytest.mark.parametrize("where", ["first", "last"])
def test_spill_chains_and_holes(key_dtype, colliding_keys, where):
    keys = colliding_keys(key_dtype, where, 24)
    idx = HashIndex(key_dtype, "cpu", capacity=64)
    idx.insert(keys, torch.arange(24))
    idx.remove(idx.find_slots(keys[1::4]))  # holes inside the chain; keys behind them stay reachable
    kernel, reference = _both_paths(idx, keys)
    assert kernel == reference
    assert sum(row >= 0 for row in kernel[1]) == 24 - keys[1::4].numel()


def test_random_batches_after_growth_and_removal(key_dtype):
    gen = torch.Generator().manual_seed(3)
    info = torch.iinfo(key_dtype)
    keys = torch.unique(torch.randint(info.min, info.max, (6000,), generator=gen, dtype=torch.int64).to(key_dtype))
    idx = HashIndex(key_dtype, "cpu", capacity=keys.numel() // 3)
    idx.rehash(keys[:2000], torch.arange(2000), capacity=keys.numel())
    idx.insert(keys[2000:], torch.arange(2000, keys.numel()))
    idx.remove(idx.find_slots(keys[::5]))
    query = torch.cat([keys, torch.randint(info.min, info.max, (500,), generator=gen, dtype=torch.int64).to(key_dtype)])
    kernel, reference = _both_paths(idx, query[torch.randperm(query.numel(), generator=gen)])
    assert kernel == reference


def test_insert_builds_the_same_layout(key_dtype, colliding_keys):
    # One batch where bucket 255 (of 256) overflows, wraps around, and meets keys whose home is bucket 0: placement
    # order across rounds decides who gets which slot, and both paths must agree on every slot and overflow flag.
    gen = torch.Generator().manual_seed(5)
    info = torch.iinfo(key_dtype)
    crowded = torch.cat([colliding_keys(key_dtype, "last", 24), colliding_keys(key_dtype, "first", 12)])
    spread = torch.randint(info.min, info.max, (300,), generator=gen, dtype=torch.int64).to(key_dtype)
    spread = torch.unique(spread[~torch.isin(spread, crowded)])
    layouts = []
    for backend in ("numba", "torch"):
        idx = HashIndex(key_dtype, "cpu", capacity=128 * HashIndex.width_for(key_dtype), backend=backend)
        assert idx.num_buckets == 256
        idx.insert(crowded, torch.arange(crowded.numel()))
        idx.insert(spread, torch.arange(spread.numel()) + 100)
        idx.remove(idx.find_slots(crowded[::5]))
        idx.insert(crowded[::5], torch.arange(crowded[::5].numel()) + 1000)  # refills holes in spilled chains
        assert idx.find(crowded).ge(0).all() and idx.find(spread).ge(0).all()
        layouts.append((idx._buckets.clone(), idx.overflow.clone()))
    assert torch.equal(layouts[0][0], layouts[1][0]) and torch.equal(layouts[0][1], layouts[1][1])


@pytest.mark.parametrize("hot", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("passes", [1, 2, 3])
def test_radix_sort_is_a_stable_sort_of_its_digits(hot, passes):
    """``radix_sort`` orders words by the bits it sorts on and keeps the input order among equal digits, whether a
    pass scatters word by word or, where a hot word (a repeated key) made a digit far above the mean, run by run."""
    import numpy as np

    from dynemb.kernels.numba_index import _RUN_PEAK, radix_sort

    rng = np.random.default_rng(passes + int(10 * hot))
    n, shift, digit = 20_000, 15, 9
    words = rng.integers(0, 1 << 62, n, dtype=np.int64).astype(np.uint64)
    words[rng.random(n) < hot] = words[0]  # copies of one word: the runs a later pass meets together
    words = (words & ~np.uint64((1 << shift) - 1)) | np.arange(n, dtype=np.uint64)  # low bits: the position
    got = radix_sort(words.copy(), np.empty(n, np.uint64), shift, digit, passes)
    digits = (words >> np.uint64(shift)) & np.uint64((1 << (digit * passes)) - 1)
    peaks = [np.bincount(((digits >> np.uint64(p * digit)) & np.uint64((1 << digit) - 1)).astype(np.int64)).max()
             for p in range(1, passes)]
    assert any(peak << digit > _RUN_PEAK * n for peak in peaks) == (hot > 0 and passes > 1)  # which scatter ran
    assert np.array_equal(got, words[np.argsort(digits, kind="stable")])
