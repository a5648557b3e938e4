"""Every call a Triton user makes, from ``tritonclient.http`` and ``tritonclient.grpc``, against a real ``dynemb
serve`` process (one for the module, HTTP and gRPC, with a token given in a lower-case ``bearer`` scheme); and a
server that listens before its first version. Probabilities are compared with ``dynemb predict``'s (atol 1e-6)."""

import gzip
import json
import os
import re
import subprocess
import sys
import time
import zlib

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest

from test_command import SRC, free_port, serving, stop, wait_ready

http = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "t0k"
ROWS = 60


@pytest.fixture(scope="module")
def server(run):
    with serving(run, token=TOKEN) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def rows(run):
    table = pq.read_table(run / "test.parquet").slice(0, ROWS).to_pydict()
    expected = np.asarray(pq.read_table(run / "preds.parquet").column("probability").to_pylist()[:ROWS])
    arrays = {"user": (np.array(table["user"], dtype=object), "BYTES"),
              "item": (np.array(table["item"], dtype=np.int64), "INT64"),
              "tags": (np.array([t for bag in table["tags"] for t in bag], dtype=object), "BYTES"),
              "tags__lengths": (np.array([len(bag) for bag in table["tags"]], dtype=np.int32), "INT32"),
              "price": (np.array(table["price"], dtype=np.float32), "FP32")}
    return arrays, expected


def inputs(module, arrays, binary=None):
    out = []
    for name, (values, datatype) in arrays.items():
        out.append(module.InferInput(name, list(values.shape), datatype))
        if binary is None:
            out[-1].set_data_from_numpy(values)
        else:
            out[-1].set_data_from_numpy(values, binary_data=binary)
    return out


HEADERS = {"Authorization": f"bearer {TOKEN}"}  # the scheme is case-insensitive


@pytest.mark.slow
def test_every_http_call_of_tritonclient(server, rows):
    arrays, expected = rows
    client = http.InferenceServerClient(server[0], network_timeout=30)
    try:
        assert client.is_server_live(headers=dict(HEADERS)) and client.is_server_ready(headers=dict(HEADERS))
        assert client.is_model_ready("ctr", headers=dict(HEADERS))
        assert client.is_model_ready("ctr", "1", headers=dict(HEADERS))
        assert client.is_model_ready("ctr", "01", headers=dict(HEADERS))  # a number, as Triton reads it
        assert not client.is_model_ready("ctr", "2", headers=dict(HEADERS))
        assert not client.is_model_ready("ctr", "1x", headers=dict(HEADERS))
        assert not client.is_model_ready("other", headers=dict(HEADERS))
        meta = client.get_server_metadata(headers=dict(HEADERS))
        assert meta["name"] == "dynemb" and "binary_tensor_data" in meta["extensions"]
        for version in ("", "1"):
            model = client.get_model_metadata("ctr", version, headers=dict(HEADERS))
            assert model["versions"] == ["1"] and [t["name"] for t in model["inputs"]] == list(arrays)
            config = client.get_model_config("ctr", version, headers=dict(HEADERS))
            assert [t["name"] for t in config["input"]] == list(arrays)
            assert config["output"] == [{"name": "probability", "data_type": "TYPE_FP64", "dims": [-1]}]
        with pytest.raises(InferenceServerException, match="serves version 1, not '7'"):
            client.get_model_metadata("ctr", "7", headers=dict(HEADERS))
        answers = {}
        for binary_in in (False, True):
            for binary_out in (False, True):
                for compress in (None, "gzip", "deflate"):
                    for version in ("", "1"):
                        out = [http.InferRequestedOutput("probability", binary_data=binary_out)]
                        result = client.infer("ctr", inputs(http, arrays, binary_in), model_version=version,
                                              outputs=out, headers=dict(HEADERS),
                                              request_compression_algorithm=compress,
                                              response_compression_algorithm=compress)
                        answers[binary_in, binary_out, compress, version] = result.as_numpy("probability")
                        response = result.get_response()
                        assert response["model_version"] == "1"
                        assert ("data" not in response["outputs"][0]) == binary_out
        for got in answers.values():
            np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
        done = client.async_infer("ctr", inputs(http, arrays, True), headers=dict(HEADERS))
        np.testing.assert_allclose(done.get_result().as_numpy("probability"), expected, atol=1e-6, rtol=0)
        with pytest.raises(InferenceServerException, match="serves version 1, not '3'"):
            client.infer("ctr", inputs(http, arrays), model_version="3", headers=dict(HEADERS))
        stats = client.get_inference_statistics("ctr", headers=dict(HEADERS))["model_stats"][0]
        assert stats["name"] == "ctr" and stats["inference_count"] >= 25 * ROWS
        assert client.get_inference_statistics(headers=dict(HEADERS))["model_stats"][0]["name"] == "ctr"
        assert client.get_inference_statistics("ctr", "1", headers=dict(HEADERS))["model_stats"][0]["version"] == "1"
        for call in (lambda: client.get_system_shared_memory_status(headers=dict(HEADERS)),
                     lambda: client.get_cuda_shared_memory_status(headers=dict(HEADERS)),
                     lambda: client.get_model_repository_index(headers=dict(HEADERS)),
                     lambda: client.load_model("ctr", headers=dict(HEADERS)),
                     lambda: client.get_trace_settings(headers=dict(HEADERS)),
                     lambda: client.get_log_settings(headers=dict(HEADERS))):
            with pytest.raises(InferenceServerException, match="not supported"):
                call()
    finally:
        client.close()


