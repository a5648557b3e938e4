"""A process training a tiered table (slow tier on disk) is SIGKILLed in the middle of a write-back to the slow
tier; reloading its last checkpoint loses no row: the table equals an untiered run of the same steps, bit for bit.
The dead process's row files are removed by the next table opened under the same path. With three levels (a fast
tier over host memory over row files, the fast tier's link the device stand-in), the write-back killed is the host's
to the row files. Both ways of writing the row files: in place through the mapping, and as a log (the append on
the writer thread is killed half written)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import dynemb
from dynemb.checkpoint import load, save
from dynemb.table import Tiers

CHECKPOINT_STEP = 8
CHILD = r"""
import os, sys, time
import torch, dynemb
from dynemb.checkpoint import save
from dynemb.table import Tiers
from dynemb.table import tiered
from dynemb.table.slow import LogStore
from dynemb.table.tier_moves import HostLink, StagedLink
tiered.ROW_FILES_AS_LOG = {log}
sys.path.insert(0, {here!r})
from test_tiered_crash import build, step, tiers

root, marker = sys.argv[1], sys.argv[2]
emb, opt = build(tiers({levels}, os.path.join(root, "slow")))
if emb.table.disk is not None:  # the fast tier moves rows as on CUDA: the host link below is the host's to the files
    emb.table.link = StagedLink(torch.device("cpu"), stand_in=True)
for i in range({steps}):
    step(emb, opt, i)
save(os.path.join(root, "ckpt"), emb, step={steps})
move = HostLink.move
def slow_move(self, fast, fast_dest, victims, slow, slow_dest, up_from):  # a write-back: half a column, then hang
    if victims.numel() > 1:
        half = victims.numel() // 2
        move(self, fast, fast_dest[:0], victims[:half], slow, slow_dest[:half], up_from[:0])
        open(marker, "w").close()
        time.sleep(120)
    return move(self, fast, fast_dest, victims, slow, slow_dest, up_from)
write = LogStore._write_parts
def slow_write(self, parts):  # a write-back to row files written as a log (the writer thread): half, then hang
    data, offset = parts[0]
    if len(data) > 1:
        write(self, [(data[: len(data) // 2], offset)])
        open(marker, "w").close()
        time.sleep(120)
    return write(self, parts)
HostLink.move = slow_move
LogStore._write_parts = slow_write
for i in range({steps}, 10 * {steps}):
    step(emb, opt, i)
"""


def tiers(levels: int, path: str) -> Tiers:
    return Tiers(fast_capacity=32, slow=path, **({"host_capacity": 24} if levels == 3 else {}))


def build(tiers):
    emb = dynemb.DynamicEmbedding(8, seed=5, tiers=tiers)
    return emb, dynemb.optim.Adagrad([emb], lr=0.2)


def step(emb, opt, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    emb((torch.rand(64, generator=g) ** 2 * 400).long()).square().sum().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("row_files", ["log", "in-place"])
@pytest.mark.parametrize("levels", [2, 3])
def test_a_process_killed_during_a_write_back_loses_no_row(levels, row_files, tmp_path):
    marker = tmp_path / "writing"
    code = CHILD.format(here=os.path.dirname(__file__), steps=CHECKPOINT_STEP, levels=levels,
                        log=row_files == "log")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(marker)], env=env,
                             stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert child.poll() is None, f"the child died first: {child.stderr.read().decode()}"
            assert time.monotonic() < deadline, "the child never reached a write-back"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    (orphan,) = os.listdir(tmp_path / "slow")  # the dead process's row files are still there

    reference, opt = build(None)
    for i in range(CHECKPOINT_STEP):
        step(reference, opt, i)
    save(tmp_path / "reference", reference, step=CHECKPOINT_STEP)  # saving ticks the clock, as in the child

    restored, _ = build(tiers(levels, str(tmp_path / "slow")))
    assert orphan not in os.listdir(tmp_path / "slow"), "the next table removes a dead process's files"
    load(tmp_path / "ckpt", restored)
    assert restored.table.slow.size() > 0 and restored.table.size() == reference.table.size() > 32
    if levels == 3:
        assert restored.table.disk.size() > 0 and restored.table.slow.size() <= 24
    a, b = restored.table.export(), reference.table.export()
    oa, ob = torch.argsort(a.keys), torch.argsort(b.keys)
    assert torch.equal(a.keys[oa], b.keys[ob]) and torch.equal(a.values[oa], b.values[ob])
    assert torch.equal(a.scores[oa], b.scores[ob])
    assert all(torch.equal(a.slots[n][oa], b.slots[n][ob]) for n in a.slots)
    assert restored.table.clock == reference.table.clock
