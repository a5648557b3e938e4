"""Files written by earlier formats still load: before dynemb.serialization (format version 2: dtypes as
``str(dtype)``, initializers and optimizer state named by class), checkpoints, incremental saves on top of them,
serving exports and the parameter server's default rows, and state dicts; before xxh3-128 checksums (versions 2 and
3: file records ``{"sha256", "bytes"}``), checkpoints and exports, their sha256 checked."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import CheckpointError, export_for_serving, load, read_export, save
from dynemb.checkpoint.export_format import manifest_digest, read_attached, read_dense
from dynemb.serving import ParameterServer
from dynemb.table import FrequencyAdmission, Normal

_CLASS_NAMES = {"uniform": "Uniform", "normal": "Normal", "truncated_normal": "TruncatedNormal",
                "constant": "Constant", "adagrad": "Adagrad", "adam": "Adam", "sgd": "SGD"}


def _as_version_2(config: dict) -> dict:
    """A table config as format version 2 wrote it."""
    old = {**config, "dtype": f"torch.{config['dtype']}", "key_dtype": f"torch.{config['key_dtype']}",
           "initializer": {**config["initializer"], "type": _CLASS_NAMES[config["initializer"]["type"]]}}
    if "slots" in config:
        old["slots"] = {n: {**s, "dtype": f"torch.{s['dtype']}"} for n, s in config["slots"].items()}
    return old


def _collection(seed: int) -> EmbeddingCollection:
    tables = [TableConfig(name="user", dim=4, optimizer=dynemb.optim.Adagrad(lr=0.1), max_capacity=64, seed=seed,
                          initializer=Normal(std=0.1), admission=FrequencyAdmission(2)),
              TableConfig(name="item", dim=4, key_dtype=torch.int32, dtype=torch.bfloat16, seed=seed + 1,
                          optimizer=dynemb.optim.Adam(lr=0.05))]
    return EmbeddingCollection(tables, [FeatureConfig(name=t.name, table=t.name) for t in tables])


def _step(ec: EmbeddingCollection, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    batch = {"user": torch.randint(-20, 20, (8, 3), generator=g),
             "item": torch.randint(-9, 9, (8, 2), generator=g, dtype=torch.int32)}
    sum(out.float().square().sum() for out in ec(batch).values()).backward()
    ec.optimizer.step()
    ec.optimizer.zero_grad()


def test_a_version_2_checkpoint_loads_and_incremental_saves_chain_on_it(tmp_path, caplog):
    trained = _collection(seed=0)
    for i in range(4):
        _step(trained, i)
    directory = save(tmp_path, trained, step=4)
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 2
    for entry in manifest["tables"].values():
        entry["config"] = _as_version_2(entry["config"])
        for shard in entry["shards"]:
            shard["optimizer"]["type"] = _CLASS_NAMES[shard["optimizer"]["type"]]
    path.write_text(json.dumps(manifest))
    assert manifest["tables"]["user"]["config"]["initializer"]["type"] == "Normal"  # the old shape

    resumed = _collection(seed=7)
    with caplog.at_level(logging.WARNING, logger="dynemb"):
        load(tmp_path, resumed)
    assert not [r for r in caplog.records if "initializer" in r.getMessage()]  # the same initializer, read
    for name in ("user", "item"):
        a, b = trained.embeddings[name].table.export(), resumed.embeddings[name].table.export()
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert all(torch.equal(a.slots[s], b.slots[s]) for s in a.slots)
    assert trained.optimizer.state_dict() == resumed.optimizer.state_dict()

    _step(resumed, 4)
    delta = save(tmp_path, resumed, step=5, incremental=True)  # the old parent's configs equal the model's
    assert json.loads((delta / "manifest.json").read_text())["kind"] == "incremental"


def test_a_version_2_serving_export_serves_its_initializer_rows(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=3, initializer=Normal(mean=0.5, std=0.1))
    emb(torch.arange(10))
    version = export_for_serving(tmp_path, emb, dtype=torch.float16)
    path = version / "manifest.json"
    manifest = json.loads(path.read_text())
    entry = manifest["tables"]["embedding"]
    entry.update(dtype="torch.float16", key_dtype="torch.int64", initializer={**entry["initializer"], "type": "Normal"})
    manifest["format_version"] = 2
    manifest["digest"] = manifest_digest(manifest)  # as the old writer computed it, over what it wrote
    path.write_text(json.dumps(manifest))

    config = {"models": [{"model": "m", "sparse_files": [str(tmp_path)], "embedding_table_names": ["embedding"],
                          "embedding_vecsize_per_table": [4]}]}
    ps = ParameterServer.from_config(config)
    ps.load("m", progress=False)
    try:
        unseen = torch.tensor([99, -5])
        assert torch.equal(ps.lookup("m", "embedding", unseen), emb.eval()(unseen).half())
        assert torch.equal(ps.lookup("m", "embedding", torch.arange(3)), emb.find(torch.arange(3)).half())
    finally:
        ps.close()


def test_a_state_dict_with_str_dtypes_loads():
    emb = dynemb.DynamicEmbedding(4, seed=0, dtype=torch.float16)
    emb(torch.arange(5))
    state = emb.state_dict()
    config = state["_extra_state"]["config"]
    assert (config["dtype"], config["key_dtype"], config["initializer"]["type"]) == ("float16", "int64", "uniform")
    state["_extra_state"]["config"] = {**config, "dtype": "torch.float16", "key_dtype": "torch.int64"}
    fresh = dynemb.DynamicEmbedding(4, seed=1, dtype=torch.float16)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.find(torch.arange(5)), emb.find(torch.arange(5)))


def _as_sha256_records(directory) -> dict:
    """Rewrite the manifest in ``directory`` as format version 3 wrote it: every file record ``{"sha256", "bytes"}``
    (an export's table entries and shards naming ``sha256`` too) and, for an export, its digest over that form."""
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 3
    manifest["files"] = {rel: {"sha256": hashlib.sha256((directory / rel).read_bytes()).hexdigest(),
                               "bytes": record["bytes"]} for rel, record in manifest["files"].items()}
    if manifest["format"] == "dynemb.serving":
        for entry in manifest["tables"].values():
            for part in [entry, *entry["shards"]]:
                if "file" in part:
                    del part["algorithm"], part["checksum"]
                    part["sha256"] = manifest["files"][part["file"]]["sha256"]
        manifest["digest"] = manifest_digest(manifest)  # as the old writer computed it, over what it wrote
    path.write_text(json.dumps(manifest))
    return manifest


def _damage(file) -> None:
    data = bytearray(file.read_bytes())
    data[-3] ^= 1
    file.write_bytes(bytes(data))


def test_a_checkpoint_with_sha256_file_records_loads_and_a_damaged_file_is_caught(tmp_path):
    """Checkpoints written before xxh3-128 (sha256 records) load, with sha256 checked, and chain new deltas."""
    trained = _collection(seed=0)
    for i in range(3):
        _step(trained, i)
    directory = save(tmp_path, trained, trained.optimizer, step=3)
    manifest = _as_sha256_records(directory)
    assert all(set(r) == {"sha256", "bytes"} for r in manifest["files"].values())

    resumed = _collection(seed=7)
    load(tmp_path, resumed, resumed.optimizer)
    for name in ("user", "item"):
        a, b = trained.embeddings[name].table.export(), resumed.embeddings[name].table.export()
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert trained.optimizer.state_dict() == resumed.optimizer.state_dict()

    _step(resumed, 3)
    delta = save(tmp_path, resumed, resumed.optimizer, step=4, incremental=True)  # a new delta on the old base
    records = json.loads((delta / "manifest.json").read_text())["files"].values()
    assert {r["algorithm"] for r in records} == {"xxh3-128"}
    again = _collection(seed=9)
    load(tmp_path, again, again.optimizer)  # the old full checkpoint, then the new delta
    user = resumed.embeddings["user"].table.export()
    assert torch.equal(again.embeddings["user"].table.export().values, user.values)

    _damage(directory / manifest["tables"]["user"]["shards"][0]["file"])
    with pytest.raises(CheckpointError, match="sha256 checksum mismatch"):
        load(directory, _collection(seed=1))


def test_a_serving_export_with_sha256_records_is_read_served_and_followed(tmp_path):
    """An export written before xxh3-128 (sha256 records, its digest over them) is read with its dense part and
    attached files, served, and a delta exported after it names its digest as its parent's."""
    emb = dynemb.DynamicEmbedding(4, seed=3)
    emb(torch.arange(10))
    version = export_for_serving(tmp_path, emb, dense=True, attach={"files": {"extra.bin": b"abc"}, "fields": {}})
    manifest = _as_sha256_records(version)
    assert set(manifest["files"]["extra.bin"]) == {"sha256", "bytes"} and "sha256" in manifest["tables"]["embedding"]

    got, tables = read_export(version)
    assert got["digest"] == manifest["digest"]
    assert sorted(tables["embedding"]["keys"].tolist()) == list(range(10))
    assert read_dense(version) is not None and read_attached(version, "extra.bin")[1] == b"abc"
    config = {"models": [{"model": "m", "sparse_files": [str(tmp_path)], "embedding_table_names": ["embedding"],
                          "embedding_vecsize_per_table": [4]}]}
    ps = ParameterServer.from_config(config)
    ps.load("m", progress=False)
    try:
        assert torch.equal(ps.lookup("m", "embedding", torch.arange(3)), emb.find(torch.arange(3)))
    finally:
        ps.close()

    emb(torch.arange(10, 12))
    delta, _ = read_export(export_for_serving(tmp_path, emb, incremental=True))
    assert delta["kind"] == "delta" and delta["parent_digest"] == manifest["digest"]
    assert {r["algorithm"] for r in delta["files"].values()} == {"xxh3-128"}

    _damage(version / "extra.bin")
    with pytest.raises(CheckpointError, match="extra.bin: sha256 checksum mismatch"):
        read_attached(version, "extra.bin")
