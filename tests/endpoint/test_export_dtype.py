"""``dynemb export --dtype``: a run's 8-bit and 16-bit exports from the command line, served by ``ServedModel``
(what ``dynemb serve --model RUN --export DIR`` runs) with probabilities close to the float32 export's, and a
clear argparse error for a dtype that is not an export's."""

import json

import pytest
import torch

from test_served_pooling import v2_request

from dynemb.cli import main
from dynemb.endpoint import ServedModel


@pytest.mark.parametrize("dtype,tolerance", [("float32", 0.0), ("bfloat16", 0.02), ("int8", 0.02),
                                             ("float8_e4m3fn", 0.05)])
def test_cli_export_dtype_serves_close_to_float32(run, tmp_path, dtype, tolerance):
    out = tmp_path / dtype
    assert main(["export", "--model", str(run / "run"), "--out", str(out), "--dtype", dtype]) == 0
    manifest = json.loads((out / "version-00000001" / "manifest.json").read_text())
    assert {t["dtype"] for t in manifest["tables"].values()} == {dtype}
    assert manifest.get("dense")  # the MLPs travel with the tables
    request = v2_request(run / "test.parquet")
    base, served = ServedModel(run / "run", name="f32"), ServedModel(run / "run", export=out, name=dtype)
    try:
        want = base.predict(base.decode_request(request, 10_000))
        got = served.predict(served.decode_request(request, 10_000))
    finally:
        base.close()
        served.close()
    assert (got - want).abs().max().item() <= tolerance
    if dtype == "float32":
        assert torch.equal(got, want)


def test_cli_export_refuses_another_dtype(run, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["export", "--model", str(run / "run"), "--out", str(tmp_path / "x"), "--dtype", "float64"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "int8" in err and "'float64'" in err
    assert not (tmp_path / "x").exists()
