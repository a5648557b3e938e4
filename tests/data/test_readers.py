import gzip
import re
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from dynemb.data import FileReader, hash_strings, null_key

I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def _read_all(reader):
    batches = list(reader)
    return batches, {
        "labels": torch.cat([b.labels for b in batches]).tolist(),
        "dense": torch.cat([b.dense for b in batches]).tolist(),
        **{c: torch.cat([b.sparse[c] for b in batches]).tolist() for c in reader.categorical},
    }


@pytest.fixture
def parquet_file(tmp_path):
    table = pa.table(
        {
            "click": pa.array([0, 1, 1, 0, 1], pa.int8()),
            "user": ["u1", None, "u1", "é", "u2"],
            "item": pa.array([I64_MIN, -1, 0, I64_MAX, None], pa.int64()),
            "big": pa.array([2**64 - 1, 2**63, 0, 5, 6], pa.uint64()),
            "price": [1.5, None, float("nan"), -2.0, 3.0],
            "age": pa.array([30, 40, None, 50, 60], pa.int32()),
            "unused": ["x"] * 5,
        }
    )
    path = tmp_path / "clicks.parquet"
    pq.write_table(table, path, row_group_size=2)
    return path


def test_parquet_round_trip(parquet_file):
    reader = FileReader(
        parquet_file, label="click", categorical=["user", "item", "big"], dense=["price", "age"], batch_size=2
    )
    batches, got = _read_all(reader)
    assert [len(b) for b in batches] == [2, 2, 1]
    assert got["labels"] == [0.0, 1.0, 1.0, 0.0, 1.0]
    nan = float("nan")  # a null is NaN: what it reads as is the model's rule (Preprocessing.normalize)
    np.testing.assert_array_equal(got["dense"], [[1.5, 30.0], [nan, 40.0], [nan, nan], [-2.0, 50.0], [3.0, 60.0]])
    assert reader.id_types == {"user": "BYTES", "item": "INT64", "big": "INT64"}
    u1, e, u2 = hash_strings(["u1", "é", "u2"]).tolist()
    assert got["user"] == [u1, null_key("user"), u1, e, u2]
    assert got["item"] == [I64_MIN, -1, 0, I64_MAX, null_key("item")]
    assert got["big"] == [-1, I64_MIN, 0, 5, 6]
    assert all(ids.dtype == torch.int64 for b in batches for ids in b.sparse.values())


def test_batches_regroup_across_row_groups_and_epochs(parquet_file):
    reader = FileReader(parquet_file, label="click", categorical=["user"], batch_size=3, drop_last=True)
    first, second = list(reader), list(reader)
    assert [len(b) for b in first] == [3]
    assert torch.equal(first[0].sparse["user"], second[0].sparse["user"])
    assert first[0].dense.shape == (3, 0)


def test_dictionary_strings_hash_like_plain_strings(tmp_path):
    plain = pa.array(["a", "b", None, "a"])
    pq.write_table(pa.table({"y": [0, 1, 0, 1], "s": plain, "d": plain.dictionary_encode()}), tmp_path / "d.parquet")
    _, got = _read_all(FileReader(tmp_path / "d.parquet", label="y", categorical=["s", "d"]))
    assert got["d"][:2] == got["s"][:2] == hash_strings(["a", "b"]).tolist()
    assert got["d"][2] == null_key("d") and got["s"][2] == null_key("s")


CSV_TEXT = (
    "label,id,price,note\n"
    "1,123,1.5,x\n"
    "0,-9223372036854775808,,x\n"
    "1,9223372036854775807,2,x\n"
    "0,9223372036854775808,nan,x\n"
    "1,007,3,x\n"
    "0,abc,4,x\n"
    "1,,5,x\n"
    '0,"",6,x\n'
)


