"""``dynemb train``, ``eval`` and ``predict`` on files with nulls, NaN, ``inf`` and ``-inf`` in a dense column:
the rule of docs/cli.md ("Ids, nulls and non-finite values") on every path, one warning per column and pass on
stderr, finite metrics, and strict JSON (no ``NaN``) in everything the commands print or write."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.cli import main
from dynemb.data.stream import held_out
from dynemb.job import evaluate
from dynemb.job.report import json_line, read_metrics

ROWS = 3000
SMALL = ["--batch-size", "128", "--dim", "4", "--eval-batches", "1", "--no-progress"]


def strict(line: str):
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity``."""
    def refuse(name):
        raise ValueError(f"not JSON: {name} in {line[:200]}")

    return json.loads(line, parse_constant=refuse)


def messy(rows: int = ROWS, seed: int = 0) -> tuple[pa.Table, np.ndarray]:
    """A learnable click log (the label follows the user and the price) whose price has NaN, nulls, inf and -inf;
    returns it and the price as read (a null as NaN)."""
    g = np.random.default_rng(seed)
    user, price = g.integers(0, 30, rows), g.random(rows) * 100
    logit = 1.5 * (user % 3 - 1) + (price - 50) / 15
    click = (g.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    r = np.arange(rows)
    values = price.tolist()
    for i in r[r % 17 == 0]:
        values[i] = float("nan")
    for i in r[r % 19 == 3]:
        values[i] = None
    for i in r[r % 23 == 5]:
        values[i] = float("inf")
    for i in r[r % 29 == 7]:
        values[i] = float("-inf")
    read = np.array([np.nan if v is None else v for v in values])
    return pa.table({"click": click, "user": [f"u{u}" for u in user], "price": values}), read


def counts(price: np.ndarray) -> str:
    nan, inf, ninf = int(np.isnan(price).sum()), int((price == np.inf).sum()), int((price == -np.inf).sum())
    return (f"column 'price': {nan} null/NaN values read as the training mean, {inf} inf values read as the "
            f"training max, {ninf} -inf values read as the training min")


def run(capsys, *args) -> tuple[int, list[str], list[str]]:
    """``dynemb ARGS`` in-process: exit status, stdout lines (each checked to be strict JSON), stderr lines."""
    threads = torch.get_num_threads()
    try:
        code = main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)
    out, err = capsys.readouterr()
    for line in out.splitlines():  # every line these commands print is strict JSON
        strict(line)
    return code, out.splitlines(), err.splitlines()


@pytest.fixture(scope="module", params=["parquet", "csv"])
def trained(request, tmp_path_factory):
    """A run trained on the messy file in one format, and what its command printed."""
    tmp = tmp_path_factory.mktemp(f"messy-{request.param}")
    table, price = messy()
    path = tmp / f"clicks.{request.param}"
    (pq.write_table if request.param == "parquet" else pcsv.write_csv)(table, path)
    return tmp, path, price


def test_train_eval_predict_follow_the_rule_with_finite_metrics_and_one_warning_a_pass(trained, capsys):
    tmp, path, price = trained
    out = tmp / "run"
    code, stdout, stderr = run(capsys, "train", "--data", path, "--label", "click", "--categorical", "user",
                               "--dense", "price", "--out", out, "--epochs", "3", *SMALL)
    assert code == 0, stderr
    summary = strict(stdout[-1])
    assert summary["auc"] > 0.7 and 0 < summary["logloss"] < 0.69  # learnt, and finite
    training = ~held_out(torch.arange(ROWS), 0.05, 0).numpy()
    warning = [line for line in stderr if "warning" in line]
    assert warning == [f"dynemb train: warning: {path} (training rows): {counts(price[training])}"]
    card = json.loads((out / "model.json").read_text())
    prep = card["preprocessing"]
    finite = price[training][np.isfinite(price[training])].astype(np.float32)  # values are read as float32
    assert (prep["dense_min"], prep["dense_max"]) == ([finite.min()], [finite.max()])
    assert prep["dense_rule"] == "signed_log1p_standardize_finite"
    for line in (out / "metrics.jsonl").read_text().splitlines():
        assert all(v is None or np.isfinite(v) for v in strict(line).values() if isinstance(v, float))

    code, stdout, stderr = run(capsys, "eval", "--model", out, "--data", path)
    assert code == 0 and strict(stdout[-1])["auc"] > 0.7 and strict(stdout[-1])["rows"] == ROWS
    assert stderr == [f"dynemb eval: warning: {path}: {counts(price)}"]

    code, stdout, stderr = run(capsys, "predict", "--model", out, "--data", path, "--out", tmp / "p.parquet",
                               "--batch-size", "1000")
    assert code == 0 and strict(stdout[-1])["rows"] == ROWS
    assert stderr == [f"dynemb predict: warning: {path}: {counts(price)}"]  # once, not once a batch
    p = pq.read_table(tmp / "p.parquet").column("probability").to_numpy()
    assert np.isfinite(p).all() and len(p) == ROWS

    # The rule itself, on the predict path: inf scores as the training max, -inf as the min, null and NaN as the
    # value whose signed log is the training mean.
    (mean,), (low,), (high,) = prep["dense_mean"], prep["dense_min"], prep["dense_max"]
    same = np.where(np.isnan(price), np.sign(mean) * np.expm1(abs(mean)), price)
    same = np.where(price == np.inf, high, np.where(price == -np.inf, low, same))
    table = pq.read_table(path) if path.suffix == ".parquet" else pcsv.read_csv(path)
    pq.write_table(table.set_column(2, "price", pa.array(same)), tmp / "replaced.parquet")
    code, _, stderr = run(capsys, "predict", "--model", out, "--data", tmp / "replaced.parquet", "--out",
                          tmp / "q.parquet", "--batch-size", "1000")
    assert code == 0 and stderr == []  # finite values: nothing to count
    q = pq.read_table(tmp / "q.parquet").column("probability").to_numpy()
    np.testing.assert_allclose(p, q, rtol=0, atol=1e-6)
    assert (p[np.isinf(price)] == q[np.isinf(price)]).all()  # the very same input values


