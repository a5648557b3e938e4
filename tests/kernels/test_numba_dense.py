"""The dense part's CPU kernels (:mod:`dynemb.kernels.numba_dense`) against the torch ops they replace, bit for bit
(``view(torch.int32)`` equality: signed zeros and NaN payloads included), from zero rows up; and the DLRM and the
dense rule giving the same bits whether the kernels run (no autograd) or torch does (autograd)."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from dynemb.collection import EmbeddingCollection
from dynemb.data.batch import Batch
from dynemb.data.preprocess import Preprocessing, signed_log1p
from dynemb.kernels.numba_dense import select_pairs
from dynemb.models import DLRM, dlrm_tables

SPECIAL = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30, -1e30, 3.0e38]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(2, 9), dim=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_select_pairs_is_index_select_then_cat(rows, n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    stacked = torch.randn(rows, n, dim, generator=g)
    dots = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)
    r, c = torch.triu_indices(n, n, offset=1)
    pairs = r * n + c
    dense = stacked[:, 0]  # a strided view, as the DLRM passes it
    want = torch.cat([dense, dots.index_select(1, pairs)], 1)
    out = torch.empty(rows, dim + len(pairs))
    select_pairs(dots.numpy(), dense.numpy(), pairs.numpy(), out.numpy())
    assert torch.equal(_bits(out), _bits(want))


def _prep(k: int, rule_seed: int) -> Preprocessing:
    g = torch.Generator().manual_seed(rule_seed)
    return Preprocessing(label=None, categorical=("c",), dense=tuple(f"x{i}" for i in range(k)),
                         dense_mean=tuple(torch.randn(k, generator=g).tolist()),
                         dense_std=tuple((torch.rand(k, generator=g) + 0.01).tolist()),
                         dense_min=tuple((-torch.rand(k, generator=g) * 9).tolist()),
                         dense_max=tuple((torch.rand(k, generator=g) * 9).tolist()), dense_rows=9)


def _torch_rule(prep: Preprocessing, x: torch.Tensor) -> torch.Tensor:
    """The dense rule in torch ops alone (what the CPU kernel must reproduce)."""
    mean, std, nan, inf, ninf = prep._constants(x.device)
    z = signed_log1p(x)
    z = torch.where(torch.isnan(z), nan, torch.where(z == float("inf"), inf, torch.where(z == -float("inf"), ninf, z)))
    return (z - mean) / std


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 30), k=st.integers(1, 6), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIAL)), max_size=20))
def test_normalize_kernel_equals_the_torch_rule(rows, k, seed, specials):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-4, 7, k)
    for at, value in specials:
        if rows:
            x.view(-1)[at % x.numel()] = value
    prep = _prep(k, seed)
    batch = Batch(x, {"c": torch.zeros(rows, dtype=torch.int64)}, torch.zeros(rows))
    got = prep.normalize(batch).dense
    assert torch.isfinite(got).all()
    assert torch.equal(_bits(got), _bits(_torch_rule(prep, x)))
    # a non-contiguous dense block takes the same path
    strided = torch.stack([x, x], 2)[:, :, 0]
    assert torch.equal(_bits(prep.normalize(batch.with_dense(strided)).dense), _bits(got))


def test_dlrm_logits_equal_with_and_without_autograd():
    """No autograd: the kernel writes the top MLP's input; with autograd: torch's index_select and cat."""
    torch.manual_seed(0)
    features = [f"f{i}" for i in range(5)]
    tables, feats = dlrm_tables(features, dim=8)
    model = DLRM(3, EmbeddingCollection(tables, feats), dim=8)
    for rows in (0, 1, 7, 300):
        batch = Batch(torch.randn(rows, 3), {f: torch.randint(0, 50, (rows,)) for f in features}, torch.zeros(rows))
        with torch.no_grad():
            fast = model(batch)
        slow = model(batch)
        assert slow.requires_grad or rows == 0
        assert torch.equal(_bits(fast), _bits(slow.detach()))