@pytest.mark.slow
def test_every_grpc_call_of_tritonclient(server, rows):
    arrays, expected = rows
    client = grpcclient.InferenceServerClient(server[1])
    headers = {"authorization": f"Bearer {TOKEN}"}
    try:
        assert client.is_server_live(headers=dict(headers)) and client.is_server_ready(headers=dict(headers))
        assert client.is_model_ready("ctr", headers=dict(headers))
        assert client.is_model_ready("ctr", "1", headers=dict(headers))
        assert not client.is_model_ready("ctr", "2", headers=dict(headers))
        assert not client.is_model_ready("other", headers=dict(headers))  # ready=false, as Triton answers
        meta = client.get_server_metadata(headers=dict(headers), as_json=True)
        assert meta["name"] == "dynemb"
        for version in ("", "1"):
            model = client.get_model_metadata("ctr", version, headers=dict(headers), as_json=True)
            assert model["versions"] == ["1"] and [t["name"] for t in model["inputs"]] == list(arrays)
            config = client.get_model_config("ctr", version, headers=dict(headers), as_json=True)["config"]
            assert [t["name"] for t in config["input"]] == list(arrays)
            assert config["output"][0]["data_type"] == "TYPE_FP64"
        for compress in (None, "gzip", "deflate"):
            for version in ("", "1"):
                result = client.infer("ctr", inputs(grpcclient, arrays), model_version=version, headers=dict(headers),
                                      outputs=[grpcclient.InferRequestedOutput("probability")],
                                      compression_algorithm=compress, request_id="r7")
                np.testing.assert_allclose(result.as_numpy("probability"), expected, atol=1e-6, rtol=0)
                assert result.get_response().model_version == "1" and result.get_response().id == "r7"
        answer = []
        client.async_infer("ctr", inputs(grpcclient, arrays), headers=dict(headers),
                           callback=lambda result, error: answer.append((result, error)))
        deadline = time.monotonic() + 30
        while not answer and time.monotonic() < deadline:
            time.sleep(0.01)
        result, error = answer[0]
        assert error is None
        np.testing.assert_allclose(result.as_numpy("probability"), expected, atol=1e-6, rtol=0)
        stats = client.get_inference_statistics("ctr", headers=dict(headers), as_json=True)["model_stats"][0]
        assert stats["name"] == "ctr" and int(stats["inference_count"]) >= 7 * ROWS
        stats = client.get_inference_statistics("ctr", "1", headers=dict(headers), as_json=True)["model_stats"][0]
        assert stats["version"] == "1"
        # The limits of HTTP: more rows than --max-batch-size (4096) is a 400 there, INVALID_ARGUMENT here.
        n = 4097
        big = {"user": (np.array(["u1"] * n, dtype=object), "BYTES"), "item": (np.zeros(n, np.int64), "INT64"),
               "tags": (np.array([], dtype=object), "BYTES"), "tags__lengths": (np.zeros(n, np.int32), "INT32"),
               "price": (np.ones(n, np.float32), "FP32")}
        with pytest.raises(InferenceServerException, match="4096") as error:
            client.infer("ctr", inputs(grpcclient, big), headers=dict(headers))
        assert "INVALID_ARGUMENT" in str(error.value.status())
        # The same errors as over HTTP: a bad input names it; no token is UNAUTHENTICATED; unsupported calls say so.
        bad = inputs(grpcclient, {**arrays, "item": (arrays["item"][0][:-1], "INT64")})
        with pytest.raises(InferenceServerException, match="input 'item'") as error:
            client.infer("ctr", bad, headers=dict(headers))
        assert "INVALID_ARGUMENT" in str(error.value.status())
        with pytest.raises(InferenceServerException, match="bearer token"):
            client.is_server_live()
        with pytest.raises(InferenceServerException, match="unknown model 'other'"):
            client.infer("other", inputs(grpcclient, arrays), headers=dict(headers))
        for call in (lambda: client.get_system_shared_memory_status(headers=dict(headers)),
                     lambda: client.get_cuda_shared_memory_status(headers=dict(headers)),
                     lambda: client.get_model_repository_index(headers=dict(headers)),
                     lambda: client.unload_model("ctr", headers=dict(headers)),
                     lambda: client.get_trace_settings(headers=dict(headers)),
                     lambda: client.get_log_settings(headers=dict(headers))):
            with pytest.raises(InferenceServerException, match="not supported"):
                call()
    finally:
        client.close()


