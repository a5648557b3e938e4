"""Criteo TSV, multi-hot list columns, nulls and file suffixes, on real files in a temp dir."""

import gzip

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.data import FileReader, hash_strings, null_key
from dynemb.data.formats import CRITEO_CATEGORICAL, CRITEO_DENSE, file_format


def criteo_lines(n: int, label: bool = True) -> list[str]:
    """``n`` Criteo rows: label i % 2, I1 = i, the other counts empty or i * k, C1 = 8 hex digits of i, other
    categoricals empty every 3rd row."""
    lines = []
    for i in range(n):
        ints = [str(i)] + [("" if (i + k) % 4 == 0 else str(i * k)) for k in range(2, 14)]
        cats = [f"{i:08x}"] + [("" if i % 3 == 0 else f"{(i * k) % 7:08x}") for k in range(2, 27)]
        lines.append("\t".join(([str(i % 2)] if label else []) + ints + cats))
    return lines


@pytest.mark.parametrize("name", ["day_0.criteo", "train.txt", "day_1.criteo.gz"])
def test_criteo_tsv(tmp_path, name):
    text = "\n".join(criteo_lines(50)) + "\n"
    path = tmp_path / name
    if name.endswith(".gz"):
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    assert file_format(path) == "criteo"
    reader = FileReader(path, label="label", categorical=list(CRITEO_CATEGORICAL), dense=list(CRITEO_DENSE),
                        batch_size=16)
    batches = list(reader)
    assert [len(b) for b in batches] == [16, 16, 16, 2]
    labels = torch.cat([b.labels for b in batches])
    dense = torch.cat([b.dense for b in batches])
    c1 = torch.cat([b.sparse["C1"] for b in batches])
    c2 = torch.cat([b.sparse["C2"] for b in batches])
    assert labels.tolist() == [float(i % 2) for i in range(50)]
    assert dense[:, 0].tolist() == [float(i) for i in range(50)]
    assert dense[2, 1].isnan() and dense[5, 1].item() == 10.0  # I2 of row 2 is empty: a null is NaN
    assert c1.tolist() == hash_strings([f"{i:08x}" for i in range(50)]).tolist()  # hex text, hashed
    assert c2[0].item() == null_key("C2") and c2[1].item() == hash_strings([f"{2 % 7:08x}"]).item()


