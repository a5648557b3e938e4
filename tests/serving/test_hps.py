"""HPS ps.json fields: renamed where they map onto ours, dropped with a warning where they mean nothing here."""

import json
import warnings
from pathlib import Path

import pytest
import torch

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.serving import ParameterServer, ServerConfig
from dynemb.serving import hps
from dynemb.serving.hps import translate


def hps_config(root, tmp_path):
    """An HPS ps.json as the HPS examples write it."""
    return {
        "supportlonglong": True,
        "models": [{
            "model": "demo", "sparse_files": [str(root)], "num_of_worker_buffer_in_pool": 3,
            "embedding_table_names": ["embedding"], "embedding_vecsize_per_table": [4],
            "maxnum_catfeature_query_per_table_per_sample": [10], "default_value_for_each_table": [1.0],
            "deployed_device_list": [0], "max_batch_size": 1024, "cache_refresh_percentage_per_iteration": 0.2,
            "hit_rate_threshold": 1.0, "gpucacheper": 0.5, "gpucache": True,
        }],
        "volatile_db": {"type": "hash_map", "num_partitions": 8, "overflow_margin": 1000},
        "persistent_db": {"type": "rocks_db", "path": str(tmp_path / "rocksdb"), "num_threads": 4},
    }


def test_an_hps_config_loads_and_serves(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=0)
    emb(torch.arange(10))
    export_for_serving(tmp_path / "export", emb)
    path = tmp_path / "ps.json"
    path.write_text(json.dumps(hps_config(tmp_path / "export", tmp_path)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ps = ParameterServer(path)
    ignored = sorted(str(w.message).split(" is ignored")[0] for w in caught)
    assert ignored == ["models[0].cache_refresh_percentage_per_iteration", "models[0].deployed_device_list",
                       "models[0].maxnum_catfeature_query_per_table_per_sample",
                       "models[0].num_of_worker_buffer_in_pool", "parameter server config.supportlonglong",
                       "persistent_db.num_threads", "volatile_db.num_partitions", "volatile_db.overflow_margin"]
    model = ps.config.models[0]
    assert (model.cache_fraction, model.max_batch_size, model.hit_rate_threshold) == (0.5, 1024, 1.0)
    assert ps.config.volatile_db == {"type": "memory"}
    assert ps.config.persistent_db == {"type": "rocksdb", "path": str(tmp_path / "rocksdb")}
    ps.load("demo", progress=False)
    assert torch.equal(ps.lookup("demo", "embedding", torch.tensor([3, 99])),
                       torch.cat([emb.find(torch.tensor([3])), torch.ones(1, 4)]))
    ps.close()


def test_store_types_and_their_fields_map_by_type():
    config = translate({"models": [], "volatile_db": {"type": "redis_cluster", "address": "10.0.0.1:7000",
                                                      "num_partitions": 4, "max_batch_size": 100},
                        "persistent_db": {"type": "disabled"}})
    assert config["volatile_db"] == {"type": "redis", "cluster": True, "address": "10.0.0.1:7000", "shards": 4,
                                     "chunk_size": 100}
    assert config["persistent_db"] is None
    ours = {"models": [{"model": "m", "cache_fraction": 0.3}], "volatile_db": {"type": "redis", "shards": 2}}
    assert translate(ours) == ours  # our own fields and type names pass through


def test_values_that_cannot_be_honoured_or_disagree_are_errors():
    with pytest.raises(ValueError, match=r"volatile_db.enable_tls=True cannot be honoured here: TLS is not"):
        translate({"models": [], "volatile_db": {"type": "redis", "enable_tls": True}})
    with pytest.raises(ValueError, match=r"models\[0\]: gpucacheper=0.5 \(HPS\) and cache_fraction=0.2 disagree"):
        translate({"models": [{"gpucacheper": 0.5, "cache_fraction": 0.2}]})
    with pytest.warns(UserWarning, match=r"models\[0\].gpucache is ignored: the cache cannot be turned off"):
        translate({"models": [{"gpucache": False}]})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['gpucacheperr'\]"):
        ServerConfig.load({"models": [{"model": "m", "sparse_files": ["x"], "embedding_table_names": ["t"],
                                       "embedding_vecsize_per_table": [4], "gpucacheperr": 0.5}]})
    with pytest.raises(ValueError, match=r"models\['m'\].cache_fraction must be a number, got '0.5'"):
        ServerConfig.load({"models": [{"model": "m", "sparse_files": ["x"], "embedding_table_names": ["t"],
                                       "embedding_vecsize_per_table": [4], "gpucacheper": "0.5"}]})


def test_every_hps_field_is_in_the_docs_table():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    table = doc[doc.index("## HPS fields"):]
    fields = [*hps.TOP_LEVEL, *hps.MODEL, *hps.VOLATILE_DB, *hps.PERSISTENT_DB, *hps.VOLATILE_TYPES,
              *hps.PERSISTENT_TYPES]
    assert [f for f in fields if f"`{f}`" not in table and f"`volatile_db.{f}`" not in table
            and f"`persistent_db.{f}`" not in table] == []


def test_sparse_files_as_one_path_is_one_export_root(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=0)
    emb(torch.arange(10))
    export_for_serving(tmp_path / "export", emb)
    config = hps_config(tmp_path / "export", tmp_path)
    config["models"][0]["sparse_files"] = str(tmp_path / "export")  # not in a list: len() counted its characters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ps = ParameterServer(config)
    ps.load("demo", progress=False)
    assert torch.equal(ps.lookup("demo", "embedding", torch.tensor([3])), emb.find(torch.tensor([3])))
    ps.close()