def test_csv_round_trip_with_text_ids(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text(CSV_TEXT)
    reader = FileReader(path, label="label", categorical=["id"], dense=["price"], batch_size=3)
    _, got = _read_all(reader)
    assert got["labels"] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    np.testing.assert_array_equal([row[0] for row in got["dense"]], [1.5, np.nan, 2.0, np.nan, 3.0, 4.0, 5.0, 6.0])
    # Not every value is a canonical decimal int64, so the column is BYTES: every value is hashed as text.
    assert reader.id_types == {"id": "BYTES"}
    hashed = hash_strings(["123", str(I64_MIN), str(I64_MAX), "9223372036854775808", "007", "abc"]).tolist()
    assert got["id"] == [*hashed, null_key("id"), null_key("id")]


def test_csv_text_an_int64_column_cannot_read_names_the_column_row_and_value(tmp_path):
    path = tmp_path / "clicks.csv"
    path.write_text(CSV_TEXT)
    reader = FileReader(path, label="label", categorical=["id"], batch_size=2, id_types={"id": "INT64"})
    with pytest.raises(ValueError, match=r"clicks\.csv: column 'id': '9223372036854775808' at row 3 is not an "
                                         r"integer id, and the model reads 'id' as INT64 ids \(id_types in "
                                         r"model\.json\)$"):
        list(reader)


def test_compressed_tsv_and_a_directory_of_parts(tmp_path):
    with gzip.open(tmp_path / "part-0.tsv.gz", "wt") as f:
        f.write("y\tc\n1\tq\n0\t-5\n")
    _, got = _read_all(FileReader(tmp_path / "part-0.tsv.gz", label="y", categorical=["c"]))
    assert got["c"] == hash_strings(["q", "-5"]).tolist()  # "q" is no integer: the column is BYTES

    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"y": [i % 2, 1], "c": [10 * i, 10 * i + 1]}), parts / f"part-{i}.parquet")
    (parts / "_SUCCESS").write_text("")
    batches, got = _read_all(FileReader(parts, label="y", categorical=["c"], batch_size=4))
    assert [len(b) for b in batches] == [4, 2]
    assert got["c"] == [0, 1, 10, 11, 20, 21]


def test_parquet_and_csv_agree(tmp_path):
    rows = {"y": [0, 1, 1], "n": [-3, 2**40, 0], "s": ["a", "b", "a"]}
    pq.write_table(pa.table(rows), tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text("y,n,s\n0,-3,a\n1,1099511627776,b\n1,0,a\n")
    kw = dict(label="y", categorical=["n", "s"])
    _, from_parquet = _read_all(FileReader(tmp_path / "t.parquet", **kw))
    _, from_csv = _read_all(FileReader(tmp_path / "t.csv", **kw))
    assert from_parquet == from_csv


# ---------------------------------------------------------------------------------------------- errors
def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.parquet: no such file or directory"):
        FileReader(tmp_path / "nope.parquet", label="y", categorical=["c"])


def test_unreadable_files(tmp_path):
    bad = _write(tmp_path, "bad.parquet", "this is not parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: cannot read it as parquet \(.*\)$"):
        FileReader(bad, label="y", categorical=["c"])
    with pytest.raises(ValueError, match=r"data\.json: unknown file type"):
        FileReader(_write(tmp_path, "data.json", "{}"), label="y", categorical=["c"])
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match=r"empty_dir: the directory holds no \.parquet, \.csv or \.criteo files"):
        FileReader(tmp_path / "empty_dir", label="y", categorical=["c"])
    # a directory of parts with one CSV among the Parquet files: which formats, with a file of each ("pass
    # format=" alone named neither, nor the command's option)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(pa.table({"y": [1], "c": [2]}), mixed / "part-0.parquet")
    _write(mixed, "part-1.parquet", "x")  # the name is what counts
    _write(mixed, "extra.csv", "y,c\n1,2\n")
    with pytest.raises(ValueError, match=r"mixed: the directory holds files of several formats \(csv: extra\.csv, "
                                         r"parquet: part-0\.parquet\); keep one format there, or pass format= "
                                         r"\(--format\) to read only the files of that one$"):
        FileReader(mixed, label="y", categorical=["c"])


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_missing_column(tmp_path, suffix):
    path = tmp_path / f"t.{suffix}"
    if suffix == "parquet":
        pq.write_table(pa.table({"y": [1], "c": [2]}), path)
    else:
        path.write_text("y,c\n1,2\n")
    with pytest.raises(ValueError, match=rf"t\.{suffix}: missing column 'price' \(the file has: y, c\)"):
        FileReader(path, label="y", categorical=["c"], dense=["price"])


