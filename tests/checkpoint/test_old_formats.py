"""Files written before dynemb.serialization (format version 2: dtypes as ``str(dtype)``, initializers and optimizer
state named by class) still load: checkpoints, incremental saves on top of them, serving exports and the parameter
server's default rows, and state dicts."""

from __future__ import annotations

import json
import logging

import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import export_for_serving, load, save
from dynemb.checkpoint.export_format import manifest_digest
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
