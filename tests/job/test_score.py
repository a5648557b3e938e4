"""``dynemb eval`` and ``dynemb predict`` against the model's own forward pass; multi-hot pooling."""

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.cli import main
from dynemb.data import FileReader
from dynemb.data.metrics import auc
from dynemb.job import load_model

ROWS = 1500


def clicks(seed: int = 0, rows: int = ROWS) -> pa.Table:
    """Users, items, tags (multi-hot, with nulls and empty lists) and a price; the label depends on all of them."""
    g = torch.Generator().manual_seed(seed)
    user, item = torch.randint(0, 50, (rows,), generator=g), torch.randint(0, 80, (rows,), generator=g)
    price = torch.rand(rows, generator=g) * 100
    tags = [None if u % 11 == 0 else [f"t{(u * k) % 9}" for k in range(u % 4)] for u in user.tolist()]
    logit = (user % 5 - 2).float() + (item % 3 - 1).float() + (user % 4 - 1.5).float() * 0.5 + price / 50 - 1
    label = (torch.rand(rows, generator=g) < torch.sigmoid(logit)).long()
    return pa.table({"click": label.tolist(), "user": [f"u{u}" for u in user.tolist()], "item": item.tolist(),
                     "tags": tags, "price": price.tolist()})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run trained on one file, and a second file drawn from the same model."""
    tmp = tmp_path_factory.mktemp("score")
    pq.write_table(clicks(0), tmp / "train.parquet", row_group_size=500)
    pq.write_table(clicks(1), tmp / "test.parquet")
    code = main(["train", "--data", str(tmp / "train.parquet"), "--label", "click", "--categorical", "user,item",
                 "--multi-hot", "tags", "--dense", "price", "--out", str(tmp / "run"), "--epochs", "4",
                 "--batch-size", "128", "--dim", "8", "--no-progress"])
    assert code == 0
    return tmp


def forward(run, path) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities and labels of the model's own forward pass over ``path``, read the way training read it."""
    model, card = load_model(run)
    prep = card.preprocessing
    reader = FileReader(path, label=prep.label, categorical=prep.categorical, multi_hot=prep.multi_hot,
                        dense=prep.dense, batch_size=97)
    with torch.no_grad():
        probs = torch.cat([torch.sigmoid(model(prep.normalize(b))) for b in reader])
    return probs, torch.cat([b.labels for b in reader])


def test_predict_equals_the_forward_pass_in_input_order(trained, dynemb):
    out = trained / "preds.parquet"
    result = dynemb("predict", "--model", trained / "run", "--data", trained / "test.parquet", "--out", out)
    table = pq.read_table(out)
    assert result["rows"] == table.num_rows == ROWS
    assert table.schema.names == ["probability", "click"] and table.schema.field("probability").type == pa.float64()
    probs, labels = forward(trained / "run", trained / "test.parquet")
    assert torch.allclose(torch.tensor(table.column("probability").to_pylist()), probs, atol=1e-6)
    assert table.column("click").to_pylist() == clicks(1).column("click").to_pylist() == labels.long().tolist()


def test_predict_in_many_blocks_gives_the_forward_pass_bits(trained, tmp_path):
    # blocks of 64 rows: the reading thread's lookups fill its ring of buffers many times over (a buffer is reused
    # every third block), and the last block is short; each probability is the forward pass's, bit for bit
    from dynemb.job import predict_file
    from dynemb.job.score import probabilities

    out = tmp_path / "p.parquet"
    assert predict_file(str(trained / "run"), str(trained / "test.parquet"), str(out), batch_size=64)["rows"] == ROWS
    model, card = load_model(trained / "run", optimizer=False)
    prep = card.preprocessing
    reader = FileReader(trained / "test.parquet", label=prep.label, categorical=prep.categorical,
                        multi_hot=prep.multi_hot, dense=prep.dense, batch_size=500)
    with torch.no_grad():
        want = torch.cat([probabilities(model(prep.normalize(b))) for b in reader])
    got = torch.tensor(pq.read_table(out).column("probability").to_numpy())
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))


