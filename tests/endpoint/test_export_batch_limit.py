"""``--max-batch-size`` for an exported model whose rows no input has as its dim 0: a model fed only by a
``KeyedJaggedTensor`` (``hand_models.SparseOnly``), whose batch size is the KJT's stride (its lengths are keys x
rows). The export records the rule (``batch_input``, ``batch_divisor``); a real ``dynemb serve --export`` process
answers a request over the limit with a 400 (HTTP) / INVALID_ARGUMENT (gRPC) naming max_batch_size, the limit and
what came in, serves one at the limit as the eager model, and reports the limit in ``get_model_config``."""

import json

import httpx
import numpy as np
import pytest
import torch

from hand_models import SparseOnly, sparse_only_batch
from test_export_model import start

from dynemb.serving import export_model
from dynemb.endpoint.served_export import ServedExport
from dynemb.endpoint.wire import RequestError

http = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402
from test_command import stop  # noqa: E402

LIMIT = 8


@pytest.fixture(scope="module")
def sparse_only(tmp_path_factory):
    torch.manual_seed(5)
    g = torch.Generator().manual_seed(6)
    model = SparseOnly()
    root = tmp_path_factory.mktemp("sparse_only")
    export_model(root, model, sparse_only_batch(model, 4, g))
    model.eval()
    return model, root, g


def inputs(batch) -> dict:
    return {"sparse_values": batch[0].values(), "sparse_lengths": batch[0].lengths()}


def test_the_export_records_the_kjt_stride_as_its_batch_rule(sparse_only):
    _, root, g = sparse_only
    manifest = json.loads((root / "version-00000001" / "manifest.json").read_text())["program"]
    assert (manifest["batch_input"], manifest["batch_divisor"]) == ("sparse_lengths", 3)
    served = ServedExport(root, name="m")
    try:
        model = sparse_only[0]
        for rows in (0, 1, LIMIT):
            request = {"inputs": [{"name": k, "datatype": "INT64", "shape": list(v.shape), "data": v.tolist()}
                                  for k, v in inputs(sparse_only_batch(model, rows, g)).items()]}
            assert len(served.decode_request(request, LIMIT)) == rows
        request = {"inputs": [{"name": k, "datatype": "INT64", "shape": list(v.shape), "data": v.tolist()}
                              for k, v in inputs(sparse_only_batch(model, LIMIT + 1, g)).items()]}
        with pytest.raises(RequestError, match=r"input 'sparse_lengths': 27 lengths, 9 rows of 3 keys .*more than "
                                               r"max_batch_size \(8\)"):
            served.decode_request(request, LIMIT)
    finally:
        served.close()


def test_an_export_without_the_recorded_rule_reads_it_off_its_program(sparse_only, tmp_path, monkeypatch):
    from dynemb.serving import model_export
    from dynemb.serving.exported_model import _Program

    model, _, g = sparse_only
    describe = model_export._describe

    def as_before(*args):  # what export_model wrote before the rule: no divisor, no batch input for a KJT alone
        meta = describe(*args)
        del meta["batch_divisor"]
        return {**meta, "batch_input": None}

    monkeypatch.setattr(model_export, "_describe", as_before)
    export_model(tmp_path, model, sparse_only_batch(model, 4, g))
    manifest = json.loads((tmp_path / "version-00000001" / "manifest.json").read_text())["program"]
    assert "batch_divisor" not in manifest and manifest["batch_input"] is None
    program = _Program(tmp_path / "version-00000001")
    assert (program.batch_input, program.batch_divisor) == ("sparse_lengths", 3)


@pytest.mark.slow
def test_dynemb_serve_export_enforces_max_batch_size_for_a_kjt_only_model(sparse_only):
    model, root, g = sparse_only
    proc, address, grpc_address = start(root, "sparse", "--max-batch-size", str(LIMIT))
    try:
        at_limit = sparse_only_batch(model, LIMIT, g)
        with torch.no_grad():
            want = model(*at_limit).numpy()
        over = {k: v.numpy() for k, v in inputs(sparse_only_batch(model, LIMIT + 1, g)).items()}
        message = "input 'sparse_lengths': 27 lengths, 9 rows of 3 keys"
        limit = "more than max_batch_size (8)"
        for module, address_ in ((http, address), (grpcclient, grpc_address)):
            client = module.InferenceServerClient(address_)
            try:
                tensors = []
                for key, value in inputs(at_limit).items():
                    tensors.append(module.InferInput(key, list(value.shape), "INT64"))
                    tensors[-1].set_data_from_numpy(value.numpy())
                np.testing.assert_array_equal(client.infer("sparse", tensors).as_numpy("output"), want)
                tensors = []
                for key, value in over.items():
                    tensors.append(module.InferInput(key, list(value.shape), "INT64"))
                    tensors[-1].set_data_from_numpy(value)
                with pytest.raises(InferenceServerException) as caught:
                    client.infer("sparse", tensors)
                assert message in str(caught.value) and limit in str(caught.value)
                if module is grpcclient:
                    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
                    config = client.get_model_config("sparse", as_json=True)["config"]
                else:
                    config = client.get_model_config("sparse")
                assert config["parameters"]["max_batch_size"] == {"string_value": str(LIMIT)}
                assert config.get("max_batch_size", 0) == 0  # Triton's: no implicit batch dimension
            finally:
                client.close()
        with httpx.Client(base_url=f"http://{address}", timeout=30) as c:
            body = {"inputs": [{"name": k, "datatype": "INT64", "shape": list(v.shape), "data": v.tolist()}
                               for k, v in over.items()]}
            r = c.post("/v2/models/sparse/infer", json=body)
            assert r.status_code == 400 and message in r.json()["error"] and limit in r.json()["error"]
    finally:
        stop(proc)
