"""The examples of docs/serving.md, run as a user would: against a real ``dynemb serve`` process, the ``curl``
command and the ``tritonclient`` snippet; and ``dynemb serve --watch`` started before ``dynemb train
--publish-every``, as the docs show it."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from dynemb.cli import main

from test_command import SRC, free_port, stop, wait_ready

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


@contextlib.contextmanager
def dynemb_serve(*args: str):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", *args, "--port", str(port),
                             "--grpc-port", str(free_port())], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc, port
    finally:
        stop(proc)


def block(language: str, contains: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), re.S)
    return next(b for b in blocks if contains in b)


@pytest.mark.slow
def test_the_curl_and_tritonclient_examples_answer(run):
    with dynemb_serve("--model", str(run / "run"), "--name", "ctr", "--token", "T") as (proc, port):
        wait_ready(f"http://127.0.0.1:{port}", proc, token="T")
        curl = block("bash", "curl -s localhost:8000").replace("localhost:8000", f"127.0.0.1:{port}")
        reply = json.loads(subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60,
                                          check=True).stdout)
        assert reply["model_name"] == "ctr" and reply["model_version"] == "1"
        by_curl = np.asarray(reply["outputs"][0]["data"], np.float64)
        snippet = block("python", "tritonclient.http").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        printed = io.StringIO()
        namespace = {}
        with contextlib.redirect_stdout(printed):
            exec(compile(snippet, "docs/serving.md tritonclient block", "exec"), namespace)  # noqa: S102
        assert printed.getvalue().split()[-1] == "1"  # the version
        np.testing.assert_allclose(namespace["result"].as_numpy("probability"), by_curl, atol=1e-6, rtol=0)
        assert by_curl.shape == (2,) and ((0 < by_curl) & (by_curl < 1)).all()
        # No token: 401 on every route, and the server keeps serving.
        assert httpx.get(f"http://127.0.0.1:{port}/v2/models/ctr", timeout=10).status_code == 401
        assert proc.poll() is None


@pytest.mark.slow
def test_serve_watch_waits_for_a_training_run_and_follows_its_versions(run, tmp_path):
    out = tmp_path / "run"
    with dynemb_serve("--model", str(out), "--name", "ctr", "--watch", "0.2") as (proc, port):
        url = f"http://127.0.0.1:{port}"
        assert "waiting for the first version" in proc.stdout.readline()
        train = ["train", "--data", str(run / "train.parquet"), "--label", "click", "--categorical", "user,item",
                 "--dense", "price", "--out", str(out), "--batch-size", "64", "--dim", "4", "--publish-every", "4",
                 "--no-progress"]
        assert main([*train, "--steps", "12"]) == 0  # versions 1 (full), 2, 3
        wait_ready(url, proc, token=None)
        # The run goes on once the server is up: version 4 (a full export: a resumed run has no delta base).
        assert main([*train, "--steps", "16", "--resume"]) == 0
        body = {"inputs": [{"name": "user", "datatype": "BYTES", "shape": [1], "data": ["u1"]},
                           {"name": "item", "datatype": "INT64", "shape": [1], "data": [3]},
                           {"name": "price", "datatype": "FP32", "shape": [1], "data": [1.5]}]}
        deadline = time.monotonic() + 60
        while (version := httpx.post(f"{url}/v2/models/ctr/infer", json=body, timeout=10).json()
               ["model_version"]) != "4":
            assert time.monotonic() < deadline, f"still serving version {version}"
            time.sleep(0.1)
    # It loaded the version there when it started, then logged each one it applied, in order, up to 4.
    first = int(re.search(r"version (\d+)\)", proc.stdout.read()).group(1))
    assert first < 4
    assert re.findall(r"now serving version (\d+)", proc.stderr.read()) == [str(v) for v in range(first + 1, 5)]


def test_the_docs_name_every_metric():
    from dynemb.endpoint.prometheus_metrics import METRIC_NAMES

    text = DOC.read_text()
    assert [n for n in METRIC_NAMES if f"`{n}`" not in text] == []
