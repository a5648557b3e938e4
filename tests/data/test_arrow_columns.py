"""Ids by the column's id type (docs/cli.md, "Ids, nulls and non-finite values"): an integer and its canonical
decimal text are one id in either type, whatever the Arrow type holds them; text an INT64 column cannot read is
an error naming the column, the row and the value."""

import re

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from dynemb.data import hash_strings, null_key
from dynemb.data.arrow_columns import categorical_ids, decimal_int64, dense_values, multi_hot_ids

I64 = st.integers(-2**63, 2**63 - 1)
# Digit-only text of every kind: canonical int64s, zeros, signs, leading zeros, 20 digits, just out of range.
DIGITS = st.one_of(I64.map(str), st.sampled_from(["0", "-0", "+1", "007", "00", "9" * 20, str(2**63), str(-2**63 - 1),
                                                  str(2**63 - 1), str(-2**63), "85711", "-", ""]),
                   st.text(alphabet="0123456789-+", max_size=21))
TEXT = st.one_of(DIGITS, st.text(max_size=8))


def canonical(v: str) -> bool:
    return bool(re.fullmatch(r"0|-?[1-9][0-9]*", v)) and -2**63 <= int(v) < 2**63


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.none(), I64), max_size=20), st.sampled_from(["INT64", "BYTES"]))
def test_an_integer_and_its_decimal_text_are_one_id_in_every_arrow_type(values, id_type):
    text = [None if v is None else str(v) for v in values]
    arrays = [pa.array(values, pa.int64()), pa.array(text, pa.string()), pa.array(text, pa.large_string()),
              pa.array(text, pa.string()).dictionary_encode(), pa.array(text, pa.binary())]
    if all(v is None or v >= 0 for v in values):
        arrays.append(pa.array(values, pa.uint64()))
    if all(v is None or -2**31 <= v < 2**31 for v in values):
        arrays.append(pa.array(values, pa.int32()).dictionary_encode())
    present = [t for t in text if t is not None]
    ids = iter(hash_strings(present).tolist() if id_type == "BYTES" else [int(t) for t in present])
    expected = [null_key("zip") if t is None else next(ids) for t in text]
    for array in arrays:
        got = categorical_ids(array, "zip", "f: column 'zip'", id_type)
        assert got.dtype == np.int64 and got.tolist() == expected, array.type
        assert got.flags.writeable


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), TEXT), max_size=12), st.integers(0, 10**6))
def test_text_is_hashed_by_a_bytes_column_and_must_be_a_canonical_integer_in_an_int64_column(values, first_row):
    array = pa.array(values, pa.string())
    present = [v for v in values if v is not None]
    hashed = iter(hash_strings(present).tolist())
    assert categorical_ids(array, "c", "w", "BYTES").tolist() == [null_key("c") if v is None else next(hashed)
                                                                  for v in values]
    np.testing.assert_array_equal(decimal_int64(pa.array(present, pa.string())), [canonical(v) for v in present])
    bad = [i for i, v in enumerate(values) if v is not None and not canonical(v)]
    if not bad:
        assert categorical_ids(array, "c", "w", "INT64", first_row).tolist() == [
            null_key("c") if v is None else int(v) for v in values]
        return
    row = first_row + bad[0]
    shown = repr(values[bad[0]])
    with pytest.raises(ValueError, match=rf"^f\.csv: column 'c': {re.escape(shown[:57])}.* at row {row} is not an "
                                         r"integer id, and the model reads 'c' as INT64 ids \(id_types in "
                                         r"model\.json\)$"):
        categorical_ids(array, "c", "f.csv: column 'c'", "INT64", first_row)


def test_bools_are_0_and_1_floats_are_an_error_and_the_type_is_checked():
    assert categorical_ids(pa.array([True, False, None]), "b", "w", "INT64").tolist() == [1, 0, null_key("b")]
    assert categorical_ids(pa.array([True, False]), "b", "w", "BYTES").tolist() == hash_strings(["1", "0"]).tolist()
    for id_type in ("INT64", "BYTES"):
        with pytest.raises(ValueError, match=r"^f: column 'x' has type double; categorical ids must be integers"):
            categorical_ids(pa.array([1.0, 2.0]), "x", "f: column 'x'", id_type)
    with pytest.raises(ValueError, match=r"id_type must be one of \('INT64', 'BYTES'\), got 'FP32'"):
        categorical_ids(pa.array([1]), "x", "w", "FP32")


def test_multi_hot_elements_follow_the_id_type_and_a_bad_one_names_its_row():
    bags = pa.array([["5", "12"], None, [], ["7", None, "x"]])
    ids, offsets = multi_hot_ids(bags, "m", "w", "BYTES")
    assert ids.tolist() == [*hash_strings(["5", "12"]).tolist(), null_key("m"),
                            *hash_strings(["7"]).tolist(), null_key("m"), *hash_strings(["x"]).tolist()]
    assert offsets.tolist() == [0, 2, 3, 3, 6]
    ints, _ = multi_hot_ids(pa.array([[5, 12], None, [], [7, None, 3]]), "m", "w", "BYTES")
    text, _ = multi_hot_ids(pa.array(["5|12", None, "", "7||3"]), "m", "w", "BYTES", separator="|")
    assert ints[:2].tolist() == text[:2].tolist() == ids[:2].tolist()
    with pytest.raises(ValueError, match=r"^t\.csv: column 'm': 'x' at row 103 is not an integer id"):
        multi_hot_ids(bags, "m", "t.csv: column 'm'", "INT64", first_row=100)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(), st.sampled_from(["nan", "inf", "-Infinity", "1e39", "-2.5"])),
                max_size=12))
def test_dense_values_come_out_raw_with_a_null_as_nan(values):
    """No rule is applied when reading: null is NaN, NaN and inf stay (Preprocessing.normalize replaces them)."""
    numbers = [v for v in values if not isinstance(v, str)]
    got = dense_values(pa.array(numbers, pa.float64()), "w")
    expected = np.array([np.nan if v is None else v for v in numbers], dtype=np.float64)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, expected.astype(np.float32))
    text = [None if v is None else str(v) for v in values]
    with np.errstate(over="ignore"):
        expected = np.array([np.nan if v is None else float(v) for v in text], dtype=np.float64).astype(np.float32)
    np.testing.assert_array_equal(dense_values(pa.array(text, pa.string()), "w"), expected)
