"""Fixtures of the serving tests: a real ``redis-server`` on a free loopback port, and a store of each type.

``scripts/install_system_deps.sh`` installs redis-server. The server runs without persistence (``--save ''``,
``--appendonly no``) in a temp dir, once per session; each test gets it flushed, and running again if an earlier
test stopped it.
"""

from __future__ import annotations

import tempfile

import pytest

from dynemb.serving.stores import make_store
from redis_process import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    """The session's redis-server; tests may ``kill()``/``restart()``/``pause()`` it."""
    with tempfile.TemporaryDirectory(prefix="dynemb-redis-") as workdir:
        server = RedisServer(workdir)
        server.start()
        try:
            yield server
        finally:
            if server.running():
                server.resume()
            server.kill()


@pytest.fixture
def redis_address(redis_server) -> str:
    """Address of a running, empty redis-server."""
    if not redis_server.running():
        redis_server.start()
    redis_server.resume()
    redis_server.client().flushall()
    return redis_server.address


STORE_TYPES = ["memory", "redis", "rocksdb", "lmdb"]


@pytest.fixture
def store_config(request, tmp_path):
    """``store_config(kind, **fields)``: a config dict for a store of ``kind`` on this test's server or tmp dir."""

    def make(kind: str, **fields) -> dict:
        if kind == "redis":
            fields.setdefault("address", request.getfixturevalue("redis_address"))
        if kind in ("rocksdb", "lmdb"):
            fields.setdefault("path", str(tmp_path / kind))
        return {"type": kind, **fields}

    return make


@pytest.fixture(params=STORE_TYPES)
def store(request, store_config):
    """An empty store of each type."""
    with make_store(store_config(request.param)) as opened:
        yield opened
