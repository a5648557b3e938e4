"""The Redis store against a real redis-server: key layout, bounded memory, failures and recovery."""

from __future__ import annotations

import time

import pytest
import torch
from redis.cluster import key_slot

from dynemb.serving.stores import (
    RedisStore,
    RedisStoreConfig,
    StoreCorruptError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    make_store,
)
from dynemb.serving.stores.redis import SCHEMA_KEY

from redis_process import RedisServer, free_port


def redis_store(address: str, **fields) -> RedisStore:
    store = RedisStore(RedisStoreConfig(address=address, **fields))
    store.create_table("t", dim=4)
    return store


def test_unreachable_at_construction_names_the_address():
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(StoreUnavailableError, match=f"cannot reach Redis at {address}") as info:
        make_store({"type": "redis", "address": address, "timeout_s": 0.5})
    assert isinstance(info.value, ConnectionError)
    assert time.monotonic() - start < 3


def test_key_layout_is_cluster_safe_and_binary(redis_server, redis_address):
    store = redis_store(redis_address, shards=12)
    keys = torch.tensor([-(2**63), -1, 0, 2**63 - 1])
    values = torch.randn(4, 4)
    store.put("t", keys, values)
    client = redis_server.client()
    names = [name for name in client.keys("{t:*") if not name.endswith(b"#z")]
    assert len(names) == 4 and all(len(name) == len(b"{t:00}") + 8 for name in names)
    for name in names:  # a row and its shard's index share one hash slot
        assert key_slot(name) == key_slot(name[: name.index(b"}") + 1] + b"#z")
    row = values[keys.tolist().index(0)].numpy().tobytes()
    assert client.get(next(n for n in names if n.endswith(b"\x80" + bytes(7)))) == row
    assert len({name[:6] for name in names}) > 1  # keys spread over shards


def test_reopen_keeps_the_stored_shard_count(redis_address):
    first = redis_store(redis_address, shards=3)
    first.put("t", torch.arange(50), torch.ones(50, 4))
    second = redis_store(redis_address, shards=7)
    assert second.get("t", torch.arange(50))[1].all()
    assert second.size("t") == 50


def test_evict_drops_oldest_writes(redis_address):
    store = redis_store(redis_address, max_rows_per_table=100, shards=4)
    store.put("t", torch.arange(100), torch.ones(100, 4))
    time.sleep(0.002)
    store.put("t", torch.arange(1000, 1040), torch.ones(40, 4))
    assert store.size("t") == 100
    assert store.get("t", torch.arange(1000, 1040))[1].all()
    assert int(store.get("t", torch.arange(100))[1].sum()) == 60


def test_refuse_raises_and_writes_nothing(redis_address):
    store = redis_store(redis_address, max_rows_per_table=10, overflow="refuse")
    store.put("t", torch.arange(8), torch.ones(8, 4))
    with pytest.raises(StoreFullError, match="holds 8 rows; 3 new would exceed max_rows_per_table=10"):
        store.put("t", torch.arange(5, 11), torch.zeros(6, 4))
    assert store.size("t") == 8 and not store.get("t", torch.tensor([8, 9, 10]))[1].any()
    assert store.get("t", torch.tensor([5]))[0].tolist() == [[1.0] * 4]


def test_killed_server_raises_typed_error_then_recovers(redis_server, redis_address):
    store = redis_store(redis_address, timeout_s=0.5)
    store.put("t", torch.tensor([1]), torch.ones(1, 4))
    redis_server.kill()
    calls = (lambda: store.get("t", torch.tensor([1])), lambda: store.put("t", torch.tensor([2]), torch.ones(1, 4)))
    for call in calls:
        with pytest.raises(StoreUnavailableError, match=f"Redis at {redis_address} is unavailable"):
            call()
    redis_server.start()
    assert not store.get("t", torch.tensor([1]))[1].any()  # a restart without persistence loses the rows
    store.put("t", torch.tensor([2]), torch.ones(1, 4))
    assert store.get("t", torch.tensor([2]))[1].all()
    assert RedisStore(RedisStoreConfig(address=redis_address)).tables() == ["t"]  # the table was re-registered


def test_frozen_server_times_out(redis_server, redis_address):
    store = redis_store(redis_address, timeout_s=0.3)
    redis_server.pause()
    start = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError):
            store.get("t", torch.arange(10))
    finally:
        redis_server.resume()
    assert time.monotonic() - start < 2


