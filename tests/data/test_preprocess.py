"""The dense rule (docs/cli.md, "Ids, nulls and non-finite values"): statistics over finite values with the
non-finite ones counted, one warning per column per pass, every batch finite after ``normalize``; the rule and the
id types saved in and read back from ``model.json``'s preprocessing, old cards included."""

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dynemb.data.batch import Batch
from dynemb.data.preprocess import (DENSE_RULE, LEGACY_DENSE_RULE, DataWarning, Preprocessing, dense_statistics,
                                    signed_log1p)

NAN, INF = float("nan"), float("inf")
VALUES = st.one_of(st.floats(-1e6, 1e6, width=32), st.sampled_from([NAN, INF, -INF, 0.0, -0.0]))


def batch(dense) -> Batch:
    dense = torch.as_tensor(np.asarray(dense, dtype=np.float32))
    return Batch(dense, {"c": torch.zeros(len(dense), dtype=torch.int64)}, torch.zeros(len(dense)))


def pieces(matrix: np.ndarray, cuts: list[int]) -> list[Batch]:
    bounds = [0, *sorted(c % (len(matrix) + 1) for c in cuts), len(matrix)]
    return [batch(matrix[a:b]) for a, b in zip(bounds, bounds[1:])]


@st.composite
def columns(draw, min_rows=0):
    rows, k = draw(st.integers(min_rows, 40)), draw(st.integers(1, 3))
    matrix = np.array(draw(st.lists(st.lists(VALUES, min_size=k, max_size=k), min_size=rows, max_size=rows)),
                      dtype=np.float32).reshape(rows, k)
    return matrix, draw(st.lists(st.integers(0, 40), max_size=3))


@settings(max_examples=150, deadline=None)
@given(columns(), st.one_of(st.none(), st.integers(1, 45)))
def test_statistics_take_finite_values_only_and_count_the_others(case, max_rows):
    matrix, cuts = case
    names = [f"d{j}" for j in range(matrix.shape[1])]
    read = matrix[:max_rows] if max_rows is not None else matrix
    finite = np.isfinite(read)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not finite.any(0).all():  # some column without a finite value (0 rows included): an error naming it
            j = int(np.argmin(finite.any(0)))
            with pytest.raises(ValueError, match=rf"^data\.csv: dense column 'd{j}' has no finite value in its "
                                                 rf"{len(read):,} rows"):
                dense_statistics(pieces(matrix, cuts), names, max_rows, where="data.csv")
            return
        stats = dense_statistics(pieces(matrix, cuts), names, max_rows, where="data.csv")
    assert stats.rows == len(read)
    for j in range(matrix.shape[1]):
        x = read[:, j][finite[:, j]].astype(np.float64)
        z = np.sign(x) * np.log1p(np.abs(x))
        assert stats.mean[j] == pytest.approx(z.mean(), rel=1e-9, abs=1e-9)
        std = z.std() if z.std() > 1e-12 else 1.0
        assert stats.std[j] == pytest.approx(std, rel=1e-6, abs=1e-9)
        assert (stats.min[j], stats.max[j]) == (x.min(), x.max())
        column = read[:, j]
        expected = (int(np.isnan(column).sum()), int((column == INF).sum()), int((column == -INF).sum()))
        assert stats.non_finite[j] == expected
    # one warning per column with a non-finite value, naming it and its counts
    messages = [str(w.message) for w in caught if issubclass(w.category, DataWarning)]
    assert len(messages) == sum(any(c) for c in stats.non_finite)
    for j, (nan, inf, ninf) in enumerate(stats.non_finite):
        if nan + inf + ninf:
            line = next(m for m in messages if m.startswith(f"data.csv: column 'd{j}': "))
            assert (f"{nan:,} null/NaN value" in line) == bool(nan) and (f"{inf:,} inf value" in line) == bool(inf)
            assert (f"{ninf:,} -inf value" in line) == bool(ninf)


def prep_of(mean, std, low, high, rule=DENSE_RULE) -> Preprocessing:
    k = len(mean)
    bounds = dict(dense_min=low, dense_max=high) if rule == DENSE_RULE else {}
    return Preprocessing(label=None, categorical=("c",), dense=tuple(f"d{j}" for j in range(k)), dense_mean=mean,
                         dense_std=std, dense_rows=1, dense_rule=rule, **bounds)


