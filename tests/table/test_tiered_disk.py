"""A slow tier's directory that cannot be written, or a disk that fills up: a clear error naming ``Tiers.slow``, and
nothing lost. Row files have their disk blocks reserved when made, so a full disk fails the call that needs a new
file (before any row moves) instead of a later append on the writer thread, which lost that append's rows and left
the table unusable even once there was room again. The full disk is a real one: a file size limit
(``RLIMIT_FSIZE``) in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import dynemb
from dynemb.table import Tiers, tiered


def build(tiers):
    emb = dynemb.DynamicEmbedding(8, seed=5, tiers=tiers)
    return emb, dynemb.optim.Adagrad([emb], lr=0.2)


def step(emb, opt, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    emb((torch.rand(64, generator=g) ** 2 * 2000).long()).square().sum().backward()
    opt.step()
    opt.zero_grad()


def same_rows(a, b) -> bool:
    a, b = a.table.export(), b.table.export()
    oa, ob = torch.argsort(a.keys), torch.argsort(b.keys)
    return (torch.equal(a.keys[oa], b.keys[ob]) and torch.equal(a.values[oa], b.values[ob])
            and all(torch.equal(a.slots[n][oa], b.slots[n][ob]) for n in a.slots))


@pytest.mark.parametrize("as_log", [True, False])
def test_row_files_have_their_blocks_reserved(tmp_path, monkeypatch, as_log):
    monkeypatch.setattr(tiered, "ROW_FILES_AS_LOG", as_log)
    emb, opt = build(Tiers(fast_capacity=16, slow=tmp_path))
    for i in range(12):
        step(emb, opt, i)
    assert emb.table.slow.size() > 16
    (private,) = os.listdir(tmp_path)
    files = [os.path.join(tmp_path, private, f) for f in os.listdir(tmp_path / private)]
    assert files
    for f in files:  # sparse before: a full disk then failed a later write into the file
        st = os.stat(f)
        assert st.st_blocks * 512 >= st.st_size, (f, st.st_size, st.st_blocks)


def test_a_tier_directory_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "a-file").write_text("")
    where = tmp_path / "a-file" / "rows"
    with pytest.raises(OSError, match=r"Tiers\.slow=.*a-file/rows.* must be a directory this process can write"):
        dynemb.DynamicEmbedding(8, tiers=Tiers(fast_capacity=4, slow=where))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into a read-only mode")
def test_a_tier_directory_without_write_permission_is_named(tmp_path):
    where = tmp_path / "read-only"
    where.mkdir(mode=0o555)
    with pytest.raises(PermissionError, match=r"Tiers\.slow=.*read-only.* must be a directory this process can"):
        dynemb.DynamicEmbedding(8, tiers=Tiers(fast_capacity=4, slow=where))


CHILD = r"""
import json, os, resource, sys
sys.path.insert(0, {here!r})
from test_tiered_disk import Tiers, build, same_rows, step
root, steps = sys.argv[1], 40
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
emb, opt = build(Tiers(fast_capacity=16, slow=os.path.join(root, "slow")))
failed, error = None, None
for i in range(steps):
    try:
        step(emb, opt, i)
    except OSError as e:
        failed, error = i, str(e)
        break
out = {{"failed": failed, "error": error}}
if failed is not None:
    reference, ref_opt = build(None)
    for i in range(failed):
        step(reference, ref_opt, i)
    out["unchanged"] = same_rows(emb, reference)  # the failed step moved and updated nothing
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)  # room again
    for i in range(failed, steps):
        step(emb, opt, i)
        step(reference, ref_opt, i)
    out["equal_after"] = same_rows(emb, reference)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_full_disk_fails_the_call_and_loses_no_row(tmp_path):
    code = CHILD.format(here=os.path.dirname(__file__), limit=200_000)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["failed"] is not None, "the limit was never reached"
    assert "Tiers.slow=" in out["error"] and str(tmp_path / "slow") in out["error"], out["error"]
    assert "File too large" in out["error"]
    assert out["unchanged"] and out["equal_after"]


def _saved_rows(root):
    from dynemb.checkpoint import load

    restored, _ = build(None)
    load(root, restored)
    return restored