@pytest.mark.parametrize(
    "text, shown",
    [("y,c\n0,1\n2,1\n", "'2' at row 1"), ("y,c\n0,1\n,1\n", "None at row 1"), ("y,c\nyes,1\n", "'yes'")],
)
def test_label_not_0_1_in_csv(tmp_path, text, shown):
    path = _write(tmp_path, "t.csv", text)
    reader = FileReader(path, label="y", categorical=["c"])
    with pytest.raises(ValueError, match=rf"t\.csv: column 'y'.*labels must be 0 or 1.*{shown}"):
        list(reader)


def test_text_labels_are_shown_for_positive_label(tmp_path):
    """A text label (the census file's income) names the values, not pyarrow's parse error, so the user sees
    which one to pass as --positive-label."""
    pq.write_table(pa.table({"y": ["<=50K", ">50K", None, "<=50K"], "c": [1, 2, 3, 4]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"^.*t\.parquet: column 'y': labels must be 0 or 1, got text \('<=50K', "
                                         r"'>50K'\); other labels need --positive-label VALUE \(the value that "
                                         r"means 1\)$"):
        list(FileReader(tmp_path / "t.parquet", label="y", categorical=["c"]))
    pq.write_table(pa.table({"y": list("abcdefg"), "c": [1] * 7}), tmp_path / "many.parquet")
    with pytest.raises(ValueError, match=r"got text \('a', 'b', 'c', 'd', 'e', \.\.\.\)"):
        list(FileReader(tmp_path / "many.parquet", label="y", categorical=["c"]))


def test_label_not_0_1_in_parquet_names_the_row(tmp_path):
    pq.write_table(pa.table({"y": [0.0, 1.0, 0.5], "c": [1, 2, 3]}), tmp_path / "t.parquet", row_group_size=2)
    with pytest.raises(ValueError, match=r"t\.parquet: column 'y': labels must be 0 or 1, got 0\.5 at row 2; other "
                                         r"labels need --positive-label"):
        list(FileReader(tmp_path / "t.parquet", label="y", categorical=["c"], batch_size=2))


@pytest.mark.parametrize("name, content", [("t.csv", ""), ("h.csv", "y,c\n"), ("e.parquet", None)])
def test_empty_dataset(tmp_path, name, content):
    path = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"y": pa.array([], pa.int64()), "c": pa.array([], pa.int64())}), path)
    else:
        path.write_text(content)
    with pytest.raises(ValueError, match=rf"{name}: .*empty"):
        FileReader(path, label="y", categorical=["c"])