def post(server, path, body: bytes, headers=None):
    return httpx.post(f"http://{server[0]}{path}", content=body, headers={**HEADERS, **(headers or {})}, timeout=30)


def test_errors_are_json_on_every_route_404s_included(server):
    for method, path, status in [("GET", "/nowhere", 404), ("GET", "/v2/models/ctr/nothing", 404),
                                 ("POST", "/v2/models/ctr", 405), ("GET", "/v2/models/ctr/infer", 405),
                                 ("GET", "/v2/models/other", 404), ("GET", "/v2/models/other/ready", 404),
                                 ("POST", "/v2/models/other/versions/1/infer", 404),
                                 ("POST", "/v2/repository/index", 501), ("GET", "/v2/logging", 501),
                                 ("GET", "/v2/models/ctr/trace/setting", 501)]:
        r = httpx.request(method, f"http://{server[0]}{path}", headers=dict(HEADERS), timeout=30)
        assert r.status_code == status and r.headers["content-type"] == "application/json", (path, r.text)
        assert r.json()["error"], path
    r = httpx.get(f"http://{server[0]}/v2", timeout=30)
    assert r.status_code == 401 and "bearer" in r.json()["error"]


def one_row(price="1.5", item="3"):
    return ('{"inputs": [{"name": "user", "datatype": "BYTES", "shape": [1], "data": ["u1"]},'
            f'{{"name": "item", "datatype": "INT64", "shape": [1], "data": [{item}]}},'
            '{"name": "tags", "datatype": "BYTES", "shape": [0], "data": []},'
            '{"name": "tags__lengths", "datatype": "INT32", "shape": [1], "data": [0]},'
            f'{{"name": "price", "datatype": "FP32", "shape": [1], "data": [{price}]}}]}}').encode()


def test_bare_nan_and_infinity_follow_the_dense_rule_and_a_nan_id_is_a_400_naming_it(server, run):
    from dynemb.job import read_card

    prep = read_card(run / "run").preprocessing
    mean_raw = float(np.expm1(prep.dense_mean[0]))  # the value whose signed log is the mean
    scored = {}
    for token, same_as in (("NaN", repr(mean_raw)), ("Infinity", repr(prep.dense_max[0])),
                           ("-Infinity", repr(prep.dense_min[0]))):
        r, s = post(server, "/v2/models/ctr/infer", one_row(token)), post(server, "/v2/models/ctr/infer",
                                                                           one_row(same_as))
        assert r.status_code == s.status_code == 200, (r.text, s.text)
        got = r.json()["outputs"][0]["data"][0]
        assert np.isfinite(got), token
        np.testing.assert_allclose(got, s.json()["outputs"][0]["data"][0], atol=1e-5)
        scored[token] = got
    for bad in ("NaN", "Infinity"):
        r = post(server, "/v2/models/ctr/infer", one_row(item=bad))
        assert r.status_code == 400 and "input 'item'" in r.json()["error"], r.text
    r = post(server, "/v2/models/ctr/infer", b'{"inputs": NaNx}')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


