"""make_store: config validation names the bad field and value."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from dynemb.serving.stores import LMDBStore, MemoryStore, RedisStore, RocksDBStore, make_store


@pytest.mark.parametrize(
    "config, error, message",
    [
        ([("type", "memory")], TypeError, "store config must be a dict"),
        ({}, ValueError, r"'type' must be one of \['lmdb', 'memory', 'redis', 'rocksdb'\], got None"),
        ({"type": "mongo"}, ValueError, "got 'mongo'"),
        ({"type": "memory", "max_rows": 3}, ValueError, r"unknown field\(s\) \['max_rows'\]; allowed fields are"),
        ({"type": "memory", "max_rows_per_table": 0}, ValueError, "max_rows_per_table must be None or an int >= 1"),
        ({"type": "memory", "overflow": "drop"}, ValueError, "overflow must be one of 'evict', 'refuse', got 'drop'"),
        ({"type": "memory", "eviction": "fifo"}, ValueError, "eviction must be 'lru' or 'lfu', got 'fifo'"),
        ({"type": "redis", "address": "localhost"}, ValueError, "address must be 'host:port'.*got 'localhost'"),
        ({"type": "redis", "address": "127.0.0.1:70000"}, ValueError, "port in 1..65535, got '127.0.0.1:70000'"),
        ({"type": "redis", "address": 6379}, TypeError, "address must be a 'host:port' str, got int"),
        ({"type": "redis", "cluster": "no"}, TypeError, "cluster must be a bool, got 'no'"),
        ({"type": "redis", "password": 123}, TypeError, "password must be a str or None, got int"),
        ({"type": "redis", "shards": 20000}, ValueError, "shards must be <= 16384"),
        ({"type": "redis", "timeout_s": 0}, ValueError, "timeout_s must be a number > 0, got 0"),
        ({"type": "redis", "chunk_size": -1}, ValueError, "chunk_size must be an int >= 1, got -1"),
        ({"type": "rocksdb"}, ValueError, r"store config \(type 'rocksdb'\): missing required field\(s\) \['path'\]"),
        ({"type": "lmdb", "path": ""}, TypeError, "path must be a non-empty str"),
        ({"type": "lmdb", "path": "/x", "read_only": "yes"}, TypeError, "read_only must be a bool, got 'yes'"),
        ({"type": "lmdb", "path": "/x", "map_size": 10}, ValueError, "map_size must be an int >= 1048576, got 10"),
    ],
)
def test_validation_errors_name_field_and_value(config, error, message):
    with pytest.raises(error, match=message):
        make_store(config)


def test_name_appears_in_errors():
    with pytest.raises(ValueError, match=r"volatile_db \(type 'memory'\): unknown field\(s\) \['adress'\]"):
        make_store({"type": "memory", "adress": "x"}, name="volatile_db")


def test_builds_each_type(store_config):
    expected = {"memory": MemoryStore, "redis": RedisStore, "rocksdb": RocksDBStore, "lmdb": LMDBStore}
    for kind, store_type in expected.items():
        with make_store(store_config(kind, **({"cluster": False, "password": None} if kind == "redis" else {}))) as s:
            assert type(s) is store_type


@pytest.mark.slow
def test_serving_and_the_cli_load_without_the_store_bindings(tmp_path):
    """A training job (or a memory-only server) needs none of redis, rocksdict or lmdb: importing ``dynemb.serving``
    and building the CLI must not import them, and naming a store whose package is missing says what to install
    (the CLI in one line, exit status 2). Run in a fresh interpreter where those imports fail."""
    script = textwrap.dedent("""
        import sys
        for name in ("redis", "rocksdict", "lmdb"):
            sys.modules[name] = None  # import fails as if not installed
        import torch
        import dynemb
        import dynemb.serving
        from dynemb.checkpoint import export_for_serving
        from dynemb.cli import build_parser, main
        from dynemb.serving import stores
        build_parser()
        print(type(stores.make_store({"type": "memory"})).__name__)
        for config in ({"type": "lmdb", "path": "x"}, {"type": "rocksdb", "path": "x"}, {"type": "redis"}):
            try:
                stores.make_store(config)
            except ImportError as error:
                print(error)
        try:
            stores.RedisStoreConfig
        except ImportError as error:
            print(error)
        emb = dynemb.DynamicEmbedding(4, seed=0)
        emb(torch.arange(50))
        export_for_serving(sys.argv[1], emb)
        print(main(["serve-bench", "--export", sys.argv[1], "--batches", "2", "--persistent", "lmdb"]))
    """)
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "export")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "MemoryStore" and lines[-1] == "2"
    for line, package in zip(lines[1:], ["lmdb", "rocksdict", "redis", "redis"]):
        assert f"needs the Python package {package!r}" in line and "pip install 'dynemb[serving]'" in line, line
    assert len(lines) == 6
    assert out.stderr.strip().splitlines()[-1].startswith(
        "dynemb serve-bench: error: store type 'lmdb' needs the Python package 'lmdb'"), out.stderr


def test_lazy_store_names_resolve_list_and_unknown_names_raise():
    from dynemb.serving import stores

    assert stores.LMDBStore is LMDBStore and stores.RocksDBStoreConfig.__name__ == "RocksDBStoreConfig"
    assert {"RedisStore", "RedisStoreConfig", "LMDBStore", "RocksDBStore", "MemoryStore"} <= set(dir(stores))
    with pytest.raises(AttributeError, match="has no attribute 'MongoStore'"):
        _ = stores.MongoStore