def test_bad_values(tmp_path):
    pq.write_table(pa.table({"y": [1], "f": [1.5], "s": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"column 'f' has type double; categorical ids must be integers or strings"):
        list(FileReader(tmp_path / "t.parquet", label="y", categorical=["f"]))
    path = _write(tmp_path, "t.csv", "y,c,x\n1,2,3\n1,2,NA\n1,2,abc\n")
    with pytest.raises(ValueError, match=r"t\.csv: column 'x': dense values must be numbers, got 'abc' at row 2 "
                                         r"\(text ids belong in a categorical column; a missing number is an empty "
                                         r"field or one of NA, N/A, .*\)$"):
        list(FileReader(path, label="y", categorical=["c"], dense=["x"]))
    pq.write_table(pa.table({"y": [1, 0], "c": [1, 2], "s": ["1.5", "11th"]}), tmp_path / "s.parquet")
    with pytest.raises(ValueError, match=r"s\.parquet: column 's': dense values must be numbers, got '11th' at row 1"):
        list(FileReader(tmp_path / "s.parquet", label="y", categorical=["c"], dense=["s"]))


def test_dense_text_of_a_missing_number_reads_as_null(tmp_path):
    """R's ``NA``, SQL exports' ``NULL``/``null``, pandas' ``None``/``<NA>``: a missing number in a CSV export, read as
    an empty field is (NaN here, the training mean after the rule); it was an error ("Failed to parse string:
    'null' as a scalar of type double"). The same text in a categorical column stays an id (text is text)."""
    import math

    rows = ["1,a,1.5", "0,b,NA", "1,NA,null", "0,c,NULL", "1,d,N/A", "0,e,None", "1,f,<NA>", "0,g,", "1,h,nan",
            "0,i,-inf"]
    path = _write(tmp_path, "t.csv", "y,c,x\n" + "\n".join(rows) + "\n")
    (batch,) = FileReader(path, label="y", categorical=["c"], dense=["x"], batch_size=100)
    x = batch.dense[:, 0].tolist()
    assert x[0] == 1.5 and all(math.isnan(v) for v in x[1:9]) and x[9] == -math.inf
    ids = batch.sparse["c"].tolist()
    assert ids[2] != ids[7] and len(set(ids)) == len(ids)  # "NA" is an id of its own, not the null key


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"categorical": "c"}, TypeError, "categorical must be a list of column names"),
        ({"categorical": []}, ValueError, "categorical must name at least one column \\(or multi_hot\\)"),
        ({"categorical": ["c", "c"]}, ValueError, "column 'c' is named twice"),
        ({"categorical": ["y"]}, ValueError, "column 'y' is named twice"),
        ({"label": ""}, TypeError, "label must be a non-empty column name"),
        ({"multi_hot": ["c"]}, ValueError, "column 'c' is named twice"),
        ({"list_separator": "||"}, ValueError, "list_separator must be one character"),
        ({"format": "orc"}, ValueError, "format must be"),
        ({"delimiter": ",,"}, ValueError, "delimiter must be"),
        ({"batch_size": 0}, ValueError, "batch_size"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, message):
    path = _write(tmp_path, "t.csv", "y,c\n1,2\n")
    with pytest.raises(error, match=message):
        FileReader(path, **{"label": "y", "categorical": ["c"], **kwargs})


# ---------------------------------------------------------------------------------------------- id types
ID_TEXT = st.one_of(
    st.integers(I64_MIN, I64_MAX).map(str),
    st.sampled_from(["0", "-0", "+1", "007", "85711", "9" * 20, str(2**63), str(I64_MIN), str(I64_MAX), "user-7"]),
    st.text(alphabet="0123456789-+ ab", min_size=1, max_size=12),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), min_size=1,
            max_size=6))


def _canonical(v: str) -> bool:
    return bool(re.fullmatch(r"0|-?[1-9][0-9]*", v)) and I64_MIN <= int(v) <= I64_MAX


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.one_of(st.none(), ID_TEXT), min_size=1, max_size=12), id_type=st.sampled_from(["INT64",
                                                                                                     "BYTES"]),
       batch_size=st.integers(1, 5))
def test_the_same_rows_as_parquet_and_csv_give_the_same_ids(tmp_path, values, id_type, batch_size):
    """An id is decided by the model's id type, not by the file format: a Parquet string column, a Parquet int
    column (when every value is an integer) and CSV text give the same ids; text an INT64 column cannot read is an
    error naming the file, the column and the row in every format. (CSV cannot tell "" from null: no "" here.)"""
    folder = tmp_path / f"case-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    table = pa.table({"y": [i % 2 for i in range(len(values))], "zip": pa.array(values, pa.string())})
    files = {"text.parquet": table, "text.csv": table}
    if all(v is None or _canonical(v) for v in values):
        ints = [None if v is None else int(v) for v in values]
        files["ints.parquet"] = table.set_column(1, "zip", pa.array(ints, pa.int64()))
    for name, t in files.items():
        (pq.write_table if name.endswith(".parquet") else pcsv.write_csv)(t, folder / name)
    present = [v for v in values if v is not None]
    readable = id_type == "BYTES" or all(_canonical(v) for v in present)
    ids = iter(hash_strings(present).tolist() if id_type == "BYTES" else [int(v) for v in present] if readable else [])
    expected = [null_key("zip") if v is None else next(ids) for v in values] if readable else None
    for name in files:
        reader = FileReader(folder / name, label="y", categorical=["zip"], batch_size=batch_size,
                            id_types={"zip": id_type})
        if readable:
            assert torch.cat([b.sparse["zip"] for b in reader]).tolist() == expected, name
        else:
            row = next(i for i, v in enumerate(values) if v is not None and not _canonical(v))
            with pytest.raises(ValueError, match=rf"{name}: column 'zip': .* at row {row} is not an integer id"):
                list(reader)
    # and the types a new run decides: by the Parquet type, or by every CSV value
    decided = {name: FileReader(folder / name, label="y", categorical=["zip"]).id_types["zip"] for name in files}
    assert decided["text.parquet"] == "BYTES" and decided.get("ints.parquet", "INT64") == "INT64"
    assert decided["text.csv"] == ("INT64" if present and all(_canonical(v) for v in present) else "BYTES")


