"""Request decoding against the file readers' column code: the joined, one-conversion-per-datatype path gives each
column exactly what ``categorical_ids`` / ``dense_values`` give it alone (nulls get their own column's key), in
JSON and in binary tensors; every id datatype gives the ids of the column's id type in the model."""

import json
import re

import numpy as np
import orjson
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from dynemb.data import hash_strings, null_key
from dynemb.data.arrow_columns import categorical_ids, dense_values
from dynemb.data.preprocess import Preprocessing
from dynemb.endpoint.inference_protocol import _numeric_batch, decode_request
from dynemb.endpoint.wire import RequestError, parse_body



def prep_of(id_types: dict) -> Preprocessing:
    return Preprocessing(label=None, categorical=("a", "b", "c"), dense=("x", "y"), dense_mean=(0.0, 0.0),
                         dense_std=(1.0, 1.0), dense_min=(-5.0, -5.0), dense_max=(5.0, 5.0), dense_rows=1,
                         id_types=id_types)


PREP = prep_of(dict.fromkeys("abc", "INT64"))
INT64 = st.one_of(st.none(), st.integers(-2**63, 2**63 - 1))
DECIMAL = st.one_of(st.none(), st.integers(-2**63, 2**63 - 1).map(str))
TEXT = st.one_of(st.none(), st.text(max_size=6))
FLOAT = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=32), st.integers(-1000, 1000))


@st.composite
def requests(draw):
    """``(rows, columns, prep)``: any datatype for each id column, with values its id type in ``prep`` reads."""
    rows = draw(st.integers(0, 12))
    kinds = draw(st.lists(st.sampled_from(["INT64", "INT32", "BYTES"]), min_size=3, max_size=3))
    prep = prep_of(dict(zip("abc", draw(st.lists(st.sampled_from(["INT64", "BYTES"]), min_size=3, max_size=3)))))
    columns = {}
    for name, kind in zip(prep.categorical, kinds):
        text = DECIMAL if prep.id_types[name] == "INT64" else TEXT
        values = st.integers(-2**31, 2**31 - 1) if kind == "INT32" else (text if kind == "BYTES" else INT64)
        columns[name] = (kind, draw(st.lists(values, min_size=rows, max_size=rows)))
    for name in prep.dense:
        columns[name] = ("FP32", draw(st.lists(FLOAT, min_size=rows, max_size=rows)))
    return rows, columns, prep


def as_json(columns) -> bytes:
    return json.dumps({"inputs": [{"name": n, "datatype": d, "shape": [len(v)], "data": v}
                                  for n, (d, v) in columns.items()]}).encode()


@settings(max_examples=60, deadline=None)
@given(requests())
def test_decoded_columns_equal_the_readers_column_by_column(request):
    rows, columns, prep = request
    batch = decode_request(parse_body(as_json(columns)), prep, 64)
    for name in prep.categorical:
        kind, values = columns[name]
        arrow = pa.array(values, pa.string() if kind == "BYTES" else pa.int64())
        np.testing.assert_array_equal(batch.sparse[name].numpy(), categorical_ids(arrow, name, name,
                                                                                  prep.id_types[name]))
    for j, name in enumerate(prep.dense):
        expected = dense_values(pa.array(columns[name][1], pa.float64()), name)
        np.testing.assert_array_equal(batch.dense[:, j].numpy(), expected)
    assert len(batch) == rows


@settings(max_examples=30, deadline=None)
@given(requests())
def test_binary_tensors_decode_like_json(request):
    rows, columns, prep = request
    if any(v is None for _, values in columns.values() for v in values):
        return  # the binary extension has no nulls
    head, raw = [], b""
    for name, (kind, values) in columns.items():
        if kind == "BYTES":
            data = b"".join(len(s.encode()).to_bytes(4, "little") + s.encode() for s in values)
        else:
            data = np.asarray(values, {"INT64": "<i8", "INT32": "<i4", "FP32": "<f4"}[kind]).tobytes()
        head.append({"name": name, "datatype": kind, "shape": [rows], "parameters": {"binary_data_size": len(data)}})
        raw += data
    header = json.dumps({"inputs": head}).encode()
    binary = decode_request(parse_body(header + raw, len(header)), prep, 64)
    # FP32 on the wire: the JSON values rounded to float32 first
    rounded = {n: (d, [float(np.float32(v)) for v in vs] if d == "FP32" else vs) for n, (d, vs) in columns.items()}
    plain = decode_request(parse_body(as_json(rounded)), prep, 64)
    for name in prep.categorical:
        np.testing.assert_array_equal(binary.sparse[name].numpy(), plain.sparse[name].numpy())
    np.testing.assert_array_equal(binary.dense.numpy(), plain.dense.numpy())


