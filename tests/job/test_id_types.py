"""An id is decided by the model, not by the file format (docs/cli.md, "Ids, nulls and non-finite values"): a run
trained on Parquet scores the same rows as CSV and as Parquet with other column types bit-identically in the same
batches, and ``train --resume`` on a CSV file keeps the run's id types."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.cli import main
from dynemb.data import hash_strings
from dynemb.serving import read_export

ROWS = 1500
SMALL = ["--batch-size", "128", "--dim", "4", "--eval-batches", "1", "--no-progress"]


def zips_and_shops(rows: int, seed: int = 0) -> pa.Table:
    """Zip codes as digit-only text (a string column: BYTES ids), shops as integers (INT64), categories as lists of
    integers, and a label that follows the zip and the shop."""
    g = np.random.default_rng(seed)
    zip_, shop = g.integers(0, 40, rows), g.integers(0, 25, rows)
    logit = 1.2 * (zip_ % 3 - 1) + 0.8 * (shop % 2) - 0.4
    click = (g.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    # no empty list: CSV cannot tell an empty field from a null one (a null list is the bag [null key])
    cats = [[int(c) for c in g.integers(0, 9, k)] for k in g.integers(1, 4, rows)]
    return pa.table({"click": click, "zip": [str(85700 + z) for z in zip_], "shop": shop * 1_000_003 - 7,
                     "cats": pa.array(cats, pa.list_(pa.int64())), "price": g.random(rows) * 50})


def write_csv(table: pa.Table, path) -> None:
    """The same rows as CSV text: the list column as ids separated by ``|``."""
    cats = ["|".join(map(str, c)) for c in table.column("cats").to_pylist()]
    pcsv.write_csv(table.set_column(3, "cats", pa.array(cats, pa.string())), path)




COLUMNS = ["--label", "click", "--categorical", "zip,shop", "--multi-hot", "cats", "--dense", "price"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained on Parquet, and the scored rows as Parquet, CSV and Parquet with the id columns' types
    swapped (zip as integers, shop as text)."""
    tmp = tmp_path_factory.mktemp("id-types")
    pq.write_table(zips_and_shops(ROWS), tmp / "train.parquet")
    threads = torch.get_num_threads()
    try:
        code = main([str(a) for a in ["train", "--data", tmp / "train.parquet", *COLUMNS, "--out", tmp / "run",
                                      "--epochs", "4", *SMALL]])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    scored = zips_and_shops(600, seed=1)
    pq.write_table(scored, tmp / "rows.parquet")
    write_csv(scored, tmp / "rows.csv")
    swapped = scored.set_column(1, "zip", pa.array([int(z) for z in scored.column("zip").to_pylist()]))
    swapped = swapped.set_column(2, "shop", pa.array([str(s) for s in scored.column("shop").to_pylist()]))
    pq.write_table(swapped, tmp / "swapped.parquet")
    return tmp


def test_the_card_records_the_id_types_the_training_file_decided(trained):
    prep = json.loads((trained / "run" / "model.json").read_text())["preprocessing"]
    assert prep["id_types"] == {"zip": "BYTES", "shop": "INT64", "cats": "INT64"}


def test_predict_and_eval_are_bit_identical_across_formats_in_the_same_batches(trained, dynemb):
    probs = {}
    for name in ("rows.parquet", "rows.csv", "swapped.parquet"):
        for batch in (256, 600):
            out = trained / f"p-{name}-{batch}.parquet"
            dynemb("predict", "--model", trained / "run", "--data", trained / name, "--out", out,
                   "--batch-size", batch)
            probs[name, batch] = pq.read_table(out).column("probability").to_numpy()
    for batch in (256, 600):
        reference = probs["rows.parquet", batch]
        assert np.ptp(reference) > 0.01  # the scores depend on the ids, so equality means something
        for name in ("rows.csv", "swapped.parquet"):
            np.testing.assert_array_equal(probs[name, batch], reference, err_msg=name)
    np.testing.assert_allclose(probs["rows.csv", 256], probs["rows.parquet", 600], rtol=0, atol=1e-6)
    metrics = [dynemb("eval", "--model", trained / "run", "--data", trained / name, "--batch-size", 256)
               for name in ("rows.parquet", "rows.csv", "swapped.parquet")]
    assert metrics[0] == metrics[1] == metrics[2]


def test_text_an_int64_column_cannot_read_is_a_one_line_error_naming_the_column(trained, capsys):
    table = zips_and_shops(50, seed=2)
    table = table.set_column(2, "shop", pa.array(["17"] * 40 + ["017"] + ["5"] * 9))
    write_csv(table, trained / "bad.csv")
    code = main(["predict", "--model", str(trained / "run"), "--data", str(trained / "bad.csv"), "--out",
                 str(trained / "bad.parquet")])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not (trained / "bad.parquet").exists()
    assert err == (f"dynemb predict: error: {trained / 'bad.csv'}: column 'shop': '017' at row 40 is not an integer "
                   "id, and the model reads 'shop' as INT64 ids (id_types in model.json)\n")


def test_resume_on_csv_reads_the_ids_as_the_run_was_trained(tmp_path, dynemb):
    table = zips_and_shops(400)
    pq.write_table(table, tmp_path / "train.parquet")
    write_csv(table, tmp_path / "train.csv")  # on its own, CSV would make the all-digit zip column INT64
    run = tmp_path / "run"
    first = dynemb("train", "--data", tmp_path / "train.parquet", *COLUMNS, "--out", run, "--steps", "2",
                   *SMALL)
    resumed = dynemb("train", "--data", tmp_path / "train.csv", *COLUMNS, "--out", run, "--steps", "4",
                     "--resume", *SMALL[2:])
    assert (first["step"], resumed["step"]) == (2, 4)
    assert json.loads((run / "model.json").read_text())["preprocessing"]["id_types"]["zip"] == "BYTES"
    main(["export", "--model", str(run), "--out", str(tmp_path / "export")])
    _, tables = read_export(tmp_path / "export")
    keys = set(tables["zip"]["keys"].tolist())
    zips = table.column("zip").to_pylist()
    assert keys <= set(hash_strings(zips).tolist()) and not keys & {int(z) for z in zips}


def test_resume_on_other_data_warns_once_and_on_the_same_data_says_nothing(tmp_path, capsys):
    """A resume skips as many batches as the run trained and compares its best model on the held-out rows of the
    data it is given: other data (another file, even the same rows as CSV) is said, in one warning line."""
    table = zips_and_shops(400)
    pq.write_table(table, tmp_path / "train.parquet")
    write_csv(table, tmp_path / "train.csv")
    run = tmp_path / "run"
    base = ["train", *COLUMNS, "--out", str(run), *SMALL]
    assert main([*base, "--data", str(tmp_path / "train.parquet"), "--steps", "2"]) == 0
    capsys.readouterr()
    assert main([*base, "--data", str(tmp_path / "train.parquet"), "--steps", "3", "--resume"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main([*base, "--data", str(tmp_path / "train.csv"), "--steps", "4", "--resume"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "resumed on other data than the run was trained on (train " in warned[0] \
        and "train.csv" in warned[0] and "start a new run" in warned[0], warned