@pytest.mark.parametrize("fmt", ["parquet", "csv"])
def test_a_dense_column_without_a_finite_value_is_a_one_line_error_before_training(tmp_path, capsys, fmt):
    table = pa.table({"click": [0, 1] * 20, "user": ["a", "b"] * 20,
                      "price": [None, float("nan"), float("inf"), float("-inf")] * 10})
    path = tmp_path / f"bad.{fmt}"
    (pq.write_table if fmt == "parquet" else pcsv.write_csv)(table, path)
    code, stdout, stderr = run(capsys, "train", "--data", path, "--label", "click", "--categorical", "user",
                               "--dense", "price", "--out", tmp_path / "run", "--steps", "2", *SMALL)
    assert code == 2 and stdout == [] and len(stderr) == 1
    assert stderr[0].startswith(f"dynemb train: error: {path} (training rows): dense column 'price' has no finite "
                                "value in its ")
    assert "null/NaN, " in stderr[0] and not (tmp_path / "run").exists()  # nothing written


def test_metrics_that_are_not_finite_are_null_in_every_json_line():
    class Broken(torch.nn.Module):
        def forward(self, batch):
            return torch.full((len(batch),), float("nan"))

    from dynemb.data.batch import Batch

    batch = Batch(torch.zeros(4, 0), {}, torch.tensor([0.0, 1.0, 0.0, 1.0]))
    metrics = evaluate(Broken(), [batch])
    assert metrics["logloss"] is None and metrics["rows"] == 4
    line = json_line({**metrics, "loss": float("inf"), "nested": [float("-inf"), {"x": float("nan")}]})
    assert strict(line)["nested"] == [None, {"x": None}] and strict(line)["loss"] is None
    assert "NaN" not in line and "Infinity" not in line


def test_metrics_log_writes_strict_json(tmp_path):
    from dynemb.job.report import MetricsLog

    with MetricsLog(tmp_path / "m.jsonl") as log:
        log.write("train", {"step": 1, "loss": float("nan")})
        log.write("eval", {"step": 1, "auc": float("inf"), "loss": 0.5})
    rows = [strict(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert rows == [{"kind": "train", "step": 1, "loss": None}, {"kind": "eval", "step": 1, "auc": None, "loss": 0.5}]
    assert read_metrics(tmp_path / "m.jsonl") == rows


def test_held_out_rows_of_one_class_give_a_null_auc_not_a_crash(tmp_path, capsys):
    """Rare positives can leave a small held-out set with none: the AUC is undefined, so it prints as null with a
    warning, the log loss still picks the best model, and the run ends with its checkpoints."""
    table, _ = messy(1000)
    pq.write_table(table, tmp_path / "train.parquet")
    pq.write_table(table.slice(0, 200).set_column(0, "click", pa.array([0] * 200)), tmp_path / "held.parquet")
    run = tmp_path / "run"
    code = main(["train", "--data", str(tmp_path / "train.parquet"), "--eval-data", str(tmp_path / "held.parquet"),
                 "--label", "click", "--categorical", "user", "--dense", "price", "--out", str(run), "--epochs", "1",
                 "--eval-every", "3", *SMALL])
    out, err = capsys.readouterr()
    assert code == 0, err
    summary = strict(out.strip().splitlines()[-1])
    assert summary["auc"] is None and summary["logloss"] > 0
    assert err.count("hold one class only (200 negatives, 0 positives): AUC is undefined (null)") >= 1
    assert (run / "checkpoint" / "latest").is_file() and (run / "checkpoint-best" / "latest").is_file()
    assert main(["eval", "--model", str(run), "--data", str(tmp_path / "held.parquet")]) == 0
    assert strict(capsys.readouterr().out.strip().splitlines()[-1])["auc"] is None