def test_predict_stops_its_reading_thread_when_the_model_fails_to_load(trained, tmp_path, monkeypatch):
    import threading

    from dynemb.job import predict_file, score

    def broken(*args, **kwargs):
        raise ValueError("no model here")

    monkeypatch.setattr(score, "load_model", broken)
    with pytest.raises(ValueError, match="no model here"):
        predict_file(str(trained / "run"), str(trained / "test.parquet"), str(tmp_path / "p.parquet"), batch_size=64)
    assert not any(t.name == "dynemb-read-ahead" for t in threading.enumerate())
    assert list(tmp_path.iterdir()) == []


def test_a_model_loaded_to_score_has_no_optimizer_and_the_same_outputs(trained, caplog):
    # what predict and eval load: no sparse optimizer, its saved slots left out without a warning; the same bits
    scoring, _ = load_model(trained / "run", optimizer=False)
    full, card = load_model(trained / "run")
    assert all(t.optimizer is None for t in scoring.embeddings.table_configs.values())
    assert all(t.optimizer is not None for t in full.embeddings.table_configs.values())
    assert "is only in the checkpoint" not in caplog.text
    prep = card.preprocessing
    reader = FileReader(trained / "test.parquet", label=prep.label, categorical=prep.categorical,
                        multi_hot=prep.multi_hot, dense=prep.dense, batch_size=300)
    with torch.no_grad():
        for b in reader:
            batch = prep.normalize(b)
            assert torch.equal(scoring(batch), full(batch))


def test_predict_a_csv_file_without_labels(trained, dynemb):
    # An empty CSV field is a null (the bag [null key]): CSV has no empty list, so compare with nulls for both.
    tags = [t or None for t in clicks(1).column("tags").to_pylist()]
    same = clicks(1).drop_columns(["tags"]).append_column("tags", pa.array(tags, pa.list_(pa.string())))
    pq.write_table(same, trained / "same.parquet")
    text = pa.array(["|".join(t) if t else None for t in tags], pa.string())
    pcsv.write_csv(same.drop_columns(["click", "tags"]).append_column("tags", text), trained / "unlabeled.csv")
    out = trained / "unlabeled.parquet"
    dynemb("predict", "--model", trained / "run", "--data", trained / "unlabeled.csv", "--out", out)
    scored = pq.read_table(out)
    assert scored.schema.names == ["probability"]
    probs, _ = forward(trained / "run", trained / "same.parquet")  # the same rows, from Parquet with labels
    assert torch.allclose(torch.tensor(scored.column("probability").to_pylist()), probs, atol=1e-6)


def test_eval_reports_auc_logloss_rows(trained, dynemb):
    result = dynemb("eval", "--model", trained / "run", "--data", trained / "test.parquet")
    assert sorted(result) == ["auc", "logloss", "model", "rows", "step"] and result["rows"] == ROWS
    assert result["model"] == "best"
    probs, labels = forward(trained / "run", trained / "test.parquet")
    assert result["auc"] == pytest.approx(auc(probs, labels), abs=1e-6) and result["auc"] > 0.75
    expected = torch.nn.functional.binary_cross_entropy(probs.double(), labels.double())
    assert result["logloss"] == pytest.approx(float(expected), abs=1e-5)


def test_multi_hot_pooling_equals_embedding_bag(trained):
    model, card = load_model(trained / "run")
    batch = next(iter(FileReader(trained / "test.parquet", label="click", categorical=["user", "item"],
                                 multi_hot=["tags"], batch_size=300)))
    assert (batch.offsets["tags"].diff() == 0).any() and (batch.offsets["tags"].diff() > 1).any()
    with torch.no_grad():
        pooled = model.embeddings(model.sparse_inputs(batch))["tags"]
    keys, values = model.embeddings.export("tags")
    ids = batch.sparse["tags"]
    assert set(ids.tolist()) <= set(keys.tolist())  # every tag of the test file was seen in training
    index = {k: i for i, k in enumerate(keys.tolist())}
    bag = torch.nn.EmbeddingBag.from_pretrained(values, mode="mean")
    rows = torch.tensor([index[k] for k in ids.tolist()], dtype=torch.int64)
    expected = bag(rows, batch.offsets["tags"][:-1])
    assert torch.allclose(pooled, expected, atol=1e-6)