def test_a_mistyped_input_name_is_named_beside_the_missing_one_over_http_and_grpc(server, rows):
    """A renamed input was only "input 'user' is missing": the name the request used instead went unsaid."""
    arrays, _ = rows
    renamed = {("User" if name == "user" else name): value for name, value in arrays.items()}
    message = "input 'user' is missing: the request has 'User', which the model does not read (the model reads"
    client = http.InferenceServerClient(server[0])
    for binary in (True, False):
        with pytest.raises(InferenceServerException, match=re.escape(message)):
            client.infer("ctr", inputs(http, renamed, binary), headers=dict(HEADERS))
    with pytest.raises(InferenceServerException, match=re.escape(message)) as error:
        grpcclient.InferenceServerClient(server[1]).infer("ctr", inputs(grpcclient, renamed),
                                                          headers={"authorization": f"Bearer {TOKEN}"})
    assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert client.is_model_ready("ctr", headers=dict(HEADERS))


def test_a_bad_inference_header_content_length_is_a_400_naming_the_header(server):
    """It was read as no header at all: the binary part then failed as "not valid JSON (unexpected content after
    document)", which named neither the header nor the value."""
    body = one_row()
    for value in ("abc", "-5", str(len(body) + 1)):
        r = post(server, "/v2/models/ctr/infer", body, {"Inference-Header-Content-Length": value})
        assert r.status_code == 400 and r.json()["error"] == (
            "header Inference-Header-Content-Length must be the bytes of the body's JSON part, an integer in "
            f"0..{len(body)} (the body's length), got {value!r}"), r.text
    assert post(server, "/v2/models/ctr/infer", body,
                {"Inference-Header-Content-Length": str(len(body))}).status_code == 200


