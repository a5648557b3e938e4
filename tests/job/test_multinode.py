"""Two "nodes" on one machine: two ``torchrun --nnodes 2 --node-rank {0,1} --master-addr 127.0.0.1 --master-port P``
launches rendezvous like two hosts would (static rendezvous through node 0's store), with no shared launcher.

``dynemb train`` trains 2 ranks (1 per node) with background checkpoints and per-rank serving exports, then resumes
at 4 ranks (2 per node); the last published export (written by 4 ranks) holds the rows of a one-process export of
the last checkpoint, and ``dynemb serve`` on it scores like ``dynemb predict``. ``examples/train_distributed.py``
runs the same way, saving, then resuming at the other world size.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import dynemb
from dynemb.checkpoint import read_export
from dynemb.cli import main
from dynemb.distributed.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
SRC = str(Path(dynemb.__file__).parents[1])
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p),
       "OMP_NUM_THREADS": "1"}


def two_nodes(nproc: int, args: list, cwd: Path, timeout: float = 400) -> list[subprocess.CompletedProcess]:
    """Run ``args`` (a module or script and its options) as two torchrun "nodes" of ``nproc`` ranks each."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
                               str(node), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                               "--master-port", str(port), *map(str, args)],
                              cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for node, proc in enumerate(done):
        assert proc.returncode == 0, f"node {node}: stdout {proc.stdout[-1500:]}\nstderr {proc.stderr[-4000:]}"
    return done


def clicks(rows: int) -> pa.Table:
    g = torch.Generator().manual_seed(0)
    user, item = torch.randint(0, 400, (rows,), generator=g), torch.randint(0, 90, (rows,), generator=g)
    price = torch.rand(rows, generator=g) * 100
    label = ((user % 5 + item % 3 + price / 50).float() > 4).long()
    return pa.table({"click": label.tolist(), "user": [f"u{u}" for u in user.tolist()], "item": item.tolist(),
                     "price": price.tolist()})


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
def test_dynemb_train_on_two_nodes_resumes_at_four_ranks_and_serves_its_per_rank_export(tmp_path):
    pq.write_table(clicks(3000), tmp_path / "clicks.parquet")
    run = tmp_path / "run"
    train = ["-m", "dynemb", "train", "--data", tmp_path / "clicks.parquet", "--label", "click", "--categorical",
             "user,item", "--dense", "price", "--out", run, "--batch-size", "64", "--dim", "4", "--eval-batches", "1",
             "--eval-every", "3", "--checkpoint-every", "3", "--publish-every", "3", "--no-progress"]
    first = two_nodes(1, [*train, "--steps", "6"], tmp_path)
    assert json.loads(first[0].stdout.strip().splitlines()[-1])["step"] == 6
    saved = json.loads((run / "checkpoint" / "step-00000006" / "manifest.json").read_text())
    assert saved["world_size"] == 2 and (run / "checkpoint" / "step-00000003").is_dir()  # the background save

    second = two_nodes(2, [*train, "--steps", "9", "--resume"], tmp_path)
    assert json.loads(second[0].stdout.strip().splitlines()[-1])["step"] == 9
    saved = json.loads((run / "checkpoint" / "step-00000009" / "manifest.json").read_text())
    assert saved["world_size"] == 4
    assert not [p for p in (run / "checkpoint").iterdir() if p.name.startswith(".tmp-")]

    # the last version 4 ranks published: every rank's files, the rows of one process's export of step 9
    published, parts = read_export(run / "export")
    assert {s["rank"] for e in published["tables"].values() for s in e["shards"]} == {0, 1, 2, 3}
    assert main(["export", "--model", str(run), "--use", "last", "--out", str(tmp_path / "one")]) == 0
    _, whole = read_export(tmp_path / "one")
    assert sorted(whole) == sorted(parts)
    for name, cols in whole.items():
        a, b = cols["keys"].argsort(), parts[name]["keys"].argsort()
        assert torch.equal(cols["keys"][a], parts[name]["keys"][b]), name
        assert torch.equal(cols["values"][a], parts[name]["values"][b]), name

    # `dynemb serve` on that export scores like `dynemb predict` of the last checkpoint in one process
    rows = clicks(3000).slice(0, 40)
    pq.write_table(rows, tmp_path / "score.parquet")
    assert main(["predict", "--model", str(run), "--use", "last", "--data", str(tmp_path / "score.parquet"),
                 "--out", str(tmp_path / "preds.parquet")]) == 0
    expected = pq.read_table(tmp_path / "preds.parquet").column("probability").to_pylist()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run), "--use", "last",
                             "--port", str(port), "--name", "ctr"], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not _ready(url):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.2)
        d = rows.to_pydict()
        inputs = [{"name": "user", "datatype": "BYTES", "shape": [40], "data": d["user"]},
                  {"name": "item", "datatype": "INT64", "shape": [40], "data": d["item"]},
                  {"name": "price", "datatype": "FP32", "shape": [40], "data": d["price"]}]
        r = httpx.post(f"{url}/v2/models/ctr/infer", json={"inputs": inputs}, timeout=30)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], expected, atol=1e-6, rtol=0)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.slow
def test_the_distributed_example_on_two_nodes_saves_and_resumes_at_another_world_size(tmp_path):
    example = ROOT / "examples" / "train_distributed.py"
    first = two_nodes(1, [example, "--steps", "6", "--checkpoint", tmp_path / "ckpt", "--save-every", "3"], tmp_path)
    assert "saved step 6" in first[0].stdout
    assert json.loads((tmp_path / "ckpt" / "latest").read_text())["step"] == 6
    second = two_nodes(2, [example, "--steps", "9", "--checkpoint", tmp_path / "ckpt", "--save-every", "3"],
                       tmp_path)
    assert "resumed at step 6 (saved by 2 ranks, now 4)" in second[0].stdout
    manifest = json.loads((tmp_path / "ckpt" / "step-00000009" / "manifest.json").read_text())
    assert manifest["world_size"] == 4
