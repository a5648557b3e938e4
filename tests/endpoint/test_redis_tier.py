"""``dynemb serve --volatile redis`` when Redis loses its rows or goes away: 503 naming the store (never initializer
rows for ids the export holds), not ready meanwhile, ready and right again after; and the small things of a clean
start and stop (temporary stores removed, names a URL cannot carry refused). Real redis-server, real server."""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from test_command import SRC, free_port, stop, wait_ready

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from redis_process import RedisServer  # noqa: E402

grpcclient = pytest.importorskip("tritonclient.grpc")


def request(table: dict, lo: int, hi: int, user=None) -> dict:
    users = table["user"][lo:hi] if user is None else [user] * (hi - lo)
    tags = table["tags"][lo:hi]
    return {"inputs": [{"name": "user", "datatype": "BYTES", "shape": [hi - lo], "data": users},
                       {"name": "item", "datatype": "INT64", "shape": [hi - lo], "data": table["item"][lo:hi]},
                       {"name": "tags", "datatype": "BYTES", "shape": [sum(map(len, tags))],
                        "data": [t for bag in tags for t in bag]},
                       {"name": "tags__lengths", "datatype": "INT32", "shape": [hi - lo], "data": list(map(len, tags))},
                       {"name": "price", "datatype": "FP32", "shape": [hi - lo], "data": table["price"][lo:hi]}]}


def tier_up(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name == "dynemb_tier_up" and sample.labels["tier"] == "volatile":
                return sample.value
    raise AssertionError("no dynemb_tier_up{tier=volatile}")


@pytest.mark.slow
def test_redis_flushed_or_gone_answers_503_not_wrong_scores_and_ready_follows(run, tmp_path):
    redis = RedisServer(str(tmp_path))
    redis.start()
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run / "run"), "--name", "ctr",
                             "--port", str(port), "--grpc-port", str(grpc_port), "--volatile", "redis",
                             "--redis-address", redis.address, "--cache-fraction", "0.05"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    table = pq.read_table(run / "test.parquet").to_pydict()
    expected = np.asarray(pq.read_table(run / "preds.parquet").column("probability").to_pylist())
    try:
        wait_ready(url, proc, token=None)
        assert tier_up(url) == 1
        redis.client().flushall()  # nothing was asked yet: every row of the first request misses the cache
        r = httpx.post(f"{url}/v2/models/ctr/infer", json=request(table, 0, 50), timeout=30)
        assert r.status_code == 503 and redis.address in r.json()["error"], r.text
        ready = httpx.get(f"{url}/v2/health/ready", timeout=5)
        if ready.status_code == 503:  # the monitor may have written the rows back already
            assert "lost the rows" in ready.json()["error"] or "Redis" in ready.json()["error"]
        wait_ready(url, proc, token=None)  # its rows written again from the export: ready, the same scores
        r = httpx.post(f"{url}/v2/models/ctr/infer", json=request(table, 0, 50), timeout=30)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], expected[:50], atol=1e-6, rtol=0)

        redis.kill()
        r = httpx.post(f"{url}/v2/models/ctr/infer", json=request(table, 0, 5, user="u-not-cached"), timeout=30)
        assert r.status_code == 503 and redis.address in r.json()["error"], r.text
        assert httpx.get(f"{url}/v2/health/ready", timeout=5).status_code == 503
        assert httpx.get(f"{url}/v2/models/ctr/ready", timeout=5).status_code == 503
        assert tier_up(url) == 0
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as g:
            assert g.is_server_live() and not g.is_server_ready() and not g.is_model_ready("ctr")
            from tritonclient.utils import InferenceServerException

            one = grpcclient.InferInput("price", [1], "FP32")
            one.set_data_from_numpy(np.array([1.0], np.float32))
            inputs = [grpcclient.InferInput("user", [1], "BYTES"), grpcclient.InferInput("item", [1], "INT64"),
                      grpcclient.InferInput("tags", [0], "BYTES"), grpcclient.InferInput("tags__lengths", [1], "INT32"),
                      one]
            inputs[0].set_data_from_numpy(np.array(["u-not-cached-either"], dtype=object))
            inputs[1].set_data_from_numpy(np.array([10**12], np.int64))
            inputs[2].set_data_from_numpy(np.array([], dtype=object))
            inputs[3].set_data_from_numpy(np.array([0], np.int32))
            with pytest.raises(InferenceServerException, match="UNAVAILABLE|Unavailable"):
                g.infer("ctr", inputs)
        time.sleep(0.5)
        redis.start()  # empty again: the rows are written again before it is ready
        wait_ready(url, proc, token=None)
        assert tier_up(url) == 1
        r = httpx.post(f"{url}/v2/models/ctr/infer", json=request(table, 0, len(expected)), timeout=30)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], expected, atol=1e-6, rtol=0)
        assert proc.poll() is None
    finally:
        stop(proc)
        redis.kill()
    err = proc.stderr.read()
    assert err.count("failed: Redis") == 2 and err.count(") is back") == 2, err  # once per change, not per request


