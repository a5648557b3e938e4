"""``dynemb train``'s seed and ``--resume``'s model options."""

import torch

from dynemb.cli import main
from dynemb.job.report import read_metrics

from .test_fit import SMALL, random_labels


def _outcome(run) -> tuple:
    """What must match between two identical runs: every metric but times, and the final checkpoint's tensors."""
    from dynemb.job import load_model

    rows = [{k: v for k, v in m.items() if k not in ("seconds", "sps", "run", "wall_s") and "per_s" not in k}
            for m in read_metrics(run / "metrics.jsonl")]
    model, _ = load_model(run)
    return rows, {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_identical_commands_give_identical_runs(tmp_path, dynemb):
    data = random_labels(tmp_path / "random.parquet", rows=1500)
    args = ["train", "--data", data, "--label", "y", "--categorical", "id", "--dense", "x", "--epochs", "1", *SMALL]
    a, b = (dynemb(*args, "--out", tmp_path / n) for n in ("a", "b"))
    (metrics_a, state_a), (metrics_b, state_b) = _outcome(tmp_path / "a"), _outcome(tmp_path / "b")
    assert a["auc"] == b["auc"] and a["logloss"] == b["logloss"] and metrics_a == metrics_b
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_resume_takes_the_model_options_from_the_run_and_refuses_contradicting_ones(tmp_path, dynemb, capsys):
    data = random_labels(tmp_path / "random.parquet", rows=1500)
    run = tmp_path / "run"
    columns = ["--data", data, "--label", "y", "--categorical", "id", "--dense", "x", "--out", run, "--no-progress"]
    model = ["--batch-size", "64", "--dim", "8", "--optimizer", "sgd", "--lr", "0.1", "--max-capacity", "500",
             "--eviction", "lru", "--admission", "2"]
    dynemb("train", *columns, *model, "--steps", "3")
    # No model option: all of them from the run (the default dim 16 or policy would not fit the checkpoint).
    assert dynemb("train", *columns, "--steps", "5", "--resume")["step"] == 5
    # The same values given again are fine.
    assert dynemb("train", *columns, *model, "--steps", "6", "--resume")["step"] == 6
    before = (run / "metrics.jsonl").read_bytes()
    for option, value, saved in [("--dim", "16", "8"), ("--eviction", "lfu", "lru"), ("--batch-size", "512", "64"),
                                 ("--lr", "0.05", "0.1")]:
        assert main(["train", *map(str, columns), option, value, "--steps", "7", "--resume"]) == 2
        err = capsys.readouterr().err
        assert option in err and f"{value}" in err and saved in err and err.count("\n") == 1, err
    assert (run / "metrics.jsonl").read_bytes() == before  # a refused resume leaves the run as it was