@settings(max_examples=150, deadline=None)
@given(columns(min_rows=1))
def test_normalize_reads_null_nan_inf_as_the_training_mean_max_and_min(case):
    matrix, _ = case
    k = matrix.shape[1]
    mean, std = [0.5 * j - 0.3 for j in range(k)], [1.0 + j for j in range(k)]
    low, high = [-2.0 - j for j in range(k)], [7.0 + j for j in range(k)]
    out = prep_of(mean, std, low, high).normalize(batch(matrix)).dense
    assert torch.isfinite(out).all()
    x = torch.from_numpy(matrix)
    replaced = torch.where(torch.isnan(x), torch.nan, x)  # NaN: checked below
    replaced = torch.where(x == INF, torch.tensor(high), torch.where(x == -INF, torch.tensor(low), replaced))
    expected = (signed_log1p(replaced) - torch.tensor(mean)) / torch.tensor(std)
    nan = torch.isnan(x)
    torch.testing.assert_close(out[~nan], expected[~nan], rtol=0, atol=1e-6)
    assert (out[nan] == 0).all()  # the training mean, standardized


def test_a_legacy_rule_keeps_null_as_zero_and_reads_inf_as_the_mean():
    prep = prep_of([1.0], [2.0], None, None, rule=LEGACY_DENSE_RULE)
    out = prep.normalize(batch([[NAN], [INF], [-INF], [0.0]])).dense[:, 0].tolist()
    assert out == [-0.5, 0.0, 0.0, -0.5]


def test_normalized_warns_once_per_column_and_pass_and_the_batches_come_out_finite():
    prep = prep_of([0.0, 0.0], [1.0, 1.0], [-1.0, -1.0], [1.0, 1.0])
    batches = [batch([[NAN, 1.0], [INF, 2.0]]), batch([[NAN, -INF], [3.0, NAN]])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = prep.normalized(iter(batches), "day_2.csv")
        out = [next(stream).dense]
        assert caught == []  # nothing until the pass ends ... then one line a column
        out = torch.cat(out + [b.dense for b in stream])
    assert torch.isfinite(out).all() and len(out) == 4
    assert [str(w.message) for w in caught] == [
        "day_2.csv: column 'd0': 2 null/NaN values read as the training mean, 1 inf value read as the training max",
        "day_2.csv: column 'd1': 1 null/NaN value read as the training mean, 1 -inf value read as the training min"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(prep.normalized([batch([[0.5, 1.0]])], "clean.csv"))  # nothing to count: no warning


def test_the_rule_and_the_id_types_round_trip_through_json_and_old_cards_load():
    prep = Preprocessing(label="y", categorical=("zip",), multi_hot=("tags",), dense=("price",), dense_mean=(1.5,),
                         dense_std=(0.5,), dense_min=(-3.0,), dense_max=(1e9,), dense_rows=10,
                         id_types={"zip": "BYTES", "tags": "INT64"})
    saved = prep.to_json()
    assert saved["dense_rule"] == DENSE_RULE and saved["id_types"] == {"zip": "BYTES", "tags": "INT64"}
    assert Preprocessing.from_json(saved) == prep
    # a card written before the rule: no min/max, no id types in the preprocessing (a Parquet run kept them in data)
    old = {k: v for k, v in saved.items() if k not in ("dense_min", "dense_max", "id_types")}
    old["dense_rule"] = LEGACY_DENSE_RULE
    loaded = Preprocessing.from_json(old, {"format": "parquet", "id_types": {"zip": "INT64", "tags": "BYTES"}})
    assert loaded.dense_rule == LEGACY_DENSE_RULE and loaded.id_types == {"zip": "INT64", "tags": "BYTES"}
    assert Preprocessing.from_json(old, {"format": "criteo"}).id_types == {"zip": "BYTES", "tags": "BYTES"}
    with pytest.raises(ValueError, match=r"no id types .* CSV ids value by value\): retrain the run"):
        Preprocessing.from_json(old, {"format": "csv", "id_types": {"zip": "BYTES", "tags": "BYTES"}})
    with pytest.raises(ValueError, match=r"dense_rule must be one of"):
        Preprocessing.from_json({**saved, "dense_rule": "other"})
    with pytest.raises(ValueError, match=r"dense_min and dense_max must have one entry per dense column"):
        Preprocessing.from_json({k: v for k, v in saved.items() if k != "dense_max"})
    with pytest.raises(ValueError, match=r"must be finite"):
        Preprocessing.from_json({**saved, "dense_max": [math.inf]})
    with pytest.raises(ValueError, match=r"id_types must map id columns"):
        Preprocessing.from_json({**saved, "id_types": {"zip": "FP32"}})
