"""``dynemb.serving.export_model`` + ``dynemb serve --export``: two models written by hand (``hand_models``: a
TorchRec-style DLRM fed by a KeyedJaggedTensor, a two-tower model) are exported after a few training steps and
served, in process (:class:`~dynemb.serving.ExportedModel`) and by a real ``dynemb serve`` process over HTTP and
gRPC with tritonclient. Served outputs are bit-equal to the eager model's in eval mode (``torch.equal``; over the
wire too: FP32 values travel exactly), for a batch of 1 and for ids training never saw (their tables' initializer
rows, as the eager model reads them). ``--watch`` follows a second version; bad inputs get a 400 naming them."""

import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
import torch

from hand_models import DLRM, KJT, TwoTower, dlrm_batch, train, two_tower_batch
from test_command import SRC, free_port, stop, wait_ready

import dynemb
from dynemb import DynamicEmbedding
from dynemb.serving import ExportedModel, export_model

UNSEEN = 10_000  # ids from here on were never trained


def dlrm_inputs(batch) -> dict:
    dense, kjt = batch
    return {"dense": dense, "sparse_values": kjt.values(), "sparse_lengths": kjt.lengths()}


def two_tower_inputs(batch) -> dict:
    return dict(zip(("user_id", "history", "history_lengths", "item_id"), batch))


def with_unseen(batch, model=None):
    """``batch`` with some ids shifted past every trained id."""
    if model is not None:  # DLRM
        dense, kjt = batch
        values = kjt.values().clone()
        values[::2] += UNSEEN
        return dense, KJT(kjt.keys(), values, kjt.lengths())
    user, history, lengths, item = (t.clone() for t in batch)
    user[0] += UNSEEN
    item[-1] += UNSEEN
    history[::3] += UNSEEN
    return user, history, lengths, item


@pytest.fixture(scope="module")
def trained():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    dlrm, two_tower = DLRM(), TwoTower()
    train(dlrm, lambda: dlrm_batch(dlrm, 32, g), 4)
    train(two_tower, lambda: two_tower_batch(32, g), 4)
    return dlrm, two_tower, g


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    dlrm, two_tower, g = trained
    root = tmp_path_factory.mktemp("export_model")
    export_model(root / "dlrm", dlrm, dlrm_batch(dlrm, 8, g))
    export_model(root / "two_tower", two_tower, two_tower_batch(8, g))
    dlrm.eval()
    two_tower.eval()
    return root