def test_a_csv_column_is_decided_by_its_first_id_rows_rows_and_an_all_null_one_is_bytes(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,a,b,n\n" + "".join(f"{i % 2},{i},{i},\n" for i in range(50)) + "1,51,x,\n")
    assert FileReader(path, label="y", categorical=["a", "b", "n"]).id_types == {"a": "INT64", "b": "BYTES",
                                                                                   "n": "BYTES"}
    reader = FileReader(path, label="y", categorical=["a", "b", "n"], id_rows=50, batch_size=8)
    assert reader.id_types == {"a": "INT64", "b": "INT64", "n": "BYTES"}
    with pytest.raises(ValueError, match=r"t\.csv: column 'b': 'x' at row 50 is not an integer id"):
        list(reader)
    for bad, error in [({"a": "INT64"}, "id_types must give id column 'b' a type"),
                       ({"a": "INT64", "b": "FP32", "n": "BYTES"}, "id_types must give id column 'b' a type"),
                       ({"a": "INT64", "b": "BYTES", "n": "BYTES", "z": "BYTES"}, "id_types names 'z'")]:
        with pytest.raises(ValueError, match=error):
            FileReader(path, label="y", categorical=["a", "b", "n"], id_types=bad)


@pytest.mark.parametrize("name, separator", [("semi.csv", ";"), ("tabs.csv", "\t"), ("commas.tsv", ",")])
def test_a_file_of_another_separator_says_so(tmp_path, name, separator):
    """A European export (``;``) read as comma-separated is one column named ``y;c``: the missing-column error
    alone left the user guessing."""
    path = _write(tmp_path, name, separator.join(["y", "c"]) + "\n" + separator.join(["1", "2"]) + "\n")
    used = "\t" if name.endswith(".tsv") else ","
    sep, used = re.escape(repr(separator)), re.escape(repr(used))
    with pytest.raises(ValueError, match=rf"missing column 'y' \(the file has: .*\) \(one column, whose name holds "
                                         rf"{sep}: fields separated by {sep}\? it is read with the "
                                         rf"separator {used}: comma for \.csv, tab for \.tsv\)$"):
        FileReader(path, label="y", categorical=["c"])


@pytest.mark.parametrize("column, positive", [([0.0, 1.0], "1.0"), ([True, False], "True"), ([True, False], "1"),
                                              ([0, 1], "01")])
def test_a_positive_label_that_typed_labels_never_write_as_is_refused(column, positive):
    # labels are compared as text: a float 1.0 reads '1', a bool 'true', an int 1 '1', so '1.0', 'True', '1' or
    # '01' named no row, and every label was read as 0 (a degenerate model trained or evaluated without a word)
    from dynemb.data.arrow_columns import label_values

    with pytest.raises(ValueError, match="never read as the positive label"):
        label_values(pa.array(column), "y", 0, positive)


@pytest.mark.parametrize("column, positive, expected", [([0.0, 1.0], "1", [0.0, 1.0]), ([0, 1], "1", [0.0, 1.0]),
                                                        ([True, False], "true", [1.0, 0.0]),
                                                        ([0.5, 1.0], "0.5", [1.0, 0.0])])
def test_a_positive_label_that_typed_labels_write_reads(column, positive, expected):
    from dynemb.data.arrow_columns import label_values

    assert label_values(pa.array(column), "y", 0, positive).tolist() == expected
