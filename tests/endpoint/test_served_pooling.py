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

