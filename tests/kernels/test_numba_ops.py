"""The ``pool`` and ``optim`` kernel families against their torch references, op by op (the tensor contract of
:mod:`dynemb.kernels.dispatch`): dedup, pool, row_grad and sparse_update in its dense and pooled forms, with
duplicate ids, empty bags, weights and every optimizer kind. Equality is exact (``torch.equal``) where
``tests/kernels/test_numba_train.py`` says the kernels are bit-identical, else within 1e-5."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from dynemb import optim
from dynemb.functional.find import sort_ids, spread_groups
from dynemb.functional.pooling import _offsets_valid, bag_of, sorted_row_grad
from dynemb.kernels import optim_kernels, pool_kernels, use_backend
from dynemb.table import EvictionPolicy, KeyValueTable
from dynemb.table.ops import copy_rows, fill_pair, fill_rows, lowest_rows, scatter_rows
from dynemb.table.policy import touch_scores

pytest.importorskip("numba")
POOL = pool_kernels("numba", "cpu")
OPTIM = optim_kernels("numba", "cpu")
D = 5


@st.composite
def bags(draw, key_dtype=torch.int64):
    info = torch.iinfo(key_dtype)
    pool = draw(st.lists(st.integers(info.min, info.max), min_size=1, max_size=6, unique=True))
    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))
    n = sum(lengths)
    ids = torch.tensor(draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n)), dtype=key_dtype)
    weights = draw(st.one_of(st.none(), st.just(torch.randn(n))))
    offsets = torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
    return ids, offsets, weights


@settings(max_examples=60, deadline=None)
@given(data=bags(), narrow=st.booleans())
def test_spread_gives_each_id_its_keys_value_on_both_paths(data, narrow):
    """``spread`` (kernel and torch) inverts a grouping: arange gives the inverse, rows each id's row."""
    assert POOL.spread is not None  # else spread_groups would test its torch fallback twice
    ids = data[0] % 1000 - 500 if narrow else data[0]
    unique, inverse, order, starts = POOL.dedup(ids)
    rows = torch.randperm(50)[: unique.numel()]
    for kernels in (POOL, None):
        assert torch.equal(spread_groups(torch.arange(unique.numel()), order, starts, kernels), inverse)
        assert torch.equal(spread_groups(rows, order, starts, kernels), rows[inverse])
        spread = spread_groups(rows.to(torch.int32), order, starts, kernels)
        assert spread.dtype == torch.int32 and torch.equal(spread, rows[inverse].to(torch.int32))


