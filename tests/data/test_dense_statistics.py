"""``dense_statistics``: the mean and standard deviation of ``signed_log1p`` of each dense column over batches of any
sizes, equal to a two-pass computation; a constant column's standard deviation is exactly 0 (kept as 1.0, so it is
only centered) whatever its value, where summing ``z`` and ``z * z`` used to leave 4e-8 for a constant 9.5, and any
other value then normalized to about 1e6."""

import math

import hypothesis.strategies as st
import torch
from hypothesis import example, given, settings

from dynemb.data.batch import Batch
from dynemb.data.preprocess import Preprocessing, dense_statistics, signed_log1p

VALUES = st.floats(-1e9, 1e9, width=32)


def batches(dense: torch.Tensor, sizes: list[int]) -> list[Batch]:
    """``dense`` cut into batches of ``sizes`` rows (empty batches included), the rest in a last batch."""
    out, start = [], 0
    for size in sizes + [dense.shape[0]]:
        part = dense[start : start + size]
        out.append(Batch(part, {}, torch.zeros(part.shape[0])))
        start += part.shape[0]
    return out


@settings(max_examples=60, deadline=None)
@example(value=9.5, rows=285, sizes=[64, 64])
@example(value=0.3, rows=1, sizes=[0])
@given(value=VALUES, rows=st.integers(1, 300), sizes=st.lists(st.integers(0, 70), max_size=4))
def test_a_constant_column_is_only_centered(value, rows, sizes):
    dense = torch.tensor([[value, 1.0]] * rows)
    stats = dense_statistics(batches(dense, sizes), ["x", "y"])
    mean, std, counted = stats.mean, stats.std, stats.rows
    assert counted == rows and std == [1.0, 1.0]
    z = signed_log1p(dense[0].double())
    assert mean == z.tolist()
    prep = Preprocessing(label=None, categorical=(), dense=("x", "y"), dense_mean=tuple(mean),
                         dense_std=tuple(std), dense_min=tuple(stats.min), dense_max=tuple(stats.max),
                         dense_rows=rows)
    # a value one above moves signed_log1p by at most 1, and so its normalized value (it was 1e6 for 9.5)
    other = prep.normalize(Batch(torch.tensor([[value + 1.0, 1.0]]), {}, torch.zeros(1))).dense
    assert float(other.abs().max()) <= 1.0 + 1e-3


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.tuples(VALUES, VALUES), min_size=1, max_size=200),
       sizes=st.lists(st.integers(0, 70), max_size=4), max_rows=st.one_of(st.none(), st.integers(1, 250)))
def test_statistics_equal_a_two_pass_computation(data, sizes, max_rows):
    dense = torch.tensor(data)
    stats = dense_statistics(batches(dense, sizes), ["x", "y"], max_rows)
    mean, std, rows = stats.mean, stats.std, stats.rows
    z = signed_log1p(dense.double())[:max_rows]
    assert rows == z.shape[0]
    want_std = [s if s > 1e-12 else 1.0 for s in z.std(0, correction=0).tolist()]
    for got, want in zip(mean + std, z.mean(0).tolist() + want_std):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)
