"""Giving a directory inside a run (its checkpoint or serving export) where the run directory is wanted: the error
says what the directory is and which one to pass (``--model run/export-best`` said "did the training run finish?")."""

import json

import pytest

from dynemb.job.card import model_checkpoint, read_card


def fake_run(root):
    run = root / "run"
    for d in ("checkpoint", "checkpoint-best/step-00000001", "export-best/version-00000001"):
        (run / d).mkdir(parents=True)
    (run / "model.json").write_text("{}")
    (run / "export-best" / "model.json").write_text("{}")  # an export root has a model.json of its own
    for d in ("checkpoint-best", "export-best"):
        (run / d / "latest").write_text(json.dumps({"name": "x", "step": 1}))
    return run


def test_a_directory_inside_a_run_names_the_run(tmp_path):
    run = fake_run(tmp_path)
    with pytest.raises(ValueError, match=r"export-best: a serving export or a checkpoint, not a `dynemb train --out` "
                                         rf"directory \(.*export-best lies in the run directory {run}: pass that\)$"):
        model_checkpoint(run / "export-best")
    with pytest.raises(ValueError, match=r"checkpoint-best: no model.json; is this a `dynemb train --out` directory\? "
                                         rf"\(.*checkpoint-best lies in the run directory {run}: pass that\)$"):
        read_card(run / "checkpoint-best")
    with pytest.raises(ValueError, match=r"elsewhere: no model.json; is this a `dynemb train --out` directory\?$"):
        read_card(tmp_path / "elsewhere")