@pytest.mark.parametrize("column, values, message", [
    ("b", [1, True], "'b': INT64 values must be integers"),
    ("b", [1, 2.5], "'b': INT64 values must be integers, got double"),
    ("x", [1.5, False], "'x': FP32 values must be numbers, got bool"),
    ("x", ["1.5", 2.0], "'x': FP32 values must be numbers"),
    ("c", ["s", 3], "'c': BYTES values must be strings"),
    ("a", [1.0, 2.0], "'a': datatype must be BYTES or an integer datatype .*, got 'FP32'"),
])
def test_a_value_of_another_type_names_its_input_even_inside_a_joined_conversion(column, values, message):
    columns = {"a": ("INT64", [1, 2]), "b": ("INT64", [3, 4]), "c": ("BYTES", ["p", "q"]), "x": ("FP32", [0.5, 1.0]),
               "y": ("FP32", [2.0, 3.0])}
    columns[column] = ("FP32" if "FP32" in message and column == "a" else columns[column][0], values)
    with pytest.raises(RequestError, match=message):
        decode_request(parse_body(as_json(columns)), prep_of({"c": "BYTES"}), 64)


# Digit-only text of every kind: canonical int64s, leading zeros, signs, out of range, extremes.
DIGITS = st.one_of(st.none(), st.integers(-2**63, 2**63 - 1).map(str),
                   st.sampled_from(["0", "007", "-0", "+1", "9" * 20, str(2**63), str(-2**63 - 1), str(2**63 - 1),
                                    str(-2**63), "", "85711"]), st.text(alphabet="0123456789-+", max_size=21))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10).flatmap(lambda n: st.lists(st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)),
                                                      min_size=n, max_size=n)),
       st.sampled_from(["INT64", "BYTES"]))
def test_every_id_datatype_gives_the_ids_of_the_column_id_type(values, id_type):
    """INT64, INT32 and BYTES (decimal text) requests of the same ids give the same ids: the integers themselves
    in an INT64 column; in a BYTES column, the hashes of their decimal text (85711 and "85711" are one id)."""
    prep = prep_of(dict.fromkeys("abc", id_type))
    text = [None if v is None else str(v) for v in values]
    decoded = []
    for datatype, data in (("INT64", values), ("INT32", values), ("BYTES", text)):
        columns = {n: (datatype, data) for n in "abc"} | {n: ("FP32", [0.0] * len(values)) for n in "xy"}
        decoded.append({n: decode_request(parse_body(as_json(columns)), prep, 64).sparse[n].tolist() for n in "abc"})
    assert decoded[0] == decoded[1] == decoded[2]
    for n in "abc":
        present = [v for v in text if v is not None]
        expected = iter(hash_strings(present).tolist() if id_type == "BYTES" else [int(v) for v in present])
        assert decoded[0][n] == [null_key(n) if v is None else next(expected) for v in text]


