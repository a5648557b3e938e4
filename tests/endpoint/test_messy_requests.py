"""The endpoint follows the model's rules (docs/cli.md, "Ids, nulls and non-finite values"), as ``dynemb predict``
does on files: the same rows sent with any id datatype (INT64, INT32, BYTES) score alike, and dense ``null``,
NaN, ``inf`` and ``-inf`` (JSON, binary FP32, binary FP64) score as the Parquet and CSV files of those rows."""

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.cli import main
from dynemb.endpoint import ServedModel, build_app, running

tritonclient_http = pytest.importorskip("tritonclient.http")

ROWS, TIMEOUT = 200, 30.0


def rows(n: int, seed: int, messy: bool) -> pa.Table:
    """Zip codes as digit-only text (BYTES ids), shops as integers (INT64 ids), categories as integer lists and a
    price; ``messy``: the price has NaN, nulls, inf and -inf."""
    g = np.random.default_rng(seed)
    zip_, shop = g.integers(0, 30, n), g.integers(0, 20, n)
    logit = 1.2 * (zip_ % 3 - 1) + 0.8 * (shop % 2) - 0.3
    price = (g.random(n) * 80).tolist()
    if messy:
        for i in range(n):
            price[i] = [float("nan"), None, float("inf"), float("-inf"), price[i]][i % 5]
    return pa.table({"click": (g.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int64),
                     "zip": [str(10000 + z) for z in zip_], "shop": shop * 7919,
                     "cats": pa.array([[int(c) for c in g.integers(0, 6, 1 + i % 3)] for i in range(n)],
                                      pa.list_(pa.int64())),
                     "price": price})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``(run directory, served model, its URL, predict's probabilities of the messy rows as Parquet and CSV)``."""
    tmp = tmp_path_factory.mktemp("messy-serve")
    pq.write_table(rows(1500, 0, messy=False), tmp / "train.parquet")
    scored = rows(ROWS, 1, messy=True)
    pq.write_table(scored, tmp / "rows.parquet")
    cats = ["|".join(map(str, c)) for c in scored.column("cats").to_pylist()]
    pcsv.write_csv(scored.set_column(3, "cats", pa.array(cats)), tmp / "rows.csv")
    threads = torch.get_num_threads()
    try:
        assert main([str(a) for a in ["train", "--data", tmp / "train.parquet", "--label", "click", "--categorical",
                                      "zip,shop", "--multi-hot", "cats", "--dense", "price", "--out", tmp / "run",
                                      "--epochs", "4", "--batch-size", "128", "--dim", "4", "--no-progress"]]) == 0
        predicted = {}
        for name in ("rows.parquet", "rows.csv"):
            assert main(["predict", "--model", str(tmp / "run"), "--data", str(tmp / name), "--out",
                         str(tmp / f"p-{name}.parquet"), "--batch-size", str(ROWS)]) == 0
            predicted[name] = pq.read_table(tmp / f"p-{name}.parquet").column("probability").to_numpy()
    finally:
        torch.set_num_threads(threads)
    model = ServedModel(tmp / "run", name="ctr")
    try:
        with running(build_app(model, max_batch_size=512)) as url:
            yield tmp, model, url, predicted
    finally:
        model.close()


def infer(url: str, table: pa.Table, types: dict, binary: bool) -> np.ndarray:
    """The probabilities of ``table``'s rows, each input sent as ``types[name]``, via ``tritonclient``."""
    d = table.to_pydict()
    bags = d["cats"]
    as_type = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "FP64": np.float64}
    values = {"zip": d["zip"], "shop": d["shop"], "cats": [c for bag in bags for c in bag],
              "price": [np.nan if p is None else p for p in d["price"]]}
    inputs = []
    for name, data in values.items():
        kind = types[name]
        if kind == "BYTES":
            array = np.array([str(v) for v in data], dtype=object)
        else:
            array = np.array([int(v) for v in data] if kind.startswith("INT") else data, dtype=as_type[kind])
        t = tritonclient_http.InferInput(name, [len(array)], kind)
        t.set_data_from_numpy(array, binary_data=binary)
        inputs.append(t)
    lengths = tritonclient_http.InferInput("cats__lengths", [len(bags)], "INT32")
    lengths.set_data_from_numpy(np.array([len(b) for b in bags], dtype=np.int32), binary_data=binary)
    client = tritonclient_http.InferenceServerClient(url.removeprefix("http://"), network_timeout=TIMEOUT)
    try:
        return client.infer("ctr", [*inputs, lengths]).as_numpy("probability")
    finally:
        client.close()


