"""Training with the numba kernels (dedup, pooled forward, fused backward + optimizer, step-mode row gradients)
equals training with the torch reference: hypothesis over every optimizer, fused and step modes, combiners,
weights, duplicate ids and extreme keys, on dynamic and static tables.

What is bit-identical and what is within a tolerance (float32):

- dedup, every pooled forward (sum/mean/sqrtn, weighted or not: weighted sums use FMA as torch's
  ``embedding_bag`` does) and the whole training of SGD (with momentum, Nesterov, weight decay):
  **bit-identical**, asserted with ``torch.equal``;
- Adagrad, Adam, FTRL and RowWiseAdagrad are within ``rtol=atol=1e-5`` after several steps (measured: at most a
  few ulps, in one element in tens to hundreds; Adagrad is most often bit-identical): the last rounding of an
  update can differ where torch's compiler contracted a multiply-add that the kernel does not (or the reverse),
  ``pow`` (FTRL) is not correctly rounded in either implementation, and RowWiseAdagrad's row norm is a
  vectorized reduction in torch and a sequential one here.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, HealthCheck, given, settings

import dynemb
from dynemb import optim
from dynemb.functional import embedding_lookup_sparse
from dynemb.kernels import use_backend

pytest.importorskip("numba")

D = 6
OPTIMIZERS = {
    "sgd": lambda t, f: optim.SGD(t, lr=0.3, fused=f),
    "sgd_momentum_wd": lambda t, f: optim.SGD(t, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True, fused=f),
    "adagrad": lambda t, f: optim.Adagrad(t, lr=0.2, lr_decay=0.01, weight_decay=0.01, fused=f),
    "rowwise_adagrad": lambda t, f: optim.RowWiseAdagrad(t, lr=0.2, fused=f),
    "adam": lambda t, f: optim.Adam(t, lr=0.05, fused=f),
    "ftrl": lambda t, f: optim.FTRL(t, lr=0.2, l1=0.001, l2=0.01, fused=f),
    "ftrl_power": lambda t, f: optim.FTRL(t, lr=0.2, learning_rate_power=-0.7, fused=f),
}


def _keys(key_dtype: torch.dtype) -> torch.Tensor:
    info = torch.iinfo(key_dtype)
    return torch.tensor([info.min, info.max, -1, 0, 1, 0x5851F42D, info.min + 1, info.max - 1, 42, 7],
                        dtype=key_dtype)


@st.composite
def batches(draw):
    """A few batches of bags over 10 keys (repeats within and across bags, empty bags)."""
    out = []
    for _ in range(draw(st.integers(1, 3))):
        lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
        n = sum(lengths)
        idx = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
        weights = draw(st.one_of(st.none(), st.lists(st.floats(-2, 2, width=32), min_size=n, max_size=n)))
        out.append((idx, lengths, weights, draw(st.integers(0, 2**31))))
    return out


def _train(backend: str, static: bool, key_dtype, optimizer: str, fused: bool, combiner: str, data,
           dim: int = D) -> tuple:
    """Outputs of every step, and every key's row and slots afterwards."""
    with use_backend(backend):
        if static:
            emb = dynemb.StaticEmbedding(10, dim, key_dtype=key_dtype, seed=3)
            keys = torch.arange(10, dtype=key_dtype)
        else:
            emb = dynemb.DynamicEmbedding(dim, key_dtype=key_dtype, seed=3)
            keys = _keys(key_dtype)
        opt = OPTIMIZERS[optimizer]([emb], fused)
        outs = []
        for idx, lengths, weights, seed in data:
            lengths = torch.tensor(lengths)
            offsets = lengths.cumsum(0) - lengths
            w = None if weights is None else torch.tensor(weights, dtype=torch.float32)
            out = embedding_lookup_sparse(emb, keys[torch.tensor(idx, dtype=torch.int64)], offsets, w, combiner)
            outs.append(out.detach().clone())
            (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))).sum().backward()
            opt.step()
            opt.zero_grad()
        table = emb.table
        rows = table.find_rows(keys)
        state = [torch.where(rows.unsqueeze(1) >= 0, src.index_select(0, rows.clamp(min=0)), 0.0)
                 for src in [table.values] + [table.slot(n) for n in table.slot_names]]
        return outs, state


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=batches(), optimizer=st.sampled_from(sorted(OPTIMIZERS)), fused=st.booleans(),
       combiner=st.sampled_from(["sum", "mean", "sqrtn"]), key_dtype=st.sampled_from([torch.int64, torch.int32]),
       static=st.booleans(), dim=st.sampled_from([D, 8, 24, 64, 96]))
