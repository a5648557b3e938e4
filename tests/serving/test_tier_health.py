"""A Redis tier that fails, loses its rows or is shared: lookups answer the export's rows or fail, never defaults in
their place; readiness, the warnings and the markers (docs/serving.md "Robustness"), against a real redis-server."""

import logging
import time

import pytest
import torch

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.serving import ParameterServer
from dynemb.serving.ps import TierUnavailableError

D = 8
KEYS = torch.arange(1000, 1400, dtype=torch.int64)
PATHS = [(True, True), (True, False), (False, False)]  # (grouped, fused): the fused, grouped and per-table paths


def trained(seed=0):
    emb = dynemb.DynamicEmbedding(D, seed=seed, initializer="uniform")
    emb(KEYS)
    emb.insert_or_assign(KEYS, torch.randn(len(KEYS), D, generator=torch.Generator().manual_seed(seed)))
    return emb.eval()


def server(root, redis_address, persistent=None, name="ctr", path=(True, True)):
    model = {"model": name, "sparse_files": [str(root)], "embedding_table_names": ["embedding"],
             "embedding_vecsize_per_table": [D], "default_value_for_each_table": ["initializer"]}
    config = {"models": [model], "volatile_db": {"type": "redis", "address": redis_address, "timeout_s": 0.5},
              "persistent_db": persistent}
    ps = ParameterServer.from_config(config)
    ps.grouped, ps.fused = path
    ps.load(name, progress=False)
    return ps


def wait_until(predicate, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def make_redis_evict(client) -> None:
    """Turn eviction on in a running Redis (``allkeys-random``, ``maxmemory`` 2 MiB over what it holds) and push it
    over: another user's keys make it evict, ours among them."""
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "allkeys-random")
    client.config_set("maxmemory", used + (2 << 20))
    for k in range(200):
        client.set(f"other:{k}", b"x" * 65536)
    assert int(client.info("stats")["evicted_keys"]) > 0


@pytest.fixture
def exported(tmp_path):
    emb = trained()
    export_for_serving(tmp_path / "export", emb)
    return emb, tmp_path / "export"


@pytest.mark.parametrize("path", PATHS)
def test_flushed_redis_fails_the_lookup_then_its_rows_come_back(exported, redis_server, redis_address, path, caplog):
    emb, root = exported
    ps = server(root, redis_address, path=path)
    try:
        assert torch.equal(ps.lookup("ctr", "embedding", KEYS[:100]), emb.find(KEYS[:100]))
        assert ps.ready() == (True, "")
        with caplog.at_level(logging.WARNING, logger="dynemb.serving.ps.tiers"):
            redis_server.client().flushall()
            for _ in range(3):  # rows the cache lacks: an error naming the store, not initializer rows
                with pytest.raises(TierUnavailableError, match=redis_address):
                    ps.lookup("ctr", "embedding", KEYS[100:200])
            assert not ps.ready()[0] and "lost the rows" in ps.ready()[1]
            assert torch.equal(ps.lookup("ctr", "embedding", KEYS[:100]), emb.find(KEYS[:100]))  # cached: answered
            wait_until(lambda: ps.ready()[0])  # the monitor wrote the rows and the marker again
            assert torch.equal(ps.lookup("ctr", "embedding", KEYS[100:300]), emb.find(KEYS[100:300]))
        failed = [r for r in caplog.records if "failed" in r.getMessage()]
        back = [r for r in caplog.records if r.getMessage().endswith("is back")]
        assert len(failed) == 1 and len(back) == 1  # once per change of state, not per request
        assert ps.stats("ctr")["tiers"]["volatile"]["up"] and ps.stats("ctr")["errors"]["volatile"] >= 1
    finally:
        ps.close()