@settings(max_examples=60, deadline=None)
@given(st.lists(DIGITS, max_size=8))
def test_text_ids_are_read_by_the_column_id_type_as_the_readers_read_them(values):
    """BYTES text of a BYTES column is hashed as text (digit-only included); of an INT64 column it must be a
    canonical decimal int64, else the request is a 400 naming the input, the row and the value."""
    columns = {n: ("BYTES", values) for n in "abc"} | {n: ("FP32", [0.0] * len(values)) for n in "xy"}
    as_bytes = decode_request(parse_body(as_json(columns)), prep_of(dict.fromkeys("abc", "BYTES")), 64)
    arrow = pa.array(values, pa.string())
    np.testing.assert_array_equal(as_bytes.sparse["b"].numpy(), categorical_ids(arrow, "b", "b", "BYTES"))
    canonical = [v is None or bool(re.fullmatch(r"0|-?[1-9][0-9]*", v)) and -2**63 <= int(v) < 2**63 for v in values]
    if all(canonical):
        as_ints = decode_request(parse_body(as_json(columns)), PREP, 64)
        assert as_ints.sparse["b"].tolist() == [null_key("b") if v is None else int(v) for v in values]
    else:
        row = canonical.index(False)
        with pytest.raises(RequestError, match=rf"^input 'a': {re.escape(repr(values[row]))} at row {row} is not an "
                                                r"integer id, and the model reads 'a' as INT64 ids"):
            decode_request(parse_body(as_json(columns)), PREP, 64)


def test_a_short_input_is_named_with_both_row_counts():
    """One column with a row less than the others: the 400 names that column, not the first input."""
    request = {"inputs": [{"name": n, "datatype": "INT64", "shape": [3], "data": [1, 2, 3]} for n in "abc"]
               + [{"name": "x", "datatype": "FP32", "shape": [3], "data": [0.5, 1, 2]},
                  {"name": "y", "datatype": "FP32", "shape": [3], "data": [0.5, 1, 2]}]}
    request["inputs"][1] = {"name": "b", "datatype": "INT64", "shape": [2], "data": [1, 2]}
    with pytest.raises(RequestError, match=r"^input 'b': 2 rows, but 4 other inputs \('a', 'c', 'x', 'y'\) have 3$"):
        decode_request(request, PREP, 64)
    request["inputs"][1] = {"name": "b", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]}
    request["inputs"][4] = {"name": "y", "datatype": "FP32", "shape": [4], "data": [0.5, 1, 2, 3]}
    with pytest.raises(RequestError, match=r"^input 'y': 4 rows, but 4 other inputs"):
        decode_request(request, PREP, 64)
    # a shape that disagrees with its own data (a typo in one shape) is named as that, not as a row count
    request["inputs"][4] = {"name": "y", "datatype": "FP32", "shape": [4], "data": [0.5, 1, 2]}
    with pytest.raises(RequestError, match=r"^input 'y': shape \[4\] but 3 values$"):
        decode_request(request, PREP, 64)


def test_multi_hot_ids_follow_the_column_id_type_and_name_the_row_of_a_bad_value():
    def ids(datatype, values, id_type):
        prep = Preprocessing(label=None, categorical=(), multi_hot=("m",), id_types={"m": id_type}, dense_rows=1)
        request = {"inputs": [{"name": "m", "datatype": datatype, "shape": [len(values)], "data": values},
                              {"name": "m__lengths", "datatype": "INT32", "shape": [2], "data": [1, len(values) - 1]}]}
        return decode_request(request, prep, 64).sparse["m"].tolist()

    assert ids("BYTES", ["5", "-7", None], "INT64") == ids("INT64", [5, -7, None], "INT64") == [5, -7, null_key("m")]
    assert ids("BYTES", ["5", "-7"], "BYTES") == ids("INT32", [5, -7], "BYTES") == hash_strings(["5", "-7"]).tolist()
    with pytest.raises(RequestError, match=r"^input 'm': 'x' at row 1 is not an integer id"):
        ids("BYTES", ["5", "-7", "x"], "INT64")


# Any JSON value a client might put in `data` (nested arrays too), and requests built around them.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.text(max_size=4),
                    st.floats(allow_nan=False, allow_infinity=False))
DATA = st.lists(st.one_of(SCALARS, st.lists(SCALARS, max_size=2)), max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["INT64", "INT32", "FP32", "FP64", "BYTES", "BOOL", 7]), DATA),
                max_size=4), st.one_of(st.none(), st.text(max_size=5)))
