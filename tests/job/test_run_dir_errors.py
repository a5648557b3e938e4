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


def test_a_refused_model_setting_leaves_out_as_it_was(tmp_path, capsys, monkeypatch):
    """A setting the model refuses when it is built (``--max-capacity 3000000000``, past a table's 2**31 - 1 rows,
    was one before the option's own check): `out` must not keep a model.json from it, which made the corrected
    command fail ("not empty; pass --resume") and ``--resume`` repeat the refused value."""
    import dynemb.job.fit as fit
    from dynemb.cli import main

    from .test_fit import SMALL, random_labels

    data = random_labels(tmp_path / "random.parquet", rows=600)
    run = tmp_path / "run"
    args = ["train", "--data", data, "--label", "y", "--categorical", "id", "--dense", "x", "--out", run,
            "--steps", "2", *SMALL]
    with pytest.raises(SystemExit):  # the option's check names the option, not the library's max_capacity
        main([str(a) for a in [*args, "--max-capacity", "3000000000"]])
    assert "argument --max-capacity: must be an int in [1, 2147483647], got 3000000000" in capsys.readouterr().err
    build = fit.build_dlrm

    def refused(*a, **k):
        raise ValueError("max_capacity must be None or an int in [1, 2147483647], got 3000000000")

    monkeypatch.setattr(fit, "build_dlrm", refused)
    assert main([str(a) for a in [*args, "--max-capacity", "300"]]) == 2
    assert "max_capacity must be None" in capsys.readouterr().err
    assert not run.exists() or not any(run.iterdir())
    monkeypatch.setattr(fit, "build_dlrm", build)
    assert main([str(a) for a in [*args, "--max-capacity", "300"]]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("resume", [False, True])
def test_out_naming_a_file_is_refused_before_anything_is_written(tmp_path, capsys, resume):
    """``--out data.parquet`` (the data file given for the run directory) said "[Errno 20] Not a directory"."""
    from dynemb.cli import main

    from .test_fit import SMALL, random_labels

    data = random_labels(tmp_path / "random.parquet", rows=300)
    before = open(data, "rb").read()
    args = ["train", "--data", data, "--label", "y", "--categorical", "id", "--out", data, "--steps", "2", *SMALL]
    assert main([str(a) for a in args + (["--resume"] if resume else [])]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    expected = (f"{data}: a file, not a run directory (a `dynemb train --out` directory, with a model.json)" if resume
                else f"--out {data}: a file, not a directory; the run directory is a new or empty directory (or, "
                     "with --resume, a run's)")
    assert line == f"dynemb train: error: {expected}", line
    assert open(data, "rb").read() == before


def test_model_naming_a_file_says_so(tmp_path):
    (tmp_path / "scores.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"scores.parquet: a file, not a run directory \(a `dynemb train --out` "
                                         r"directory, with a model.json\)$"):
        read_card(tmp_path / "scores.parquet")