def test_redis_gone_fails_until_it_is_back_with_its_rows(exported, redis_server, redis_address):
    emb, root = exported
    ps = server(root, redis_address)
    try:
        redis_server.kill()
        start = time.monotonic()
        with pytest.raises(TierUnavailableError, match=f"volatile tier.*{redis_address}"):
            ps.lookup("ctr", "embedding", KEYS[:50])
        with pytest.raises(TierUnavailableError):  # skipped while failed: no timeout a request
            ps.lookup("ctr", "embedding", KEYS[50:100])
        assert time.monotonic() - start < 3
        assert not ps.ready()[0]
        redis_server.start()  # empty: the marker is gone too, so the rows are written again first
        wait_until(lambda: ps.ready()[0])
        assert torch.equal(ps.lookup("ctr", "embedding", KEYS), emb.find(KEYS))
        assert ps.stats("ctr")["tables"]["embedding"]["default"] == 0
    finally:
        ps.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_complete_persistent_tier_answers_while_redis_is_gone(exported, redis_server, redis_address, tmp_path,
                                                                path):
    emb, root = exported
    ps = server(root, redis_address, persistent={"type": "lmdb", "path": str(tmp_path / "lmdb")}, path=path)
    try:
        redis_server.client().flushall()
        assert torch.equal(ps.lookup("ctr", "embedding", KEYS[:200]), emb.find(KEYS[:200]))  # from LMDB
        redis_server.kill()
        assert torch.equal(ps.lookup("ctr", "embedding", KEYS[200:]), emb.find(KEYS[200:]))
        assert ps.ready()[0] and not ps.stats("ctr")["tiers"]["volatile"]["up"]
        redis_server.start()
        wait_until(lambda: ps.stats("ctr")["tiers"]["volatile"]["up"])  # only the marker is written again
    finally:
        ps.close()


def test_two_runs_under_one_name_keep_their_own_rows(tmp_path, redis_address):
    a, b = trained(0), trained(1)
    export_for_serving(tmp_path / "a", a)
    export_for_serving(tmp_path / "b", b)
    first = server(tmp_path / "a", redis_address)
    second = server(tmp_path / "b", redis_address)  # blue/green: another run under the same --name
    try:
        assert first._table("ctr", "embedding").store_name != second._table("ctr", "embedding").store_name
        assert torch.equal(first.lookup("ctr", "embedding", KEYS), a.find(KEYS))
        assert torch.equal(second.lookup("ctr", "embedding", KEYS), b.find(KEYS))
        replica = server(tmp_path / "a", redis_address)  # a replica of one export shares its rows
        assert replica._table("ctr", "embedding").store_name == first._table("ctr", "embedding").store_name
        assert torch.equal(replica.lookup("ctr", "embedding", KEYS), a.find(KEYS))
        assert first.ready()[0] and replica.ready()[0]
        replica.close()
    finally:
        first.close()
        second.close()


def test_a_server_never_answers_from_another_versions_rows(tmp_path, redis_address):
    emb = trained()
    root = tmp_path / "export"
    export_for_serving(root, emb)
    old = server(root, redis_address)
    emb.insert_or_assign(KEYS, emb.find(KEYS) + 1.0)
    v2 = export_for_serving(root, emb, incremental=True)
    new = server(root, redis_address)  # version 2 of the same run: the newest version wins the namespace
    try:
        assert torch.equal(new.lookup("ctr", "embedding", KEYS), emb.find(KEYS))
        with pytest.raises(TierUnavailableError, match="another server's version"):
            old.lookup("ctr", "embedding", KEYS)
        assert not old.ready()[0]
        old.apply_update(v2)  # it reaches the marker's version: ready again at once, the same rows
        assert old.ready() == (True, "")
        assert torch.equal(old.lookup("ctr", "embedding", KEYS), emb.find(KEYS))
        old.rollback("ctr", 1)  # explicitly back: it takes the namespace, the newer server refuses
        with pytest.raises(TierUnavailableError):
            new.lookup("ctr", "embedding", KEYS + 1000)
    finally:
        old.close()
        new.close()
    stale = ParameterServer.from_config({"models": [{"model": "ctr", "sparse_files": [str(root / "version-00000001")],
                                                     "embedding_table_names": ["embedding"],
                                                     "embedding_vecsize_per_table": [D]}],
                                         "volatile_db": {"type": "redis", "address": redis_address}})
    try:
        new = server(root, redis_address)  # version 2 again
        with pytest.raises(ValueError, match="holds version 2"):
            stale.load("ctr", progress=False)  # an older version never overwrites a newer one
        new.close()
    finally:
        stale.close()


def test_an_evicting_redis_is_refused_as_the_only_tier(exported, redis_server, redis_address, tmp_path):
    _, root = exported
    client = redis_server.client()
    client.config_set("maxmemory", 1 << 30)
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(ValueError, match="maxmemory-policy allkeys-lru"):
            server(root, redis_address)
        server(root, redis_address, persistent={"type": "lmdb", "path": str(tmp_path / "lmdb")}).close()
    finally:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 0)


