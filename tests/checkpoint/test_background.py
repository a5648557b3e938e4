"""``save(..., blocking=False)``: the checkpoint equals a blocking save at that step although training goes on
changing the same rows (updates, inserts, evictions, erases whose compaction moves rows, the fused kernels' in-place
writes) while the files are written; the handle reports the outcome; a failed background save publishes nothing.

The save's thread is held before it writes its first file until the training steps are done, so the overlap is
certain rather than left to timing.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from ckpt_util import TwoTables, assert_same_models, train_step, trained_model

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import SaveHandle, load, save
from dynemb.checkpoint.file_image import FileImage
from dynemb.checkpoint.manifest import read_manifest
from dynemb.table.tiered import Tiers


@pytest.fixture
def held(monkeypatch):
    """An Event: a background save's thread waits for it before writing its first file (blocking saves and exports
    write on the caller's thread, unheld)."""
    gate = threading.Event()
    original = FileImage.write

    def write(*args, **kwargs):
        assert threading.current_thread().name.startswith("dynemb-save-")  # only a background save's thread
        assert gate.wait(60), "the test never released the save"
        return original(*args, **kwargs)

    monkeypatch.setattr(FileImage, "write", write)
    return gate


def _files(directory) -> dict:
    """The manifest's file records (checksum and size of every file): equal records, equal bytes."""
    return read_manifest(directory)["files"]


def _seeded(make):
    torch.manual_seed(0)  # the dense layers' initial weights
    return make()


def test_background_save_equals_a_blocking_save_while_training_goes_on(tmp_path, held):
    model, twin = _seeded(trained_model), _seeded(trained_model)
    opt = torch.optim.Adam(model.dense.parameters(), lr=0.01)
    twin_opt = torch.optim.Adam(twin.dense.parameters(), lr=0.01)
    for m, o in ((model, opt), (twin, twin_opt)):
        m.dense(torch.randn(3, 12, generator=torch.Generator().manual_seed(0))).sum().backward()
        o.step()
    save(tmp_path / "blocking", twin, twin_opt, step=6, extra={"k": [1]})

    extra = {"k": [1]}
    moves, evicted = model.user.table.row_moves, model.user.table.evicted
    handle = save(tmp_path / "bg", model, opt, step=6, extra=extra, blocking=False)
    assert isinstance(handle, SaveHandle) and not handle.done() and handle.error is None
    extra["k"].append(2)  # the caller's objects may change too
    for i in range(6, 14):  # inserts, evictions (bounded lru), erases (compaction moves rows), restrict, upserts
        train_step(model, i)
    assert model.user.table.row_moves > moves and model.user.table.evicted > evicted
    assert not handle.done()
    held.set()
    assert handle.wait(60) == tmp_path / "bg" / "step-00000006"
    assert handle.done() and handle.error is None and "done" in repr(handle)

    assert _files(handle.path) == _files(tmp_path / "blocking" / "step-00000006")
    assert read_manifest(handle.path)["extra"] == {"k": [1]}
    fresh = TwoTables(seed=9)
    fresh_opt = torch.optim.Adam(fresh.dense.parameters(), lr=0.5)
    assert load(tmp_path / "bg", fresh, fresh_opt)["step"] == 6
    assert_same_models(fresh, twin)
    assert not [p for p in (tmp_path / "bg").iterdir() if p.name.startswith(".tmp-")]


def _fused_collection() -> EmbeddingCollection:
    opt = dynemb.optim.Adagrad(lr=0.2, fused=True)
    tables = [TableConfig(name="a", dim=8, optimizer=opt, seed=1, max_capacity=64, init_capacity=16),
              TableConfig(name="b", dim=4, optimizer=opt, seed=2)]
    return EmbeddingCollection(tables, [FeatureConfig(name=n, table=n) for n in "ab"])


def _fused_step(ec: EmbeddingCollection, i: int) -> None:
    """Forward and backward: the fused Adagrad writes rows and slots in place inside backward."""
    g = torch.Generator().manual_seed(i)
    batch = {"a": torch.randint(0, 120, (32,), generator=g), "b": torch.randint(-50, 50, (32,), generator=g)}
    out = ec(batch)
    sum(o.pow(2).sum() for o in out.values()).backward()
    ec.optimizer.step()
    ec.optimizer.zero_grad()
    if i % 2:
        ec.embeddings["b"].erase(torch.arange(-50, 50, 7))  # holes filled by the last rows: compaction


