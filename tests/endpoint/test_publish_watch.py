"""A run publishes a full export and 3 deltas while clients send requests without pause to a server following it
with ``--watch``: no request fails, each response's probabilities are those the training model of the version it
names predicts (0 mixed-version responses), and the server ends on the last version."""

import shutil
import threading
import time

import pytest
import httpx
import numpy as np
import pyarrow.parquet as pq
import torch

from dynemb.checkpoint.export_format import version_name
from dynemb.checkpoint.fsutil import write_pointer
from dynemb.cli import main
from dynemb.data import FileReader
from dynemb.job import RunSpec, read_card, train_run
from dynemb.endpoint import ServedModel, build_app, running
from dynemb.endpoint.watch import ExportWatcher
from dynemb.serving.ps import ParameterServer
from dynemb.train import TrainConfig

CLIENTS, RESPONSES_PER_VERSION, ROWS = 3, 5, 64


def infer_body(run, prep) -> dict:
    """The first ``ROWS`` rows of ``run/test.parquet`` as they are (ids are read by the model's id types)."""
    rows = pq.read_table(run / "test.parquet").slice(0, ROWS).to_pydict()
    inputs = [{"name": c, "datatype": prep.id_types[c], "shape": [ROWS], "data": rows[c]} for c in prep.categorical]
    return {"inputs": inputs + [{"name": c, "datatype": "FP32", "shape": [ROWS], "data": rows[c]} for c in prep.dense]}


@pytest.mark.slow
def test_three_deltas_published_during_traffic_are_served_in_order_without_mixed_or_failed_responses(run, tmp_path):
    out = tmp_path / "run"
    spec = RunSpec(out=str(out), data=str(run / "train.parquet"), label="click", categorical=("user", "item"),
                   dense=("price",), batch_size=64, publish_every=5)
    cfg = TrainConfig(steps=20, dim=8, eval_every=1000)
    expected: dict[int, torch.Tensor] = {}  # version -> what the training model of that version predicts
    first, served_up, responses = threading.Event(), threading.Event(), {}
    rows = {}

    def on_publish(step, directory, model):
        version = int(directory.name.rsplit("-", 1)[1])
        if not rows:
            prep = read_card(out).preprocessing
            reader = FileReader(run / "test.parquet", label=prep.label, categorical=prep.categorical,
                                dense=prep.dense, batch_size=ROWS)
            rows["batch"], rows["prep"] = next(iter(reader)), prep
        model.eval()
        with torch.no_grad():
            expected[version] = torch.sigmoid(model(rows["prep"].normalize(rows["batch"]))).float()
        model.train()
        first.set()
        # Pace training: each version is answered a few times before the next one is published.
        assert served_up.wait(120), "the server did not start"
        deadline = time.monotonic() + 60
        while responses.get(version, 0) < RESPONSES_PER_VERSION:
            assert time.monotonic() < deadline, f"version {version} was not served within 60 s"
            time.sleep(0.02)

    training = {}
    trainer = threading.Thread(target=lambda: training.update(result=train_run(spec, cfg, progress=False,
                                                                               on_publish=on_publish)))
    trainer.start()
    while not first.wait(0.05):
        assert trainer.is_alive(), "training ended before its first version"
    served = ServedModel(out, name="ctr")
    watcher = ExportWatcher(served, interval_s=0.1).start()
    failures, mixed, seen, stop = [], [], [[] for _ in range(CLIENTS)], threading.Event()
    lock = threading.Lock()

    def client(i):
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.post(f"{url}/v2/models/ctr/infer", json=body)
                if r.status_code != 200:
                    failures.append(r.text)
                    continue
                reply = r.json()
                version, probs = int(reply["model_version"]), np.asarray(reply["outputs"][0]["data"], np.float64)
                if not np.allclose(probs, expected[version].numpy(), atol=1e-5, rtol=0):
                    mixed.append(version)
                seen[i].append(version)
                with lock:
                    responses[version] = responses.get(version, 0) + 1

    try:
        with running(build_app(served)) as url:
            body = infer_body(run, rows["prep"])
            clients = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
            for t in clients:
                t.start()
            served_up.set()
            trainer.join(timeout=300)
            assert not trainer.is_alive() and "result" in training
            stop.set()
            for t in clients:
                t.join(timeout=30)
    finally:
        stop.set()
        watcher.stop()
        served.close()
    published = [int(p.rsplit("-", 1)[1]) for p in training["result"]["published"]]
    assert published == [1, 2, 3, 4]  # a full export at step 5, deltas at 10, 15 and 20
    assert failures == [] and mixed == []
    assert all(responses[v] >= RESPONSES_PER_VERSION for v in published)
    # Each client saw the versions in order; the server ended on the last one.
    assert all(versions == sorted(versions) and versions[-1] == 4 for versions in seen)
    assert served.version == 4 and watcher.applied == [2, 3, 4]
    # The versions differ (so a mixed response would have been caught): training moved the predictions.
    assert all(not torch.allclose(expected[a], expected[b], atol=1e-4) for a, b in [(1, 2), (2, 3), (3, 4)])
    # The last version is the run's final model: `dynemb predict` on the same rows agrees.
    assert main(["predict", "--model", str(out), "--data", str(run / "test.parquet"), "--out",
                 str(tmp_path / "preds.parquet")]) == 0
    final = np.asarray(pq.read_table(tmp_path / "preds.parquet").column("probability"), np.float64)[:ROWS]
    np.testing.assert_allclose(final, expected[4].numpy(), atol=1e-6, rtol=0)