def test_corrupt_row_names_the_key(redis_server, redis_address):
    store = redis_store(redis_address, shards=1)
    redis_server.client().set(b"{t:0}" + (2**63 + 5).to_bytes(8, "big"), b"short")
    with pytest.raises(StoreCorruptError, match="stored row for key 5 has 5 bytes"):
        store.get("t", torch.tensor([4, 5]))


def test_other_redis_errors_are_store_errors(redis_server, redis_address):
    store = redis_store(redis_address, shards=1)
    redis_server.client().set(b"{t:0}#z", b"not a sorted set")
    with pytest.raises(StoreError, match="WRONGTYPE"):
        store.size("t")


def test_password(tmp_path):
    server = RedisServer(str(tmp_path), password="s3cret")
    server.start()
    try:
        with pytest.raises(StoreUnavailableError, match=f"Redis at {server.address}"):
            RedisStore(RedisStoreConfig(address=server.address))
        with pytest.raises(StoreUnavailableError, match="rejected the password"):
            RedisStore(RedisStoreConfig(address=server.address, password="wrong"))
        store = redis_store(server.address, password="s3cret")
        store.put("t", torch.tensor([3]), torch.ones(1, 4))
        assert store.get("t", torch.tensor([3]))[1].all()
        assert store.get_concat(["t"], torch.tensor([3, 4]), [2])[1].tolist() == [True, False]  # a reader connection
        assert server.client().hexists(SCHEMA_KEY, "t")
    finally:
        server.kill()