def test_json_bodies_parse_as_json_loads_reads_them_with_numeric_data_as_arrays(tensors, request_id):
    request = {"inputs": [{"name": f"t{i}", "datatype": d, "shape": [len(v)], "data": v}
                          for i, (d, v) in enumerate(tensors)]}
    if request_id is not None:
        request["id"] = request_id
    text = json.dumps(request).encode()
    got, expected = parse_body(text), orjson.loads(text)  # what the server read before (ints past 64 bits: floats)
    assert {k: v for k, v in got.items() if k != "inputs"} == {k: v for k, v in expected.items() if k != "inputs"}
    for g, e in zip(got["inputs"], expected["inputs"], strict=True):
        assert {k: v for k, v in g.items() if k != "data"} == {k: v for k, v in e.items() if k != "data"}
        if not isinstance(g["data"], np.ndarray):
            assert g["data"] == e["data"]
            continue
        # an array only for a numeric datatype whose values (read flat, row-major) are all of its JSON type
        flat = [x for v in e["data"] for x in (v if isinstance(v, list) else [v])]
        if e["datatype"] in ("INT64", "INT32"):
            assert g["data"].dtype == np.int64 and all(type(x) is int for x in flat)
            assert g["data"].tolist() == flat
        else:
            assert e["datatype"] in ("FP32", "FP64") and g["data"].dtype == np.float64
            assert all(type(x) in (int, float) for x in flat)
            assert g["data"].tolist() == [float(x) for x in flat]


def test_nested_data_is_read_in_row_major_order_as_the_protocol_allows():
    nested = {"a": ("INT64", [[1, 2], [3, 4]]), "b": ("INT64", [5, 6, 7, 8]), "c": ("BYTES", ["p", "q", "r", "s"]),
              "x": ("FP32", [[0.5, 1.0], [1.5, 2.0]]), "y": ("FP32", [1.0, 2.0, 3.0, 4.0])}
    text = json.dumps({"inputs": [{"name": n, "datatype": d, "shape": [4], "data": v}
                                  for n, (d, v) in nested.items()]}).encode()
    flat = {n: (d, np.ravel(v).tolist()) for n, (d, v) in nested.items()}
    prep = prep_of({"a": "INT64", "b": "INT64", "c": "BYTES"})
    got, expected = decode_request(parse_body(text), prep, 64), decode_request(parse_body(as_json(flat)), prep, 64)
    for name in prep.categorical:
        np.testing.assert_array_equal(got.sparse[name].numpy(), expected.sparse[name].numpy())
    np.testing.assert_array_equal(got.dense.numpy(), expected.dense.numpy())


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 12).flatmap(lambda rows: st.tuples(
    st.lists(st.lists(st.integers(-2**63, 2**63 - 1), min_size=rows, max_size=rows), min_size=3, max_size=3),
    st.lists(st.lists(st.floats(width=32), min_size=rows, max_size=rows), min_size=2, max_size=2),
    st.sampled_from(["FP32", "FP64"]))))
def test_all_numeric_arrays_decode_as_the_general_path_decodes_lists(case):
    ids, dense, dense_type = case  # NaN and inf included: both paths keep them raw, for the dense rule
    def request(as_array):
        make = (lambda v, dt: np.asarray(v, dt)) if as_array else (lambda v, dt: list(v))
        return {"inputs": [{"name": n, "datatype": "INT64", "shape": [len(v)], "data": make(v, np.int64)}
                           for n, v in zip(PREP.categorical, ids)]
                + [{"name": n, "datatype": dense_type, "shape": [len(v)], "data": make(v, np.float64)}
                   for n, v in zip(PREP.dense, dense)]}
    fast, general = decode_request(request(True), PREP, 64), decode_request(request(False), PREP, 64)
    by_name = {t["name"]: t for t in request(True)["inputs"]}
    assert _numeric_batch(by_name, PREP, len(ids[0])) is not None  # the arrays took the numpy path
    assert _numeric_batch({t["name"]: t for t in request(False)["inputs"]}, PREP, len(ids[0])) is None
    for name in PREP.categorical:
        np.testing.assert_array_equal(fast.sparse[name].numpy(), general.sparse[name].numpy())
        assert fast.sparse[name].numpy().flags.writeable
    np.testing.assert_array_equal(fast.dense.numpy(), general.dense.numpy())
    assert len(fast) == len(general) and fast.dense.dtype == general.dense.dtype


