"""The persistent stores (RocksDB, LMDB) on real database files: read-only mode, byte order, atomic writes."""

from __future__ import annotations

import lmdb
import pytest
import rocksdict
import torch

from dynemb.serving.stores import StoreError, StoreFullError, StoreReadOnlyError, make_store
from dynemb.serving.stores.row_bytes import decode_keys

KINDS = ["rocksdb", "lmdb"]


def raw_keys(kind: str, path: str) -> list:
    """Every key of the database in byte order, read with the backend's own client."""
    if kind == "rocksdb":
        with rocksdict.Rdict(path, rocksdict.Options(raw_mode=True)) as db:
            return list(db.keys())
    with lmdb.open(path, readonly=True) as env, env.begin() as txn:
        return [key for key, _ in txn.cursor()]


@pytest.mark.parametrize("kind", KINDS)
def test_read_only_refuses_writes_and_reads(store_config, kind):
    config = store_config(kind)
    with make_store(config) as store:
        store.create_table("t", dim=2)
        store.put("t", torch.tensor([4, -4]), torch.ones(2, 2))
    with make_store({**config, "read_only": True}) as reader:
        assert reader.get("t", torch.tensor([-4, 5]))[1].tolist() == [True, False]
        for write in (
            lambda: reader.put("t", torch.tensor([1]), torch.ones(1, 2)),
            lambda: reader.delete("t", torch.tensor([4])),
            lambda: reader.create_table("u", dim=2),
        ):
            with pytest.raises(StoreReadOnlyError, match="read-only") as info:
                write()
            assert isinstance(info.value, PermissionError)
        assert reader.size("t") == 2 and reader.tables() == ["t"]


@pytest.mark.parametrize("kind", KINDS)
def test_read_only_needs_an_existing_database(store_config, kind, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not an existing database"):
        make_store(store_config(kind, path=str(tmp_path / "missing"), read_only=True))


@pytest.mark.parametrize("kind", KINDS)
def test_byte_order_is_numeric_order_per_table(store_config, kind):
    config = store_config(kind)
    keys = torch.tensor([2**63 - 1, 0, -1, -(2**63), 5, -5, 2**40])
    with make_store(config) as store:
        store.create_table("a", dim=1)
        store.create_table("b", dim=1)
        store.put("a", keys, torch.zeros(len(keys), 1))
        store.put("b", torch.tensor([3]), torch.zeros(1, 1))
    rows = [key for key in raw_keys(kind, config["path"]) if not key.startswith(b"\x00")]
    assert [key[:2] for key in rows] == [b"a\x00"] * len(keys) + [b"b\x00"]
    assert decode_keys([key[2:] for key in rows[:-1]]).tolist() == sorted(keys.tolist())


def test_rocksdb_second_writer_is_refused(store_config):
    config = store_config("rocksdb")
    with make_store(config):
        with pytest.raises(StoreError, match="cannot open RocksDB at .*lock"):
            make_store(config)


def test_lmdb_map_full_writes_nothing(store_config):
    with make_store(store_config("lmdb", map_size=1 << 20)) as store:
        store.create_table("t", dim=64)
        store.put("t", torch.arange(100), torch.ones(100, 64))
        with pytest.raises(StoreFullError, match="reached map_size=1048576"):
            store.put("t", torch.arange(100, 5100), torch.ones(5000, 64))
        assert store.size("t") == 100
        assert not store.get("t", torch.tensor([100, 5099]))[1].any()
