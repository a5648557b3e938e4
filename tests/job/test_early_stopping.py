"""``dynemb train``'s early stopping and best model; ``--use`` of the scoring commands."""

import json

import pyarrow.parquet as pq
import pytest
import torch

from dynemb.data.stream import held_out
from dynemb.job import load_model, read_card
from dynemb.job.report import read_metrics

from .test_fit import SMALL, random_labels

# Random labels with an id per row: the held-out loss falls a little (the label rate), then rises as the model
# memorizes its rows. Evaluated every 5 steps on 512 rows, the best is at step 50 and patience 3 stops the run at 65.
MEMORIZE = ["--label", "y", "--categorical", "id", "--dense", "x", "--epochs", "10", "--eval-every", "5",
            "--eval-batches", "4", "--lr", "0.5", "--eval-fraction", "0.2", *SMALL]


def _steps(args: list, n: int) -> list:
    """``args`` with ``--steps n`` instead of ``--epochs``."""
    i = args.index("--epochs")
    return [*args[:i], "--steps", str(n), *args[i + 2:]]


def _pointer_step(root) -> int:
    return json.loads((root / "latest").read_text())["step"]


@pytest.fixture(scope="module")
def memorized(tmp_path_factory):
    from dynemb.cli import main

    tmp = tmp_path_factory.mktemp("early")
    data = random_labels(tmp / "random.parquet", rows=4000)
    assert main(["train", "--data", str(data), "--out", str(tmp / "run"), "--patience", "3", *MEMORIZE]) == 0
    return tmp, data


@pytest.mark.slow
def test_training_stops_after_patience_evaluations_without_a_better_loss(memorized, capsys):
    tmp, _ = memorized
    from dynemb.cli import main

    assert main(["train", "--data", str(tmp / "random.parquet"), "--out", str(tmp / "again"), "--patience", "3",
                 *MEMORIZE]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    evals = [m for m in read_metrics(tmp / "again" / "metrics.jsonl") if m["kind"] == "eval"]
    losses = [e["loss"] for e in evals]
    best = losses.index(min(losses))
    assert result["best_step"] == evals[best]["step"] and result["model"] == "best"
    # Stopped at the third evaluation after the best, none of them better; far before the 10 epochs (250 steps).
    assert result["stopped_early"] and len(evals) == best + 4 and result["step"] == evals[-1]["step"] < 100
    assert _pointer_step(tmp / "again" / "checkpoint-best") == result["best_step"]
    assert _pointer_step(tmp / "again" / "checkpoint") == result["step"]
    assert read_card(tmp / "again").metrics["step"] == result["best_step"]


def test_the_held_out_metrics_and_the_scoring_commands_use_the_best_model(memorized, dynemb):
    tmp, data = memorized
    run = tmp / "run"
    summary = read_metrics(run / "metrics.jsonl")[-1]
    assert summary["kind"] == "final" and summary["best_step"] < summary["step"]
    # The summary's held-out metrics are the best model's: `dynemb eval` on exactly the held-out rows agrees.
    table = pq.read_table(data)
    rows = held_out(torch.arange(table.num_rows), 0.2, 0).nonzero().squeeze(1).tolist()
    pq.write_table(table.take(rows), tmp / "held_out.parquet")
    best = dynemb("eval", "--model", run, "--data", tmp / "held_out.parquet")
    assert best["rows"] == summary["rows"]
    assert best["auc"] == pytest.approx(summary["auc"], abs=2e-6)
    assert best["logloss"] == pytest.approx(summary["logloss"], abs=2e-6)
    assert (best["model"], best["step"]) == ("best", summary["best_step"])
    last = dynemb("eval", "--model", run, "--data", tmp / "held_out.parquet", "--use", "last")
    assert (last["model"], last["step"]) == ("last", summary["step"]) and last["logloss"] > best["logloss"]
    predicted = dynemb("predict", "--model", run, "--data", data, "--out", tmp / "p.parquet", "--use", "last")
    assert (predicted["model"], predicted["step"]) == ("last", summary["step"])
    # The models themselves: the same rows (two epochs saw every id), other values.
    (best_model, _), (last_model, _) = load_model(run), load_model(run, use="last")
    (kb, vb), (kl, vl) = best_model.embeddings.export("id"), last_model.embeddings.export("id")
    assert torch.equal(kb.sort().values, kl.sort().values)
    assert not torch.equal(vb[kb.argsort()], vl[kl.argsort()])


def test_export_uses_the_best_model_unless_told(memorized, tmp_path):
    from dynemb.checkpoint import read_export
    from dynemb.cli import main

    tmp, _ = memorized
    for use in ("best", "last"):
        assert main(["export", "--model", str(tmp / "run"), "--out", str(tmp_path / use), "--use", use]) == 0
    model, _ = load_model(tmp / "run")
    (_, best), (_, last) = read_export(tmp_path / "best"), read_export(tmp_path / "last")
    assert set(best["id"]["keys"].tolist()) == set(model.embeddings.export("id")[0].tolist())
    order_b, order_l = best["id"]["keys"].argsort(), last["id"]["keys"].argsort()
    assert not torch.equal(best["id"]["values"][order_b], last["id"]["values"][order_l])
    # each export carries the MLPs of its own checkpoint: a server of the last export scores with the last MLPs
    from dynemb.checkpoint.dense import dense_state
    from dynemb.checkpoint.export_format import read_dense, version_name

    for use in ("best", "last"):
        dense = read_dense(tmp_path / use / version_name(1))
        want = dense_state(load_model(tmp / "run", use=use)[0])
        assert dense.keys() == want.keys() and all(torch.equal(dense[k], want[k]) for k in want), use


def test_patience_0_trains_every_epoch_and_still_keeps_the_best(tmp_path, dynemb):
    data = random_labels(tmp_path / "random.parquet", rows=2000)
    result = dynemb("train", "--data", data, "--out", tmp_path / "run", "--patience", "0",
                    *[a if a != "10" else "2" for a in MEMORIZE])
    evals = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if m["kind"] == "eval"]
    assert not result["stopped_early"] and result["samples"] == 2 * (2000 - int(held_out(torch.arange(2000), 0.2,
                                                                                          0).sum()))
    assert result["best_step"] == min(evals, key=lambda e: e["loss"])["step"]