@example(data=[([0, 0], [2], [0.0, 2.802596928649634e-45], 0)], optimizer="adagrad", fused=False, combiner="mean",
         key_dtype=torch.int64, static=False, dim=D)  # a weight sum that underflows: NaN on both paths, alike
@pytest.mark.slow
def test_training_matches_torch(data, optimizer, fused, combiner, key_dtype, static, dim):
    # dim: the kernels' gradient sums run in vector registers by blocks of 64, 32, 16 or 8 columns where one divides
    # the dimension (64 and 96: more than one block), in place otherwise (D)
    got_outs, got_state = _train("numba", static, key_dtype, optimizer, fused, combiner, data, dim)
    ref_outs, ref_state = _train("torch", static, key_dtype, optimizer, fused, combiner, data, dim)
    assert torch.equal(got_outs[0], ref_outs[0])  # the first step reads untouched rows
    exact = optimizer.startswith("sgd")
    for got, ref in zip(got_outs + got_state, ref_outs + ref_state):
        # equal_nan: a weight sum that underflows (hypothesis found 2.8e-45) makes both paths NaN in the same places
        torch.testing.assert_close(got, ref, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5, equal_nan=True)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "adam"])
def test_a_zero_divisor_gives_torchs_nan_not_an_exception(optimizer):
    """``eps=0`` and a zero gradient divide zero by zero: torch gives NaN, and so do the kernels (numpy's error
    model, which also lets LLVM vectorize their divisions and square roots), where Python's would raise
    ZeroDivisionError inside the backward."""
    make = {"adagrad": lambda t: optim.Adagrad(t, lr=0.1, eps=0.0),
            "rowwise_adagrad": lambda t: optim.RowWiseAdagrad(t, lr=0.1, eps=0.0),
            "adam": lambda t: optim.Adam(t, lr=0.1, eps=0.0)}[optimizer]
    results = []
    for backend in ("numba", "torch"):
        with use_backend(backend):
            emb = dynemb.DynamicEmbedding(D, seed=1)
            opt = make([emb])
            out = embedding_lookup_sparse(emb, torch.tensor([3, 4]), torch.tensor([0, 1]), combiner="sum")
            (out * torch.tensor([[0.0] * D, [1.0] * D])).sum().backward()  # key 3: a zero gradient
            opt.step()
            results.append(emb.find(torch.tensor([3, 4])))
    assert results[1][0].isnan().all() and not results[1][1].isnan().any()  # what torch does
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("fused", [True, False])
def test_a_kernel_step_changes_the_table_like_torch(fused):
    """A non-hypothesis anchor: one RowWiseAdagrad step on 2,000 ids with repeats moves rows and slots alike."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-500, 500, (2000,), generator=g)
    offsets = torch.arange(0, 2000, 8)
    grad = torch.randn(250, D, generator=g)
    results = []
    for backend in ("numba", "torch"):
        with use_backend(backend):
            emb = dynemb.DynamicEmbedding(D, seed=1)
            opt = optim.RowWiseAdagrad([emb], lr=0.5, fused=fused)
            (embedding_lookup_sparse(emb, ids, offsets, combiner="mean") * grad).sum().backward()
            opt.step()
            keys = torch.arange(-500, 500)
            results.append((emb.find(keys), emb.table.slot(emb.table.slot_names[0])[emb.table.find_rows(keys)]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-6)
    assert not torch.equal(results[1][0], dynemb.DynamicEmbedding(D, seed=1).find(torch.arange(-500, 500)))


@pytest.mark.parametrize("fused", [True, False])
def test_rows_moved_between_forward_and_backward_get_their_gradient(fused):
    """An erase between forward and backward moves the table's last row into the hole: the backward's row check
    (the ``rows_current`` kernel, then torch's re-find) sends each gradient to its key's new row, as torch does."""
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(40)
    grad = torch.randn(10, D, generator=g)
    results = []
    for backend in ("numba", "torch"):
        with use_backend(backend):
            emb = dynemb.DynamicEmbedding(D, seed=1)
            emb.table.find_or_insert(torch.arange(60))
            opt = optim.SGD([emb], lr=0.5, fused=fused)
            out = embedding_lookup_sparse(emb, ids, torch.arange(0, 40, 4))
            assert emb.table.erase(torch.tensor([3, 50])) == 2  # key 59 (last row) moves into key 3's row
            (out * grad).sum().backward()
            opt.step()
            results.append(emb.find(torch.arange(60)))
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0][10:40], dynemb.DynamicEmbedding(D, seed=1).find(torch.arange(10, 40)))
