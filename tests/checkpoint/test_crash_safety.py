"""A process SIGKILLed in the middle of ``save`` leaves ``latest`` at the previous complete checkpoint, which loads.

The child process saves step 1, then starts saving step 2 with one of the save's own steps wrapped to announce
itself and sleep, so the kill lands at a known point: between two shard files, after the manifest but before the
rename, or after the rename but before ``latest`` moves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import dynemb
from dynemb.checkpoint import load, save

BUILD = """
import torch, dynemb
emb = dynemb.DynamicEmbedding(16, seed=3)
emb.table.add_slot("m", 16)
emb(torch.arange(2000))
"""

CHILD = BUILD + """
import sys, time
import dynemb.checkpoint.commit as save_module
from dynemb.checkpoint import save

root, where = sys.argv[1], sys.argv[2]
save(root, emb, step=1)
emb.insert_or_assign(torch.arange(100), torch.ones(100, 16))

def announce_and_sleep(fn, before):
    def wrapped(*args, **kwargs):
        if not before:
            fn(*args, **kwargs)
        print("PAUSED", flush=True)
        time.sleep(600)
    return wrapped

name = {"between_files": "write_tensors", "before_rename": "write_json", "before_latest": "write_pointer"}[where]
setattr(save_module, name, announce_and_sleep(getattr(save_module, name), before=where == "before_latest"))
save(root, emb, step=2)
"""


def _expected() -> dynemb.DynamicEmbedding:
    scope: dict = {}
    exec(BUILD, scope)
    return scope["emb"]


@pytest.mark.parametrize("where", ["between_files", "before_rename", "before_latest"])
@pytest.mark.slow
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path, where):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), where], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "PAUSED"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((tmp_path / "latest").read_text())["name"] == "step-00000001"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-00000002")]
    assert (tmp_path / "step-00000002").exists() == (where == "before_latest")
    assert bool(leftovers) == (where != "before_latest")

    restored = dynemb.DynamicEmbedding(16, seed=0)
    restored.table.add_slot("m", 16)
    assert load(tmp_path, restored)["step"] == 1
    expected = _expected()
    for got, want in zip(restored.table.export()[:3], expected.table.export()[:3]):
        assert torch.equal(got, want)

    save(tmp_path, restored, step=3, keep_last=1)  # the next save prunes what the crash left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003"]


BACKGROUND_CHILD = BUILD + """
import sys, threading, time
from dynemb.checkpoint import save
from dynemb.checkpoint.file_image import FileImage

root = sys.argv[1]
save(root, emb, step=1)
original = FileImage.write
calls = []

def announce_and_sleep(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:  # one file written, the second one half way
        print("PAUSED", flush=True)
        time.sleep(600)
    return original(*args, **kwargs)

FileImage.write = announce_and_sleep  # how a background save's thread writes each file
handle = save(root, emb, step=2, blocking=False)
for i in range(10**9):  # training goes on while the save's thread writes
    emb(torch.arange(i % 3000, i % 3000 + 64))
"""


@pytest.mark.slow
def test_a_save_after_a_killed_background_save_succeeds_and_leaves_no_temp_dir(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", BACKGROUND_CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "PAUSED"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-step-00000002")]
    assert json.loads((tmp_path / "latest").read_text())["name"] == "step-00000001"

    restored = dynemb.DynamicEmbedding(16, seed=0)
    restored.table.add_slot("m", 16)
    assert load(tmp_path, restored)["step"] == 1
    # no keep_last: the dead writer's temp directory goes because its process is gone
    save(tmp_path, restored, step=2, blocking=False).wait(60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002"]
    again = dynemb.DynamicEmbedding(16, seed=1)
    again.table.add_slot("m", 16)
    assert load(tmp_path, again)["step"] == 2
    for got, want in zip(again.table.export()[:3], restored.table.export()[:3]):
        assert torch.equal(got, want)