def test_an_update_older_than_the_marker_leaves_the_shared_rows_alone(tmp_path, redis_address):
    emb = trained()
    root = tmp_path / "export"
    export_for_serving(root, emb)
    old = server(root, redis_address)  # version 1
    emb.insert_or_assign(KEYS, emb.find(KEYS) + 1.0)
    v2 = export_for_serving(root, emb, incremental=True)
    emb.insert_or_assign(KEYS, emb.find(KEYS) + 1.0)
    export_for_serving(root, emb, incremental=True)
    new = server(root, redis_address)  # version 3
    try:
        old.apply_update(v2)  # behind the marker's version 3: Redis keeps version 3's rows
        assert torch.equal(new.lookup("ctr", "embedding", KEYS), emb.find(KEYS))
        with pytest.raises(TierUnavailableError, match="another server's version"):
            old.lookup("ctr", "embedding", KEYS)
    finally:
        old.close()
        new.close()


def test_keys_redis_evicts_after_the_load_fail_the_tier_until_restored(exported, redis_server, redis_address,
                                                                       tmp_path):
    emb, root = exported
    client = redis_server.client()
    ps = server(root, redis_address, persistent={"type": "lmdb", "path": str(tmp_path / "lmdb")})
    try:
        make_redis_evict(client)
        errors = ps.stats("ctr")["errors"]["volatile"]
        wait_until(lambda: ps.stats("ctr")["errors"]["volatile"] > errors)  # the monitor saw the evictions
        client.config_set("maxmemory", 0)
        wait_until(lambda: ps.stats("ctr")["tiers"]["volatile"]["up"])  # marker written again: back
        assert torch.equal(ps.lookup("ctr", "embedding", KEYS), emb.find(KEYS))  # evicted rows from LMDB
        assert ps.stats("ctr")["tables"]["embedding"]["default"] == 0
    finally:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 0)
        ps.close()


def test_a_redis_set_to_evict_at_runtime_stays_failed_until_it_stops_not_refilled_in_a_loop(
        exported, redis_server, redis_address):
    """Redis alone holds every row and an operator turns eviction on at runtime: rewriting the rows would push them
    out again, so the tier stays failed (not ready, misses 503, the reason names the policy) and nothing is written
    until Redis stops evicting; then the rows come back, all of them."""
    emb, root = exported
    client = redis_server.client()
    ps = server(root, redis_address)
    restores = []
    restore = ps.tiers._restore
    ps.tiers._restore = lambda tier: (restores.append(tier), restore(tier))
    try:
        make_redis_evict(client)
        wait_until(lambda: not ps.ready()[0])
        time.sleep(3.0)  # several probes (back-off 0.25 s doubling to 2 s): none may rewrite the rows
        ready, why = ps.ready()
        assert not ready and "maxmemory-policy allkeys-random" in why
        assert restores == []
        with pytest.raises(TierUnavailableError, match="allkeys-random"):
            ps.lookup("ctr", "embedding", KEYS)
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 0)
        wait_until(lambda: ps.ready()[0])
        assert len(restores) == 1
        assert torch.equal(ps.lookup("ctr", "embedding", KEYS), emb.find(KEYS))
        assert ps.stats("ctr")["tables"]["embedding"]["default"] == 0
    finally:
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", 0)
        for k in range(200):
            client.delete(f"other:{k}")
        ps.close()


def test_a_probe_asked_for_during_the_monitors_probe_is_not_lost_to_its_back_off():
    # StoreTiers._probe_now while the monitor probes (it holds the probe lock): the update asks for a probe at the
    # monitor's next turn (probe_soon); the monitor's probe, started before the update changed the markers, then
    # fails. Its back-off must not replace the request: the server that caught up was not ready for up to 2 s.
    from dynemb.serving.ps.tiers import StoreTier
    from dynemb.serving.stores import StoreError

    tier = StoreTier("volatile", None)
    tier.fail(StoreError("marker of another version"))
    tier.probed_in_vain(StoreError("marker of another version"))  # backed off
    tier.probe_soon()  # _probe_now: the monitor is probing
    tier.probed_in_vain(StoreError("marker of another version"))  # the monitor's probe ends, in vain
    assert tier.probe_due(time.monotonic())
    tier.probed_in_vain(StoreError("still failed"))  # the probe asked for ran, in vain: back-off again
    assert not tier.probe_due(time.monotonic())
