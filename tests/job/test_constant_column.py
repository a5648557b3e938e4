"""``dynemb train`` on a file with constant categorical columns (every row the same id, so their tables end with
exactly one row): train (publishing serving versions), eval, predict, serving the published versions, export and
``train --resume`` work on the run directory, from Parquet and from CSV. Saving a one-row table crashed every such
run at its first checkpoint."""

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.checkpoint import read_chain, read_export
from dynemb.cli import main
from dynemb.data import FileReader, hash_strings
from dynemb.job import read_card
from dynemb.endpoint import ServedModel

ROWS = 300
TINY = ["--batch-size", "64", "--dim", "4", "--eval-batches", "1", "--no-progress"]
COLUMNS = ["--label", "click", "--categorical", "user,country,code", "--dense", "price,fee"]


def clicks() -> pa.Table:
    """Varied users; ``country`` is one string, ``code`` one int64 (the largest) and ``fee`` one float on every
    row (a dense column whose standard deviation is 0)."""
    g = torch.Generator().manual_seed(0)
    user = torch.randint(0, 40, (ROWS,), generator=g)
    return pa.table({"click": (user % 3 == 0).long().tolist(), "user": [f"user-{u}" for u in user.tolist()],
                     "country": ["fr"] * ROWS, "code": [2**63 - 1] * ROWS,
                     "price": torch.rand(ROWS, generator=g).tolist(), "fee": [9.5] * ROWS})


def _shard_rows(run) -> dict:
    """Rows of each table in the run's latest checkpoint, from its manifest."""
    step = json.loads((run / "checkpoint" / "latest").read_text())["name"]
    manifest = json.loads((run / "checkpoint" / step / "manifest.json").read_text())
    return {name: sum(s["rows"] for s in entry["shards"]) for name, entry in manifest["tables"].items()}


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
@pytest.mark.slow
def test_constant_columns_train_score_export_and_resume(tmp_path, dynemb, capsys, fmt):
    data = tmp_path / f"clicks.{fmt}"
    (pq.write_table if fmt == "parquet" else pcsv.write_csv)(clicks(), data)
    run = tmp_path / "run"

    first = dynemb("train", "--data", data, *COLUMNS, "--out", run, "--steps", "3", "--publish-every", "2", *TINY)
    assert first["step"] == 3 and math.isfinite(first["logloss"])
    assert read_card(run).preprocessing.dense_std[1] == 1.0  # "fee" is only centered
    rows = _shard_rows(run)
    assert rows["country"] == rows["code"] == 1 and rows["user"] > 1
    published = read_chain(run / "export")  # a full version at step 2, then a delta at step 3
    assert [m["kind"] for m, _ in published] == ["full", "delta"]
    assert published[0][1]["country"]["keys"].tolist() == hash_strings(["fr"]).tolist()

    assert dynemb("eval", "--model", run, "--data", data)["rows"] == ROWS
    predicted = dynemb("predict", "--model", run, "--data", data, "--out", tmp_path / "preds.parquet")
    probability = np.asarray(pq.read_table(tmp_path / "preds.parquet").column("probability"), dtype=np.float32)
    assert predicted["rows"] == probability.size == ROWS
    served = ServedModel(run, name="ctr")  # what `dynemb serve` answers, from the published versions
    try:
        batch = next(iter(FileReader(data, label=None, categorical=["user", "country", "code"], dense=["price", "fee"],
                                     batch_size=ROWS)))
        np.testing.assert_allclose(served.predict(batch).numpy(), probability, atol=1e-6, rtol=0)
    finally:
        served.close()

    assert main(["export", "--model", str(run), "--out", str(tmp_path / "export")]) == 0
    assert "exported to" in capsys.readouterr().out
    _, tables = read_export(tmp_path / "export")
    assert tables["code"]["keys"].tolist() == [2**63 - 1] and tables["code"]["values"].shape == (1, 4)
    assert tables["country"]["keys"].tolist() == hash_strings(["fr"]).tolist()

    resumed = dynemb("train", "--data", data, *COLUMNS, "--out", run, "--steps", "6", "--resume", "--no-progress")
    assert resumed["step"] == 6
    assert _shard_rows(run)["country"] == 1
