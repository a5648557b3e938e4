"""The served model pools features with the collection's own code: for any pooling a feature config asks for
(combiner sum/mean/sqrtn, ``max_norm``, multi-hot bags with empty ones, one id a row), its outputs from the
parameter server's rows are bit-equal to the run's ``EmbeddingCollection`` in eval mode (what ``dynemb predict``
runs) on the same batch. A pooling rule written again on the serving side, and drifting, fails here."""

import dataclasses

import pyarrow.parquet as pq
import pytest
import torch

from dynemb.endpoint import ServedModel
from dynemb.job import load_model
from dynemb.job.score import probabilities


# The CLI trains with the tables' default combiner (mean); each change is another rule the collection follows.
CHANGES = [{}, {"combiner": "sum"}, {"combiner": "sqrtn"}, {"max_norm": 0.05}, {"combiner": "sum", "max_norm": 0.05}]


def v2_request(path) -> dict:
    """A v2 JSON infer request of the rows of a Parquet file (multi-hot ``tags`` as flat ids and lengths)."""
    d = pq.read_table(path).to_pydict()
    tags = d["tags"]
    columns = {"user": ("BYTES", d["user"]), "item": ("INT64", d["item"]),
               "tags": ("BYTES", [t for bag in tags for t in bag]),
               "tags__lengths": ("INT32", [len(bag) for bag in tags]), "price": ("FP32", d["price"])}
    return {"inputs": [{"name": name, "shape": [len(data)], "datatype": datatype, "data": data}
                       for name, (datatype, data) in columns.items()]}


