"""``export_model`` of a model trained under torchrun: 2 gloo ranks, each holding its shards of a sharded
collection (row, column and table plans) and the dense layers wrapped in DistributedDataParallel, call
``export_model`` together. Each rank writes its own rows (``export_for_serving``), rank 0 traces the program from
the collection's logical view: its ``program.pt2`` is byte for byte the one-process export's, and the served model
(:class:`~dynemb.serving.ExportedModel`) answers bit for bit (``torch.equal``) what the one-process export of the
same weights (the checkpoint of that step loaded into an unsharded copy) answers, and what that copy computes
eagerly in eval mode, for a full version and a delta after it, ids never trained and a batch of 1 included. Rank
0's example inputs refused: every rank raises, nothing is written."""

import json

import pytest
import torch
from torch import nn

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import load, save
from dynemb.collection.features import Bags
from dynemb.serving import ExportedModel, export_model

from .harness import run

PLAN = {"user": "row", "item": "column", "cat": ("table", 1)}
UNSEEN = 10_000  # ids from here on were never trained


class Ranker(nn.Module):
    """``forward(dense [B, 3], user_id [B], history [N], history_lengths [B], cat [B, 2]) -> logits [B]``."""

    def __init__(self, plan=None) -> None:
        super().__init__()
        opt = dynemb.optim.Adagrad(lr=0.3)
        self.ec = EmbeddingCollection(
            [TableConfig(name="user", dim=4, optimizer=opt, seed=1),
             TableConfig(name="item", dim=6, optimizer=opt, seed=2, combiner="sum"),
             TableConfig(name="cat", dim=3, vocabulary_size=20, optimizer=opt, seed=3)],
            [FeatureConfig(name="user_id", table="user"), FeatureConfig(name="history", table="item"),
             FeatureConfig(name="cat", table="cat", combiner="mean")], plan=plan, timeout=60)
        self.bottom = nn.Linear(3, 4)
        self.top = nn.Sequential(nn.Linear(4 + 4 + 6 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, user_id, history, history_lengths, cat):
        out = self.ec({"user_id": user_id, "history": Bags(history, lengths=history_lengths), "cat": cat})
        x = torch.cat([self.bottom(dense), out["user_id"], out["history"], out["cat"]], 1)
        return self.top(x).squeeze(1)


def batch(rows: int, seed: int, ids: int = 60) -> tuple:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (rows,), generator=g)
    return (torch.randn(rows, 3, generator=g), torch.randint(-ids, ids, (rows,), generator=g),
            torch.randint(0, ids, (int(lengths.sum()),), generator=g), lengths,
            torch.randint(0, 20, (rows, 2), generator=g))


def train(model, rank: int, world: int, steps: range) -> None:
    dense = torch.optim.SGD([p for n, p in model.named_parameters()], lr=0.05)
    model.train()
    for step in steps:
        b = batch(12, 100 * step + rank)  # each rank its own batch
        loss = model(*b).square().mean()
        loss.backward()
        dense.step()
        dense.zero_grad()
        model.ec.optimizer.step()
        model.ec.optimizer.zero_grad()


def _ranks(rank, world, root):
    torch.manual_seed(0)  # the same dense initialization on every rank, as DistributedDataParallel expects
    model = Ranker(plan=PLAN)
    model.bottom = nn.parallel.DistributedDataParallel(model.bottom)  # as dynemb.train wraps its MLPs
    model.top = nn.parallel.DistributedDataParallel(model.top)
    train(model, rank, world, range(3))
    good = batch(5, 7 + rank)  # each rank passes its own batch; rank 0's is traced

    # rank 0's example inputs refused: every rank raises, and nothing is written
    bad = (good[0], good[1].float(), *good[2:])
    with pytest.raises(TypeError, match=r"ids must have dtype torch.int64") as e:
        export_model(f"{root}/refused", model, bad)
    if rank:
        assert "export_model failed on rank 0" in str(e.value), str(e.value)
    save(f"{root}/ckpt", model, step=1)
    export_model(f"{root}/export", model, good)
    train(model, rank, world, range(3, 5))
    save(f"{root}/ckpt", model, step=2)
    export_model(f"{root}/export", model, good, incremental=True)


def eager(model, b) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(*b)


def inputs(b) -> dict:
    return dict(zip(("dense", "user_id", "history", "history_lengths", "cat"), b))


def with_unseen(b) -> tuple:
    dense, user, history, lengths, cat = (t.clone() for t in b)
    user[::2] += UNSEEN
    history[::3] += UNSEEN
    return dense, user, history, lengths, cat


@pytest.mark.slow
def test_an_export_from_2_ranks_serves_what_the_one_process_export_serves(tmp_path):
    (tmp_path / "out").mkdir()
    run(_ranks, 2, tmp_path / "out", str(tmp_path))
    errors = [p.read_text() for p in (tmp_path / "out").glob("*.err")]
    assert not errors, errors
    assert not (tmp_path / "refused" / "latest").exists()

    versions = []
    for step in (1, 2):  # the one-process model of each step, and its export
        one = Ranker()
        load(tmp_path / "ckpt" / f"step-{step:08d}", one)
        export_model(tmp_path / f"one-{step}", one, batch(5, 7))
        versions.append(one)
    two = json.loads((tmp_path / "export" / "version-00000001" / "manifest.json").read_text())
    single = json.loads((tmp_path / "one-1" / "version-00000001" / "manifest.json").read_text())
    assert two["program"] == single["program"]  # the same program: no layout in it
    program = "version-00000001/program.pt2"
    assert (tmp_path / "export" / program).read_bytes() == (tmp_path / "one-1" / program).read_bytes()
    delta = json.loads((tmp_path / "export" / "version-00000002" / "manifest.json").read_text())
    assert delta["kind"] == "delta" and delta["program"] == two["program"]
    assert {t: e["rows"] for t, e in two["tables"].items()} == {t: e["rows"] for t, e in single["tables"].items()}
    assert {t: len(e["shards"]) for t, e in two["tables"].items()} == {"user": 2, "item": 1, "cat": 1}

    served, alone = ExportedModel(tmp_path / "export"), ExportedModel(tmp_path / "one-2")
    try:
        assert served.version == 2  # the full version 1 and the delta after it
        for rows, seed in ((1, 50), (9, 51), (16, 52)):
            b = batch(rows, seed)
            for case in (b, with_unseen(b)):
                got, _ = served(inputs(case))
                want, _ = alone(inputs(case))
                assert torch.equal(got["output"], want["output"]), rows
                assert torch.equal(got["output"], eager(versions[1], case)), rows
    finally:
        served.close()
        alone.close()
