"""``dynemb serve`` as a process: it listens on loopback, answers like ``dynemb predict``, and stops on SIGTERM."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import httpx
import numpy as np
import pyarrow.parquet as pq

from dynemb.distributed.launch import free_port

SRC = str(Path(__file__).resolve().parents[2] / "src")


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 120.0, token: str | None = "t0k") -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            ready = httpx.get(f"{url}/v2/health/ready", headers=headers, timeout=2)
            if ready.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"dynemb serve did not come up within {seconds} s")


@contextlib.contextmanager
def serving(run, *options: str, token: str | None = None):
    """A real ``dynemb serve`` of run ``run`` as 'ctr' (HTTP and gRPC on free ports, ``options`` added), ready;
    yields ``("127.0.0.1:HTTP", "127.0.0.1:GRPC")`` and stops it after."""
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "dynemb", "serve", "--model", str(run / "run"), "--name", "ctr",
            *(["--token", token] if token else []), "--port", str(port), "--grpc-port", str(grpc_port), *options]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, token=token)
        yield f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, seconds: float = 30.0) -> int:
    """SIGTERM, then SIGKILL if ``dynemb serve`` has not exited within ``seconds``; its exit code."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=seconds)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def scored(run, url: str, token: str | None = None, rows: int = 50) -> list:
    """The probabilities ``dynemb serve`` at ``url`` answers for the first ``rows`` rows of the run's test file (one
    JSON request, ``token`` as its bearer token)."""
    d = pq.read_table(run / "test.parquet").slice(0, rows).to_pydict()
    inputs = [{"name": "user", "datatype": "BYTES", "shape": [rows], "data": d["user"]},
              {"name": "item", "datatype": "INT64", "shape": [rows], "data": d["item"]},
              {"name": "tags", "datatype": "BYTES", "shape": [sum(map(len, d["tags"]))],
               "data": [t for bag in d["tags"] for t in bag]},
              {"name": "tags__lengths", "datatype": "INT32", "shape": [rows], "data": list(map(len, d["tags"]))},
              {"name": "price", "datatype": "FP32", "shape": [rows], "data": d["price"]}]
    r = httpx.post(f"{url}/v2/models/ctr/infer", json={"id": "r1", "inputs": inputs},
                   headers={"Authorization": f"Bearer {token}"} if token else {}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "r1" and r.json()["outputs"][0]["name"] == "probability"
    return r.json()["outputs"][0]["data"]


def predicted(run, rows: int = 50) -> list:
    """``dynemb predict``'s probabilities of the first ``rows`` rows of the run's test file."""
    return pq.read_table(run / "preds.parquet").column("probability").to_pylist()[:rows]


def test_dynemb_serve_scores_like_predict_with_lmdb_and_a_token(run, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run / "run"), "--port", str(port),
                             "--grpc-port", str(free_port()),
                             "--name", "ctr", "--token", "t0k", "--persistent", "lmdb", "--persistent-path",
                             str(tmp_path / "lmdb"), "--cache-fraction", "0.1"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        np.testing.assert_allclose(scored(run, url, "t0k"), predicted(run), atol=1e-6, rtol=0)
        assert httpx.get(f"{url}/v2/health/live", timeout=5).status_code == 401
    finally:
        assert stop(proc) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after a clean shutdown


@pytest.mark.parametrize("busy_option", ["--port", "--grpc-port"])
def test_a_port_in_use_is_one_error_and_no_serving_line(run, capsys, monkeypatch, busy_option):
    """Found before anything loads (an export written, a model read): the error comes in a moment, not after."""
    from dynemb.cli import main
    from dynemb.endpoint import model as served
    from dynemb.job import publish

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the ports were checked")

    monkeypatch.setattr(publish, "serving_export", never)
    monkeypatch.setattr(served.ServedModel, "__init__", never)
    with socket.socket() as busy, socket.socket() as free:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        free.bind(("127.0.0.1", 0))  # a port no one listens on, once closed
        port, other = busy.getsockname()[1], free.getsockname()[1]
        free.close()
        ports = {"--port": port, "--grpc-port": other} if busy_option == "--port" else \
            {"--port": other, "--grpc-port": port}
        args = ["serve", "--model", str(run / "run")] + [str(x) for kv in ports.items() for x in kv]
        assert main(args) == 2
    out, err = capsys.readouterr()
    assert "serving" not in out and f"cannot listen on 127.0.0.1:{port}" in err, (out, err)


def test_the_line_printed_when_watch_loads_the_first_version_names_the_grpc_port_too(tmp_path, capsys):
    """``--watch`` before the first version prints the serving line from the loading thread; it named only the
    HTTP address there, although gRPC listens as well."""
    import argparse
    from types import SimpleNamespace

    from dynemb.endpoint.command import _Loader

    args = argparse.Namespace(model=None, export=str(tmp_path), name="m", host="127.0.0.1", port=8000, watch=0.01)
    loader = _Loader(args, service=None)
    loader.grpc_line = " and grpc://127.0.0.1:8001"
    loader.load = lambda: setattr(loader, "model", SimpleNamespace(export=tmp_path, version=1))
    (tmp_path / "latest").write_text('{"name": "version-00000001"}')
    loader._wait_and_load(tmp_path)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith("on http://127.0.0.1:8000/v2/models/m/infer and grpc://127.0.0.1:8001"), line


@pytest.mark.parametrize("watch", [[], ["--watch"]])
def test_a_run_directory_given_as_export_is_refused_even_with_watch(tmp_path, capsys, watch):
    """With --watch it waited for a first version that a run directory never gets."""
    from dynemb.cli import main

    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "model.json").write_text("{}")
    assert main(["serve", "--export", str(tmp_path / "run"), "--no-grpc", *watch]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"dynemb serve: error: --export {tmp_path / 'run'}: a `dynemb train` run directory, not an "
                    "export of your own model; serve it with --model RUN_DIR"), line