def test_eval_and_predict_errors_are_one_line(trained, capsys):
    assert main(["eval", "--model", str(trained), "--data", str(trained / "test.parquet")]) == 2
    assert "no model.json; is this a `dynemb train --out` directory?" in capsys.readouterr().err
    pq.write_table(clicks(1).drop_columns(["price"]), trained / "no_price.parquet")
    assert main(["predict", "--model", str(trained / "run"), "--data", str(trained / "no_price.parquet"),
                 "--out", str(trained / "x.parquet")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "missing column 'price'" in line and not (trained / "x.parquet").exists()


def test_train_eval_predict_on_each_device(tmp_path, dynemb, device):
    pq.write_table(clicks(0, rows=600), tmp_path / "train.parquet")
    run = tmp_path / "run"
    common = ["--device", str(device)]
    dynemb("train", "--data", tmp_path / "train.parquet", "--label", "click", "--categorical", "user,item",
           "--multi-hot", "tags", "--dense", "price", "--out", run, "--epochs", "2", "--batch-size", "64",
           "--no-progress", *common)
    scored = dynemb("predict", "--model", run, "--data", tmp_path / "train.parquet", "--out", tmp_path / "p.parquet",
                    *common)
    probs = torch.tensor(pq.read_table(tmp_path / "p.parquet").column("probability").to_pylist())
    assert scored["rows"] == 600 and ((probs > 0) & (probs < 1)).all()
    cpu_probs, _ = forward(run, tmp_path / "train.parquet")  # the same checkpoint, on the CPU
    assert torch.allclose(probs, cpu_probs, atol=1e-4)
    assert dynemb("eval", "--model", run, "--data", tmp_path / "train.parquet", *common)["rows"] == 600


# ---------------------------------------------------------------------------------------------- predict's output
def test_predict_never_overwrites_an_input_or_the_run(trained, tmp_path, capsys):
    import os

    inputs = tmp_path / "inputs"
    inputs.mkdir()
    pq.write_table(clicks(1), inputs / "part-0.parquet")
    data = inputs / "part-0.parquet"
    os.symlink(data, tmp_path / "link.parquet")
    os.link(data, tmp_path / "hard.parquet")
    pcsv.write_csv(clicks(1).drop_columns(["tags"]), tmp_path / "mine.csv")  # a file of the user's, not an input
    before = {p: p.read_bytes() for p in [data, tmp_path / "mine.csv", trained / "run" / "model.json"]}
    cases = [
        (data, data, f"--out {data} is the input file {data}; predict never overwrites its input"),
        (data, tmp_path / "link.parquet", f"is the input file {data}"),  # a symlink to it
        (data, tmp_path / "hard.parquet", f"is the input file {data}"),  # a hard link: the same file
        (inputs, inputs / "scores.parquet", f"is inside the input directory --data {inputs}"),
        (data, trained / "run" / "model.json.csv", "is inside the run directory --model"),
        (data, trained / "run" / "preds.parquet", "is inside the run directory --model"),
        (data, tmp_path / "mine.csv", "exists and is not a file `dynemb predict` wrote as csv"),
    ]
    for source, out, message in cases:
        assert main(["predict", "--model", str(trained / "run"), "--data", str(source), "--out", str(out)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"dynemb predict: error: --out {out}") and message in line, line
    assert all(p.read_bytes() == b for p, b in before.items())
    assert not (inputs / "scores.parquet").exists() and not (trained / "run" / "preds.parquet").exists()
    assert not list(tmp_path.glob(".tmp-*")) and not list(inputs.glob(".tmp-*"))


def test_the_suffix_picks_the_format_and_predict_replaces_its_own_output(trained, tmp_path, dynemb, capsys):
    run, data = trained / "run", trained / "test.parquet"
    dynemb("predict", "--model", run, "--data", data, "--out", tmp_path / "p.parquet")
    dynemb("predict", "--model", run, "--data", data, "--out", tmp_path / "p.csv")
    parquet, text = pq.read_table(tmp_path / "p.parquet"), pcsv.read_csv(tmp_path / "p.csv")
    assert (tmp_path / "p.csv").read_text().splitlines()[0] == '"probability","click"'
    assert text.column("probability").to_pylist() == parquet.column("probability").to_pylist()  # exact in text
    assert text.column("click").to_pylist() == parquet.column("click").to_pylist()
    # Scored again (another model here), each file is replaced: the user asked for that name before.
    for name in ("p.parquet", "p.csv"):
        dynemb("predict", "--model", run, "--data", data, "--out", tmp_path / name, "--use", "last")
    for out in ("scores.txt", "scores.csv.gz", "scores.parquet.gz", "scores"):
        assert main(["predict", "--model", str(run), "--data", str(data), "--out", str(tmp_path / out)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "the suffix picks the format; use .parquet, .pq, .csv" in line, line
        assert not (tmp_path / out).exists()


def test_probabilities_of_a_confident_model_give_a_finite_log_loss(trained, tmp_path, monkeypatch, dynemb):
    import numpy as np

    from dynemb.job import score
    from dynemb.job.score import PROBABILITY_EPS

    real = score.load_model

    def confident(run, device="cpu", use="best", **kwargs):  # the run's model, its logits scaled up 100 times
        model, card = real(run, device, use, **kwargs)
        last = [m for m in model.top.modules() if isinstance(m, torch.nn.Linear)][-1]
        with torch.no_grad():
            last.weight.mul_(100)
            last.bias.mul_(100)
        return model, card

    monkeypatch.setattr(score, "load_model", confident)
    for name in ("c.parquet", "c.csv"):
        dynemb("predict", "--model", trained / "run", "--data", trained / "test.parquet", "--out", tmp_path / name)
        table = (pq.read_table if name.endswith("parquet") else pcsv.read_csv)(tmp_path / name)
        p = np.asarray(table.column("probability"), dtype=np.float64)
        y = np.asarray(table.column("click"), dtype=np.float64)
        assert ((p == PROBABILITY_EPS) | (p == 1 - PROBABILITY_EPS)).mean() > 0.2  # saturated rows are common
        assert ((p > 0) & (p < 1)).all()
        logloss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
        assert np.isfinite(logloss) and logloss > 0


def test_predict_and_eval_draw_a_bar_of_rows_on_a_terminal_only(trained, tmp_path, capsys):
    """A bar of rows on stderr when asked (its total the Parquet files' row count; open-ended for CSV), none when
    stderr is not a terminal (a log, a pipe) or with ``--no-progress``."""
    from dynemb.job import evaluate_file, predict_file

    predict_file(str(trained / "run"), str(trained / "test.parquet"), str(tmp_path / "p.parquet"), progress=True,
                 batch_size=500)
    err = capsys.readouterr().err
    assert "predict" in err and f"/{ROWS / 1000:.2f}k" in err  # 1.50k rows known ahead, from the metadata
    evaluate_file(str(trained / "run"), str(trained / "test.parquet"), progress=True)
    assert "scoring" in capsys.readouterr().err
    tags = pa.array(["|".join(t) if t else None for t in clicks(1).column("tags").to_pylist()], pa.string())
    pcsv.write_csv(clicks(1).drop_columns(["tags"]).append_column("tags", tags), tmp_path / "plain.csv")
    predict_file(str(trained / "run"), str(tmp_path / "plain.csv"), str(tmp_path / "q.parquet"), progress=True)
    assert "row" in capsys.readouterr().err  # no total: a count and a rate
    for args in ([], ["--no-progress"]):  # capsys's stderr is no terminal
        assert main(["predict", "--model", str(trained / "run"), "--data", str(trained / "test.parquet"), "--out",
                     str(tmp_path / "r.parquet"), *args]) == 0
        assert "predict" not in capsys.readouterr().err
    assert main(["eval", "--model", str(trained / "run"), "--data", str(trained / "test.parquet"),
                 "--no-progress"]) == 0
    assert "scoring" not in capsys.readouterr().err


@pytest.mark.slow
def test_a_predict_process_on_a_terminal_draws_its_bar(trained, tmp_path):
    """``dynemb predict`` whose stderr is a terminal (a pseudo-terminal here) draws the bar; its JSON stays on
    stdout."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios
    import threading

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 columns wide
    out = tmp_path / "p.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "predict", "--model", str(trained / "run"), "--data",
                             str(trained / "test.parquet"), "--out", str(out), "--batch-size", "500"],
                            stdout=subprocess.PIPE, stderr=follower, stdin=subprocess.DEVNULL)
    os.close(follower)
    drawn = []

    def read_terminal():  # while the process runs: what is left when its side closes may be dropped
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other side is closed
                return
            if not chunk:
                return
            drawn.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    stdout, _ = proc.communicate(timeout=120)
    reader.join(timeout=10)
    os.close(leader)
    drawn = b"".join(drawn)
    assert proc.returncode == 0 and b'"rows": 1500' in stdout
    assert b"predict" in drawn and b"/1.50k" in drawn, drawn[-500:]  # the total, known from the metadata