def eager(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(*batch)


def test_exported_models_serve_the_eager_outputs_in_process(trained, exported):
    dlrm, two_tower, g = trained
    sizes = [t.size() for t in dlrm.sparse_arch.dynemb_tables()]
    for root, model, batches, inputs in (
            (exported / "dlrm", dlrm, lambda n: dlrm_batch(dlrm, n, g), dlrm_inputs),
            (exported / "two_tower", two_tower, lambda n: two_tower_batch(n, g), two_tower_inputs)):
        served = ExportedModel(root, name="m")
        try:
            assert served.version == 1
            for rows in (1, 2, 17):
                batch = batches(rows)
                for b in (batch, with_unseen(batch, model if model is dlrm else None)):
                    got, version = served(inputs(b))
                    assert version == 1 and list(got) == ["output"]
                    assert torch.equal(got["output"], eager(model, b)), (root.name, rows)
        finally:
            served.close()
    # the eager model in eval mode read the unseen ids' default rows without inserting them
    assert [t.size() for t in dlrm.sparse_arch.dynemb_tables()] == sizes


def test_the_export_names_the_users_inputs_and_binds_lookups_by_name(exported):
    import json

    manifest = json.loads((exported / "dlrm" / "version-00000001" / "manifest.json").read_text())
    program = manifest["program"]
    assert program["inputs"] == [{"name": "dense", "dtype": "float32", "shape": [-1, 4]},
                                 {"name": "sparse_values", "dtype": "int64", "shape": [-1]},
                                 {"name": "sparse_lengths", "dtype": "int64", "shape": [-1]}]
    assert program["outputs"] == [{"name": "output", "dtype": "float32", "shape": [-1]}]
    assert (program["batch_input"], program["batch_divisor"]) == ("dense", 1)
    assert sorted(manifest["tables"]) == ["t_cat_0", "t_cat_1", "t_cat_2"]
    assert list(program["collections"]) == ["sparse_arch"]
    two = json.loads((exported / "two_tower" / "version-00000001" / "manifest.json").read_text())["program"]
    assert sorted(two["collections"]) == ["item_tower_embeddings", "user_tower_embeddings"]
    # the program holds the dense weights, not one table row
    import zipfile

    with zipfile.ZipFile(exported / "dlrm" / "version-00000001" / "program.pt2") as z:
        assert all("t_cat" not in n for n in z.namelist())
        # no pickle: no example inputs (torch.save'd), and weights as raw bytes
        assert all(z.getinfo(n).file_size == 0 for n in z.namelist() if "sample_inputs" in n)
        assert all(b'"use_pickle": true' not in z.read(n) for n in z.namelist() if n.endswith("config.json"))
        graph = next(z.read(n) for n in z.namelist() if n.endswith(".json") and b"served_features" in z.read(n))
    assert b"dynemb::served_features" in graph or b"dynemb.served_features" in graph


def test_export_model_refuses_what_it_cannot_serve(tmp_path, trained):
    dlrm, _, g = trained
    with pytest.raises(ValueError, match=r"model holds no table \(an EmbeddingCollection, DynamicEmbedding or "
                                         r"StaticEmbedding\)"):
        export_model(tmp_path / "a", torch.nn.Linear(2, 1), (torch.zeros(1, 2),))
    with pytest.raises(TypeError, match="input 'scale' must be a tensor"):
        export_model(tmp_path / "c", dlrm, dlrm_batch(dlrm, 2, g), example_kwargs={"scale": 0.5})
    assert not (tmp_path / "a").exists() and not (tmp_path / "c" / "latest").exists()


def test_example_inputs_the_collection_refuses_are_refused_at_export(tmp_path, trained):
    """Float ids export fine through the collection's stand-in, yet every request would then be refused: the
    export runs the eager model once in eval mode and refuses them with the collection's message, writing
    nothing and changing no table."""
    _, two_tower, g = trained
    user, history, lengths, item = two_tower_batch(4, g)
    sizes = [t.size() for t in two_tower.user_tower_embeddings.embeddings.values()]
    mode = two_tower.training
    with pytest.raises(TypeError, match=r"example_inputs: feature 'user_id' \(table 'user'\): ids must have dtype "
                                        r"torch.int64 .* got torch.float32"):
        export_model(tmp_path / "f", two_tower, (user.float(), history, lengths, item))
    with pytest.raises(ValueError, match=r"example_inputs: feature 'history' \(table 'tag'\): lengths"):
        export_model(tmp_path / "l", two_tower, (user, history, lengths + 1, item))
    assert not (tmp_path / "f").exists() and not (tmp_path / "l").exists()
    assert [t.size() for t in two_tower.user_tower_embeddings.embeddings.values()] == sizes
    assert two_tower.training == mode


def test_serving_a_version_directory_or_a_missing_one_says_what_to_pass(exported, tmp_path):
    with pytest.raises(ValueError, match=r"version-00000001: this is one version of the export .*two_tower; serve "
                                         r"the export's root"):
        ExportedModel(exported / "two_tower" / "version-00000001")
    with pytest.raises(ValueError, match=r"nowhere: no such directory; write one with dynemb.serving.export_model"):
        ExportedModel(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"no export there \(no 'latest'\)"):
        ExportedModel(tmp_path)
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "model.json").write_text("{}")
    with pytest.raises(ValueError, match=r"run: a `dynemb train` run directory, not an export of your own model; "
                                         r"serve it with `dynemb serve --model RUN_DIR`"):
        ExportedModel(tmp_path / "run")


def test_an_integer_input_takes_a_narrower_integer_datatype_widened():
    """INT32 ids (what many Triton clients send) for an input traced as int64 are widened, as a collection takes
    ids of a narrower integer dtype; a float datatype is still refused, naming the ones taken."""
    from dynemb.endpoint.served_export import _tensor
    from dynemb.endpoint.wire import RequestError

    spec = {"name": "user_id", "dtype": "int64", "shape": [-1]}
    ids = np.array([-2**31, 7, 2**31 - 1], dtype=np.int32)
    for data in (ids, ids.tolist()):  # a binary tensor, JSON
        got = _tensor({"datatype": "INT32", "shape": [3], "data": data}, spec)
        assert got.dtype == torch.int64 and got.tolist() == ids.tolist()
    with pytest.raises(RequestError, match=r"^input 'user_id': datatype must be INT64 \(or the narrower INT32, "
                                           r"INT16, INT8, UINT8\), got 'FP32'$"):
        _tensor({"datatype": "FP32", "shape": [3], "data": [1.0, 2.0, 3.0]}, spec)
    with pytest.raises(RequestError, match=r"^input 'x': datatype must be FP32, got 'FP64'$"):
        _tensor({"datatype": "FP64", "shape": [1], "data": [1.0]}, {"name": "x", "dtype": "float32", "shape": [-1]})