@pytest.mark.parametrize("option, value, message", [
    ("--grpc-max-connections", "0", "--grpc-max-connections must be >= 1, got 0"),
    ("--grpc-idle-timeout", "-1", "--grpc-idle-timeout must be >= 0 seconds (0: never), got -1.0")])
def test_grpc_limits_out_of_range_are_refused_before_anything_loads(tmp_path, capsys, option, value, message):
    from dynemb.cli import main

    assert main(["serve", "--export", str(tmp_path / "nothing"), option, value]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"dynemb serve: error: {message}", line


def test_loading_a_run_to_serve_or_export_builds_no_optimizer(run, tmp_path):
    """Serving and exporting read rows and the dense part only: building the tables' sparse optimizer imports
    torch's compiler stack (``torch.optim`` wraps its constructor with dynamo: ~2.6 s of a fresh ``dynemb serve``'s
    start on a 2-core machine). A fresh process loads the served model, writes the run's missing export and the
    best model's export, and must not have imported ``torch._dynamo``."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run / "run", copy)
    shutil.rmtree(copy / "export", ignore_errors=True)
    code = ("import sys\n"
            "from dynemb.endpoint.model import ServedModel\n"
            "from dynemb.job.publish import serving_export\n"
            f"ServedModel({str(copy)!r})\n"
            f"serving_export({str(copy)!r}, use='best')\n"
            f"serving_export({str(copy)!r}, use='last')\n"
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'clean')\n")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == "clean"
    assert (copy / "export" / "latest").is_file()


@pytest.mark.parametrize("options, message", [
    (["--threads", "0"], "--threads must be >= 1, got 0"),  # was torch's RuntimeError, with a traceback
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1, got 0"),  # named max_batch_size
    (["--max-body-mb", "0"], "--max-body-mb must be > 0 (at least one byte), got 0.0"),  # named max_body_bytes
    (["--cache-fraction", "2"], "--cache-fraction must be in (0, 1], got 2.0"),  # named models['ctr'].cache_fraction
    # both were ignored without a word: the store was not where the user said, the export not the --use one
    (["--persistent-path", "store"], "--persistent-path is where the persistent store lives: give --persistent "
                                     "lmdb or --persistent rocksdb with it"),
    (["--export", "exports", "--use", "last"], "--use picks which export of the run is served, and --export names "
                                               "one already: drop one of them"),
    (["--grpc-port", "5"], "--grpc-port 5 with --no-grpc: no gRPC server is started; drop one of them")])
def test_serve_options_out_of_range_or_without_effect_are_one_line_naming_the_option(tmp_path, capsys, monkeypatch,
                                                                                   options, message):
    from dynemb.cli import main
    from dynemb.endpoint import model as served

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(served.ServedModel, "__init__", never)
    assert main(["serve", "--model", str(tmp_path / "run"), "--name", "ctr", "--no-grpc", *options]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [f"dynemb serve: error: {message}"] and not out, (out, err)


def test_an_own_model_awaited_by_watch_names_export_model_as_what_writes_it(tmp_path):
    """The waiting line said `dynemb train --publish-every` writes the version, for a model of the user's own too."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--export", str(tmp_path / "own"), "--watch",
                             "--no-grpc", "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
    finally:
        stop(proc)
    assert line.startswith(f"waiting for the first version in {tmp_path / 'own'} (dynemb.serving.export_model "
                           "writes it)"), line


@pytest.mark.slow
def test_a_refused_token_says_what_was_wrong_over_http_and_grpc_and_never_echoes_it(run):
    """Every refusal read "missing or wrong bearer token": a client sending `Basic ...`, or the token without its
    scheme, could not tell its mistake from a wrong token."""
    import re

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    cases = [({}, "send the header `Authorization: Bearer <token>` (gRPC: `authorization` metadata), got none"),
             ({"authorization": "Basic dXNlcjpwYXNz"}, "wants `Authorization: Bearer <token>`, got the scheme 'Basic'"),
             ({"authorization": "t0k"}, "got a value without a scheme (put `Bearer ` before the token)"),
             ({"authorization": "Bearer nope"}, "wrong bearer token")]
    with serving(run, token="t0k") as (http, grpc):
        for client in (httpclient.InferenceServerClient(http), grpcclient.InferenceServerClient(grpc)):
            for headers, message in cases:
                with pytest.raises(InferenceServerException, match=re.escape(message)) as error:
                    client.get_model_metadata("ctr", headers=headers)
                assert str(error.value.status()) in ("401", "StatusCode.UNAUTHENTICATED")
                assert "t0k" not in error.value.message() and "nope" not in error.value.message()
            assert client.get_model_metadata("ctr", headers={"authorization": "bearer t0k"})
        assert httpx.get(f"http://{http}/v2/health/live", timeout=5).status_code == 401  # the server kept serving
        assert httpx.get(f"http://{http}/v2/health/live", headers={"Authorization": "Bearer t0k"},
                         timeout=5).json() == {"live": True}


@pytest.mark.slow
def test_watch_serves_a_version_of_another_row_dtype_in_its_own_dtype(run, tmp_path):
    """A server that loaded int8 rows and then follows a float32 version serves float32 rows, as a server started on
    that version does (it kept int8 rows: the same version answered differently by a server's history): scores
    equal to `dynemb predict`'s, which the int8 version's are not. With LMDB under it: the store's int8 table is
    dropped and created again in float32."""
    from dynemb.cli import main

    root = tmp_path / "exports"
    assert main(["export", "--model", str(run / "run"), "--out", str(root), "--dtype", "int8"]) == 0
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run / "run"), "--export",
                             str(root), "--watch", "0.2", "--no-grpc", "--name", "ctr", "--port", str(port),
                             "--persistent", "lmdb", "--persistent-path", str(tmp_path / "lmdb")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, token=None)
        int8 = scored(run, url)
        assert np.abs(np.subtract(int8, predicted(run))).max() > 1e-6  # the test can tell the two apart
        assert main(["export", "--model", str(run / "run"), "--out", str(root)]) == 0  # version 2, float32 rows
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/v2/models/ctr", timeout=5).json()["versions"] != ["2"]:
            assert time.monotonic() < deadline, "version 2 was not served within 60 s"
            time.sleep(0.2)
        np.testing.assert_array_equal(scored(run, url), predicted(run))
    finally:
        stop(proc)
    # and a server started again on that LMDB store and version 2 (its tables now float32) serves the same
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run / "run"), "--export",
                             str(root), "--no-grpc", "--name", "ctr", "--port", str(port), "--persistent", "lmdb",
                             "--persistent-path", str(tmp_path / "lmdb")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(url, proc, token=None)
        np.testing.assert_array_equal(scored(run, url), predicted(run))
    finally:
        stop(proc)
