"""``dynemb train`` on real files: the held-out split, the run directory, checkpoints and resume."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.cli import main
from dynemb.data import FileReader, SyntheticClickLog
from dynemb.data.preprocess import dense_statistics
from dynemb.data.stream import held_out, split
from dynemb.data.writers import write_synthetic
from dynemb.job import read_card
from dynemb.job.report import read_metrics

SMALL = ["--batch-size", "128", "--dim", "4", "--no-progress"]


def random_labels(path, rows: int = 8000):
    """Labels are coin flips and every row has its own id: nothing generalizes, everything can be memorized."""
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 2, (rows,), generator=g)
    pq.write_table(pa.table({"y": labels.tolist(), "id": [f"row-{i}" for i in range(rows)],
                             "x": torch.randn(rows, generator=g).tolist()}), path)
    return path


@pytest.mark.slow
def test_held_out_rows_never_reach_training(tmp_path, dynemb):
    data = random_labels(tmp_path / "random.parquet")
    run = tmp_path / "run"
    result = dynemb("train", "--data", data, "--label", "y", "--categorical", "id", "--dense", "x", "--out", run,
                    "--epochs", "5", "--lr", "0.5", "--eval-fraction", "0.2", *SMALL)
    held = int(held_out(torch.arange(8000), 0.2, 0).sum())
    assert result["rows"] == held and result["table_rows"] == 8000 - held  # no held-out id got a row
    assert abs(result["auc"] - 0.5) < 0.08  # held-out AUC of random labels (its std here is about 0.015)
    # The model did memorize its training rows: on the whole file (80% of it seen) the AUC is far above 0.5.
    assert dynemb("eval", "--model", run, "--data", data)["auc"] > 0.85


def test_the_run_directory(tmp_path, dynemb):
    data = random_labels(tmp_path / "random.parquet", rows=2000)
    run = tmp_path / "run"
    result = dynemb("train", "--data", data, "--label", "y", "--categorical", "id", "--dense", "x", "--out", run,
                    "--epochs", "2", "--eval-every", "5", "--patience", "0", *SMALL)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "checkpoint-best", "loss_auc.png", "metrics.jsonl",
                                                     "model.json"]
    card = read_card(run)
    reader = FileReader(data, label="y", categorical=["id"], dense=["x"])
    stats = dense_statistics(split(reader.chunks(), 0.05, 0, "train"), ["x"])
    prep = card.preprocessing
    assert (prep.label, prep.categorical, prep.dense, prep.dense_rows) == ("y", ("id",), ("x",), stats.rows)
    assert prep.dense_mean == pytest.approx(stats.mean) and prep.dense_std == pytest.approx(stats.std)  # training rows
    assert (prep.dense_min, prep.dense_max) == (tuple(stats.min), tuple(stats.max))
    assert card.metrics == {**{k: result[k] for k in ("auc", "logloss", "rows", "model")}, "step": result["best_step"]}
    assert json.loads((run / "model.json").read_text())["preprocessing"]["null_keys"]["id"] != 0
    metrics = read_metrics(run / "metrics.jsonl")
    steps = [m["step"] for m in metrics if m["kind"] == "train"]
    assert steps == list(range(1, result["step"] + 1)) and result["samples"] == 2 * (2000 - result["rows"])
    assert [m["step"] for m in metrics if m["kind"] == "eval"][:2] == [5, 10]
    assert metrics[-1]["kind"] == "final" and metrics[-1]["auc"] == result["auc"]
    assert (run / "loss_auc.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_steps_a_multiple_of_checkpoint_every(tmp_path, dynemb, monkeypatch):
    import dynemb.checkpoint as checkpoint

    calls, save = [], checkpoint.save

    def spy(path, model, optimizer=None, **kwargs):  # the periodic saves go to the background, the last one not
        out = save(path, model, optimizer, **kwargs)
        if Path(path).name == "checkpoint":  # not the best model's saves
            calls.append((kwargs["step"], kwargs.get("blocking", True), type(out).__name__))
        return out

    monkeypatch.setattr(checkpoint, "save", spy)
    data = random_labels(tmp_path / "random.parquet", rows=1000)
    run = tmp_path / "run"
    common = ["--data", data, "--label", "y", "--categorical", "id", "--out", run, "--checkpoint-every", "2", *SMALL]
    assert dynemb("train", *common, "--steps", "5")["step"] == 5
    assert calls == [(2, False, "SaveHandle"), (4, False, "SaveHandle"),
                                                        (5, True, "PosixPath")]
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest", "step-00000002", "step-00000004",
                                                                       "step-00000005"]
    run = tmp_path / "run4"
    common = ["--data", data, "--label", "y", "--categorical", "id", "--out", run, "--checkpoint-every", "2", *SMALL]
    assert dynemb("train", *common, "--steps", "4")["step"] == 4
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest", "step-00000002", "step-00000004"]
    assert (run / "model.json").is_file()
    assert dynemb("train", *common, "--steps", "6", "--resume")["step"] == 6
    assert json.loads((run / "checkpoint" / "latest").read_text())["step"] == 6
    metrics = read_metrics(run / "metrics.jsonl")  # one run: steps 1..6 once, one final line
    assert [m["step"] for m in metrics if m["kind"] == "train"] == [1, 2, 3, 4, 5, 6]
    assert [m["kind"] for m in metrics].count("final") == 1
    assert main(["export", "--model", str(run), "--out", str(tmp_path / "export")]) == 0


def test_a_run_directory_is_never_overwritten(tmp_path, dynemb, capsys):
    data = random_labels(tmp_path / "random.parquet", rows=500)
    run = tmp_path / "run"
    args = ["train", "--data", str(data), "--label", "y", "--categorical", "id", "--out", str(run), "--steps", "1",
            *SMALL]
    dynemb(*args)
    assert main(args) == 2
    assert "run: not empty; pass --resume to continue the run there" in capsys.readouterr().err
    assert main([*args[:-len(SMALL) - 2], "--steps", "1", "--resume", *SMALL]) == 0  # already at step 1


def test_criteo_file_with_its_default_columns(tmp_path, dynemb):
    log = SyntheticClickLog(batch_size=100, seed=0)
    path = write_synthetic(log, tmp_path / "day_0.criteo.gz", 4, format="criteo")
    result = dynemb("train", "--data", path, "--out", tmp_path / "run", "--epochs", "1", "--eval-fraction", "0.25",
                    *SMALL)
    prep = read_card(tmp_path / "run").preprocessing
    assert len(prep.categorical) == 26 and len(prep.dense) == 13 and prep.label == "label"
    assert result["rows"] + result["samples"] == 400


def test_no_held_out_row_is_an_error_that_leaves_nothing(tmp_path, capsys):
    data = random_labels(tmp_path / "random.parquet", rows=3)
    args = ["train", "--data", str(data), "--label", "y", "--categorical", "id", "--out", str(tmp_path / "run"),
            "--eval-fraction", "0.01", *SMALL]
    assert main(args) == 2
    assert "no held-out rows" in capsys.readouterr().err and not (tmp_path / "run").exists()
