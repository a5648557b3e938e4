"""Under torch.distributed every rank takes the same early-stopping and Ctrl-C decisions (their saves are
collective: a rank that stopped alone would leave the others waiting forever)."""

import json
import time
from pathlib import Path

import pytest

from distributed.harness import run


def _train(rank, world, out):
    from dynemb.data import SyntheticClickLog
    from dynemb.train import TrainConfig, Trainer, build_dlrm

    data = SyntheticClickLog(num_categorical=2, num_dense=2, batch_size=64, seed=0)
    for scenario in ("early", "interrupt"):
        root = Path(out) / scenario
        cfg = TrainConfig(steps=300, dim=4, lr=0.5, eval_every=2, patience=2, checkpoint_dir=str(root / "last"),
                          best_dir=str(root / "best"))
        trainer = Trainer(build_dlrm(2, data.categorical_names, cfg), cfg)
        # Each rank evaluates rows of its own: their losses differ, rank 0's decides.
        evals = [data.batch(rank, "eval")]
        stop = (lambda trainer=trainer: rank == 1 and trainer.step == 7) if scenario == "interrupt" else None
        trainer.fit(data.batches("train", start=rank, step=world), evals, progress=False, should_stop=stop)
        losses = [e["loss"] for e in trainer.history.evals]
        (root / f"rank{rank}.json").write_text(json.dumps({"step": trainer.step, "best": trainer.best_step,
                                                           "stopped": trainer.stopped, "losses": losses}))


@pytest.mark.slow
def test_every_rank_stops_at_the_same_step_early_or_on_ctrl_c(tmp_path):
    ctx = run(_train, 2, tmp_path, str(tmp_path), join=False)
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):  # ranks that disagree wait for each other forever: fail instead of hanging
        if time.monotonic() > deadline:
            for process in ctx.processes:
                process.kill()
            pytest.fail("the ranks did not finish: they disagreed on when to stop")
    r0, r1 = (json.loads((tmp_path / "early" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["losses"] != r1["losses"]  # the ranks measured different losses ...
    assert (r0["step"], r0["best"], r0["stopped"]) == (r1["step"], r1["best"], r1["stopped"])  # ... and agreed
    assert r0["stopped"] == "early" and r0["step"] < 300
    assert r0["best"] == 2 * (r0["losses"].index(min(r0["losses"])) + 1)  # rank 0's best
    assert json.loads((tmp_path / "early" / "best" / "latest").read_text())["step"] == r0["best"]
    # Ctrl-C reached rank 1 only (should_stop true there at step 7): both ranks stopped after step 7, and saved.
    r0, r1 = (json.loads((tmp_path / "interrupt" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["stopped"] == r1["stopped"] == "interrupted" and r0["step"] == r1["step"] == 7
    assert json.loads((tmp_path / "interrupt" / "last" / "latest").read_text())["step"] == 7