# A server that starts while training publishes: versions 2 and 3 land after the server has read `latest` (version 1)
# and before its parameter server loads the tables (a hook on ParameterServer.load, no sleeps). Every response must
# equal the training model's prediction of the version it reports, before and after the watcher's next poll.
def test_versions_published_while_the_server_loads_are_served_with_their_own_mlps(run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    spec = RunSpec(out=str(out), data=str(run / "train.parquet"), label="click", categorical=("user", "item"),
                   dense=("price",), batch_size=64, publish_every=5)
    expected, rows = {}, {}

    def on_publish(step, directory, model):
        if not rows:
            prep = read_card(out).preprocessing
            rows["prep"] = prep
            rows["batch"] = next(iter(FileReader(run / "test.parquet", label=prep.label, categorical=prep.categorical,
                                                 dense=prep.dense, batch_size=ROWS)))
        model.eval()
        with torch.no_grad():
            expected[int(directory.name.rsplit("-", 1)[1])] = torch.sigmoid(
                model(rows["prep"].normalize(rows["batch"]))).float()
        model.train()

    train_run(spec, TrainConfig(steps=15, dim=8, eval_every=1000), progress=False, on_publish=on_publish)
    assert sorted(expected) == [1, 2, 3]
    assert not torch.allclose(expected[1], expected[3], atol=1e-4)  # a v1-MLP/v3-table mix would be caught
    # An export root that holds only version 1, as when the server starts right after the first publish.
    published, root = out / "export", tmp_path / "export"
    shutil.copytree(published, root, ignore=lambda d, names: [n for n in names if n.startswith("version-")
                                                             and n != version_name(1)] + ["latest"])
    write_pointer(root, version_name(1))
    load = ParameterServer.load

    def publish_then_load(self, model, progress=True):
        for v in (2, 3):  # training publishes twice more before the tables are read
            shutil.copytree(published / version_name(v), root / version_name(v))
            write_pointer(root, version_name(v))
        return load(self, model, progress)

    monkeypatch.setattr(ParameterServer, "load", publish_then_load)
    served = ServedModel(out, export=root, name="ctr")
    monkeypatch.setattr(ParameterServer, "load", load)
    watcher = ExportWatcher(served, interval_s=0.05)
    try:
        with running(build_app(served)) as url:
            body = infer_body(run, rows["prep"])
            for _ in range(2):  # before and after a poll: nothing newer to apply, the pair stays right
                reply = httpx.post(f"{url}/v2/models/ctr/infer", json=body, timeout=30).json()
                version = int(reply["model_version"])
                assert version == 3
                np.testing.assert_allclose(np.asarray(reply["outputs"][0]["data"], np.float64),
                                           expected[version].numpy(), atol=1e-5, rtol=0)
                assert watcher.poll() == []
    finally:
        served.close()
