"""``dynemb serve --watch``: new export versions (full, then deltas) applied in order; the served model then scores
like the updated training model."""

import torch

from dynemb.checkpoint import export_for_serving
from dynemb.data import FileReader
from dynemb.job import load_model
from dynemb.job.score import probabilities
from dynemb.endpoint import ServedModel
from dynemb.endpoint.watch import ExportWatcher, pending_versions


def test_new_versions_are_applied_in_order_and_served(run, tmp_path):
    model, card = load_model(run / "run")
    export_for_serving(tmp_path / "exp", model)  # version 1
    served = ServedModel(run / "run", export=tmp_path / "exp", name="ctr")
    try:
        watcher = ExportWatcher(served, interval_s=60)
        assert watcher.poll() == [] and served.version == 1
        user = model.embeddings.embeddings["user"]
        model.train()
        prep = card.preprocessing
        batch = next(iter(FileReader(run / "test.parquet", label=prep.label, categorical=prep.categorical,
                                     multi_hot=prep.multi_hot, dense=prep.dense, batch_size=64)))
        users = batch.sparse["user"][:8]
        user.insert_or_assign(users[:4], torch.full((4, 8), 0.5))
        export_for_serving(tmp_path / "exp", model, incremental=True)  # version 2: a delta
        user.insert_or_assign(users[4:8], torch.full((4, 8), -0.5))
        user.erase(users[:2])
        export_for_serving(tmp_path / "exp", model, incremental=True)  # version 3: a delta on top of 2
        model.eval()
        assert [p.name for p in pending_versions(tmp_path / "exp", 1)] == ["version-00000002", "version-00000003"]
        assert watcher.poll() == [2, 3] and served.version == 3 and watcher.poll() == []
        with torch.no_grad():
            expected = probabilities(model(prep.normalize(batch)))
        torch.testing.assert_close(served.predict(batch), expected, atol=1e-6, rtol=0)
    finally:
        served.close()


def test_a_refused_version_is_logged_once_while_its_error_stays_the_same(tmp_path, caplog):
    """A version the server refuses (say, tables that differ from the served ones) is retried at every poll; the
    operator's log gets the error once, again when it changes, and the version applies once it can."""
    import logging
    import types

    from dynemb.checkpoint.fsutil import write_pointer

    (tmp_path / "version-00000002").mkdir()
    write_pointer(tmp_path, "version-00000002")
    errors = ["tables differ", "tables differ", "tables differ", "disk full", None]
    applied = []

    def apply_update(directory):
        error = errors.pop(0)
        if error is not None:
            raise ValueError(error)
        applied.append(directory.name)

    model = types.SimpleNamespace(export=tmp_path, version=1, apply_update=apply_update)
    watcher = ExportWatcher(model, interval_s=60)
    with caplog.at_level(logging.DEBUG, logger="dynemb.endpoint.watch"):
        assert [watcher.poll() for _ in range(5)] == [[], [], [], [], [2]]
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage().split("(")[1].split(")")[0] for r in logged] == ["tables differ", "disk full"]
    assert watcher.errors == 4 and applied == ["version-00000002"] and watcher.version == 2
