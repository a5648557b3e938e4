"""The Triton pooled-lookup kernels (``pool``, ``row_grad``) against torch's embedding_bag, and the kernels that
generate initializer rows against the torch initializers, bit for bit (interpreter on CPU without a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from dynemb.functional.find import sort_ids  # noqa: E402
from dynemb.functional.pooling import bag_of, sorted_row_grad  # noqa: E402
from dynemb.kernels import triton_init, triton_pool  # noqa: E402
from dynemb.table.initializers import Constant, Uniform  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@st.composite
def bags(draw):
    """Rows of a table, ids into them (repeats likely) split into bags (some empty), optional weights/divisors."""
    dim = draw(st.sampled_from([1, 3, 8, 33, 300]))  # 300: two column blocks
    num_rows = draw(st.integers(1, 40))
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=8))
    n = sum(lengths)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    ids = torch.randint(-3, 4, (n,), generator=gen) * 1_000_003  # few distinct ids: repeats within and across bags
    lengths = torch.tensor(lengths)
    weighted, divided = draw(st.booleans()), draw(st.booleans())
    return dict(values=torch.randn(num_rows + 7, dim, generator=gen), ids=ids, offsets=lengths.cumsum(0) - lengths,
                weights=torch.rand(n, generator=gen) if weighted else None,
                denom=torch.rand(lengths.numel(), generator=gen) + 0.5 if divided else None, num_rows=num_rows,
                gen=gen)


def _to(d):
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


@settings(max_examples=25, deadline=None)
@given(case=bags())
@pytest.mark.slow
def test_pool_equals_embedding_bag(case):
    c = _to(case)
    s = sort_ids(c["ids"])
    rows = torch.randperm(c["values"].shape[0], generator=case["gen"])[: s.unique.numel()].to(DEVICE)
    got = triton_pool.pool(c["values"], rows, s.inverse, c["offsets"], c["weights"], c["denom"])
    want = F.embedding_bag(rows[s.inverse], c["values"], c["offsets"], mode="sum", per_sample_weights=c["weights"])
    if c["denom"] is not None:
        want = want / c["denom"].unsqueeze(1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    by_id = triton_pool.pool(c["values"], rows[s.inverse], None, c["offsets"], c["weights"], c["denom"])
    assert torch.equal(by_id, got)  # inverse None: rows holds each id's own row


@settings(max_examples=25, deadline=None)
@given(case=bags())
@pytest.mark.slow
def test_row_grad_equals_the_torch_reference(case):
    c = _to(case)
    s = sort_ids(c["ids"])
    grad = torch.randn(c["offsets"].numel(), c["values"].shape[1], generator=case["gen"]).to(DEVICE)
    bag = bag_of(c["offsets"], c["ids"].numel())
    got = triton_pool.row_grad(grad, s.order, s.starts, bag, c["weights"])
    want = sorted_row_grad(grad, s.order, s.starts, bag, c["weights"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # bags of one id each: no bag tensor (None), the same sums as the bags written out
    ones = torch.randn(c["ids"].numel(), grad.shape[1], generator=case["gen"]).to(DEVICE)
    each = torch.arange(c["ids"].numel(), device=DEVICE)
    want = sorted_row_grad(ones, s.order, s.starts, each, c["weights"])
    torch.testing.assert_close(triton_pool.row_grad(ones, s.order, s.starts, None, c["weights"]), want, rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(sorted_row_grad(ones, s.order, s.starts, None, c["weights"]), want)


@pytest.mark.parametrize("key_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("initializer", [Uniform(), Uniform(-3.0, 0.7), Constant(0.1), Constant(-2.0)],
                         ids=["uniform", "uniform_wide", "constant", "constant2"])
def test_initial_rows_are_the_torch_initializer_bit_for_bit(key_dtype, dtype, initializer, extreme_keys):
    keys = torch.cat([extreme_keys, torch.arange(-20, 20, dtype=key_dtype)]).to(DEVICE)
    spec = ("uniform", (initializer.low, initializer.high)) if isinstance(initializer, Uniform) else (
        "constant", (initializer.value,))
    for seed, dim in ((0, 8), (-7, 70), (2**62 + 3, 300)):
        out = torch.full((keys.numel(), dim), float("nan"), dtype=dtype, device=DEVICE)
        triton_init.initial_rows(*spec, keys, seed, out)
        assert torch.equal(out, initializer(keys, dim, dtype, seed))


def test_initial_rows_into_a_slice_of_a_table_and_bad_arguments():
    values = torch.zeros(10, 6, device=DEVICE)
    keys = torch.tensor([5, -5, 2**40], device=DEVICE)
    triton_init.initial_rows("uniform", (-0.05, 0.05), keys, 9, values[4:7])
    assert torch.equal(values[4:7], Uniform()(keys, 6, torch.float32, 9))
    assert not values[:4].any() and not values[7:].any()
    with pytest.raises(ValueError, match="kind must be one of"):
        triton_init.initial_rows("normal", (0.0, 1.0), keys, 0, values[:3])
    with pytest.raises(ValueError, match=r"out must be \[3, D\]"):
        triton_init.initial_rows("uniform", (0.0, 1.0), keys, 0, values[:2])


@settings(max_examples=25, deadline=None)
@given(ids=st.lists(st.sampled_from([0, -1, 1, 2**63 - 1, -(2**63), 5, 5 << 40]), max_size=60))
def test_dedup_groups_ids_in_input_order(ids):
    ids = torch.tensor(ids, dtype=torch.int64, device=DEVICE)
    unique, inverse, order, starts = triton_pool.dedup(ids)
    want = sort_ids(ids)  # the torch reference: one stable sort
    for got, ref in zip((unique, inverse, order, starts), want):
        assert torch.equal(got, ref)
    bare = triton_pool.dedup(ids, inverse=False)
    assert bare[1] is None and all(torch.equal(got, ref) for got, ref in zip(bare[::2] + bare[3:],
                                                                            (unique, order, starts)))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 1500), now=st.integers(-2**40, 2**45),
       spread=st.sampled_from([1 << 10, 1 << 30, 1 << 52]))
def test_decayed_scores_equal_the_torch_ops_bit_for_bit(seed, size, now, spread):
    """decayed_lfu scores (old scores near ``now``, far below it and above its 2**60 ceiling) as the torch
    reference computes them: the same bits, which fused multiply-adds would break (launched without them)."""
    from dynemb.kernels import use_backend
    from dynemb.table import policy

    g = torch.Generator().manual_seed(seed)
    old = now + torch.randint(-spread, spread // 64 + 1, (size,), generator=g)
    n = torch.randint(1, 100, (size,), generator=g)
    with use_backend("torch"):
        want = policy._decayed(old, n, now)
    got = triton_pool.decayed_scores(old.to(DEVICE), n.to(DEVICE), now, policy.DECAY_MATH)
    assert torch.equal(got.cpu(), want)