def test_a_column_b_by_1_reads_as_b_for_a_one_dimensional_input_and_other_ranks_stay_strict():
    """Triton clients send a feature as ``[B, 1]``: an input of rank 1 takes it (JSON flat or nested, binary), bit-
    equal to ``[B]``; an input of rank 2 (dense ``[B, K]``) stays as it is, and ``[B, 2]`` is still a 400."""
    from dynemb.endpoint.served_export import _tensor
    from dynemb.endpoint.wire import RequestError

    spec = {"name": "user_id", "dtype": "int64", "shape": [-1]}
    ids = np.array([-2**63, 7, 2**63 - 1], dtype=np.int64)
    want = _tensor({"datatype": "INT64", "shape": [3], "data": ids}, spec)
    for data in (ids, ids.tolist(), [[v] for v in ids.tolist()]):
        got = _tensor({"datatype": "INT64", "shape": [3, 1], "data": data}, spec)
        assert got.shape == (3,) and torch.equal(got, want)
    with pytest.raises(RequestError, match=r"^input 'user_id': shape must be \[n\] or a column \[n, 1\], n >= 0 "
                                           r"\(the model's shape is \[-1\], -1: any size\), got \[3, 2\]$"):
        _tensor({"datatype": "INT64", "shape": [3, 2], "data": list(range(6))}, spec)
    dense = {"name": "dense", "dtype": "float32", "shape": [-1, 1]}
    assert _tensor({"datatype": "FP32", "shape": [2, 1], "data": [1.0, 2.0]}, dense).shape == (2, 1)
    with pytest.raises(RequestError, match=r"^input 'dense': shape must be 2 sizes"):
        _tensor({"datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}, dense)


def test_a_bad_input_is_a_value_error_naming_it(exported):
    served = ExportedModel(exported / "dlrm", name="m")
    try:
        with pytest.raises(ValueError, match="input 'sparse_lengths' is missing"):
            served({"dense": torch.zeros(2, 4), "sparse_values": torch.zeros(0, dtype=torch.long)})
        with pytest.raises(ValueError, match=r"sparse_lengths.size\(\)\[0\] // 3 == dense.size\(\)\[0\] "
                                             r"\(got dense \[2, 4\], sparse_lengths \[5\]\)$"):
            served({"dense": torch.zeros(2, 4), "sparse_values": torch.zeros(0, dtype=torch.long),
                    "sparse_lengths": torch.zeros(5, dtype=torch.long)})
    finally:
        served.close()


def test_the_docs_example_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    section = doc.split("## Serving your own model", 1)[1]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs/serving.md", "exec"), {"__name__": "docs_example"})
    assert (tmp_path / "exports" / "two_tower" / "version-00000001" / "program.pt2").is_file()


# ------------------------------------------------------------------ a real `dynemb serve --export` process

http = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402


def start(export, name, *extra, wait: bool = True):
    port, grpc_port = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", "serve", "--export", str(export), "--name", name,
                             "--port", str(port), "--grpc-port", str(grpc_port), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        wait_ready(f"http://127.0.0.1:{port}", proc, token=None)
    return proc, f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def servers(exported):
    procs = {}
    try:
        for name in ("dlrm", "two_tower"):  # both start at once
            procs[name] = start(exported / name, name, wait=False)
        for proc, address, _ in procs.values():
            wait_ready(f"http://{address}", proc, token=None)
        yield {name: p[1:] for name, p in procs.items()}
    finally:
        for proc, *_ in procs.values():
            stop(proc)


def infer(module, address: str, name: str, inputs: dict, binary: bool = True):
    client = module.InferenceServerClient(address)
    try:
        tensors = []
        for key, value in inputs.items():
            array = value.numpy()
            tensors.append(module.InferInput(key, list(array.shape), "FP32" if array.dtype == np.float32 else "INT64"))
            if module is http:
                tensors[-1].set_data_from_numpy(array, binary_data=binary)
            else:
                tensors[-1].set_data_from_numpy(array)
        result = client.infer(name, tensors)
        response = result.get_response()
        version = response["model_version"] if module is http else response.model_version
        return result.as_numpy("output"), version
    finally:
        client.close()


@pytest.mark.slow
def test_dynemb_serve_export_answers_the_eager_outputs_over_http_and_grpc(trained, servers):
    dlrm, two_tower, g = trained
    cases = {"dlrm": (dlrm, lambda n: dlrm_batch(dlrm, n, g), dlrm_inputs),
             "two_tower": (two_tower, lambda n: two_tower_batch(n, g), two_tower_inputs)}
    for name, (model, batches, inputs) in cases.items():
        for rows in (1, 9):
            batch = with_unseen(batches(rows), model if model is dlrm else None)
            want = eager(model, batch).numpy()
            for module, binary in ((http, False), (http, True), (grpcclient, True)):
                got, version = infer(module, servers[name][0 if module is http else 1], name, inputs(batch), binary)
                assert version == "1" and got.dtype == np.float32
                np.testing.assert_array_equal(got, want)  # bit-equal


@pytest.mark.slow
def test_model_metadata_lists_the_models_inputs(servers):
    address, grpc_address = servers["dlrm"]
    meta = http.InferenceServerClient(address).get_model_metadata("dlrm")
    assert meta["platform"] == "dynemb_torch_export"
    assert meta["inputs"] == [{"name": "dense", "datatype": "FP32", "shape": [-1, 4]},
                              {"name": "sparse_values", "datatype": "INT64", "shape": [-1]},
                              {"name": "sparse_lengths", "datatype": "INT64", "shape": [-1]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1]}]
    assert grpcclient.InferenceServerClient(grpc_address).get_model_metadata("dlrm", as_json=True)["inputs"][0] == {
        "name": "dense", "datatype": "FP32", "shape": ["-1", "4"]}  # (protobuf's JSON writes int64 as text)
    grpc_meta = grpcclient.InferenceServerClient(servers["two_tower"][1]).get_model_metadata("two_tower",
                                                                                              as_json=True)
    assert [(t["name"], t["datatype"]) for t in grpc_meta["inputs"]] == [
        ("user_id", "INT64"), ("history", "INT64"), ("history_lengths", "INT64"), ("item_id", "INT64")]


@pytest.mark.slow
def test_bad_inputs_get_a_400_naming_the_input(servers, trained):
    dlrm, _, g = trained
    address, grpc_address = servers["dlrm"]
    good = {k: v.numpy() for k, v in dlrm_inputs(dlrm_batch(dlrm, 3, g)).items()}

    def body(**change):
        tensors = {**{k: {"name": k, "datatype": "FP32" if k == "dense" else "INT64", "shape": list(v.shape),
                          "data": v.reshape(-1).tolist()} for k, v in good.items()}}
        for key, fields in change.items():
            tensors[key] = {**tensors[key], **fields} if fields is not None else None
        return {"inputs": [t for t in tensors.values() if t is not None]}

    cases = [(body(dense={"datatype": "INT64"}), "input 'dense': datatype must be FP32"),
             (body(dense={"shape": [4, 3]}), "input 'dense': shape [4, 3], but size 1 must be 4"),
             (body(sparse_values={"data": [1.5] * len(good["sparse_values"])}), "input 'sparse_values': INT64"),
             # a JSON bool among ids was read as the id 1 (200), a null and text named by numpy's dtype letters
             (body(sparse_values={"data": [True] + good["sparse_values"].tolist()[1:]}),
              "input 'sparse_values': INT64 values must be integers, got bool True at position 0"),
             (body(sparse_values={"data": good["sparse_values"].tolist()[:-1] + [None]}),
              f"input 'sparse_values': INT64 values must be integers, got null at position "
              f"{len(good['sparse_values']) - 1}"),
             (body(dense={"data": ["x"] + good["dense"].reshape(-1).tolist()[1:]}),
              "input 'dense': FP32 values must be numbers, got string 'x' at position 0"),
             (body(sparse_lengths=None), "input 'sparse_lengths' is missing"),
             # was "shape must be 1 sizes >= 0 like [-1]", which neither said that [n, 1] is taken nor why [1, n] not
             (body(sparse_lengths={"shape": [1, len(good["sparse_lengths"])]}),
              f"input 'sparse_lengths': shape must be [n] or a column [n, 1], n >= 0 (the model's shape is [-1], -1: "
              f"any size), got [1, {len(good['sparse_lengths'])}] (a [1, n] row is not read as n values: send [n])"),
             (body(sparse_lengths={"shape": [2], "data": [0, 0]}), "sparse_lengths.size()[0] // 3 == dense.size()[0]"),
             (body(sparse_values={"shape": [len(good["sparse_values"]) + 1],
                                  "data": good["sparse_values"].tolist() + [1]}),
              "collection 'sparse_arch': the KeyedJaggedTensor's lengths must be >= 0 and sum to its"),
             ({"inputs": body()["inputs"] + [{"name": "extra", "datatype": "INT64", "shape": [1], "data": [1]}]},
              "input 'extra' is not an input of this model")]
    with httpx.Client(base_url=f"http://{address}", timeout=30) as c:
        for request, message in cases:
            r = c.post("/v2/models/dlrm/infer", json=request)
            assert r.status_code == 400 and message in r.json()["error"], (message, r.text)
    client = grpcclient.InferenceServerClient(grpc_address)
    bad = grpcclient.InferInput("dense", [3, 5], "FP32")
    bad.set_data_from_numpy(np.zeros((3, 5), dtype=np.float32))
    rest = []
    for key in ("sparse_values", "sparse_lengths"):
        rest.append(grpcclient.InferInput(key, list(good[key].shape), "INT64"))
        rest[-1].set_data_from_numpy(good[key])
    with pytest.raises(InferenceServerException, match="input 'dense': shape"):
        client.infer("dlrm", [bad, *rest])


@pytest.mark.slow
def test_watch_waits_for_the_first_version_then_serves_a_second_one_published_while_serving(tmp_path):
    torch.manual_seed(3)
    g = torch.Generator().manual_seed(4)
    model = TwoTower()
    train(model, lambda: two_tower_batch(32, g), 3)
    root = tmp_path / "two_tower"
    proc, address, _ = start(root, "tt", "--watch", "0.2", wait=False)  # before any version
    try:
        deadline = time.monotonic() + 120
        while True:  # live (listening), not ready
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://{address}/v2/health/live", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(f"http://{address}/v2/health/ready", timeout=2).status_code != 200
        export_model(root, model, two_tower_batch(4, g))
        batch = two_tower_batch(6, g)
        first = eager(model, batch).numpy()
        wait_ready(f"http://{address}", proc, token=None)
        got, version = infer(http, address, "tt", two_tower_inputs(batch))
        assert version == "1"
        np.testing.assert_array_equal(got, first)
        train(model, lambda: two_tower_batch(32, g), 3)  # changes rows (and the towers)
        export_model(root, model, two_tower_batch(4, g), incremental=True)
        second = eager(model, batch).numpy()
        assert not np.array_equal(first, second)
        deadline = time.monotonic() + 60
        while version != "2":
            assert time.monotonic() < deadline, "version 2 was not served within 60 s"
            time.sleep(0.1)
            got, version = infer(http, address, "tt", two_tower_inputs(batch))
        np.testing.assert_array_equal(got, second)
    finally:
        stop(proc)


class Forms(torch.nn.Module):
    """One collection fed every input form ``export_model`` serves, each feature pooled its own way."""

    def __init__(self):
        super().__init__()
        from dynemb import EmbeddingCollection, FeatureConfig, TableConfig

        self.ec = EmbeddingCollection(
            [TableConfig(name="a", dim=4, optimizer=dynemb.optim.SGD(lr=0.5)),
             TableConfig(name="b", dim=4, combiner="sum", optimizer=dynemb.optim.SGD(lr=0.5))],
            [FeatureConfig(name="one", table="a"), FeatureConfig(name="padded", table="a", padding_value=-1),
             FeatureConfig(name="starts", table="b", combiner="sqrtn", max_norm=0.01),
             FeatureConfig(name="ends", table="b"), FeatureConfig(name="weighted", table="a", combiner="sum"),
             FeatureConfig(name="sequence", table="b", combiner="none")])

    def forward(self, one, padded, ids, starts, ends, w_ids, w_lengths, weights, sequence):
        from dynemb.collection.features import Bags

        out = self.ec({"one": one, "padded": padded, "starts": (ids, starts),
                       "ends": Bags(ids, offsets=ends, include_last_offset=True),
                       "weighted": Bags(w_ids, lengths=w_lengths), "sequence": sequence},
                      weights={"weighted": weights})
        return {"pooled": torch.cat([out[k] for k in ("one", "padded", "starts", "ends", "weighted")], 1),
                "sequence": out["sequence"]}


def forms_batch(rows: int, g: torch.Generator, ids: int = 30) -> tuple:
    padded = torch.randint(0, ids, (rows, 3), generator=g)
    padded[:, -1] = -1
    lengths = torch.randint(0, 3, (rows,), generator=g)
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    w_lengths = torch.randint(0, 3, (rows,), generator=g)
    n = int(lengths.sum())
    return (torch.randint(0, ids, (rows,), generator=g), padded, torch.randint(0, ids, (n,), generator=g),
            bounds[:-1].clone(), bounds, torch.randint(0, ids, (int(w_lengths.sum()),), generator=g), w_lengths,
            torch.rand(int(w_lengths.sum()), generator=g), torch.randint(0, ids, (rows, 2), generator=g))


def test_every_input_form_and_pooling_rule_serves_as_eager(tmp_path):
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    model = Forms()
    for _ in range(3):
        out = model(*forms_batch(16, g))
        (out["pooled"].sum() + out["sequence"].sum()).backward()
    export_model(tmp_path, model, forms_batch(5, g))
    served = ExportedModel(tmp_path)
    try:
        assert [o["name"] for o in served.outputs] == ["pooled", "sequence"]
        for rows in (1, 3, 8):
            batch = forms_batch(rows, g, ids=60)  # ids 30..59 were never trained
            got, _ = served(dict(zip([i["name"] for i in served.inputs], batch)))
            want = eager(model, batch)
            for name in ("pooled", "sequence"):
                assert torch.equal(got[name], want[name]), (rows, name)
    finally:
        served.close()


def test_8bit_rows_serve_within_their_quantization_error(trained, tmp_path):
    dlrm, _, g = trained
    export_model(tmp_path, dlrm, dlrm_batch(dlrm, 4, g), dtype=torch.int8)
    served = ExportedModel(tmp_path)
    try:
        batch = dlrm_batch(dlrm, 32, g)
        got, _ = served(dlrm_inputs(batch))
        want = eager(dlrm, batch)
        assert not torch.equal(got["output"], want)  # the rows are int8 ...
        torch.testing.assert_close(got["output"], want, atol=0.02, rtol=0.02)  # ... within their error
    finally:
        served.close()


class Tables(torch.nn.Module):
    """Standalone tables, as a user of ``nn.Embedding`` writes a model: a DynamicEmbedding read twice (one id per
    sample, and a [B, M] history the model pools itself, an ``EmbeddingBag`` by hand), an int32-keyed one, a
    StaticEmbedding, beside a collection."""

    def __init__(self):
        super().__init__()
        from dynemb import EmbeddingCollection, FeatureConfig, StaticEmbedding, TableConfig

        self.user = DynamicEmbedding(4, seed=1)
        self.tower = torch.nn.ModuleDict({"tags": DynamicEmbedding(3, seed=2, key_dtype=torch.int32,
                                                                   initializer="normal")})
        self.country = StaticEmbedding(10, 2, seed=3)
        self.ec = EmbeddingCollection([TableConfig(name="item", dim=4, seed=4)],
                                      [FeatureConfig(name="item_id", table="item")])
        self.head = torch.nn.Linear(4 + 4 + 3 + 2 + 4, 1)

    def forward(self, user_id, history, tags, country, item_id):
        pooled = self.user(history).sum(1) / (history.shape[1] ** 0.5)
        x = torch.cat([self.user(user_id), pooled, self.tower["tags"](tags).mean(1), self.country(country),
                       self.ec({"item_id": item_id})["item_id"]], 1)
        return self.head(x).squeeze(1)


def tables_batch(rows: int, g: torch.Generator, ids: int = 30) -> tuple:
    return (torch.randint(0, ids, (rows,), generator=g), torch.randint(0, ids, (rows, 3), generator=g),
            torch.randint(0, ids, (rows, 2), generator=g), torch.randint(0, 10, (rows,), generator=g),
            torch.randint(0, ids, (rows,), generator=g))


def test_standalone_tables_serve_as_one_table_collections(tmp_path):
    """A standalone Dynamic/StaticEmbedding is served as the one sequence feature of a one-table collection
    named by its module path (the table ``export_for_serving`` writes): served outputs equal the eager model's in
    eval mode, bit for bit, trained and never-trained ids alike."""
    g = torch.Generator().manual_seed(8)
    model = Tables()
    model(*tables_batch(32, g))  # training mode: the tables insert their ids ...
    with torch.no_grad():  # ... which then take rows other than their initializer's
        for emb in (model.user, model.tower["tags"]):
            keys, values = emb.export()
            emb.insert_or_assign(keys, torch.randn(values.shape, generator=g))
        model.country.table.values.copy_(torch.randn(10, 2, generator=g))
    export_model(tmp_path, model, tables_batch(4, g))
    manifest = __import__("json").loads((tmp_path / "version-00000001" / "manifest.json").read_text())
    assert sorted(manifest["tables"]) == ["country", "item", "tower.tags", "user"]
    assert sorted(manifest["program"]["collections"]) == ["country", "ec", "tower.tags", "user"]
    served = ExportedModel(tmp_path)
    try:
        for rows in (1, 5):
            batch = tables_batch(rows, g, ids=60)  # ids 30..59 were never trained
            got, _ = served(dict(zip([i["name"] for i in served.inputs], batch)))
            assert torch.equal(got["output"], eager(model, batch)), rows
    finally:
        served.close()


class Bagged(torch.nn.Module):
    """A standalone table pooled as ``nn.EmbeddingBag`` pools, through ``embedding_lookup_sparse``: dense [B, M]
    ids with padding and per-id weights, 1-D ids with bag starts, TorchRec's [B+1] offsets; and
    ``embedding_lookup`` with ``max_norm``."""

    def __init__(self):
        super().__init__()
        self.emb = DynamicEmbedding(4, seed=5)

    def forward(self, dense_ids, weights, ids, starts, bounds):
        from dynemb.functional import embedding_lookup, embedding_lookup_sparse

        d = self.emb.dim
        return torch.cat([
            embedding_lookup_sparse(self.emb, dense_ids, combiner="mean", padding_value=-1),
            embedding_lookup_sparse(self.emb, dense_ids.clamp(min=0), weights=weights, combiner="sum"),
            embedding_lookup_sparse(self.emb, ids, starts, combiner="sqrtn", max_norm=0.5),
            embedding_lookup_sparse(self.emb, ids, bounds, combiner="mean", include_last_offset=True),
            embedding_lookup(self.emb, dense_ids.clamp(min=0), max_norm=0.3).sum(1),
            self.emb(dense_ids.clamp(min=0)).view(-1, dense_ids.shape[1] * d)], 1)


def bagged_batch(rows: int, g: torch.Generator, ids: int = 30) -> tuple:
    dense = torch.randint(0, ids, (rows, 3), generator=g)
    dense[::2, -1] = -1
    lengths = torch.randint(0, 3, (rows,), generator=g)
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return (dense, torch.rand(rows, 3, generator=g), torch.randint(0, ids, (int(lengths.sum()),), generator=g),
            bounds[:-1].clone(), bounds)


def test_a_standalone_table_pooled_as_an_embedding_bag_serves_as_eager(tmp_path):
    g = torch.Generator().manual_seed(9)
    model = Bagged()
    model.emb(torch.arange(30))
    with torch.no_grad():
        keys, values = model.emb.export()
        model.emb.insert_or_assign(keys, torch.randn(values.shape, generator=g))
    export_model(tmp_path, model, bagged_batch(4, g))
    served = ExportedModel(tmp_path)
    try:
        for rows in (1, 6):
            batch = bagged_batch(rows, g, ids=60)
            got, _ = served(dict(zip([i["name"] for i in served.inputs], batch)))
            assert torch.equal(got["output"], eager(model, batch)), rows
    finally:
        served.close()


def test_a_table_read_other_than_by_a_lookup_is_refused(tmp_path):
    """A lookup (``emb(ids)``, ``embedding_lookup``, ``embedding_lookup_sparse``) is what serving answers for a
    standalone table; a model that reads anything else of it (``find``, its ``table``) is refused at export,
    naming the module; so are ids the eager lookup refuses."""

    class Finds(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.user = DynamicEmbedding(4, seed=1)

        def forward(self, ids):
            return self.user.find(ids)

    with pytest.raises(ValueError, match=r"^module \(DynamicEmbedding\) 'user' is read as \.find in the model's "
                                         r"forward: export_model serves its calls \(emb\(ids\), "):
        export_model(tmp_path / "f", Finds(), (torch.tensor([[1, 2], [3, 4]]),))
    with pytest.raises(ValueError, match=r"^example_inputs: offsets and lengths must be None for 2-D ids"):
        export_model(tmp_path / "o", Bagged(), (torch.tensor([[1, 2, 3]]), torch.ones(1, 3), torch.tensor([[1, 2]]),
                                                 torch.tensor([0]), torch.tensor([0, 2])))
    assert not (tmp_path / "f").exists() and not (tmp_path / "o").exists()


class Sequences(torch.nn.Module):
    """Jagged sequences (``combiner="none"`` on bags: ``Jagged(values [N, D], offsets [B])``) in every form the
    collection takes them: lengths, bag starts, TorchRec's [B+1] offsets, a KeyedJaggedTensor; the model attends
    over them with its own code and returns one sequence as it is."""

    def __init__(self):
        super().__init__()
        from dynemb import EmbeddingCollection, FeatureConfig, TableConfig

        self.ec = EmbeddingCollection(
            [TableConfig(name="item", dim=4, seed=1), TableConfig(name="tag", dim=4, seed=2, dtype=torch.float16)],
            [FeatureConfig(name="clicks", table="item", combiner="none"),
             FeatureConfig(name="views", table="item", combiner="none", max_norm=0.05),
             FeatureConfig(name="tags", table="tag", combiner="none"), FeatureConfig(name="user", table="item"),
             FeatureConfig(name="k_seq", table="tag", combiner="none"), FeatureConfig(name="k_sum", table="item",
                                                                                       combiner="sum")])
        self.query = torch.nn.Linear(4, 4)

    @staticmethod
    def attend(query, seq):
        values, starts = seq
        bag = torch.searchsorted(starts, torch.arange(values.shape[0]), right=True) - 1
        scores = (values.float() * query[bag]).sum(1).exp()
        total = query.new_zeros(query.shape[0]).index_add(0, bag, scores)
        return query.new_zeros(query.shape).index_add(0, bag, values.float() * scores[:, None]) / \
            total.clamp(min=1e-6)[:, None]

    def forward(self, ids, lengths, v_ids, v_starts, t_ids, t_bounds, user, kjt):
        from dynemb.collection.features import Bags

        out = self.ec({"clicks": Bags(ids, lengths=lengths), "views": (v_ids, v_starts),
                       "tags": Bags(t_ids, offsets=t_bounds, include_last_offset=True), "user": user})
        keyed = self.ec(kjt)
        q = self.query(out["user"] + keyed["k_sum"])
        x = self.attend(q, out["clicks"]) + self.attend(q, out["views"]) + self.attend(q, out["tags"]) \
            + self.attend(q, keyed["k_seq"])
        return {"scores": x.sum(1), "clicks": out["clicks"].values, "clicks_offsets": out["clicks"].offsets}


def sequences_batch(rows: int, g: torch.Generator, ids: int = 30) -> tuple:
    from hand_models import KJT

    def bags():
        lengths = torch.randint(0, 4, (rows,), generator=g)
        return torch.randint(0, ids, (int(lengths.sum()),), generator=g), lengths

    c_ids, c_lengths = bags()
    v_ids, v_lengths = bags()
    t_ids, t_lengths = bags()
    k_lengths = torch.randint(0, 3, (2 * rows,), generator=g)
    kjt = KJT(["k_seq", "k_sum"], torch.randint(0, ids, (int(k_lengths.sum()),), generator=g), k_lengths)
    return (c_ids, c_lengths, v_ids, v_lengths.cumsum(0) - v_lengths, t_ids,
            torch.cat([torch.zeros(1, dtype=torch.long), t_lengths.cumsum(0)]), torch.randint(0, ids, (rows,),
                                                                                                generator=g), kjt)


def test_jagged_sequences_serve_as_eager(tmp_path):
    g = torch.Generator().manual_seed(10)
    model = Sequences()
    with torch.no_grad():
        model(*sequences_batch(32, g))  # inserts nothing (no grad): every row is its initializer's ...
    model(*sequences_batch(32, g))  # ... but these, inserted by training mode
    export_model(tmp_path, model, sequences_batch(4, g))
    served = ExportedModel(tmp_path)
    try:
        assert [o["name"] for o in served.outputs] == ["scores", "clicks", "clicks_offsets"]
        for rows in (1, 7):
            batch = sequences_batch(rows, g, ids=60)
            flat = [batch[0], batch[1], batch[2], batch[3], batch[4], batch[5], batch[6], batch[7].values(),
                    batch[7].lengths()]
            got, _ = served(dict(zip([i["name"] for i in served.inputs], flat)))
            want = eager(model, batch)
            for name in ("scores", "clicks", "clicks_offsets"):
                assert torch.equal(got[name], want[name]), (rows, name)
    finally:
        served.close()


class Coo(torch.nn.Module):
    """Sparse COO inputs ``[B, M]`` (``tf.SparseTensor`` style): ids of a pooled feature, with COO weights of the
    same pattern; and ids with dense weights."""

    def __init__(self):
        super().__init__()
        from dynemb import EmbeddingCollection, FeatureConfig, TableConfig

        self.ec = EmbeddingCollection([TableConfig(name="tag", dim=4, seed=1, combiner="sqrtn")],
                                      [FeatureConfig(name="tags", table="tag"),
                                       FeatureConfig(name="topics", table="tag", combiner="mean")])

    def forward(self, tags, tag_weights, topics):
        out = self.ec({"tags": tags, "topics": topics}, weights={"tags": tag_weights})
        return torch.cat([out["tags"], out["topics"]], 1)


def coo_batch(rows: int, g: torch.Generator, ids: int = 30) -> tuple:
    def coo(values):
        n = values.shape[0]
        index = torch.stack([torch.randint(0, rows, (n,), generator=g), torch.randint(0, 5, (n,), generator=g)])
        return torch.sparse_coo_tensor(index, values, (rows, 5), check_invariants=True)

    n = 2 * rows
    tags = coo(torch.randint(0, ids, (n,), generator=g)).coalesce()
    weights = torch.sparse_coo_tensor(tags.indices(), torch.rand(tags.values().shape, generator=g), (rows, 5),
                                      check_invariants=True)
    return tags, weights, coo(torch.randint(0, ids, (n,), generator=g))  # topics: not coalesced


def test_sparse_coo_inputs_serve_as_eager(tmp_path):
    """A sparse COO input is served as two dense inputs, ``name [B, M]`` (its values) and ``name_mask [B, M]``
    (bool: where its entries are), rebuilt into the COO tensor the collection takes: outputs bit-equal to eager,
    a row without entries and an entry of id 0 included."""
    g = torch.Generator().manual_seed(11)
    model = Coo()
    model(*coo_batch(16, g))
    export_model(tmp_path, model, coo_batch(4, g))
    served = ExportedModel(tmp_path)
    try:
        assert [(i["name"], i["dtype"], i["shape"]) for i in served.inputs] == [
            ("tags", "int64", [-1, -1]), ("tags_mask", "bool", [-1, -1]), ("tag_weights", "float32", [-1, -1]),
            ("tag_weights_mask", "bool", [-1, -1]), ("topics", "int64", [-1, -1]), ("topics_mask", "bool", [-1, -1])]
        for rows in (1, 6):
            tags, weights, topics = coo_batch(rows, g, ids=60)
            zeroed = tags.values() * (torch.arange(tags.values().numel()) % 3 > 0)  # ids 0 among them
            tags = torch.sparse_coo_tensor(tags.indices(), zeroed, tags.shape, check_invariants=True)
            request = {}
            for name, value in (("tags", tags), ("tag_weights", weights), ("topics", topics)):
                value = value.coalesce()
                request[name] = value.to_dense()
                request[f"{name}_mask"] = torch.zeros(value.shape, dtype=torch.bool).index_put_(
                    tuple(value.indices()), torch.tensor(True))
            got, _ = served(request)
            assert torch.equal(got["output"], eager(model, (tags, weights, topics))), rows
    finally:
        served.close()


def test_a_sparse_input_read_other_than_by_a_collection_is_refused(tmp_path):
    class Densifies(Coo):
        def forward(self, tags, tag_weights, topics):
            return super().forward(tags, tag_weights, topics) + tags.to_dense().sum()

    g = torch.Generator().manual_seed(12)
    with pytest.raises(ValueError, match=r"^input 'tags' is a sparse COO tensor, read as \.to_dense in the model's "
                                         r"forward: export_model serves a sparse input only as a collection"):
        export_model(tmp_path, Densifies(), coo_batch(4, g))


@pytest.mark.slow
def test_dynemb_serve_export_takes_a_sparse_input_as_values_and_a_bool_mask(tmp_path):
    g = torch.Generator().manual_seed(13)
    model = Coo()
    model(*coo_batch(16, g))
    export_model(tmp_path / "coo", model, coo_batch(4, g))
    proc, address, grpc_address = start(tmp_path / "coo", "coo")
    try:
        batch = coo_batch(5, g, ids=60)
        want = eager(model, batch).numpy()
        for module in (http, grpcclient):
            client, tensors = module.InferenceServerClient(grpc_address if module is grpcclient else address), []
            for name, value in zip(("tags", "tag_weights", "topics"), batch):
                value = value.coalesce()
                mask = torch.zeros(value.shape, dtype=torch.bool).index_put_(tuple(value.indices()),
                                                                            torch.tensor(True))
                for key, array in ((name, value.to_dense().numpy()), (f"{name}_mask", mask.numpy())):
                    kind = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64", np.dtype(bool): "BOOL"}
                    tensors.append(module.InferInput(key, list(array.shape), kind[array.dtype]))
                    tensors[-1].set_data_from_numpy(array)
            np.testing.assert_array_equal(client.infer("coo", tensors).as_numpy("output"), want)  # bit-equal
            client.close()
    finally:
        stop(proc)
