"""A small trained run directory, and ``dynemb predict`` on a file of rows to serve."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dynemb.cli import main

ROWS = 300


def clicks(seed: int, rows: int) -> pa.Table:
    g = torch.Generator().manual_seed(seed)
    user, item = torch.randint(0, 40, (rows,), generator=g), torch.randint(0, 60, (rows,), generator=g)
    price = torch.rand(rows, generator=g) * 100
    tags = [[f"t{(u * k) % 9}" for k in range(u % 4)] for u in user.tolist()]
    label = ((user % 5 + item % 3 + price / 50).float() > 4).long()
    return pa.table({"click": label.tolist(), "user": [f"u{u}" for u in user.tolist()], "item": item.tolist(),
                     "tags": tags, "price": price.tolist()})


@pytest.fixture(scope="session")
def make_clicks():
    """``clicks`` for test modules: ``from conftest import`` would find another folder's conftest in a whole-suite
    run."""
    return clicks


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    pq.write_table(clicks(0, 1200), tmp / "train.parquet")
    # Row 0 of the scored file has a user training never saw: it reads its initializer row on both sides.
    scored = clicks(1, ROWS).to_pydict()
    scored["user"][0] = "never-seen"
    pq.write_table(pa.table(scored), tmp / "test.parquet")
    threads = torch.get_num_threads()
    try:
        code = main(["train", "--data", str(tmp / "train.parquet"), "--label", "click", "--categorical",
                     "user,item", "--multi-hot", "tags", "--dense", "price", "--out", str(tmp / "run"), "--epochs",
                     "2", "--batch-size", "128", "--dim", "8", "--no-progress"])
        assert code == 0
        assert main(["predict", "--model", str(tmp / "run"), "--data", str(tmp / "test.parquet"), "--out",
                     str(tmp / "preds.parquet")]) == 0
    finally:
        torch.set_num_threads(threads)
    return tmp