@pytest.fixture(scope="module")
def both(run):
    """``(served model, the run's model in eval mode, a normalized batch with an unseen user and empty bags, the
    served outputs of that batch as trained)``."""
    served = ServedModel(run / "run", name="pooling")
    model, _ = load_model(run / "run")
    batch = served.preprocessing.normalize(served.decode_request(v2_request(run / "test.parquet"), 10_000))
    assert (batch.offsets["tags"].diff() == 0).any() and (batch.offsets["tags"].diff() > 1).any()
    with torch.no_grad():
        as_trained = served.pooled(batch)
    yield served, model, batch, as_trained
    served.close()


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "as-trained")
def test_served_pooling_is_the_collections(both, change):
    served, model, batch, as_trained = both
    collection = model.embeddings
    before = dict(collection.feature_configs)
    try:
        for name in ("tags", "user"):  # a multi-hot feature and a one-id-a-row feature
            config = dataclasses.replace(before[name], **change)
            served.feature_configs[name] = collection.feature_configs[name] = config
        with torch.no_grad():
            want = collection(model.sparse_inputs(batch))
            got = served.pooled(batch)
        assert sorted(got) == sorted(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name
        # the change shows in the outputs, so that equality above tests the rule it names
        assert (not change) == all(torch.equal(got[name], as_trained[name]) for name in want)
    finally:
        served.feature_configs.update({k: before[k] for k in served.feature_configs})
        collection.feature_configs.update(before)



@pytest.fixture(scope="module")
def one_id_run(tmp_path_factory, make_clicks):
    """A run whose features are all one id a row (a CTR model's usual case, as the demo's): the served model
    pools them through its kept plan, without preparing each feature (``ServedModel.pooled``)."""
    from dynemb.cli import main

    tmp = tmp_path_factory.mktemp("one-id")
    pq.write_table(make_clicks(0, 1200).drop(["tags"]), tmp / "train.parquet")
    threads = torch.get_num_threads()
    try:
        assert main(["train", "--data", str(tmp / "train.parquet"), "--label", "click", "--categorical", "user,item",
                     "--dense", "price", "--out", str(tmp / "run"), "--epochs", "1", "--batch-size", "128", "--dim",
                     "8", "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    return tmp / "run"


@pytest.mark.parametrize("tier", ["memory", "redis", "memory+lmdb"])
def test_one_id_features_pool_in_one_call_as_the_collection_does(one_id_run, tmp_path, tier):
    # batches of 0, 1 and 300 rows, unseen ids among them, cold caches then warm ones: the plan's path (one id
    # tensor, one lookup, one pooling call) gives the collection's outputs bit for bit, and the per-feature path's
    volatile = None
    if tier == "redis":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
        from redis_process import RedisServer

        redis = RedisServer(str(tmp_path))
        redis.start()
        volatile = {"type": "redis", "address": redis.address}
    persistent = {"type": "lmdb", "path": str(tmp_path / "lmdb")} if "lmdb" in tier else None
    served = ServedModel(one_id_run, name="one-id", volatile_db=volatile, persistent_db=persistent)
    try:
        model, _ = load_model(one_id_run)
        g = torch.Generator().manual_seed(0)
        rows = clicks_request(300, g)
        for n in (0, 1, 300, 300, 7):
            request = served.decode_request(rows(n), 10_000)
            batch = served.preprocessing.normalize(request)
            with torch.no_grad():
                got = served.pooled(batch)
                assert served._request_plan().one_id_ids(batch) is not None  # the plan's path ran
                want = model.embeddings(model.sparse_inputs(batch))
                plan = served._request_plan()
                plan.one_id = False  # the per-feature path, once
                try:
                    per_feature = served.pooled(batch)
                finally:
                    plan.one_id = True
                scores = served.predict(request)
                if n:  # the served DLRM's [B, F + 1, D] input held this batch's pooled outputs after slot 0, and
                    # DLRM.forward_stacked scored them as forward scores the collection's outputs, bit for bit
                    whole = served._buffer(n)[0]
                    assert torch.equal(whole[:, 1:], torch.stack([want[f] for f in served.features], 1))
                    assert torch.equal(scores, probabilities(served.model(batch, pooled=want)))
                # the [B, F, D] path the served DLRM scores through: the same outputs, the same logits bit for bit
                stacked = served.pooled_stacked(batch)
                assert stacked.shape == (n, 2, 8)
                assert torch.equal(stacked, torch.stack([want[f] for f in served.features], 1))
                assert torch.equal(served.model(batch, pooled=stacked), served.model(batch, pooled=want))
                eager = torch.sigmoid(model(batch).double()) if n else torch.zeros(0, dtype=torch.float64)
            assert sorted(got) == sorted(want) == sorted(per_feature) == ["item", "user"]
            for name in want:
                assert got[name].shape == (n, 8)
                assert torch.equal(got[name], want[name]) and torch.equal(per_feature[name], want[name]), name
            assert torch.allclose(scores, eager, rtol=0, atol=1e-12)
    finally:
        served.close()
        if tier == "redis":
            redis.kill()


def clicks_request(rows: int, g: torch.Generator):
    """``rows(n)``: a v2 JSON request of ``n`` rows (users and items seen in training, and some never seen)."""

    def make(n: int) -> dict:
        user = [f"u{u}" if u < 40 else f"never-{u}" for u in torch.randint(0, 44, (n,), generator=g).tolist()]
        item = [i if i < 60 else 10**12 + i for i in torch.randint(0, 64, (n,), generator=g).tolist()]
        price = (torch.rand(n, generator=g) * 100).tolist()
        columns = {"user": ("BYTES", user), "item": ("INT64", item), "price": ("FP32", price)}
        return {"inputs": [{"name": name, "shape": [n], "datatype": datatype, "data": data}
                           for name, (datatype, data) in columns.items()]}

    return make


def test_dlrm_takes_pooled_outputs_as_one_tensor_bit_for_bit():
    # a dict of [B, D], one [B, F, D], or (predict's and the served model's entry) the pooled rows already in
    # stacked[:, 1:] with the bottom MLP's output written into slot 0: the same logits, in one block and in several
    from dynemb.collection import EmbeddingCollection
    from dynemb.data.batch import Batch
    from dynemb.models.dlrm import DLRM, INTERACTION_ROWS, SCORING_ROWS, dlrm_tables

    torch.manual_seed(0)
    tables, features = dlrm_tables(["a", "b", "c"], dim=4)
    model = DLRM(2, EmbeddingCollection(tables, features), dim=4).eval()
    for n in (0, 1, 300, 2 * INTERACTION_ROWS + 5):
        batch = Batch(dense=torch.randn(n, 2), sparse={f: torch.randint(0, 50, (n,)) for f in "abc"},
                      labels=torch.zeros(n))
        pooled = {f: torch.randn(n, 4) for f in "abc"}
        view = torch.stack([pooled[f] for f in "abc"]).transpose(0, 1)  # a view, as the served model's
        stacked = torch.full((n, 4, 4), float("nan"))
        stacked[:, 1:] = view
        with torch.no_grad():
            expected = model(batch, pooled=pooled)
            assert torch.equal(model(batch, pooled=view), expected), n
            assert torch.equal(model.forward_stacked(batch.dense, stacked), expected), n
            # the bottom MLP of the pass as scoring runs it: padded to SCORING_ROWS rows
            padded = torch.cat([batch.dense, torch.zeros(-n % SCORING_ROWS, 2)])
            assert torch.equal(stacked[:, 0], model.bottom(padded)[:n]), n