def test_background_save_holds_rows_the_fused_kernels_write_afterwards(tmp_path, held):
    ec, twin = _seeded(_fused_collection), _seeded(_fused_collection)
    for i in range(4):
        _fused_step(ec, i)
        _fused_step(twin, i)
    save(tmp_path / "blocking", twin, twin.optimizer, step=4)
    handle = save(tmp_path / "bg", ec, ec.optimizer, step=4, blocking=False)
    before = ec.embeddings["b"].table.row_moves
    for i in range(4, 10):
        _fused_step(ec, i)
    assert ec.embeddings["b"].table.row_moves > before and not handle.done()
    held.set()
    handle.wait(60)
    assert _files(handle.path) == _files(tmp_path / "blocking" / "step-00000004")
    fresh = _fused_collection()
    load(handle.path, fresh, fresh.optimizer)
    for name in "ab":
        got, want = fresh.embeddings[name].table.export(), twin.embeddings[name].table.export()
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values), name
        for slot in want.slots:
            assert torch.equal(got.slots[slot], want.slots[slot]), (name, slot)


def test_a_failed_background_save_publishes_nothing_and_the_next_one_works(tmp_path, monkeypatch):
    model = trained_model()
    save(tmp_path, model, step=1)

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileImage, "write", broken)
    handle = save(tmp_path, model, step=2, blocking=False)
    with pytest.raises(OSError, match="No space left"):
        handle.wait(60)
    assert handle.done() and isinstance(handle.error, OSError) and "failed" in repr(handle)
    assert json.loads((tmp_path / "latest").read_text())["name"] == "step-00000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    monkeypatch.undo()
    train_step(model, 7)
    assert save(tmp_path, model, step=2, blocking=False).wait(60).name == "step-00000002"


def test_background_saves_run_in_call_order_and_chain_incrementally(tmp_path, held):
    model = trained_model()
    held.set()
    first = save(tmp_path, model, step=6, blocking=False)
    train_step(model, 6)
    second = save(tmp_path, model, step=7, incremental=True, blocking=False)  # waits for the first one
    assert first.done()
    second.wait(60)
    assert read_manifest(second.path)["parent"] == "step-00000006"
    fresh = TwoTables(seed=4)
    load(tmp_path, fresh)
    assert_same_models(fresh, model)


def test_wait_times_out_while_the_save_runs(tmp_path, held):
    handle = save(tmp_path, trained_model(), step=1, blocking=False)
    with pytest.raises(TimeoutError, match="still running"):
        handle.wait(0.01)
    held.set()
    handle.wait(60)


def test_blocking_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="blocking must be a bool"):
        save(tmp_path, trained_model(), step=1, blocking="no")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_full_background_save_of_a_tiered_table_is_refused(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=0, tiers=Tiers(fast_capacity=64))
    emb(torch.arange(100))
    with pytest.raises(ValueError, match="tiered table"):
        save(tmp_path, emb, step=1, blocking=False)
    save(tmp_path, emb, step=1)
    emb(torch.arange(100, 120))
    save(tmp_path, emb, step=2, incremental=True, blocking=False).wait(60)
    assert read_manifest(tmp_path / "step-00000002")["kind"] == "incremental"



def test_a_serving_export_does_not_wait_for_a_background_save(tmp_path, held):
    from dynemb.checkpoint import export_for_serving, read_export

    model = trained_model()
    handle = save(tmp_path / "ckpt", model, step=6, blocking=False)
    train_step(model, 6)
    export_for_serving(tmp_path / "export", model)  # while the save's thread is held
    assert not handle.done()
    _, tables = read_export(tmp_path / "export")
    rows = model.user.table.export()
    assert torch.equal(tables["user"]["keys"], rows.keys) and torch.equal(tables["user"]["values"], rows.values)
    held.set()
    handle.wait(60)
    fresh = TwoTables(seed=3)
    load(handle.path, fresh)
    assert fresh.steps.item() == 6