@pytest.mark.parametrize("dense", ["FP32", "FP64"])
def test_any_id_datatype_and_non_finite_dense_values_score_as_the_files_do(served, dense):
    tmp, _, url, predicted = served
    table = pq.read_table(tmp / "rows.parquet")
    # the metadata's datatypes: zip is BYTES (a string column in training), shop and cats INT64
    native = infer(url, table, {"zip": "BYTES", "shop": "INT64", "cats": "INT64", "price": dense}, binary=True)
    assert np.isfinite(native).all() and np.ptp(native) > 0.01
    np.testing.assert_array_equal(native, predicted["rows.parquet"])  # one batch of the same rows on each side
    np.testing.assert_array_equal(predicted["rows.csv"], predicted["rows.parquet"])  # the files agree exactly
    # every other datatype of the same ids: the same scores, bit for bit (the same batch, the same ids)
    for types in ({"zip": "INT64", "shop": "BYTES", "cats": "BYTES"}, {"zip": "INT32", "shop": "INT32",
                                                                        "cats": "INT32"}):
        other = infer(url, table, {**types, "price": dense}, binary=True)
        np.testing.assert_array_equal(other, native, err_msg=str(types))


def test_json_null_reads_as_binary_nan_does(served):
    tmp, _, url, _ = served
    table = pq.read_table(tmp / "rows.parquet")
    price = table.column("price").to_pylist()
    subset = table.take([i for i, p in enumerate(price) if p is None or not np.isinf(p)])  # JSON has no inf
    as_binary = infer(url, subset, {"zip": "BYTES", "shop": "INT64", "cats": "INT64", "price": "FP64"}, binary=True)
    d = subset.to_pydict()
    data = {"zip": ("BYTES", d["zip"]), "shop": ("INT64", d["shop"]),
            "cats": ("INT64", [c for bag in d["cats"] for c in bag]),
            "cats__lengths": ("INT32", [len(bag) for bag in d["cats"]]),
            "price": ("FP64", [None if p is None or np.isnan(p) else p for p in d["price"]])}  # NaN as null
    body = {"inputs": [{"name": n, "datatype": t, "shape": [len(v)], "data": v} for n, (t, v) in data.items()]}
    response = httpx.post(f"{url}/v2/models/ctr/infer", json=body, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    assert None in data["price"][1] and any(p is not None and np.isnan(p) for p in d["price"])
    np.testing.assert_array_equal(np.asarray(response.json()["outputs"][0]["data"], np.float64), as_binary)


def test_an_id_input_of_a_float_datatype_or_unreadable_text_is_a_400_naming_the_input(served):
    _, _, url, _ = served
    base = {"zip": ("BYTES", ["10001"]), "shop": ("INT64", [7919]), "cats": ("INT64", [1]),
            "cats__lengths": ("INT32", [1]), "price": ("FP32", [None])}

    def post(**replace):
        inputs = {**base, **replace}
        body = {"inputs": [{"name": n, "datatype": d, "shape": [len(v)], "data": v} for n, (d, v) in inputs.items()]}
        return httpx.post(f"{url}/v2/models/ctr/infer", json=body, timeout=TIMEOUT)

    assert post().status_code == 200
    for replace, error in [
        ({"shop": ("FP32", [7919.0])}, "input 'shop': datatype must be BYTES or an integer datatype "
                                       "(INT64, INT32, INT16, INT8, UINT64, UINT32, UINT16, UINT8), got 'FP32'"),
        ({"zip": ("FP64", [10001.0])}, "input 'zip': datatype must be BYTES or an integer datatype "
                                       "(INT64, INT32, INT16, INT8, UINT64, UINT32, UINT16, UINT8), got 'FP64'"),
        ({"shop": ("BYTES", ["7919.0"])}, "input 'shop': '7919.0' at row 0 is not an integer id, and the model "
                                          "reads 'shop' as INT64 ids (id_types in model.json)"),
        ({"cats": ("BYTES", ["1", "x"]), "cats__lengths": ("INT32", [2])},
         "input 'cats': 'x' at row 0 is not an integer id, and the model reads 'cats' as INT64 ids (id_types in "
         "model.json)")]:
        response = post(**replace)
        assert (response.status_code, response.json()) == (400, {"error": error})


def test_metadata_reports_the_model_id_types(served):
    _, _, url, _ = served
    meta = httpx.get(f"{url}/v2/models/ctr", timeout=TIMEOUT).json()
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [
        ("zip", "BYTES"), ("shop", "INT64"), ("cats", "INT64"), ("cats__lengths", "INT32"), ("price", "FP32")]
