"""A fresh ``dynemb predict`` process and the served model (``ServedModel.predict``, what ``dynemb serve``
answers) give the same probabilities, bit for bit, on the same rows: predict's reading thread (lookups into a ring
of buffers, the dense part through ``DLRM.forward_stacked`` in blocks of ``INTERACTION_ROWS``) and the endpoint's
request path (parameter-server lookups) score them alike, requests cut at predict's block boundaries, at 37 rows
or one row at a time: a row's score does not depend on the rows beside it in its pass."""

import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from dynemb.cli import main
from dynemb.data import FileReader
from dynemb.endpoint import ServedModel
from dynemb.models.dlrm import INTERACTION_ROWS

from .test_score import clicks

SRC = str(Path(__file__).resolve().parents[2] / "src")
ROWS = 2 * INTERACTION_ROWS + 333  # two whole blocks of the interaction and a short one


@pytest.mark.slow
def test_a_fresh_predict_process_writes_the_served_probabilities(tmp_path):
    pq.write_table(clicks(0), tmp_path / "train.parquet")
    pq.write_table(clicks(2, rows=ROWS), tmp_path / "score.parquet")
    run = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "train.parquet"), "--label", "click", "--categorical",
                 "user,item", "--dense", "price", "--out", str(run), "--epochs", "2", "--batch-size", "128",
                 "--dim", "8", "--no-progress"]) == 0
    out = tmp_path / "p.parquet"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "dynemb", "predict", "--model", str(run), "--data",
                    str(tmp_path / "score.parquet"), "--out", str(out), "--threads", "1"], env=env, check=True,
                   capture_output=True, timeout=300)
    got = torch.from_numpy(pq.read_table(out).column("probability").to_numpy())
    assert got.shape == (ROWS,)
    served = ServedModel(run, name="ctr")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reader = FileReader(tmp_path / "score.parquet", label=None, categorical=["user", "item"], dense=["price"],
                            batch_size=INTERACTION_ROWS)
        want = torch.cat([served.predict(batch) for batch in reader])
        # requests of any size give the same bits (the dense part pads its passes: models.dlrm.SCORING_ROWS)
        odd = FileReader(tmp_path / "score.parquet", label=None, categorical=["user", "item"], dense=["price"],
                         batch_size=37)
        cut = torch.cat([served.predict(batch) for batch in odd])
        one = torch.cat([served.predict(batch) for _, batch in zip(range(20), FileReader(
            tmp_path / "score.parquet", label=None, categorical=["user", "item"], dense=["price"], batch_size=1))])
    finally:
        torch.set_num_threads(threads)
        served.close()
    assert want.dtype == got.dtype == torch.float64
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    assert torch.equal(got.view(torch.int64), cut.view(torch.int64))
    assert torch.equal(got[:20].view(torch.int64), one.view(torch.int64))
