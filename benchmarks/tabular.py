"""``dynemb train`` with its defaults against a hand-written PyTorch MLP on a census-like tabular file.

No census data ships inside an installable package here (and nothing is downloaded), so the file is generated:
48,842 rows shaped like the UCI census-income ("adult") data: 8 string categorical columns with adult's
cardinalities (workclass 9, education 16, marital_status 7, occupation 15, relationship 6, race 5, sex 2,
native_country 42, skewed), 4 dense columns (age, fnlwgt, capital_gain mostly 0 and heavy-tailed,
hours_per_week) and a 0/1 ``income`` label (about 24% positive) from a hidden model with per-category effects,
nonlinear dense effects and one interaction.

Both models are scored on the same held-out rows: ``dynemb train``'s default split (5% of the rows by a seeded
hash of the row number), so the MLP trains on exactly dynemb's training rows. The MLP is what a user would write:
one-hot categories, standardized dense (log1p for capital_gain), 2 x 64 ReLU, Adam 1e-3, batch 256, 10 epochs.

    OMP_NUM_THREADS=1 python benchmarks/tabular.py [--rows 48842] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from dynemb.data import auc
from dynemb.data.stream import held_out

CATEGORICAL = {"workclass": 9, "education": 16, "marital_status": 7, "occupation": 15, "relationship": 6,
               "race": 5, "sex": 2, "native_country": 42}
DENSE = ("age", "fnlwgt", "capital_gain", "hours_per_week")


def census_like(rows: int, seed: int = 0) -> pa.Table:
    """The generated file's columns (see the module docstring)."""
    torch.manual_seed(seed)  # the Gamma sampler draws from the global generator
    g = torch.Generator().manual_seed(seed)
    columns, logit = {}, torch.zeros(rows)
    for i, (name, k) in enumerate(CATEGORICAL.items()):
        weights = torch.rand(k, generator=g) ** 2 + 0.02  # skewed category frequencies
        codes = torch.multinomial(weights / weights.sum(), rows, replacement=True, generator=g)
        effect = torch.randn(k, generator=g) * (1.0 if name in ("education", "marital_status", "occupation") else 0.5)
        logit += effect[codes]
        columns[name] = pa.array([f"{name}-{c}" for c in codes.tolist()]).dictionary_encode().dictionary_decode()
        if name == "sex":
            sex = codes
        if name == "education":
            education = codes
    age = (17 + torch.distributions.Gamma(3.0, 0.15).sample((rows,))).clamp(max=90).round()
    hours = (40 + 12 * torch.randn(rows, generator=g)).clamp(1, 99).round()
    gain = torch.where(torch.rand(rows, generator=g) < 0.08, torch.exp(6 + 2.5 * torch.rand(rows, generator=g)),
                       torch.zeros(rows)).round()
    fnlwgt = torch.exp(12 + 0.5 * torch.randn(rows, generator=g)).round()
    logit += -((age - 48) / 14) ** 2 + 0.9 * torch.log1p(gain) / 4 + 0.03 * (hours - 40)
    logit += 0.6 * (sex == 1).float() * (education >= 10).float()  # one interaction
    logit += torch.randn(rows, generator=g) * 0.3
    bias = torch.tensor(0.0)
    for _ in range(50):  # about 24% positive
        bias += 0.5 * (0.24 - torch.sigmoid(logit + bias).mean())
    label = (torch.rand(rows, generator=g) < torch.sigmoid(logit + bias)).to(torch.int8)
    columns.update(age=age.tolist(), fnlwgt=fnlwgt.tolist(), capital_gain=gain.tolist(), hours_per_week=hours.tolist())
    return pa.table({"income": pa.array(label.numpy()), **columns})


def mlp_baseline(table: pa.Table, train: torch.Tensor, test: torch.Tensor, epochs: int = 10) -> dict:
    """One-hot + standardized dense -> 2 x 64 ReLU MLP, Adam; returns held-out AUC and seconds."""
    started = time.perf_counter()
    parts = []
    for name in CATEGORICAL:
        codes = torch.tensor(table.column(name).dictionary_encode().combine_chunks().indices.to_numpy())
        parts.append(torch.nn.functional.one_hot(codes.long()).float())
    dense = torch.tensor([table.column(c).to_pylist() for c in DENSE]).T
    dense[:, 2] = torch.log1p(dense[:, 2])
    mean, std = dense[train].mean(0), dense[train].std(0)
    x = torch.cat(parts + [(dense - mean) / std], 1)
    y = torch.tensor(table.column("income").to_pylist()).float()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(epochs):
        for idx in train[torch.randperm(len(train))].split(256):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x[idx]).squeeze(1), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        score = auc(model(x[test]).squeeze(1), y[test])
    return {"auc": round(float(score), 4), "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=48_842)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--train-args", default="", help="extra `dynemb train` options (default: none)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    table = census_like(args.rows)
    held = held_out(torch.arange(args.rows), 0.05, 0)  # dynemb train's default split
    train, test = (~held).nonzero().squeeze(1), held.nonzero().squeeze(1)
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(table, Path(tmp) / "census.parquet")
        command = [sys.executable, "-m", "dynemb", "train", "--data", "census.parquet", "--label", "income",
                   "--categorical", ",".join(CATEGORICAL), "--dense", ",".join(DENSE), "--out", "run",
                   *args.train_args.split()]
        started = time.perf_counter()
        proc = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if proc.returncode:
            sys.exit(proc.stderr)
        dynemb = json.loads(proc.stdout.strip().splitlines()[-1])
    mlp = mlp_baseline(table, train, test)
    result = {"rows": args.rows, "train_rows": len(train), "held_out_rows": len(test),
              "dynemb": {"auc": dynemb["auc"], "command_seconds": round(wall, 1), "train_seconds": dynemb["seconds"],
                         "steps": dynemb["step"], "options": args.train_args or "defaults"},
              "mlp": mlp, "auc_gap": round(mlp["auc"] - dynemb["auc"], 4)}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
