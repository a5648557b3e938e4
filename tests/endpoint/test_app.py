"""``dynemb serve``'s endpoint against ``dynemb predict`` on the same rows; malformed requests; health,
metadata and the bearer token. The client is ``tritonclient.http`` (the Triton/KServe v2 client), plus ``httpx``
for requests a v2 client would never send."""

import concurrent.futures

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.endpoint import ServedModel, build_app, running

tritonclient_http = pytest.importorskip("tritonclient.http")

TIMEOUT = 30.0


@pytest.fixture(scope="module")
def served(run):
    model = ServedModel(run / "run", name="ctr")
    yield model
    model.close()


@pytest.fixture(scope="module")
def url(served):
    with running(build_app(served, max_batch_size=512)) as base:
        yield base


def triton_inputs(table: pa.Table, binary: bool, item=np.int64, price=np.float32) -> list:
    d = table.to_pydict()
    tags = d["tags"]
    arrays = {"user": np.array(d["user"], dtype=object), "item": np.array(d["item"], dtype=item),
              "tags": np.array([t for bag in tags for t in bag], dtype=object),
              "tags__lengths": np.array([len(bag) for bag in tags], dtype=np.int32),
              "price": np.array(d["price"], dtype=price)}
    types = {"user": "BYTES", "item": "INT64" if item == np.int64 else "INT32", "tags": "BYTES",
             "tags__lengths": "INT32", "price": "FP32" if price == np.float32 else "FP64"}
    inputs = []
    for name, a in arrays.items():
        t = tritonclient_http.InferInput(name, list(a.shape), types[name])
        t.set_data_from_numpy(a, binary_data=binary)
        inputs.append(t)
    return inputs


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_probabilities_equal_dynemb_predict(run, url, binary):
    client = tritonclient_http.InferenceServerClient(url.removeprefix("http://"), network_timeout=TIMEOUT)
    try:
        result = client.infer("ctr", triton_inputs(pq.read_table(run / "test.parquet"), binary))
    finally:
        client.close()
    got = result.as_numpy("probability")
    expected = np.asarray(pq.read_table(run / "preds.parquet").column("probability").to_pylist(), dtype=np.float64)
    assert got.dtype == np.float64 and got.shape == expected.shape == (300,)
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
    assert np.ptp(expected) > 0.01  # the model is not constant, so equality means something


def test_health_and_metadata(url):
    client = tritonclient_http.InferenceServerClient(url.removeprefix("http://"), network_timeout=TIMEOUT)
    try:
        assert client.is_server_live() and client.is_server_ready()
        meta = client.get_model_metadata("ctr")
    finally:
        client.close()
    assert meta["name"] == "ctr" and meta["versions"] == ["1"]
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [
        ("user", "BYTES"), ("item", "INT64"), ("tags", "BYTES"), ("tags__lengths", "INT32"), ("price", "FP32")]
    assert meta["outputs"] == [{"name": "probability", "datatype": "FP64", "shape": [-1]}]
    assert httpx.get(f"{url}/v2/models/other", timeout=TIMEOUT).status_code == 404


def test_bytes_ids_of_an_integer_column_score_as_the_integers_they_spell(url):
    # `item` is an int64 Parquet column, INT64 in model.json: "17" is the id 17. Text that is no canonical integer
    # ("017", "+17") is a 400 naming the input, the row and the value, as the CSV reader's error names them.
    items = [17, 3, -1, 0, 9223372036854775807, -9223372036854775808]
    as_int = body(rows=len(items), item={"data": items})
    as_text = body(rows=len(items), item={"datatype": "BYTES", "data": [str(i) for i in items]})
    odd = body(rows=3, item={"datatype": "BYTES", "data": ["17", "017", "+17"]})
    scores = [httpx.post(f"{url}/v2/models/ctr/infer", json=b, timeout=TIMEOUT) for b in (as_int, as_text, odd)]
    assert [r.status_code for r in scores] == [200, 200, 400]
    assert scores[0].json()["outputs"][0]["data"] == scores[1].json()["outputs"][0]["data"]
    assert scores[2].json()["error"] == ("input 'item': '017' at row 1 is not an integer id, and the model reads "
                                         "'item' as INT64 ids (id_types in model.json)")