def test_criteo_without_label_and_an_explicit_format(tmp_path):
    path = tmp_path / "day_0"  # no suffix: --format criteo
    path.write_text("\n".join(criteo_lines(5, label=False)) + "\n")
    with pytest.raises(ValueError, match="unknown file type"):
        FileReader(path, label=None, categorical=["C1"])
    batch = next(iter(FileReader(path, label=None, categorical=["C1"], dense=["I1"], format="criteo")))
    assert batch.labels.isnan().all() and batch.dense[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    with pytest.raises(ValueError, match=r"missing column 'label' .*read as Criteo TSV: pass --format csv"):
        FileReader(path, label="label", categorical=["C1"], format="criteo")


@pytest.mark.parametrize("kind", ["string", "int"])
def test_multi_hot_list_columns_with_nulls(tmp_path, kind):
    if kind == "string":
        values = [["a", "b"], [], None, ["b", None, "a"]]
        element = hash_strings(["a", "b"]).tolist()
    else:
        values = [[2**63 - 1, -5], [], None, [-5, None, 2**63 - 1]]
        element = [2**63 - 1, -5]
    pq.write_table(pa.table({"y": [1, 0, 1, 0], "tags": values}), tmp_path / "t.parquet", row_group_size=3)
    batches = list(FileReader(tmp_path / "t.parquet", label="y", categorical=[], multi_hot=["tags"], batch_size=3))
    assert [len(b) for b in batches] == [3, 1]
    a, b, n = element[0], element[1], null_key("tags")
    assert batches[0].sparse["tags"].tolist() == [a, b, n] and batches[0].offsets["tags"].tolist() == [0, 2, 2, 3]
    assert batches[1].sparse["tags"].tolist() == [b, n, a] and batches[1].offsets["tags"].tolist() == [0, 3]


def test_multi_hot_in_csv_and_errors(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("y,tags,user\n1,a|12|a,u\n0,,u\n1,7,\n")
    batch = next(iter(FileReader(path, label="y", categorical=["user"], multi_hot=["tags"])))
    a, twelve, seven = hash_strings(["a", "12", "7"]).tolist()  # "a" is no integer: the column is BYTES
    assert batch.sparse["tags"].tolist() == [a, twelve, a, null_key("tags"), seven]
    assert batch.offsets["tags"].tolist() == [0, 3, 4, 5]
    assert batch.sparse["user"][2].item() == null_key("user")
    path.write_text("y,tags,user\n1,5|12|5,u\n0,,u\n1,7|x,\n")
    reader = FileReader(path, label="y", categorical=["user"], multi_hot=["tags"])
    assert reader.id_types == {"user": "BYTES", "tags": "BYTES"}
    reader = FileReader(path, label="y", categorical=["user"], multi_hot=["tags"], id_rows=2)  # decided by 2 rows
    assert reader.id_types == {"user": "BYTES", "tags": "INT64"}
    with pytest.raises(ValueError, match=r"t\.csv: column 'tags': 'x' at row 2 is not an integer id"):
        list(reader)

    pq.write_table(pa.table({"y": [1], "tags": [["a"]], "n": [3]}), tmp_path / "l.parquet")
    with pytest.raises(ValueError, match=r"column 'n' has type int64; multi-hot columns must be lists"):
        list(FileReader(tmp_path / "l.parquet", label="y", categorical=[], multi_hot=["n"]))
    with pytest.raises(ValueError, match=r"column 'tags' has type list<.*>; categorical ids must be integers"):
        list(FileReader(tmp_path / "l.parquet", label="y", categorical=["tags"]))


@pytest.mark.parametrize("name", ["t.parquet.brotli", "t.parquet.snappy", "t.snappy.parquet", "t.pq"])
def test_parquet_codec_suffixes(tmp_path, name):
    path = tmp_path / name
    pq.write_table(pa.table({"y": [0, 1], "c": ["x", "y"]}), path, compression="brotli")
    assert file_format(path) == "parquet"
    batch = next(iter(FileReader(path, label="y", categorical=["c"])))
    assert batch.sparse["c"].tolist() == hash_strings(["x", "y"]).tolist()


@pytest.mark.parametrize("codec, suffix", [("gzip", ".gz"), ("brotli", ".brotli"), ("zstd", ".zst"),
                                           ("bz2", ".bz2")])
def test_compressed_csv(tmp_path, codec, suffix):
    path = tmp_path / f"t.csv{suffix}"
    with pa.CompressedOutputStream(str(path), codec) as out:
        out.write(b"y,c\n1,5\n0,6\n")
    batch = next(iter(FileReader(path, label="y", categorical=["c"])))
    assert batch.sparse["c"].tolist() == [5, 6] and batch.labels.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("name", ["synthetic.criteo", "synthetic.criteo.zst"])
def test_synthetic_criteo_files_read_back(tmp_path, name):
    from dynemb.data import SyntheticClickLog
    from dynemb.data.writers import write_synthetic

    log = SyntheticClickLog(num_categorical=26, num_dense=13, batch_size=64, seed=3)
    path = write_synthetic(log, tmp_path / name, 2, format="criteo")
    batches = list(FileReader(path, label="label", categorical=list(CRITEO_CATEGORICAL), dense=list(CRITEO_DENSE),
                              batch_size=64))
    for i, batch in enumerate(batches):
        source = log.batch(i)
        assert torch.equal(batch.labels, source.labels)
        assert torch.equal(batch.dense, torch.round(source.dense * 10))
        hex_ids = [f"{v & 0xFFFFFFFF:08x}" for v in source.sparse["C7"].tolist()]
        assert batch.sparse["C7"].tolist() == hash_strings(hex_ids).tolist()


def test_a_directory_of_criteo_days_without_suffixes(tmp_path):
    days = tmp_path / "days"
    days.mkdir()
    for day in range(2):
        (days / f"day_{day}").write_text("\n".join(criteo_lines(10)) + "\n")
    (days / "_SUCCESS").write_text("")
    (days / "day_2.csv").write_text("y,c\n1,2\n")  # another format: not read
    with pytest.raises(ValueError, match=r"day_2\.csv: missing column 'label'"):  # no format: only suffixes count
        FileReader(days, label="label", categorical=["C1"])
    reader = FileReader(days, label="label", categorical=["C1"], format="criteo")
    assert [p.name for p in reader.files] == ["day_0", "day_1"]
    assert sum(len(b) for b in reader) == 20
