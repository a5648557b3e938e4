"""``dynemb train --publish-every``: a full export, then deltas, each with the MLPs; the last version is the run."""

import pytest
import numpy as np
import pyarrow.parquet as pq

from dynemb.checkpoint.fsutil import read_pointer
from dynemb.checkpoint.export_format import read_chain, read_dense
from dynemb.cli import main
from dynemb.data import FileReader
from dynemb.endpoint import ServedModel

from .test_fit import SMALL, random_labels


def test_train_publishes_a_full_export_then_deltas_and_the_last_is_the_final_model(tmp_path, dynemb):
    data = random_labels(tmp_path / "random.parquet", rows=3000)
    run = tmp_path / "run"
    result = dynemb("train", "--data", data, "--label", "y", "--categorical", "id", "--dense", "x", "--out", run,
                    "--steps", "25", "--publish-every", "10", *SMALL)
    # steps 10, 20 and the final step 25
    assert [p.rsplit("/", 1)[1] for p in result["published"]] == [f"version-0000000{v}" for v in (1, 2, 3)]
    chain = read_chain(run / "export")
    manifests = [m for m, _ in chain]
    assert [m["kind"] for m in manifests] == ["full", "delta", "delta"]
    assert [m["parent_version"] for m in manifests] == [None, 1, 2]
    assert [m["parent_digest"] for m in manifests[1:]] == [m["digest"] for m in manifests[:2]]
    assert len({m["model"] for m in manifests}) == 1
    assert all(read_dense(m["path"]) for m in manifests)
    # A delta holds only the rows written since: steps 11..20 of the first epoch (2850 rows, 22 steps) train 10 x 128
    # ids of their own (every row has its own id), none of the full export's.
    full, delta = chain[0][1]["id"]["keys"].tolist(), chain[1][1]["id"]["keys"].tolist()
    assert len(full) == len(delta) == 10 * 128 and not set(full) & set(delta)
    # Served from the published versions alone (tables and MLPs), the run scores like `dynemb predict`, which
    # reads the final checkpoint.
    dynemb("predict", "--model", run, "--data", data, "--out", tmp_path / "preds.parquet")
    expected = np.asarray(pq.read_table(tmp_path / "preds.parquet").column("probability"), dtype=np.float32)
    served = ServedModel(run, name="ctr")
    try:
        assert served.version == 3
        batch = next(iter(FileReader(data, label=None, categorical=["id"], dense=["x"], batch_size=4000)))
        np.testing.assert_allclose(served.predict(batch).numpy(), expected, atol=1e-6, rtol=0)
    finally:
        served.close()


def test_publish_options_are_checked(tmp_path, capsys):
    assert main(["train", "--steps", "2", "--publish-dir", str(tmp_path / "e"), "--out", str(tmp_path / "r")]) == 2
    assert "--publish-dir needs --publish-every" in capsys.readouterr().err
    with pytest.raises(SystemExit) as raised:
        main(["train", "--steps", "2", "--publish-every", "-1", "--out", str(tmp_path / "r")])
    assert raised.value.code == 2
    assert "argument --publish-every: must be an int >= 0, got -1" in capsys.readouterr().err


@pytest.mark.slow
def test_a_publish_dir_elsewhere_holds_the_versions(tmp_path, dynemb):
    data = random_labels(tmp_path / "random.parquet", rows=1000)
    result = dynemb("train", "--data", data, "--label", "y", "--categorical", "id", "--out", tmp_path / "run",
                    "--steps", "4", "--publish-every", "2", "--publish-dir", tmp_path / "pub", *SMALL)
    assert not (tmp_path / "run" / "export").exists()
    assert read_pointer(tmp_path / "pub") == "version-00000002"
    assert len(result["published"]) == 2


@pytest.mark.slow
def test_serve_serves_the_best_model_by_default_and_the_last_on_request(tmp_path, dynemb, capsys):
    from dynemb.job import serving_export

    # Random labels, an id per row: the held-out loss falls until step 50, then rises (memorization).
    data = random_labels(tmp_path / "random.parquet", rows=4000)
    run = tmp_path / "run"
    common = ["train", "--data", data, "--label", "y", "--categorical", "id", "--dense", "x", "--out", run,
              "--eval-every", "5", "--eval-batches", "4", "--lr", "0.5", "--eval-fraction", "0.2", "--patience", "0",
              *SMALL]
    assert dynemb(*common, "--steps", "30")["best_step"] == 30
    assert serving_export(run) == run / "export-best"
    assert read_pointer(run / "export-best") == "version-00000001"
    trained = dynemb(*common, "--steps", "65", "--resume")
    assert (trained["best_step"], trained["step"]) == (50, 65)
    # The best export follows the best checkpoint: a new version when it changed, none otherwise.
    serving_export(run)
    serving_export(run)
    assert read_pointer(run / "export-best") == "version-00000002"
    batch = next(iter(FileReader(data, label=None, categorical=["id"], dense=["x"], batch_size=4000)))
    scores = {}
    for use, root in (("best", "export-best"), ("last", "export")):
        assert serving_export(run, use) == run / root
        dynemb("predict", "--model", run, "--data", data, "--out", tmp_path / f"{use}.parquet", "--use", use)
        expected = np.asarray(pq.read_table(tmp_path / f"{use}.parquet").column("probability"), dtype=np.float32)
        served = ServedModel(run, export=run / root, name="ctr")
        try:
            scores[use] = served.predict(batch).numpy()
            np.testing.assert_allclose(scores[use], expected, atol=1e-6, rtol=0)  # tables and MLPs of one model
        finally:
            served.close()
    assert np.abs(scores["best"] - scores["last"]).max() > 1e-3
    # `--watch` follows what training publishes: the model of each step, never the best one.
    assert main(["serve", "--model", str(run), "--watch", "--use", "best"]) == 2
    assert "--watch serves the versions training publishes" in capsys.readouterr().err
