"""Incremental checkpoints: a full save plus deltas loads to exactly the table a full save would give."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from ckpt_util import TwoTables, assert_same_models, train_step, trained_model

import dynemb
from dynemb.checkpoint import CheckpointError, load, save


def _manifest(directory) -> dict:
    return json.loads((directory / "manifest.json").read_text())


def test_full_plus_three_deltas_equals_a_full_save(tmp_path):
    trained = trained_model()
    chain_root, full_root = tmp_path / "chain", tmp_path / "full"
    save(chain_root, trained, step=6)
    for step in (7, 8, 9):  # inserts, updates, accum, erases (step % 3 == 2), restrict (step % 4 == 3), evictions
        train_step(trained, step)
        train_step(trained, step + 100)
        twin = copy.deepcopy(trained)  # the same model, never saved incrementally
        directory = save(chain_root, trained, step=step, incremental=True)
        assert _manifest(directory)["kind"] == "incremental"
    assert _manifest(directory)["parent"] == "step-00000008"
    assert trained.user.table.evicted > 0 and trained.user.table.removed > 0 and trained.item.table.evicted > 0
    save(full_root, twin, step=9)
    from_chain, from_full = TwoTables(seed=11), TwoTables(seed=12)
    load(chain_root, from_chain)
    load(full_root, from_full)
    assert_same_models(from_chain, from_full)
    assert_same_models(trained, from_chain)


def test_delta_holds_only_changed_rows(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=0)
    emb(torch.arange(1000))
    save(tmp_path, emb, step=0)
    emb.insert_or_assign(torch.tensor([3, 500, 5000]), torch.ones(3, 4))
    directory = save(tmp_path, emb, step=1, incremental=True)
    shard = _manifest(directory)["tables"]["embedding"]["shards"][0]
    assert shard["changed_rows"] == 3 and shard["deleted"] == 0 and shard["rows"] == 1001
    emb.erase(torch.tensor([7]))
    directory = save(tmp_path, emb, step=2, incremental=True)
    shard = _manifest(directory)["tables"]["embedding"]["shards"][0]
    assert shard["deleted"] == 1 and shard["changed_rows"] == 0  # the last row moved into the hole: "order" has it
    fresh = dynemb.DynamicEmbedding(4, seed=1)
    load(tmp_path, fresh)
    assert torch.equal(fresh.export()[0], emb.export()[0]) and torch.equal(fresh.export()[1], emb.export()[1])


def test_first_incremental_save_is_full(tmp_path, caplog):
    trained = trained_model()
    with caplog.at_level(logging.WARNING, logger="dynemb.checkpoint"):
        directory = save(tmp_path, trained, step=1, incremental=True)
    assert _manifest(directory)["kind"] == "full"
    assert "writing a full one" in caplog.text


def test_incremental_after_load_builds_on_the_loaded_checkpoint(tmp_path):
    trained = trained_model()
    save(tmp_path, trained, step=6)
    resumed = TwoTables(seed=3)
    load(tmp_path, resumed)
    for model in (trained, resumed):
        train_step(model, 6)
    directory = save(tmp_path, resumed, step=7, incremental=True)
    manifest = _manifest(directory)
    assert manifest["kind"] == "incremental" and manifest["parent"] == "step-00000006"
    assert manifest["tables"]["user"]["shards"][0]["changed_rows"] < len(trained.user)
    check = TwoTables(seed=4)
    load(tmp_path, check)
    assert_same_models(resumed, check)


def test_slot_added_since_the_parent_forces_a_full_save(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=0)
    emb(torch.arange(10))
    save(tmp_path, emb, step=0)
    emb.table.add_slot("acc", 1)
    assert _manifest(save(tmp_path, emb, step=1, incremental=True))["kind"] == "full"


def test_missing_parent_is_named(tmp_path):
    trained = trained_model()
    save(tmp_path, trained, step=1)
    train_step(trained, 6)
    save(tmp_path, trained, step=2, incremental=True)
    (tmp_path / "step-00000001" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="its parent checkpoint .*step-00000001 is missing"):
        load(tmp_path, TwoTables())


def test_a_save_between_forward_and_optimizer_step_is_not_lost(tmp_path):
    emb = dynemb.DynamicEmbedding(2, initializer="zeros", seed=0)
    opt = dynemb.optim.SGD([emb], lr=1.0)
    save(tmp_path, emb, step=0)
    emb(torch.tensor([1, 2])).sum().backward()  # forward ticks the clock ...
    save(tmp_path, emb, step=1, incremental=True)
    opt.step()  # ... and the update is stamped with that same clock
    save(tmp_path, emb, step=2, incremental=True)
    fresh = dynemb.DynamicEmbedding(2, initializer="zeros", seed=0)
    load(tmp_path, fresh)
    assert fresh.find(torch.tensor([1, 2])).tolist() == [[-1.0, -1.0], [-1.0, -1.0]]


def test_score_only_changes_reach_the_incremental_checkpoint(tmp_path):
    a = dynemb.DynamicEmbedding(2, seed=0, eviction="lfu", max_capacity=100)
    a(torch.arange(10))
    save(tmp_path, a, step=1)
    a(torch.tensor([5, 5, 7]))  # only scores change: no optimizer, no new keys
    save(tmp_path, a, step=2, incremental=True)
    b = dynemb.DynamicEmbedding(2, seed=0, eviction="lfu", max_capacity=100)
    load(tmp_path, b)
    ka, _, sa = a.export(with_scores=True)
    kb, _, sb = b.export(with_scores=True)
    assert torch.equal(ka, kb) and torch.equal(sa, sb)