def test_a_save_reads_row_files_where_they_stand(tmp_path):
    # a save (full and incremental) and a serving export of a table whose row file has holes write nothing under
    # Tiers.slow: before, they rewrote ("packed") the whole file there first, so a full tier disk blocked them
    from dynemb.checkpoint import export_for_serving, save
    from dynemb.serving import read_export

    emb, opt = build(Tiers(fast_capacity=16, slow=tmp_path / "slow"))
    reference, ref_opt = build(None)
    for i in range(10):
        step(emb, opt, i)
        step(reference, ref_opt, i)
    log = emb.table.slow
    files = sorted(os.listdir(log.directory))
    assert not log._packed() and log.size() > 16
    rewrites = log.rewrites
    save(tmp_path / "ckpt", emb, step=10)
    assert (log.rewrites, sorted(os.listdir(log.directory))) == (rewrites, files)
    for i in range(10, 14):
        step(emb, opt, i)
        step(reference, ref_opt, i)
    assert not log._packed()
    rewrites, files = log.rewrites, sorted(os.listdir(log.directory))
    save(tmp_path / "ckpt", emb, step=14, incremental=True)
    export_for_serving(tmp_path / "export", emb)
    assert (log.rewrites, sorted(os.listdir(log.directory))) == (rewrites, files)
    assert not log._packed()
    assert same_rows(_saved_rows(tmp_path / "ckpt"), reference)
    _, tables = read_export(tmp_path / "export")
    keys, values = tables["embedding"]["keys"], tables["embedding"]["values"]
    ref = reference.table.export()
    o, r = torch.argsort(keys), torch.argsort(ref.keys)
    assert torch.equal(keys[o], ref.keys[r]) and torch.equal(values[o], ref.values[r])


@pytest.mark.parametrize("as_log", [True, False])
def test_a_row_file_that_could_not_be_made_leaves_the_store_on_its_file(tmp_path, monkeypatch, as_log):
    # a full disk fails the call that needs a new row file (in place and as a log); once there is room the table
    # grows again as if that call never ran (the store still on its old file, which a later growth replaces)
    import errno

    monkeypatch.setattr(tiered, "ROW_FILES_AS_LOG", as_log)
    real, full = os.posix_fallocate, [False]

    def fallocate(fd, offset, length):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    emb, opt = build(Tiers(fast_capacity=16, slow=tmp_path / "slow"))
    reference, ref_opt = build(None)
    failed = None
    for i in range(40):
        full[0] = failed is None and i >= 2
        try:
            step(emb, opt, i)
        except OSError as e:
            assert "Tiers.slow=" in str(e) and "No space left" in str(e), e
            failed = i
        if failed != i:
            step(reference, ref_opt, i)
        else:
            full[0] = False
            assert same_rows(emb, reference)  # the failed step changed nothing
            step(emb, opt, i)  # room again: the step runs
            step(reference, ref_opt, i)
    assert failed is not None, "no row file was made after step 2"
    assert same_rows(emb, reference)
    (private,) = os.listdir(tmp_path / "slow")
    assert len(os.listdir(tmp_path / "slow" / private)) == 1  # the store's one file: none left behind


@pytest.mark.slow
def test_streamed_columns_of_a_wrapped_holed_ring_keep_the_keys_order(tmp_path, monkeypatch):
    # a save reads the row file where it stands (c08dbc0): every column, full and delta, in export()'s row order,
    # for a ring that wrapped (its tail cleaned, rows appended again) and has holes (erased keys), a chunk of the
    # ring at a time (chunks smaller than the ring, so a chunk's offset counts)
    from dynemb.checkpoint import tiered_stream
    from dynemb.checkpoint.tables import find_tables
    from dynemb.table.slow import LogStore

    monkeypatch.setattr(LogStore, "_CLEAN_MIN", 8)
    monkeypatch.setattr(tiered_stream, "CHUNK_ROWS", 7)
    emb, opt = build(Tiers(fast_capacity=16, slow=tmp_path / "slow"))
    log, version = emb.table.slow, None
    for i in range(120):
        g = torch.Generator().manual_seed(i)  # few keys, many steps: rows go down and up again, the ring wraps
        emb((torch.rand(64, generator=g) ** 2 * 400).long()).square().sum().backward()
        opt.step()
        opt.zero_grad()
        if i % 10 == 5 and i < 90:
            emb.table.erase(torch.arange(i, i + 40))
        if i == 100:
            version = emb.table.clock
    assert log._tail > 0 and not log._packed()  # wrapped, with holes
    shard = next(iter(find_tables(emb).values()))
    ref = emb.table.export()
    cols = {k: v.materialize() for k, v in tiered_stream.tiered_columns(shard).items()}
    assert torch.equal(cols["keys"], ref.keys) and torch.equal(cols["values"], ref.values)
    assert torch.equal(cols["scores"], ref.scores) and all(torch.equal(cols["slot." + n], ref.slots[n])
                                                           for n in ref.slots)
    rows, _ = emb.table.changes_since(version)
    assert 0 < rows.numel() < ref.keys.numel()
    delta = {k: v.materialize() for k, v in tiered_stream.tiered_delta_columns(shard, rows).items()}
    assert torch.equal(delta["keys"], ref.keys[rows]) and torch.equal(delta["values"], ref.values[rows])