MIXED = prep_of({"a": "INT64", "b": "BYTES", "c": "INT64"})


def column_request(rows: int, shape_of, nest: bool = False) -> dict:
    """A request of ``rows`` rows of MIXED's columns (INT64, BYTES, INT32 ids; FP32, FP64 dense), each input's shape
    ``shape_of(rows)``; ``nest``: JSON ``data`` nested by rows."""
    g = np.random.default_rng(rows)
    columns = {"a": ("INT64", g.integers(-2**63, 2**63 - 1, rows).tolist()),
               "b": ("BYTES", [f"t{v}" for v in g.integers(0, 9, rows)]),
               "c": ("INT32", g.integers(-2**31, 2**31 - 1, rows).tolist()),
               "x": ("FP32", g.normal(size=rows).astype(np.float32).tolist()),
               "y": ("FP64", [float("nan")] * (rows > 0) + g.normal(size=max(rows - 1, 0)).tolist())}
    return {"inputs": [{"name": n, "datatype": d, "shape": shape_of(rows),
                        "data": [[v] for v in data] if nest else data} for n, (d, data) in columns.items()]}


def same_batch(a, b) -> None:
    assert len(a) == len(b) and a.sparse.keys() == b.sparse.keys()
    for name in a.sparse:
        np.testing.assert_array_equal(a.sparse[name].numpy(), b.sparse[name].numpy())
    assert a.dense.numpy().tobytes() == b.dense.numpy().tobytes()  # bit-equal, NaN included


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_inputs_shaped_b_by_1_decode_as_the_b_form(rows):
    """Triton clients send each feature as ``[B, 1]``: JSON (flat and nested), binary tensors and arrays (gRPC)
    decode bit-equal to ``[B]``."""
    flat = decode_request(column_request(rows, lambda n: [n]), MIXED, 64)
    for nest in (False, True):
        request = column_request(rows, lambda n: [n, 1], nest)
        same_batch(decode_request(parse_body(json.dumps(request).encode()), MIXED, 64), flat)
        same_batch(decode_request(json.loads(json.dumps(request)), MIXED, 64), flat)  # the plain parser's lists
    # binary tensors, as tritonclient sends them: shape [B, 1], the bytes flat
    request = column_request(rows, lambda n: [n, 1])
    head, blobs = {"inputs": []}, []
    for t in request["inputs"]:
        if t["datatype"] == "BYTES":
            blob = b"".join(len(v).to_bytes(4, "little") + v.encode() for v in t["data"])
        else:
            blob = np.asarray(t["data"], {"INT64": "<i8", "INT32": "<i4", "FP32": "<f4", "FP64": "<f8"}[
                t["datatype"]]).tobytes()
        head["inputs"].append({**{k: v for k, v in t.items() if k != "data"},
                               "parameters": {"binary_data_size": len(blob)}})
        blobs.append(blob)
    text = json.dumps(head).encode()
    same_batch(decode_request(parse_body(text + b"".join(blobs), len(text)), MIXED, 64), flat)


def test_an_int64_batch_shaped_b_by_1_takes_the_numpy_path_as_b_does():
    g = np.random.default_rng(0)
    ids = {c: g.integers(-2**63, 2**63 - 1, 7) for c in PREP.categorical}
    dense = {c: g.normal(size=7).astype(np.float32) for c in PREP.dense}
    def request(shape):
        return {"inputs": [{"name": c, "datatype": "INT64", "shape": shape, "data": v} for c, v in ids.items()]
                + [{"name": c, "datatype": "FP32", "shape": shape, "data": v} for c, v in dense.items()]}
    same_batch(decode_request(request([7, 1]), PREP, 64), decode_request(request([7]), PREP, 64))


@pytest.mark.parametrize("shape, message", [
    ([4, 2], "shape must be [n] or [n, 1], n rows of one value each, got [4, 2]"),
    ([1, 4], "a [1, n] row is not read as n rows"),
    ([4, 1, 1], "got [4, 1, 1]"), ([], "got []"), ([-4, 1], "got [-4, 1]"), ([4, True], "got [4, True]")])