@pytest.mark.slow
@pytest.mark.parametrize("persistent", ["lmdb", "rocksdb"])
def test_a_temporary_persistent_store_is_removed_on_a_clean_stop(run, tmp_path, persistent):
    temp = tmp_path / "tmp"
    temp.mkdir()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run / "run"), "--port", str(port),
                             "--no-grpc", "--persistent", persistent], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, token=None)
        assert [p.name for p in temp.glob(f"dynemb-serve-{persistent}-*")]
    finally:
        stop(proc)
    assert list(temp.glob(f"dynemb-serve-{persistent}-*")) == []


@pytest.mark.parametrize("name", ["my model/v", "a?b", "..", "x#y", ""])
def test_a_name_a_url_path_cannot_carry_is_refused(run, capsys, name):
    from dynemb.cli import main

    assert main(["serve", "--model", str(run / "run"), "--name", name, "--no-grpc"]) == 2
    err = capsys.readouterr().err
    assert "--name must be usable as it is in /v2/models/NAME/infer" in err and repr(name) in err, err


@pytest.mark.slow
def test_two_runs_served_under_one_name_on_one_redis_keep_their_own_rows(run, tmp_path):
    """Blue/green: server B starts with another run's export under A's --name on A's Redis; A's answers stay its
    own predict's (B's load wrote its rows into B's namespace, not over A's)."""
    from dynemb.checkpoint import export_for_serving
    from dynemb.job import load_model

    other = load_model(run / "run")[0]
    for table in other.embeddings.dynemb_tables():  # another run's rows: every row moved
        keys, values = table.export()[:2]
        table.insert_or_assign(keys, values + 0.25)
    export_for_serving(tmp_path / "other", other)
    redis = RedisServer(str(tmp_path))
    redis.start()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    procs, urls = [], []
    table = pq.read_table(run / "test.parquet").to_pydict()
    expected = np.asarray(pq.read_table(run / "preds.parquet").column("probability").to_pylist())
    try:
        for extra in ([], ["--export", str(tmp_path / "other")]):
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run / "run"),
                                           "--name", "ctr", "--port", str(port), "--no-grpc", "--volatile", "redis",
                                           "--redis-address", redis.address, "--cache-fraction", "0.05", *extra],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            urls.append(f"http://127.0.0.1:{port}")
            wait_ready(urls[-1], procs[-1], token=None)  # A is up (and has answered nothing) before B loads
        a = httpx.post(f"{urls[0]}/v2/models/ctr/infer", json=request(table, 0, len(expected)), timeout=30)
        assert a.status_code == 200, a.text
        np.testing.assert_allclose(a.json()["outputs"][0]["data"], expected, atol=1e-6, rtol=0)
        b = httpx.post(f"{urls[1]}/v2/models/ctr/infer", json=request(table, 0, len(expected)), timeout=30)
        assert b.status_code == 200 and not np.allclose(b.json()["outputs"][0]["data"], expected, atol=1e-3)
        spaces = {key.split(b":", 2)[2] for key in redis.client().keys("dynemb:served:*")}
        assert len(spaces) == 2 and all(s.startswith(b"ctr@") for s in spaces), spaces
    finally:
        for proc in procs:
            stop(proc)
        redis.kill()