@settings(max_examples=60, deadline=None)
@given(data=bags(), key_dtype=st.sampled_from([torch.int64, torch.int32]), narrow=st.booleans())
def test_dedup_groups_ids_like_the_sort(data, key_dtype, narrow):
    """Wide int64 spans take the hash table; narrow spans (and int32 ids) the radix sort, equal to the sort."""
    ids = (data[0] % 1000 - 500 if narrow or key_dtype == torch.int32 else data[0]).to(key_dtype)
    unique, inverse, order, starts = POOL.dedup(ids)
    ref = sort_ids(ids)
    assert torch.equal(unique[inverse], ids) and unique.dtype == ids.dtype
    assert sorted(unique.tolist()) == ref.unique.tolist()
    for u in range(unique.numel()):  # each unique id's ids, in input order
        assert order[starts[u]:starts[u + 1]].tolist() == (ids == unique[u]).nonzero().squeeze(1).tolist()
    if narrow or key_dtype == torch.int32:
        assert torch.equal(unique, ref.unique) and torch.equal(inverse, ref.inverse)
    # without inverse: the same grouping, on both paths (the kernel's radix sort and hash table, and torch's sort)
    bare = POOL.dedup(ids, inverse=False)
    assert bare[1] is None and all(torch.equal(a, b) for a, b in zip(bare[::2], (unique, order))) \
        and torch.equal(bare[3], starts)
    bare_ref = sort_ids(ids, inverse=False)
    assert bare_ref.inverse is None and torch.equal(bare_ref.order, ref.order) and torch.equal(bare_ref.starts,
                                                                                              ref.starts)


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("n", [0, 1, 65, 5000, 300_000])
def test_dedup_of_large_batches_groups_ids_like_the_sort(n, key_dtype):
    """Batches past the hypothesis sizes (the kernel's hash table sized for 300k ids, long probe runs), with repeats
    (a skewed draw) and the dtype's extreme keys as the most frequent ids."""
    g = torch.Generator().manual_seed(n)
    info = torch.iinfo(key_dtype)
    pool = torch.cat([torch.tensor([info.min, info.max, -1, 0]),  # the most frequent ids
                      torch.randint(info.min, info.max, (max(n // 3, 1),), generator=g, dtype=torch.int64)])
    ids = pool[(torch.rand(n, generator=g) ** 3 * pool.numel()).long()].to(key_dtype)
    unique, inverse, order, starts = POOL.dedup(ids)
    ref = sort_ids(ids)
    assert torch.equal(unique[inverse], ids) and unique.dtype == ids.dtype
    assert torch.equal(unique.sort().values, ref.unique)
    assert starts[0] == 0 and starts[-1] == n and bool((starts.diff() > 0).all())
    assert torch.equal(ids[order], unique.repeat_interleave(starts.diff()))  # grouped by unique id
    # within a unique id, its ids keep their input order: positions in order rise along each id's occurrences
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(n)
    by_id = inverse.argsort(stable=True)
    assert bool((ranks[by_id].diff()[inverse[by_id][1:] == inverse[by_id][:-1]] > 0).all())


@settings(max_examples=200, deadline=None)
@given(offsets=st.lists(st.integers(-3, 12), min_size=1, max_size=8), n=st.integers(0, 12))
def test_offsets_valid_equals_the_torch_check(offsets, n):
    t = torch.tensor(offsets)
    want = offsets[0] == 0 and offsets[-1] <= n and all(a <= b for a, b in zip(offsets, offsets[1:]))
    assert POOL.offsets_valid(t, n) is want
    assert POOL.offsets_valid(t[::2], n) is POOL.offsets_valid(t[::2].clone(), n)  # a strided view alike
    with use_backend("torch"):
        assert _offsets_valid(t, n) is want


@settings(max_examples=60, deadline=None)
@given(data=bags(), divide=st.booleans(), torch_bag=st.booleans(), dim=st.sampled_from([D, 8, 16, 24, 32, 64, 128]))
def test_pool_and_row_grad_equal_embedding_bag(data, divide, torch_bag, dim):
    """``pool`` by torch's embedding_bag (where torch has fbgemm) and by the numba kernel alike; ``row_grad`` sums in
    vector registers by blocks of columns wherever 8 divides ``dim``, in place otherwise (``D``)."""
    ids, offsets, weights = data
    s = sort_ids(ids)
    values = torch.randn(20, dim)
    rows = torch.randperm(20)[: s.unique.numel()]
    denom = torch.rand(offsets.numel()) + 0.5 if divide else None
    ref = torch.nn.functional.embedding_bag(rows[s.inverse], values, offsets, mode="sum", per_sample_weights=weights)
    ref = ref / denom.unsqueeze(1) if divide else ref
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(POOL, "USE_TORCH_BAG", torch_bag)
        assert torch.equal(POOL.pool(values, rows, s.inverse, offsets, weights, denom), ref)
        assert torch.equal(POOL.pool(values, rows[s.inverse], None, offsets, weights, denom), ref)  # each id's row
    grad = torch.randn(offsets.numel(), dim)
    bag = bag_of(offsets, ids.numel())
    kernel_bag = bag_of(offsets, ids.numel(), POOL)  # the kernel's: int32 here
    assert kernel_bag.dtype == torch.int32 and kernel_bag.tolist() == bag.tolist() and bag.dtype == torch.int64
    want = sorted_row_grad(grad, s.order, s.starts, bag, weights)
    for b in (bag, kernel_bag):  # every consumer takes either dtype
        assert torch.equal(POOL.row_grad(grad, s.order, s.starts, b, weights), want)
        assert torch.equal(sorted_row_grad(grad, s.order, s.starts, b, weights), want)


KINDS = {
    "sgd": lambda t: optim.SGD(t, lr=0.3),
    "sgd_momentum": lambda t: optim.SGD(t, lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True),
    "adagrad": lambda t: optim.Adagrad(t, lr=0.2, weight_decay=0.05),
    "rowwise_adagrad": lambda t: optim.RowWiseAdagrad(t, lr=0.2, weight_decay=0.05),
    "adam": lambda t: optim.Adam(t, lr=0.1),
    "ftrl": lambda t: optim.FTRL(t, lr=0.2, l1=0.01, l2=0.1),
}


def _table(make, dim=D):
    table = KeyValueTable(dim, seed=4, backend="torch")
    table.find_or_insert(torch.arange(30))
    opt = make([table])
    g = torch.Generator().manual_seed(0)
    for name in table.slot_names:  # non-trivial optimizer state, the same in every table
        table.slot(name).uniform_(0.1, 1.0, generator=g)
    return table, opt


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("pooled", [False, True, "int32", "per_id"])
@pytest.mark.parametrize("dim", [D, 16, 192])  # sums in place; in one block of 16 columns; in three of 64
def test_sparse_update_equals_the_torch_update(kind, pooled, dim):
    # pooled: grad [B, D] of bags of 4 ids ("int32": the bags as the bag_of kernel gives them); "per_id": grad
    # [N, D], one row per id (bag None: bag[j] == j)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 30, (40,), generator=g)
    weights = torch.randn(40, generator=g)
    grad = torch.randn(40 if pooled == "per_id" else 10, dim, generator=g)
    bag = torch.arange(40) if pooled == "per_id" else torch.arange(10).repeat_interleave(4)
    bag = bag.int() if pooled == "int32" else bag
    s = sort_ids(ids)
    rows = s.unique  # key i is row i here
    dense = sorted_row_grad(grad, s.order, s.starts, bag, weights)
    tables = []
    for use_kernel in (True, False):
        table, opt = _table(KINDS[kind], dim)
        before = dense.clone()
        if use_kernel:
            args = opt.kernel_args(opt.param_groups[0], {"step": 1})
            slots = tuple(table.slot(opt.slot_key(n)) for n in args[2])
            if pooled:
                OPTIM.sparse_update(*args[:2], table.values, slots, rows, grad, s.order, s.starts,
                                    None if pooled == "per_id" else bag, weights)
            else:
                OPTIM.sparse_update(*args[:2], table.values, slots, rows, dense, None, None, None, None)
            assert torch.equal(dense, before)  # the caller's gradient is left as it was
        else:
            opt._update(table, rows, dense, opt.param_groups[0], {"step": 1})
        tables.append([table.values[:30]] + [table.slot(n)[:30] for n in table.slot_names])
    exact = kind.startswith("sgd")
    for got, ref in zip(*tables):
        torch.testing.assert_close(got, ref, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)
    assert not torch.equal(tables[1][0], _table(KINDS[kind], dim)[0].values[:30])


def test_unknown_kind_is_a_value_error():
    with pytest.raises(ValueError, match="kind must be one of"):
        OPTIM.sparse_update("lamb", (), torch.zeros(1, 1), (), torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1),
                            None, None, None, None)


def test_gather_equals_index_select_and_find_is_the_same_under_both_backends():
    values = torch.randn(50, 7)
    rows = torch.tensor([3, -1, 49, 0, 3] + list(range(40)))
    got = POOL.gather(values, rows, torch.empty(rows.numel(), 7))
    assert torch.equal(got, values.index_select(0, rows.clamp(min=0)))
    table = KeyValueTable(7, seed=1)
    table.insert_or_assign(torch.arange(100), torch.randn(100, 7))
    keys = torch.tensor([[5, -3], [99, 2**40]])
    found = {}
    for backend in ("numba", "torch"):
        table.backend = backend
        found[backend] = table.find(keys)
    assert all(torch.equal(a, b) for a, b in zip(found["numba"], found["torch"]))
    assert found["numba"][1].tolist() == [[True, False], [True, False]]


@settings(max_examples=60, deadline=None)
@given(key_dtype=st.sampled_from([torch.int64, torch.int32]), size=st.integers(0, 40),
       picks=st.lists(st.integers(-3, 45), max_size=30, unique=True), corrupt=st.integers(-1, 29))
def test_rows_current_equals_the_torch_check(key_dtype, size, picks, corrupt):
    info = torch.iinfo(key_dtype)
    row_keys = torch.tensor([info.min, info.max, -1, 0] + list(range(1, 45)), dtype=key_dtype)
    rows = torch.tensor(picks, dtype=torch.int64)
    keys = row_keys[rows.clamp(0, row_keys.numel() - 1)].clone()
    if 0 <= corrupt < keys.numel():  # one key that its row no longer holds (moved or reused since)
        keys[corrupt] = info.max if keys[corrupt] != info.max else info.min
    expected = not bool(((rows < 0) | (rows >= size) | (row_keys[rows.clamp(0, 47)] != keys)).any())
    assert POOL.rows_current(row_keys, size, keys, rows) is expected


def _column(values: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``values`` as a contiguous column, or as one column of an interleaved ``[C, 2]`` pair (a table's stamps);
    the other column of the pair holds -7 everywhere."""
    if not interleaved:
        return values.clone()
    pair = torch.full((values.numel(), 2), -7, dtype=values.dtype)
    pair[:, 0] = values
    return pair[:, 0]


def _sibling_untouched(column: torch.Tensor) -> bool:
    """Whether the other column of an interleaved pair still holds only -7 (True for a contiguous column)."""
    if column.is_contiguous():
        return True
    return bool((column.as_strided((column.numel(),), (2,), column.storage_offset() + 1) == -7).all())


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.int64, torch.int32]), n=st.integers(0, 9000), value=st.integers(-2**31, 2**31 - 1),
       bad=st.sampled_from([None, -1, 10_000]), interleaved=st.booleans())
def test_fill_rows_equals_index_fill_and_writes_nothing_for_rows_out_of_range(dtype, n, value, bad, interleaved):
    """Contiguous columns and columns interleaved with another (a table's score and version) alike."""
    g = torch.Generator().manual_seed(n)
    column = _column(torch.randint(-100, 100, (10_000,), generator=g, dtype=dtype), interleaved)
    rows = torch.randint(0, 10_000, (n,), generator=g)
    if bad is not None and n:
        rows[n // 2] = bad
    got = _column(column, interleaved)
    assert POOL.fill_rows(got, rows, value) is (bad is None or not n)  # the kernel writes all rows or none
    if bad is not None and n:
        assert torch.equal(got, column)
    else:
        assert torch.equal(got, column.clone().index_fill_(0, rows, value))
    assert _sibling_untouched(got)
    with use_backend("numba"):  # the table layer's entry point does exactly what index_fill_ does, errors included
        expected, error = column.clone(), None
        try:
            expected.index_fill_(0, rows, value)
        except IndexError as e:
            error = e
        got = column.clone()
        if error is None:
            fill_rows(got, rows, value)
            assert torch.equal(got, expected)
        else:
            with pytest.raises(IndexError):
                fill_rows(got, rows, value)
            assert torch.equal(got, expected)  # what index_fill_ wrote before its error


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 9000), a=st.integers(-2**63, 2**63 - 1), b=st.integers(-2**63, 2**63 - 1),
       bad=st.sampled_from([None, -1, 10_000]), interleaved=st.booleans())
def test_fill_pair_equals_two_index_fills_and_writes_nothing_for_rows_out_of_range(n, a, b, bad, interleaved):
    """Both stamps of a lookup in one pass: what two ``index_fill_`` write, on interleaved or separate columns, and
    nothing in either column when a row is out of range. The table layer's entry point falls back to two fills."""
    g = torch.Generator().manual_seed(n)
    pair = torch.randint(-100, 100, (10_000, 2), generator=g)
    first, second = (pair[:, 0], pair[:, 1]) if interleaved else (pair[:, 0].clone(), pair[:, 1].clone())
    rows = torch.randint(0, 10_000, (n,), generator=g)
    if bad is not None and n:
        rows[n // 2] = bad
    before = first.clone(), second.clone()
    ok = POOL.fill_pair(first, second, rows, a, b)
    assert ok is (bad is None or not n)
    if not ok:
        assert torch.equal(first, before[0]) and torch.equal(second, before[1])
        expected, error = (before[0].clone(), before[1].clone()), None
        try:  # the entry point does what index_fill_ does, errors included (-1 counts from the end there)
            expected[0].index_fill_(0, rows, a)
            expected[1].index_fill_(0, rows, b)
        except IndexError as e:
            error = e
        with use_backend("numba"):
            if error is None:
                fill_pair(first, second, rows, a, b)
            else:
                with pytest.raises(IndexError):
                    fill_pair(first, second, rows, a, b)
        assert torch.equal(first, expected[0]) and torch.equal(second, expected[1])
        return
    assert torch.equal(first, before[0].index_fill_(0, rows, a))
    assert torch.equal(second, before[1].index_fill_(0, rows, b))
    with use_backend("numba"):
        fill_pair(first, second, rows, b, a)
    assert torch.equal(first, before[0].index_fill_(0, rows, b))
    assert torch.equal(second, before[1].index_fill_(0, rows, a))


@pytest.mark.parametrize("key_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("span_bits", [0, 1, 11, 12, 20, 33, 34, 62])
def test_dedup_of_narrow_and_wide_spans_equals_the_sort(span_bits, key_dtype):
    """Ids spanning at most 2**33 values (every int32 batch) take the radix sort, whose result is the reference's:
    unique ids ascending. Wider spans take the hash table: unique ids in order of first occurrence. Spans sit at
    the dtype's ends and across 0, with repeats."""
    info = torch.iinfo(key_dtype)
    g = torch.Generator().manual_seed(span_bits)
    span = min(1 << span_bits, info.max - info.min + 1)  # ids in [base, base + span)
    for base in (info.min, -(span // 2), info.max - span + 1):
        ids = (torch.randint(0, min(span, 1 << 62), (5000,), generator=g, dtype=torch.int64) + base).to(key_dtype)
        ids[::7] = ids[3]  # one id repeated all over the batch
        ids[-2:] = torch.tensor([base, base + span - 1])  # both ends of the span
        got, ref = POOL.dedup(ids), sort_ids(ids)
        bare = POOL.dedup(ids, inverse=False)  # the radix sort or the hash table without inverse: the same grouping
        assert bare[1] is None and all(torch.equal(a, b) for a, b in zip(bare[::2] + bare[3:], got[::2] + got[3:]))
        if span_bits <= 33 or key_dtype == torch.int32:
            assert all(torch.equal(a, b) for a, b in zip(got, ref)), (span_bits, base)
            continue
        unique, inverse, order, starts = got
        assert torch.equal(unique[inverse], ids) and torch.equal(unique.sort().values, ref.unique)
        assert torch.equal(ids[order], unique.repeat_interleave(starts.diff()))
        assert bool((order[starts[:-1]].diff() > 0).all())  # unique ids in order of first occurrence


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.sampled_from([1, 3, 1000, 50_000]), n=st.integers(0, 6000),
       counted=st.booleans(), bad=st.sampled_from([None, -1, 50_000]), interleaved=st.booleans())
def test_touch_counts_equals_a_dict_model_and_write_last_writes_each_rows_last_occurrence(seed, size, n, counted,
                                                                                          bad, interleaved):
    """Each occurrence gets its row's value before the call; the last occurrence of each row also gets the sum of
    its counts; a row out of range writes nothing. Values are arbitrary int64, positions among them (a value that
    looks like an earlier position of the same row must not be taken for one). The column may be interleaved with
    another (a table's score and version), which is left alone."""
    g = torch.Generator().manual_seed(seed)
    column = torch.randint(-(2**62), 2**62, (size,), generator=g)
    column[::2] = torch.randint(0, max(n, 1), (len(column[::2]),), generator=g)  # values that are positions
    rows = torch.randint(0, size, (n,), generator=g)
    counts = torch.randint(1, 2**40, (n,), generator=g) if counted else None
    if bad is not None and n:
        rows[n // 3] = bad
        got = _column(column, interleaved)
        assert POOL.touch_counts(got, rows, counts) is None and torch.equal(got, column)
        return
    got = _column(column, interleaved)
    before, total, last = POOL.touch_counts(got, rows, counts)
    sums: dict[int, int] = {}
    for j, r in enumerate(rows.tolist()):
        sums[r] = sums.get(r, 0) + (counts[j].item() if counts is not None else 1)
    final = {r: j for j, r in enumerate(rows.tolist())}
    assert before.tolist() == column[rows].tolist()
    assert last.tolist() == [final[r] == j for j, r in enumerate(rows.tolist())]
    assert total[last].tolist() == [sums[r] for r in rows[last].tolist()]
    POOL.write_last(got, rows, before, last)  # writing back what was read restores the column
    assert torch.equal(got, column)
    POOL.write_last(got, rows, torch.arange(n) * 2 + 1, last)
    expected = column.clone()
    expected[rows[last]] = (torch.arange(n) * 2 + 1)[last]
    assert torch.equal(got, expected) and _sibling_untouched(got)


@settings(max_examples=40, deadline=None)
@given(policy=st.sampled_from([EvictionPolicy.LFU, EvictionPolicy.EPOCH_LFU, EvictionPolicy.DECAYED_LFU]),
       seed=st.integers(0, 2**31 - 1), size=st.sampled_from([2, 300, 100_000]), n=st.integers(4096, 9000),
       counted=st.booleans(), spread=st.sampled_from([1 << 10, 1 << 24, 1 << 44]), clock=st.integers(0, 10**9),
       half_life=st.integers(1, 64), epoch=st.integers(0, 3))
def test_counting_policies_give_the_same_bits_through_the_kernels(policy, seed, size, n, counted, spread, clock,
                                                                  half_life, epoch):
    """An access of a large batch under lfu, epoch_lfu and decayed_lfu (duplicate rows, counts or none; decayed
    scores near ``now`` and far on either side of it, epoch scores of this epoch and others) gives the torch
    path's scores bit for bit: the kernels gather, the same arithmetic runs (decayed: ``decayed_scores``)."""
    g = torch.Generator().manual_seed(seed)
    if policy is EvictionPolicy.DECAYED_LFU:
        scores = round(clock / half_life * 65536) + torch.randint(-spread, spread, (size,), generator=g)
    else:
        scores = (torch.randint(0, 4, (size,), generator=g) << 32) + torch.randint(0, spread, (size,), generator=g)
    rows = torch.randint(0, size, (n,), generator=g)
    counts = torch.randint(1, 50, (n,), generator=g) if counted else None
    got, expected = scores.clone(), scores.clone()
    for backend, out in (("torch", expected), ("numba", got)):
        with use_backend(backend):
            touch_scores(policy, out, rows, clock=clock, epoch=epoch, counts=counts, half_life=half_life)
    assert torch.equal(got, expected)


def test_decayed_lfu_scores_stay_when_the_arithmetic_fails(monkeypatch):
    """The kernels leave scratch values in the rows until the new scores are written: a failure in between puts the
    scores back."""
    from dynemb.table import policy

    g = torch.Generator().manual_seed(0)
    scores, rows = torch.arange(10_000) * 3, torch.randint(0, 10_000, (5000,), generator=g)
    before = scores.clone()

    def fail(*args):
        raise MemoryError("injected")

    monkeypatch.setattr(policy, "_decayed", fail)
    with use_backend("numba"), pytest.raises(MemoryError, match="injected"):
        touch_scores(EvictionPolicy.DECAYED_LFU, scores, rows, clock=5, epoch=0)
    assert torch.equal(scores, before)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.sampled_from([0, 1, 7, 20_000, 70_000]), k=st.integers(0, 80_000),
       spread=st.sampled_from([1, 3, 1000, 2**62]), pinned=st.sampled_from([0, 1, 100, 30_000]),
       layout=st.sampled_from(["random", "ascending", "descending"]))
def test_lowest_rows_through_the_kernel_equals_the_reference_and_a_sort(seed, size, k, spread, pinned, layout):
    """Victims of eviction: the k unpinned rows lowest by (score, row), in that order, from the kernel (one pass
    after a sampled threshold) and the torch reference alike; heavy ties, all rows pinned, k beyond the free
    rows, and scores sorted either way (a sample that misjudges the threshold)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-spread, spread, (size,), generator=g) if size else torch.empty(0, dtype=torch.int64)
    if layout != "random":
        scores = scores.sort(descending=layout == "descending").values
    pins = torch.randint(0, max(size, 1), (min(pinned, size * 2),), generator=g) if size else None
    free = torch.ones(size, dtype=torch.bool)
    if pins is not None:
        free[pins] = False
    rows = free.nonzero().squeeze(1).numpy()
    expected = rows[np.lexsort((rows, scores.numpy()[rows]))][:k].tolist()  # by score, then row
    with use_backend("torch"):
        assert lowest_rows(scores, k, pins).tolist() == expected
    assert POOL.lowest_rows(scores, k, pins).tolist() == expected


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 9000), bad=st.sampled_from([None, -1, 10_000]))
def test_scatter_equals_index_copy_and_writes_nothing_for_rows_out_of_range(seed, n, bad):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(10_000, 3, generator=g)
    rows = torch.randperm(10_000, generator=g)[:n]
    src = torch.randn(n, 3, generator=g)
    if bad is not None and n:
        rows[n // 2] = bad
    got = values.clone()
    assert POOL.scatter(got, rows, src) is (bad is None or not n)
    if bad is not None and n:
        assert torch.equal(got, values)
        with use_backend("numba"), pytest.raises(IndexError):
            scatter_rows(got, rows, src)  # the table layer's entry point raises as index_copy_ does
    else:
        assert torch.equal(got, values.clone().index_copy_(0, rows, src))
        got = values.clone()
        with use_backend("numba"):
            scatter_rows(got, rows, src)
        assert torch.equal(got, values.clone().index_copy_(0, rows, src))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(0, 2000), bad=st.sampled_from([None, "dst -1", "src 4000"]),
       column=st.sampled_from([(torch.float32, (64,)), (torch.int64, ()), (torch.float32, (1,)),
                               (torch.bfloat16, (6,)), (torch.int32, ()), (torch.float64, (3,))]),
       same=st.booleans())
def test_move_rows_equals_indexing_bit_for_bit_and_writes_nothing_for_rows_out_of_range(seed, n, bad, column, same):
    """Rows of every column a table keeps (values, keys, scores, slots, bf16 values) move as raw words, within one
    tensor too (compaction: disjoint rows). Random bit patterns (NaN payloads, int64 extremes) survive."""
    dtype, shape = column
    g = torch.Generator().manual_seed(seed)
    words = 4000 * max(math.prod(shape), 1) * dtype.itemsize // 4
    col = torch.randint(-2**31, 2**31, (words,), generator=g).to(torch.int32).view(dtype).view(4000, *shape)
    perm = torch.randperm(4000, generator=g)
    dst_rows, src_rows = perm[:n], (perm[n:2 * n].clone() if same else torch.randint(0, 4000, (n,), generator=g))
    if bad is not None and n:
        (dst_rows if bad.startswith("dst") else src_rows)[n // 2] = int(bad.split()[1])
    got = col.clone()
    src = got if same else col.flip(0).contiguous()
    expected = col.view(torch.uint8).clone()  # compared as bytes: NaN payloads compare equal to themselves
    if not (bad is not None and n):
        expected.view(dtype)[dst_rows] = (col if same else col.flip(0))[src_rows]
    assert POOL.move_rows(got, dst_rows, src, src_rows) is (bad is None or not n)
    assert torch.equal(got.view(torch.uint8), expected)
    if bad is not None and n:
        with use_backend("numba"), pytest.raises(IndexError):
            copy_rows(got, dst_rows, src, src_rows)  # the table layer's entry point raises as index_copy_ does


def test_move_rows_declines_layouts_it_cannot_take_and_copy_rows_moves_them_as_torch_does():
    """Strided columns (a table's interleaved score and version), a half-precision view off a word boundary, a
    one-row strided column, a conjugate view, and a source that is another view of the destination's storage: the
    kernel writes nothing and says False; ``copy_rows`` then gives torch's result."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randperm(3000, generator=g)[:600]
    stamps = torch.randint(0, 2**40, (3000, 2), generator=g)
    odd = torch.randn(3000 * 4 + 1, generator=g).half()[1:].view(3000, 4)
    values = torch.randn(3000, 4, generator=g)
    cases = [(stamps[:, 0], stamps[:, 1]),  # strided columns
             (odd, odd.clone()),  # 2-byte offset from a word boundary
             (stamps[:1, 0], stamps[:1, 1]),  # one row, strided
             (torch.randn(3000, 2, dtype=torch.complex64, generator=g).conj(),  # a lazy conjugate
              torch.randn(3000, 2, dtype=torch.complex64, generator=g)),
             (values, values.view(3000, 4))]  # another view of the destination's storage
    for dst, src in cases:
        dst_rows, src_rows = (rows[:300], rows[300:]) if dst.shape[0] > 1 else (rows[:1] * 0, rows[:1] * 0)
        before = dst.clone()
        assert POOL.move_rows(dst, dst_rows, src, src_rows) is False
        assert torch.equal(dst.resolve_conj(), before.resolve_conj())
        expected = dst.clone().index_copy_(0, dst_rows, src.index_select(0, src_rows))
        with use_backend("numba"):
            copy_rows(dst, dst_rows, src, src_rows)
        assert torch.equal(dst.resolve_conj(), expected.resolve_conj())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), size=st.integers(1, 3000), now=st.integers(0, 2**45),
       spread=st.sampled_from([1 << 10, 1 << 22, 1 << 40, 1 << 62]), chunk=st.integers(1, 40))
@pytest.mark.slow
def test_decayed_scores_are_the_same_bits_at_any_position_on_both_paths(seed, size, now, spread, chunk):
    """A row's new decayed_lfu score depends on its old score and count alone: not on where the batch puts it (the
    dedup orders keys differently by backend and by rank count) nor on the batch's length, and the kernel gives the
    torch ops' bits. torch's own exp2/log2 did not: an element in a vector's tail rounded differently."""
    from dynemb.table import policy

    g = torch.Generator().manual_seed(seed)
    old = (now + torch.randint(-spread, spread // 64 + 1, (size,), generator=g)).clamp(-2**63, 2**63 - 1)
    n = torch.randint(1, 100, (size,), generator=g)
    with use_backend("torch"):
        ref = policy._decayed(old, n, now)
        perm = torch.randperm(size, generator=g)
        assert torch.equal(policy._decayed(old[perm], n[perm], now), ref[perm])
        assert torch.equal(torch.cat([policy._decayed(old[i:i + chunk], n[i:i + chunk], now)
                                      for i in range(0, size, chunk)]), ref)
    assert torch.equal(POOL.decayed_scores(old, n, now, policy.DECAY_MATH), ref)
    assert torch.equal(POOL.decayed_scores(old[perm], n[perm], now, policy.DECAY_MATH), ref[perm])
    for i in torch.randint(0, size, (8,), generator=g).tolist():  # float reference: within a fixed-point unit
        d = (int(old[i]) - now) / 65536
        want = int(old[i]) if d > 60 else now + math.log2(2 ** max(d, -1000) + int(n[i])) * 65536
        assert abs(int(ref[i]) - want) <= 0.5 + 1e-6 * (d > 60)