def test_other_two_dimensional_shapes_are_400s_naming_the_input(shape, message):
    request = column_request(4, lambda n: [n])
    request["inputs"][2]["shape"] = shape
    with pytest.raises(RequestError, match=re.escape(message)) as error:
        decode_request(request, MIXED, 64)
    assert "input 'c'" in str(error.value)


def test_one_by_one_is_one_row_and_multi_hot_ids_stay_flat():
    one = decode_request(column_request(1, lambda n: [1, 1]), MIXED, 64)
    same_batch(one, decode_request(column_request(1, lambda n: [1]), MIXED, 64))
    prep = Preprocessing(label=None, categorical=(), multi_hot=("m",), dense=(), dense_mean=(), dense_std=(),
                         dense_min=(), dense_max=(), dense_rows=1, id_types={"m": "INT64"})
    request = {"inputs": [{"name": "m", "datatype": "INT64", "shape": [3], "data": [1, 2, 3]},
                          {"name": "m__lengths", "datatype": "INT32", "shape": [2, 1], "data": [2, 1]}]}
    batch = decode_request(request, prep, 64)
    assert batch.offsets["m"].tolist() == [0, 2, 3] and batch.sparse["m"].tolist() == [1, 2, 3]
    request["inputs"][0]["shape"] = [3, 1]
    with pytest.raises(RequestError, match=re.escape("input 'm': shape must be [n], one size (all the rows' ids")):
        decode_request(request, prep, 64)


def _binary_request(columns: dict, prep_columns=("a", "b", "c")) -> tuple[bytes, int]:
    """A binary-extension body: BYTES columns as raw bytes values, dense columns as float32."""
    head, raw = [], b""
    for name, (kind, values) in columns.items():
        if kind == "BYTES":
            data = b"".join(len(v).to_bytes(4, "little") + v for v in values)
        else:
            data = np.asarray(values, "<f4").tobytes()
        head.append({"name": name, "datatype": kind, "shape": [len(values)],
                     "parameters": {"binary_data_size": len(data)}})
        raw += data
    header = json.dumps({"inputs": head}).encode()
    return header + raw, len(header)


def test_binary_bytes_ids_are_hashed_as_sent_even_when_not_utf8():
    """What ``dynemb predict`` scores from a binary Parquet column, the endpoint scores too: bytes hashed as they
    are; a text id and its UTF-8 bytes are one key. An INT64 column names the value that is no integer."""
    odd = [b"\xff\xfe", "é".encode(), b"", b"plain"]
    prep = prep_of({"a": "BYTES", "b": "BYTES", "c": "INT64"})
    columns = {"a": ("BYTES", odd), "b": ("BYTES", [b"x"] * 4), "c": ("BYTES", [b"1", b"2", b"3", b"4"]),
               "x": ("FP32", [0.0] * 4), "y": ("FP32", [1.0] * 4)}
    body, size = _binary_request(columns)
    batch = decode_request(parse_body(body, size), prep, 64)
    np.testing.assert_array_equal(batch.sparse["a"].numpy(), categorical_ids(pa.array(odd, pa.binary()), "a", "a",
                                                                             "BYTES"))
    assert batch.sparse["a"][1] == hash_strings(["é"])[0]
    assert batch.sparse["c"].tolist() == [1, 2, 3, 4]
    columns["c"] = ("BYTES", [b"1", b"\xff", b"3", b"4"])
    body, size = _binary_request(columns)
    with pytest.raises(RequestError, match="input 'c'.*non-UTF-8 value at row 1 is not an integer id"):
        decode_request(parse_body(body, size), prep, 64)


@pytest.mark.parametrize("cut", [1, 3, 5, 8])
def test_a_truncated_binary_bytes_element_names_the_input_and_the_offset(cut):
    raw = (3).to_bytes(4, "little") + b"abc" + (5).to_bytes(4, "little") + b"hello"
    header = json.dumps({"inputs": [{"name": "a", "datatype": "BYTES", "shape": [2],
                                     "parameters": {"binary_data_size": len(raw) - cut}}]}).encode()
    with pytest.raises(RequestError, match=r"input 'a': truncated binary BYTES element at byte (0|7) of"):
        parse_body(header + raw[:len(raw) - cut], len(header))