@pytest.mark.slow
def test_resume_continues_the_early_stopping_where_it_was(memorized, tmp_path, dynemb):
    """Stopped at step 20 and resumed: the same evaluations, the same best and the same stop as one run."""
    tmp, data = memorized
    once = read_metrics(tmp / "run" / "metrics.jsonl")
    run = tmp_path / "run"
    args = ["train", "--data", data, "--out", run, "--patience", "3", *MEMORIZE]
    dynemb(*_steps(args, 52))  # stopped two steps after the best (step 50)
    assert _pointer_step(run / "checkpoint-best") == 50
    resumed = dynemb(*args, "--resume")

    def periodic(rows):  # the cut run also evaluated at its last step, 52
        return [m for m in rows if m["kind"] == "eval" and m["step"] % 5 == 0]

    assert periodic(read_metrics(run / "metrics.jsonl")) == periodic(once)
    assert (resumed["best_step"], resumed["step"], resumed["stopped_early"]) == (50, 65, True)
    # A run that stopped early stays stopped on --resume (patience is spent) unless patience changes.
    assert dynemb(*args, "--resume")["step"] == 65
    assert dynemb(*_steps(args, 70), "--resume", "--patience", "0")["step"] == 70


@pytest.mark.slow
def test_a_run_interrupted_between_saves_resumes_from_its_best_checkpoint(memorized, tmp_path, dynemb):
    """Only the best checkpoint was written (a crash before the last save): --resume starts from it."""
    import shutil

    tmp, data = memorized
    run = tmp_path / "run"
    args = ["train", "--data", data, "--out", run, "--patience", "3", *MEMORIZE]
    dynemb(*_steps(args, 52))
    shutil.rmtree(run / "checkpoint")
    resumed = dynemb(*args, "--resume")
    assert (resumed["best_step"], resumed["step"]) == (50, 65)


def test_servers_started_together_write_one_export(memorized, tmp_path, monkeypatch):
    """``serving_export`` from several threads at once on a run with no export yet (``dynemb serve`` processes
    started together; each write made slow, so that all would see no export): one version is written, and every
    caller gets the same root."""
    import shutil
    import threading
    import time

    from dynemb.checkpoint.fsutil import read_pointer
    from dynemb.job import publish
    from dynemb.job.publish import serving_export

    write = publish.export_for_serving

    def slow_write(*args, **kwargs):
        time.sleep(0.5)
        return write(*args, **kwargs)

    monkeypatch.setattr(publish, "export_for_serving", slow_write)

    tmp, _ = memorized
    run = tmp_path / "run"
    shutil.copytree(tmp / "run", run, ignore=shutil.ignore_patterns("export*"))
    start, roots = threading.Barrier(4), []

    def serve():
        start.wait()
        roots.append(serving_export(run))

    threads = [threading.Thread(target=serve) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(roots) == 4 and len(set(roots)) == 1  # none raised
    (root,) = set(roots)
    assert sorted(p.name for p in root.glob("version-*")) == ["version-00000001"]
    assert read_pointer(root) == "version-00000001"
