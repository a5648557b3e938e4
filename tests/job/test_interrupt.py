"""Runs that end early leave a run directory that ``--resume`` continues: Ctrl-C (a real SIGINT to a real process),
a failure at the final save, a run stopped before its first checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dynemb.cli import main
from dynemb.job.report import read_metrics

from .test_fit import SMALL, random_labels

COLUMNS = ["--label", "y", "--categorical", "id", "--dense", "x"]


def _metrics(run) -> list:
    return read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_saves_and_resume_continues(tmp_path):
    data = random_labels(tmp_path / "random.parquet", rows=4000)
    run = tmp_path / "run"
    args = ["train", "--data", str(data), *COLUMNS, "--out", str(run), "--steps", "1000000", "--eval-every", "5",
            "--patience", "0", *SMALL]
    proc = subprocess.Popen([sys.executable, "-m", "dynemb", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    deadline = time.monotonic() + 240
    while not any(m["kind"] == "eval" for m in _metrics(run)):  # eval lines are flushed: training is under way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    step = json.loads((run / "checkpoint" / "latest").read_text())["step"]
    assert 5 <= step < 1000000
    line = err.strip().splitlines()[-1]
    assert line == (f"dynemb train: interrupted at step {step}; saved a checkpoint in {run / 'checkpoint'}; "
                    f"continue with: dynemb {' '.join(args)} --resume"), line
    assert "stopping after this step" in err and "Traceback" not in err and not out.strip()
    assert [m["step"] for m in _metrics(run) if m["kind"] == "train"] == list(range(1, step + 1))
    # The same command with --resume (a smaller --steps, to end the test) continues from the saved step.
    resumed = args[:args.index("--steps")] + ["--steps", str(step + 7)] + args[args.index("--steps") + 2:]
    code = main([*resumed, "--resume"])
    assert code == 0
    metrics = _metrics(run)
    assert [m["step"] for m in metrics if m["kind"] == "train"] == list(range(1, step + 8))
    assert metrics[-1]["kind"] == "final" and metrics[-1]["step"] == step + 7


def test_a_second_ctrl_c_aborts_at_once_and_the_handlers_are_restored():
    from dynemb.job.fit import _stop_signals

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with _stop_signals(True, print) as should_stop:
        assert not should_stop()
        os.kill(os.getpid(), signal.SIGINT)
        assert should_stop()
        os.kill(os.getpid(), signal.SIGTERM)  # torchrun follows a Ctrl-C with SIGTERM: not a second Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes; it raises here at the latest
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with _stop_signals(False, print) as should_stop:
        assert should_stop is None and signal.getsignal(signal.SIGINT) == before[0]


def _fail_saves(monkeypatch, when):
    """Make ``dynemb.checkpoint.save`` raise for the saves ``when(root, step)`` picks; returns the calls."""
    import dynemb.checkpoint

    real, calls = dynemb.checkpoint.save, []

    def save(root, *args, step, **kwargs):
        calls.append((str(root).rsplit("/", 1)[1], step))
        if when(str(root).rsplit("/", 1)[1], step):
            raise OSError(28, "No space left on device")
        return real(root, *args, step=step, **kwargs)

    monkeypatch.setattr(dynemb.checkpoint, "save", save)
    return calls


@pytest.mark.slow
def test_a_failure_at_the_final_save_keeps_the_previous_checkpoint_and_resume_finishes_the_run(tmp_path, monkeypatch,
                                                                                             capsys):
    data = random_labels(tmp_path / "random.parquet", rows=1000)
    args = ["train", "--data", str(data), *COLUMNS, "--steps", "6", "--checkpoint-every", "4", "--eval-every", "100",
            *SMALL]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    run = tmp_path / "run"
    calls = _fail_saves(monkeypatch, lambda root, step: root == "checkpoint" and step == 6)
    assert main([*args, "--out", str(run)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "dynemb train: error: [Errno 28] No space left on device"
    assert calls == [("checkpoint", 4), ("checkpoint-best", 6), ("checkpoint", 6)]
    assert json.loads((run / "checkpoint" / "latest").read_text())["step"] == 4
    assert sorted(p.name for p in (run / "checkpoint").iterdir()) == ["latest", "step-00000004"]  # no leftovers
    monkeypatch.undo()
    # The best checkpoint (step 6, evaluated at the end) is the newest: resume starts there and only finishes.
    assert main([*args, "--out", str(run), "--resume"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == f"resumed from {run} at step 6"
    resumed = json.loads(out[-1])
    assert {k: resumed[k] for k in ("auc", "logloss", "step", "best_step")} == \
        {k: whole[k] for k in ("auc", "logloss", "step", "best_step")}


def test_a_run_stopped_before_any_checkpoint_resumes_from_step_0(tmp_path, monkeypatch, capsys):
    data = random_labels(tmp_path / "random.parquet", rows=1000)
    run = tmp_path / "run"
    args = ["train", "--data", str(data), *COLUMNS, "--out", str(run), "--steps", "6", "--eval-every", "3", *SMALL]
    _fail_saves(monkeypatch, lambda root, step: True)  # the first save is the best model at step 3
    assert main(args) == 2
    capsys.readouterr()
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl", "model.json"]
    monkeypatch.undo()
    assert main(args) == 2  # a new run in the same directory is refused, as for any run
    assert "not empty; pass --resume to continue the run there" in capsys.readouterr().err
    assert main([*args, "--resume"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == f"no checkpoint in {run} yet: training it from step 0"
    assert json.loads(out[-1])["step"] == 6
    metrics = _metrics(run)
    assert [m["step"] for m in metrics if m["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # the lost steps dropped
    assert [m["kind"] for m in metrics].count("final") == 1
