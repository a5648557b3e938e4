"""Serving on a GPU (skipped without one; ``benchmarks/gpu_lease.sh`` runs it when a GPU is lent): a CLI run served
with ``device="cuda"`` scores as the CPU-served model does, and a hand-written model exported from CUDA
(``export_model`` of a model moved there) serves its eager outputs. Tolerance: 1e-5 on probabilities and logits
(the GPU's matmuls sum in another order; TF32 stays off, torch's default for float32 matmuls)."""

import pyarrow.parquet as pq
import pytest
import torch

from hand_models import DLRM, KJT, dlrm_batch, train

from dynemb.endpoint import ServedModel
from dynemb.serving import ExportedModel, export_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_cli_run_served_on_cuda_scores_as_on_cpu(run):
    from test_served_pooling import v2_request

    request = v2_request(run / "test.parquet")
    cpu, gpu = ServedModel(run / "run", name="cpu"), ServedModel(run / "run", name="gpu", device="cuda")
    try:
        want = cpu.predict(cpu.decode_request(request, 10_000))
        got = gpu.predict(gpu.decode_request(request, 10_000))
        assert got.device.type == "cpu" and got.dtype == torch.float64  # what the endpoint answers
        assert len(got) == pq.read_metadata(run / "test.parquet").num_rows
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    finally:
        cpu.close()
        gpu.close()


def test_a_model_exported_from_cuda_serves_its_eager_outputs(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = DLRM()
    train(model, lambda: dlrm_batch(model, 32, g), 3)
    model = model.to("cuda")

    def on_gpu(batch):
        dense, kjt = batch
        return dense.cuda(), KJT(kjt.keys(), kjt.values().cuda(), kjt.lengths().cuda())

    export_model(tmp_path / "dlrm", model, on_gpu(dlrm_batch(model, 8, g)))
    served = ExportedModel(tmp_path / "dlrm", name="m", device="cuda")
    try:
        model.eval()
        for rows in (1, 17):
            batch = on_gpu(dlrm_batch(model, rows, g))
            dense, kjt = batch
            got, _ = served({"dense": dense, "sparse_values": kjt.values(), "sparse_lengths": kjt.lengths()})
            with torch.no_grad():
                want = model(*batch)
            torch.testing.assert_close(got["output"].to(want.device), want, atol=1e-5, rtol=0)
    finally:
        served.close()
