"""The torchrun command of docs/distributed.md, ``dynemb train --synthetic`` on 2 ranks, runs to the end and writes
its run directory; a few steps leave a table whose shard on one rank holds one row, which crashed the first save.
``dynemb export`` then reads that 2-rank checkpoint in one process."""

import json
import os
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import dynemb
from dynemb.checkpoint import read_export
from dynemb.cli import main
from dynemb.distributed.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTED = "torchrun --nproc_per_node=2 -m dynemb train --synthetic --steps 200"
SMALL = ["--steps", "2", "--batch-size", "64", "--eval-batches", "1", "--no-progress"]  # later options win


def _torchrun(args: list[str], out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args[1:3], "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", *args[3:], *SMALL, "--out", str(out)]
    # the ranks import the dynemb this test imported, whatever the working directory
    path = os.pathsep.join(p for p in (str(Path(dynemb.__file__).parents[1]), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out.parent,
                          env={**os.environ, "PYTHONPATH": path})


@pytest.mark.slow
def test_the_documented_torchrun_command_trains_saves_and_exports(tmp_path):
    assert DOCUMENTED in (ROOT / "docs" / "distributed.md").read_text()
    args = shlex.split(DOCUMENTED)
    assert args[:3] == ["torchrun", "--nproc_per_node=2", "-m"]
    proc = _torchrun(args, tmp_path / "run")
    # As tests/examples/test_examples.py: a rank may abort inside torch's C++ on a fresh machine; relaunch once then.
    if proc.returncode != 0 and "terminate called without an active exception" in proc.stderr:
        warnings.warn(f"torchrun: a rank aborted in torch's C++; relaunched once. stdout: {proc.stdout[-500:]!r}",
                      stacklevel=2)
        proc = _torchrun(args, tmp_path / "run2")
    assert proc.returncode == 0, f"stdout: {proc.stdout[-1500:]}\nstderr: {proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["step"] == 2
    run = Path(proc.args[proc.args.index("--out") + 1])
    latest = json.loads((run / "checkpoint" / "latest").read_text())["name"]
    manifest = json.loads((run / "checkpoint" / latest / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    shard_rows = [s["rows"] for entry in manifest["tables"].values() for s in entry["shards"]]
    assert 1 in shard_rows, shard_rows  # the case this test is for
    assert main(["export", "--model", str(run), "--out", str(tmp_path / "export")]) == 0
    _, tables = read_export(tmp_path / "export")
    rows = {name: sum(s["rows"] for s in entry["shards"]) for name, entry in manifest["tables"].items()}
    assert {name: cols["keys"].numel() for name, cols in tables.items()} == rows