def test_get_concat_sends_redis_py_s_bytes_and_answers_as_get_many(redis_server, redis_address):
    # the MGET commands written by pack_mget are byte for byte what redis-py packs for the same names (prefixes of
    # several lengths, 10 shards: a hash mod a non-power of two, negative hashes among them; chunks of 3 names),
    # and get_concat answers as get_many; after a server restart it answers too (the pooled connection is
    # replaced)
    from dynemb.kernels.numba_find_many import pack_mget

    store = RedisStore(RedisStoreConfig(address=redis_address, shards=10, chunk_size=3))
    names = ["a", "bb", "a-much-longer-table-name"]
    keys_of = {}
    for k, name in enumerate(names):
        store.create_table(name, dim=3)
        keys_of[name] = torch.cat([torch.tensor([0, -1, 2**63 - 1, -(2**63)]), torch.arange(50) * (k + 7) - 100])
        store.put(name, keys_of[name], torch.randn(len(keys_of[name]), 3, generator=torch.Generator().manual_seed(k)))
    g = torch.Generator().manual_seed(1)
    for sizes in ([5, 0, 7], [1, 1, 1], [0, 0, 2], [20, 13, 30]):
        keys = torch.cat([torch.cat([keys_of[name], torch.tensor([5, -5, 2**40])])[
            torch.randint(0, 57, (n,), generator=g)] for name, n in zip(names, sizes)])
        table_of = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
        packed, commands = pack_mget(keys, table_of, *store._packing(tuple(names))[:4], 3)
        wire = store._names(tuple(names), keys, sizes)
        conn = store._client.connection_pool.get_connection()
        try:
            want = b"".join(b"".join(conn.pack_command("MGET", *wire[lo:lo + 3])) for lo in range(0, len(wire), 3))
        finally:
            store._client.connection_pool.release(conn)
        assert packed == want and commands == -(-len(wire) // 3)
        values, found = store.get_concat(names, keys, sizes)
        many = store.get_many({name: run for name, run in zip(names, keys.split(sizes))})
        assert torch.equal(found, torch.cat([many[name][1] for name in names]))
        assert torch.equal(values, torch.cat([many[name][0] for name in names]))
    redis_server.restart()
    assert not store.get_concat(names, keys, sizes)[1].any()  # a restart without persistence loses the rows
    store.close()


def test_get_concat_into_writes_the_rows_found_and_leaves_the_others(redis_server, redis_address):
    # the fused path's read: MGET replies (nulls among them, several commands of 3 names) parsed into the caller's
    # rows by numba; the same rows and found flags as get_many, bit for bit, for 0, 1 and many keys of tables in
    # any order, float32 and float16 rows (the 16-bit words 8-bit rows are stored as); rows of keys Redis lacks
    # stay as they were
    import numpy as np

    store = RedisStore(RedisStoreConfig(address=redis_address, shards=4, chunk_size=3))
    g = torch.Generator().manual_seed(5)
    for names, dtype in ((("a", "bb"), torch.float32), (("h",), torch.float16)):
        for name in names:
            store.create_table(name, dim=5, dtype=dtype)
            store.put(name, torch.arange(40) - 20, torch.randn(40, 5, generator=g).to(dtype))
        for n in (0, 1, 1, 2, 17, 60):
            keys = torch.randint(-30, 30, (n,), generator=g)
            keys[::7] = torch.tensor([2**63 - 1, -(2**63)])[torch.randint(0, 2, keys[::7].shape, generator=g)]
            table_of = torch.randint(0, len(names), (n,), generator=g)
            out = np.full((n, 5), 7.0, dtype=np.float32 if dtype == torch.float32 else np.float16)
            found = store.get_concat_into(names, keys.numpy(), table_of.numpy(), out)
            want_values, want_found = torch.zeros(n, 5, dtype=dtype), torch.zeros(n, dtype=torch.bool)
            for t, name in enumerate(names):
                at = (table_of == t).nonzero().squeeze(1)
                want_values[at], want_found[at] = store.get(name, keys[at])
            assert torch.equal(torch.from_numpy(found), want_found) and found.dtype == np.bool_
            assert torch.equal(torch.from_numpy(out)[want_found], want_values[want_found])
            assert bool((out[~found] == 7.0).all()) and (n < 17 or 0 < found.sum() < n)
            order = torch.argsort(table_of, stable=True)  # get_concat: the keys of each table one after the other
            sizes = torch.bincount(table_of, minlength=len(names)).tolist()
            values, found_concat = store.get_concat(names, keys[order], sizes)
            assert torch.equal(found_concat, want_found[order]) and torch.equal(values, want_values[order])
    keys, table_of = np.arange(3, dtype=np.int64), np.zeros(3, np.int64)
    for bad, match in (((("a", "h"), keys, table_of, np.zeros((3, 5), np.float32)), "share one schema"),
                       ((("a",), keys.astype(np.int32), table_of, np.zeros((3, 5), np.float32)), "1-D int64"),
                       ((("a",), keys, table_of + 1, np.zeros((3, 5), np.float32)), r"index the 1 tables"),
                       ((("a",), keys, table_of, np.zeros((3, 4), np.float32)), r"\[3, 5\] numpy array"),
                       ((("a",), keys, table_of[:2], np.zeros((3, 5), np.float32)), r"\[3\] int64")):
        with pytest.raises(ValueError, match=match):
            store.get_concat_into(*bad)
    store.close()


def test_the_reply_parser_takes_replies_split_anywhere_and_names_what_is_wrong():
    # read_mget_reply resumes where the bytes stopped (a row split over two reads), reads RESP2 and RESP3 nulls,
    # and reports an error reply, a row of another length (its key's position) and bytes that are no MGET reply
    import numpy as np

    from dynemb.kernels.numba_find_many import (MGET_BAD_LENGTH, MGET_BAD_REPLY, MGET_DONE, MGET_ERROR_REPLY,
                                                MGET_RUNNING, mget_reply_state, read_mget_reply)

    reply = b"*3\r\n$4\r\nabcd\r\n$-1\r\n_\r\n*1\r\n$4\r\n\r\n\r\n\r\n"  # the last row: 4 bytes of CRLFs
    for step in (1, 2, 5, len(reply)):
        buf = np.frombuffer(reply, np.uint8)
        out, found, state = np.full((4, 4), 9, np.uint8), np.zeros(4, np.bool_), mget_reply_state(2)
        for end in list(range(step, len(reply), step)) + [len(reply)]:
            status = read_mget_reply(buf, end, state, out, found, False)
            assert status == (MGET_DONE if end == len(reply) else MGET_RUNNING)
        assert found.tolist() == [True, False, False, True]
        assert bytes(out[0]) == b"abcd" and bytes(out[3]) == b"\r\n\r\n" and bool((out[1:3] == 9).all())
    zeroed = np.full((3, 4), 9, np.uint8)
    assert read_mget_reply(np.frombuffer(reply, np.uint8), len(reply), mget_reply_state(1), zeroed,
                           np.zeros(3, np.bool_), True) == MGET_DONE and bool((zeroed[1:] == 0).all())
    for wrong, status, at in ((b"-NOPERM no\r\n", MGET_ERROR_REPLY, 0), (b"*1\r\n$5\r\nabcde\r\n", MGET_BAD_LENGTH, 0),
                              (b"*2\r\n$-1\r\n$3\r\nabc\r\n", MGET_BAD_LENGTH, 1), (b"+OK\r\n", MGET_BAD_REPLY, 0),
                              (b"*1\r\n$4\r\nabcdXY", MGET_BAD_REPLY, 0), (b"*9\r\n", MGET_BAD_REPLY, 0),
                              (b"*1\r\n:4\r\n", MGET_BAD_REPLY, 0)):
        state = mget_reply_state(1)
        assert read_mget_reply(np.frombuffer(wrong, np.uint8), len(wrong), state, np.zeros((4, 4), np.uint8),
                               np.zeros(4, np.bool_), False) == status
        if status == MGET_BAD_LENGTH:
            assert state[1] == at and state[5] in (5, 3)


def test_get_concat_names_a_corrupt_row_and_fails_as_redis_fails(redis_server, redis_address):
    # the numba reply parser's failures: a row of another length names its key; an error reply (an ACL that
    # refuses MGET) is a StoreError and the connection serves again once MGET is allowed; a frozen server times out
    import numpy as np

    store = redis_store(redis_address, shards=1, timeout_s=0.3)
    client = redis_server.client()
    client.set(b"{t:0}" + (2**63 + 5).to_bytes(8, "big"), b"short")
    keys = torch.tensor([4, 5, 6])
    into = (("t",), keys.numpy(), np.zeros(3, np.int64), np.zeros((3, 4), np.float32))
    for call in (lambda: store.get_concat(["t"], keys, [3]), lambda: store.get_concat_into(*into)):
        with pytest.raises(StoreCorruptError, match="stored row for key 5 has 5 bytes"):
            call()
    client.delete(b"{t:0}" + (2**63 + 5).to_bytes(8, "big"))
    store.put("t", torch.tensor([6]), torch.ones(1, 4))
    client.execute_command("ACL", "SETUSER", "default", "-mget")
    try:
        with pytest.raises(StoreError, match="NOPERM"):
            store.get_concat(["t"], keys, [3])
    finally:
        client.execute_command("ACL", "SETUSER", "default", "+mget")
    assert store.get_concat(["t"], keys, [3])[1].tolist() == [False, False, True]
    redis_server.pause()
    start = time.monotonic()
    try:
        with pytest.raises(StoreUnavailableError):
            store.get_concat(["t"], keys, [3])
    finally:
        redis_server.resume()
    assert time.monotonic() - start < 2
    assert store.get_concat(["t"], keys, [3])[1].tolist() == [False, False, True]
    store.close()


def test_reader_connections_serve_threads_at_once_and_close_with_the_store(redis_address):
    # get_concat from 4 threads at once: each read takes a reader connection of its own (a free one, else a new one),
    # each answer is its own keys' rows; close() disconnects the free ones
    from concurrent.futures import ThreadPoolExecutor

    store = RedisStore(RedisStoreConfig(address=redis_address, chunk_size=7))
    store.create_table("t", dim=4)
    store.put("t", torch.arange(500), torch.arange(2000, dtype=torch.float32).view(500, 4))

    def read(k: int) -> bool:
        keys = torch.arange(k, k + 40) * 3
        values, found = store.get_concat(["t"], keys, [40])
        return torch.equal(found, keys < 500) and torch.equal(values[found][:, 0], 4.0 * keys[found])

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(read, range(200)))
    readers = list(store._readers)
    assert 1 <= len(readers) <= 4 and all(conn._sock is not None for conn in readers)
    store.close()
    assert all(conn._sock is None for conn in readers)


def test_the_reply_parser_refuses_replies_with_fewer_rows_than_keys_asked():
    # every key asked gets its row or its null: a reply that answers fewer (an empty array, a short one) is no MGET
    # reply (get_concat's found and rows start uninitialized: they would have been returned as they were)
    import numpy as np

    from dynemb.kernels.numba_find_many import MGET_BAD_REPLY, mget_reply_state, read_mget_reply

    for short, commands in ((b"*0\r\n", 1), (b"*1\r\n$-1\r\n", 1), (b"*1\r\n$-1\r\n*0\r\n", 2)):
        found = np.zeros(2, np.bool_)
        assert read_mget_reply(np.frombuffer(short, np.uint8), len(short), mget_reply_state(commands),
                               np.zeros((2, 4), np.uint8), found, True) == MGET_BAD_REPLY
