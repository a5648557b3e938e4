"""Each example in examples/ runs to completion."""

import subprocess
import sys
from pathlib import Path

from dynemb.distributed.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_train_distributed_under_torchrun_world_2():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(ROOT / "examples" / "train_distributed.py"), "--steps", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert len(losses) >= 2 and losses[-1] < losses[0]