def body(rows: int = 2, **replace) -> dict:
    inputs = {"user": {"name": "user", "datatype": "BYTES", "shape": [rows], "data": ["u1"] * rows},
              "item": {"name": "item", "datatype": "INT64", "shape": [rows], "data": [3] * rows},
              "tags": {"name": "tags", "datatype": "BYTES", "shape": [rows], "data": ["t1"] * rows},
              "tags__lengths": {"name": "tags__lengths", "datatype": "INT32", "shape": [rows], "data": [1] * rows},
              "price": {"name": "price", "datatype": "FP32", "shape": [rows], "data": [1.5] * rows}}
    for name, value in replace.items():
        if value is None:
            del inputs[name]
        else:
            inputs[name] = {**inputs[name], **value}
    return {"inputs": list(inputs.values())}


MALFORMED = {
    "wrong datatype": (body(item={"datatype": "FP32"}), "'item'"),
    "missing input": (body(price=None), "'price'"),
    "lengths do not sum to the ids": (body(tags__lengths={"data": [1, 2]}), "'tags__lengths'"),
    "rows disagree": (body(price={"shape": [3], "data": [1.0, 2.0, 3.0]}), "'price'"),
    "shape disagrees with data": (body(user={"shape": [3]}), "'user'"),
    "strings as INT64": (body(item={"data": ["a", "b"]}), "'item'"),
    "unknown input": ({"inputs": body()["inputs"] + [{"name": "zzz", "datatype": "FP32", "shape": [2],
                                                       "data": [0, 0]}]}, "'zzz'"),
    "too many rows": (body(rows=513), "'user'"),
    "a float as INT64": (body(item={"data": [3, 1.5]}), "'item'"),
    "a bool as INT64": (body(item={"data": [3, True]}), "'item'"),
    "a bool as FP32": (body(price={"data": [1.0, False]}), "'price'"),
    "a negative length": (body(tags__lengths={"data": [-1, 3]}, tags={"shape": [2], "data": ["a", "b"]}),
                          "'tags__lengths'"),
    "an INT32 id beyond int32": (body(item={"datatype": "INT32", "data": [3, 9999999999]}),
                                 "input 'item': INT32 values must be in [-2147483648, 2147483647], got 9999999999"),
    "an INT32 length beyond int32": (body(tags__lengths={"data": [1, -(2**31) - 1]}), "'tags__lengths'"),
    "an unknown output": ({**body(), "outputs": [{"name": "probability"}, {"name": "logit"}]},
                          "output 'logit' is not an output of this model (it has ['probability'])"),
    "outputs not a list of named objects": ({**body(), "outputs": "probability"}, "'outputs' must be a list"),
    "null data (BYTES)": (body(user={"data": None}), "'user'"),
    "null data (INT64)": (body(item={"data": None}), "'item'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_request_is_a_400_naming_the_input_and_the_server_stays_up(url, case):
    payload, named = MALFORMED[case]
    r = httpx.post(f"{url}/v2/models/ctr/infer", json=payload, timeout=TIMEOUT)
    assert r.status_code == 400 and named in r.json()["error"], r.text
    ok = httpx.post(f"{url}/v2/models/ctr/infer", json=body(), timeout=TIMEOUT)
    assert ok.status_code == 200 and len(ok.json()["outputs"][0]["data"]) == 2


def test_bad_json_and_a_10_mb_body_are_400s(url):
    r = httpx.post(f"{url}/v2/models/ctr/infer", content=b"{not json", timeout=TIMEOUT)
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    big = b'{"inputs": [' + b" " * (10 << 20) + b"]}"
    r = httpx.post(f"{url}/v2/models/ctr/infer", content=big, timeout=TIMEOUT)
    assert r.status_code == 400 and "limit" in r.json()["error"]
    assert httpx.get(f"{url}/v2/health/live", timeout=TIMEOUT).status_code == 200


def test_concurrent_requests_get_their_own_rows(run, served, url):
    table = pq.read_table(run / "test.parquet")
    expected = np.asarray(pq.read_table(run / "preds.parquet").column("probability").to_pylist(), dtype=np.float64)

    def one(i):
        start = (i * 17) % (len(expected) - 20)
        with tritonclient_http.InferenceServerClient(url.removeprefix("http://"), network_timeout=TIMEOUT) as c:
            got = c.infer("ctr", triton_inputs(table.slice(start, 1 + i % 20), False)).as_numpy("probability")
        return start, got

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for start, got in pool.map(one, range(32)):
            np.testing.assert_allclose(got, expected[start:start + len(got)], atol=1e-6, rtol=0)


def test_the_token_guards_every_route(served):
    with running(build_app(served, token="s3cret")) as base:
        for method, path in [("GET", "/v2/health/live"), ("GET", "/v2/health/ready"), ("GET", "/v2/models/ctr"),
                             ("POST", "/v2/models/ctr/infer")]:
            payload = body() if method == "POST" else None
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                r = httpx.request(method, base + path, json=payload, headers=headers, timeout=TIMEOUT)
                assert r.status_code == 401, (path, headers)
            r = httpx.request(method, base + path, json=payload, headers={"Authorization": "Bearer s3cret"},
                              timeout=TIMEOUT)
            assert r.status_code == 200, (path, r.text)


def test_waiting_requests_share_a_forward_pass_up_to_max_batch_size(run, served):
    import asyncio

    from dynemb.data import FileReader
    from dynemb.data.batch import slice_rows
    from dynemb.endpoint.service import Batcher

    prep = served.preprocessing
    batch = next(iter(FileReader(run / "test.parquet", label=None, categorical=prep.categorical,
                                 multi_hot=prep.multi_hot, dense=prep.dense, batch_size=40)))
    parts = [slice_rows(batch, i, i + 10) for i in range(0, 40, 10)]
    expected = served.predict(batch)

    async def score_all(max_rows):
        batcher = Batcher(served, max_rows)
        try:
            got = await asyncio.gather(*(batcher.score(p) for p in parts))
        finally:
            batcher.close()
        assert {version for _, version in got} == {served.version} and batcher.inline_passes == 0
        return torch.cat([p["probability"] for p, _ in got]), batcher.forward_passes

    got, passes = asyncio.run(score_all(40))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert passes == 1

    async def alone():  # a request alone is scored on the event loop's thread, no hand-off
        batcher = Batcher(served, 40)
        try:
            outputs, version = await batcher.score(parts[0])
        finally:
            batcher.close()
        return outputs["probability"], batcher.inline_passes

    probs, inline = asyncio.run(alone())
    torch.testing.assert_close(probs, expected[:10], atol=1e-6, rtol=0)
    assert inline == 1
    got, passes = asyncio.run(score_all(20))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert passes == 2


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_int32_ids_and_fp64_dense_values_score_as_int64_and_fp32(run, url, binary):
    """What a user's numpy arrays often are: int32 ids, float64 prices."""
    table = pq.read_table(run / "test.parquet").slice(0, 40)
    client = tritonclient_http.InferenceServerClient(url.removeprefix("http://"), network_timeout=TIMEOUT)
    try:
        plain = client.infer("ctr", triton_inputs(table, binary)).as_numpy("probability")
        other = client.infer("ctr", triton_inputs(table, binary, np.int32, np.float64)).as_numpy("probability")
        unknown = triton_inputs(table, binary)
        unknown[-1] = tritonclient_http.InferInput("price", [40], "FP16")
        unknown[-1].set_data_from_numpy(np.ones(40, np.float16), binary_data=True)
        with pytest.raises(tritonclient_http.InferenceServerException, match="'price'.*FP16"):
            client.infer("ctr", unknown)
    finally:
        client.close()
    np.testing.assert_allclose(other, plain, atol=1e-6, rtol=0)


def test_statistics_count_requests_rows_and_forward_passes_as_triton_reports_them(served):
    # A fresh app: its counts start at zero.
    with running(build_app(served)) as base:
        with tritonclient_http.InferenceServerClient(base.removeprefix("http://"), network_timeout=TIMEOUT) as c:
            assert c.get_inference_statistics("ctr")["model_stats"][0]["inference_count"] == 0
            for rows in (2, 5):
                assert httpx.post(f"{base}/v2/models/ctr/infer", json=body(rows=rows), timeout=TIMEOUT).is_success
            bad = httpx.post(f"{base}/v2/models/ctr/infer", json=body(price=None), timeout=TIMEOUT)
            assert bad.status_code == 400
            stats = c.get_inference_statistics("ctr")["model_stats"]
            assert c.get_inference_statistics()["model_stats"] == stats  # every model: this one
        (s,) = stats
        assert (s["name"], s["version"]) == ("ctr", str(served.version))
        assert s["inference_count"] == 7 and s["execution_count"] == 2 and s["last_inference"] > 0
        assert s["inference_stats"]["success"]["count"] == 2 and s["inference_stats"]["fail"]["count"] == 1
        assert s["inference_stats"]["success"]["ns"] >= s["inference_stats"]["compute_infer"]["ns"] > 0
        assert httpx.get(f"{base}/v2/models/other/stats", timeout=TIMEOUT).status_code == 404
        assert httpx.get(f"{base}/v2/models/ctr/versions/999/stats", timeout=TIMEOUT).status_code == 404
        ok = httpx.get(f"{base}/v2/models/ctr/versions/{served.version}/stats", timeout=TIMEOUT)
        assert ok.json()["model_stats"][0]["execution_count"] == 2


def test_infer_answers_other_methods_unknown_models_and_paths_in_json(url):
    for method in ("GET", "PUT", "DELETE"):
        r = httpx.request(method, f"{url}/v2/models/ctr/infer", timeout=TIMEOUT)
        assert r.status_code == 405 and "POST" in r.json()["error"], method
    r = httpx.post(f"{url}/v2/models/other/infer", json=body(), timeout=TIMEOUT)
    assert r.status_code == 404 and "'other'" in r.json()["error"]
    assert httpx.post(f"{url}/v2/models/ctr/infer/more", json=body(), timeout=TIMEOUT).status_code == 404
    assert httpx.post(f"{url}/v2/models//infer", json=body(), timeout=TIMEOUT).status_code == 404
    r = httpx.post(f"{url}/v2/models/ctr/infer", json=body(), timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"


@pytest.mark.parametrize("size", [2 << 10, 100 << 10])  # read and dropped; past DRAIN_FACTOR x the limit: not read
def test_an_oversized_body_is_a_400_the_client_receives_and_the_server_stays_up(served, size):
    from geventhttpclient import HTTPClient  # what tritonclient.http sends with: it sends the body, then reads

    with running(build_app(served, max_body_bytes=1 << 10)) as base:
        host, port = base.removeprefix("http://").split(":")
        for chunked in (False, True):
            client = HTTPClient(host, int(port), network_timeout=TIMEOUT)
            try:
                data = b" " * size
                r = client.post("/v2/models/ctr/infer", iter([data]) if chunked else data,
                                {"Content-Type": "application/json"})
                assert r.status_code == 400 and b"limit" in r.read()
            finally:
                client.close()
        assert httpx.post(f"{base}/v2/models/ctr/infer", json=body(), timeout=TIMEOUT).status_code == 200