def test_binary_bytes_no_input_claims_are_a_400_not_dropped(server):
    """A binary_data_size short of its tensor left bytes after the last input, which were dropped: the request was
    scored on the other values (Triton refuses such a body too)."""
    head = one_row().replace(b'"shape": [1], "data": [1.5]}', b'"shape": [1], "parameters": {"binary_data_size": 4}}')
    price = np.array([1.5], dtype="<f4").tobytes()
    ok = post(server, "/v2/models/ctr/infer", head + price, {"Inference-Header-Content-Length": str(len(head))})
    assert ok.status_code == 200 and ok.json()["outputs"] == post(server, "/v2/models/ctr/infer",
                                                                   one_row()).json()["outputs"], ok.text
    r = post(server, "/v2/models/ctr/infer", head + price + b"\0" * 4,
             {"Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400 and r.json()["error"] == (
        f"the body has 4 bytes after the JSON part and the inputs' binary data ({len(head)} + the binary_data_size "
        f"of each input = {len(head) + 4} of {len(head) + 8} bytes): each binary input's binary_data_size must be its "
        "tensor's bytes"), r.text


def test_json_data_of_mixed_types_names_the_first_value_of_the_wrong_type(server):
    """A number among strings got pyarrow's words about the string after it ("Could not convert 'u2' with type
    str: tried to convert to int64")."""
    for data, wrong in (('[7, "u2"]', "number 7 at position 0"), ('["u1", true]', "bool True at position 1"),
                        ('[["u1"], "u2"]', "list ['u1'] at position 0")):
        body = one_row().replace(b'"shape": [0], "data": []', b'"shape": [2], "data": ' + data.encode())
        r = post(server, "/v2/models/ctr/infer", body.replace(b'"data": [0]', b'"data": [2]'))  # tags, 2 ids
        want = f"input 'tags': BYTES values must be strings, got {wrong}"
        assert r.status_code == 400 and r.json()["error"] == want, r.text
    assert post(server, "/v2/models/ctr/infer", one_row()).status_code == 200  # and it keeps serving


def test_a_json_number_past_float64_reads_as_infinity_and_follows_the_dense_rule(server):
    """1e400 is a JSON number; it was a 400 naming no input ("not valid JSON (number is infinity when parsed as
    double)"), where the docs read a dense value past float32 as inf, and inf as the training max."""
    for big, same_as in (("1e400", "Infinity"), ("-1e400", "-Infinity")):
        r, s = post(server, "/v2/models/ctr/infer", one_row(big)), post(server, "/v2/models/ctr/infer",
                                                                         one_row(same_as))
        assert r.status_code == s.status_code == 200, (r.text, s.text)
        assert r.json()["outputs"] == s.json()["outputs"]
    r = post(server, "/v2/models/ctr/infer", one_row(item="1e400"))
    assert r.status_code == 400 and r.json()["error"].startswith("input 'item'"), r.text


def test_a_dense_column_sent_as_integers_scores_as_predict_reads_an_integer_column(server, run, tmp_path):
    """Census ages and hours are integer columns in Parquet, which `train` and `predict` read as dense values; sent
    as INT64 (or INT32) they were a 400 ("datatype must be FP32 or FP64"). Bit-equal to `predict` of a file whose
    column is int64, over HTTP (binary and JSON) and gRPC; an integer float64 cannot hold is a 400 naming it."""
    import pyarrow as pa

    from dynemb.cli import main

    table = pq.read_table(run / "test.parquet").slice(0, ROWS)
    whole = pa.array(np.floor(table.column("price").to_numpy()).astype(np.int64) - 20)  # negatives too
    table = table.set_column(table.schema.get_field_index("price"), "price", whole)
    pq.write_table(table, tmp_path / "ints.parquet")
    assert main(["predict", "--model", str(run / "run"), "--data", str(tmp_path / "ints.parquet"), "--out",
                 str(tmp_path / "p.parquet")]) == 0
    want = pq.read_table(tmp_path / "p.parquet").column("probability").to_numpy()
    d = table.to_pydict()
    for datatype, dtype in (("INT64", np.int64), ("INT32", np.int32)):
        arrays = {"user": (np.array(d["user"], dtype=object), "BYTES"), "item": (np.array(d["item"]), "INT64"),
                  "tags": (np.array([t for bag in d["tags"] for t in bag], dtype=object), "BYTES"),
                  "tags__lengths": (np.array([len(b) for b in d["tags"]], dtype=np.int32), "INT32"),
                  "price": (np.array(d["price"], dtype=dtype), datatype)}
        for binary in (True, False):
            got = http.InferenceServerClient(server[0]).infer("ctr", inputs(http, arrays, binary),
                                                              headers=dict(HEADERS)).as_numpy("probability")
            assert np.array_equal(got, want), (datatype, binary)
        got = grpcclient.InferenceServerClient(server[1]).infer(
            "ctr", inputs(grpcclient, arrays), headers={"authorization": f"Bearer {TOKEN}"}).as_numpy("probability")
        assert np.array_equal(got, want), datatype
    body = one_row().replace(b'"datatype": "FP32", "shape": [1], "data": [1.5]',
                             b'"datatype": "INT64", "shape": [1], "data": [9007199254740993]')
    r = post(server, "/v2/models/ctr/infer", body)
    assert r.status_code == 400 and r.json()["error"].startswith("input 'price'"), r.text
    r = post(server, "/v2/models/ctr/infer", one_row().replace(b'"datatype": "FP32"', b'"datatype": "BYTES"'))
    assert r.status_code == 400 and r.json()["error"] == (
        "input 'price': datatype must be FP32, FP64 or an integer datatype (INT64, INT32, INT16, INT8, UINT64, "
        "UINT32, UINT16, UINT8), got 'BYTES'"), r.text


def test_compressed_bodies_both_ways_and_their_limits(server):
    plain = post(server, "/v2/models/ctr/infer", one_row())
    assert plain.status_code == 200
    for encoding, packed in (("gzip", gzip.compress(one_row())), ("deflate", zlib.compress(one_row())),
                             ("deflate", zlib.compress(one_row())[2:-4])):  # raw deflate too
        r = post(server, "/v2/models/ctr/infer", packed, {"Content-Encoding": encoding, "Accept-Encoding": encoding})
        assert r.status_code == 200 and r.headers["content-encoding"] == encoding, r.text
        assert r.json() == plain.json()  # httpx inflates it
    r = post(server, "/v2/models/ctr/infer", b"not gzip", {"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "gzip" in r.json()["error"]
    r = post(server, "/v2/models/ctr/infer", one_row(), {"Content-Encoding": "br"})
    assert r.status_code == 400 and "Content-Encoding" in r.json()["error"]
    bomb = gzip.compress(b" " * (9 << 20))  # 9 MiB of spaces: under 10 KB sent, over the 8 MiB limit inflated
    r = post(server, "/v2/models/ctr/infer", bomb, {"Content-Encoding": "gzip"})
    assert r.status_code == 400 and "once inflated" in r.json()["error"]


@pytest.mark.slow
def test_a_watching_server_is_live_before_its_first_version_and_ready_after(run, tmp_path):
    from dynemb.checkpoint import export_for_serving
    from dynemb.job import load_model

    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--model", str(run / "run"), "--name", "ctr",
                             "--export", str(tmp_path / "exp"), "--watch", "0.2", "--port", str(port),
                             "--grpc-port", str(grpc_port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert "waiting for the first version" in proc.stdout.readline()
        deadline = time.monotonic() + 60
        while True:
            try:
                live = httpx.get(f"{url}/v2/health/live", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.1)
        assert live.status_code == 200
        ready = httpx.get(f"{url}/v2/health/ready", timeout=5)
        assert ready.status_code == 503 and "waiting for the first version" in ready.json()["error"]
        client = http.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_server_live() and not client.is_server_ready() and not client.is_model_ready("ctr")
        r = httpx.post(f"{url}/v2/models/ctr/infer", content=one_row(), timeout=5)
        assert r.status_code == 503 and "not ready" in r.json()["error"]
        with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}") as g:
            assert g.is_server_live() and not g.is_server_ready()
        export_for_serving(tmp_path / "exp", load_model(run / "run")[0])
        wait_ready(url, proc, token=None)
        assert client.is_model_ready("ctr", "1")
        assert json.loads(httpx.post(f"{url}/v2/models/ctr/infer", content=one_row(), timeout=30).text)[
            "model_version"] == "1"
        client.close()
    finally:
        stop(proc)


def test_metrics_are_prometheus_text_that_its_parser_reads(server, rows):
    from prometheus_client.parser import text_string_to_metric_families

    from dynemb.endpoint.prometheus_metrics import METRIC_NAMES

    arrays, _ = rows
    client = http.InferenceServerClient(server[0], network_timeout=30)
    try:
        client.infer("ctr", inputs(http, arrays), headers=dict(HEADERS))
        with pytest.raises(InferenceServerException):
            client.infer("ctr", inputs(http, {**arrays, "item": (arrays["item"][0][:-1], "INT64")}),
                         headers=dict(HEADERS))
    finally:
        client.close()
    with grpcclient.InferenceServerClient(server[1]) as g:
        g.infer("ctr", inputs(grpcclient, arrays), headers={"authorization": f"Bearer {TOKEN}"})
    assert httpx.get(f"http://{server[0]}/metrics", timeout=30).status_code == 401  # the token guards it too
    r = httpx.get(f"http://{server[0]}/metrics", headers=dict(HEADERS), timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    # The parser names a counter without its _total suffix.
    assert {n.removesuffix("_total") for n in METRIC_NAMES} <= set(families), sorted(families)

    def value(family, suffix="", **labels):
        return sum(s.value for s in families[family].samples
                   if s.name == family + suffix and all(s.labels.get(k) == v for k, v in labels.items()))

    for protocol in ("http", "grpc"):
        assert value("dynemb_requests", "_total", model="ctr", route="infer", protocol=protocol) >= 1
        assert value("dynemb_request_duration_seconds", "_count", route="infer", protocol=protocol) >= 1
        assert value("dynemb_request_rows", "_sum", protocol=protocol) >= ROWS
    assert value("dynemb_request_failures", "_total", route="infer", protocol="http") >= 1
    assert value("dynemb_forward_rows", "_sum", model="ctr") >= 2 * ROWS
    looked = {tier: value("dynemb_rows_looked_up", "_total", tier=tier)
              for tier in ("cache", "volatile", "persistent", "default")}
    assert looked["cache"] + looked["volatile"] > 0
    rates = [value("dynemb_tier_hit_rate", tier=tier) for tier in looked]
    assert all(0 <= r <= 1 for r in rates) and abs(sum(rates) - 1) < 1e-9
    assert value("dynemb_model_ready", model="ctr") == 1 and value("dynemb_model_version", model="ctr") == 1
    assert value("dynemb_newest_version", model="ctr") == 1
    assert 0 <= value("dynemb_newest_version_age_seconds", model="ctr") < 3600
