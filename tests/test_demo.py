"""`dynemb demo` (what `make demo` runs), shortened: the same commands on a small training file."""

import pytest

from dynemb.cli import main
from dynemb.demo import run_demo


@pytest.mark.slow
def test_demo_runs_train_eval_predict_export_and_serve_bench(tmp_path, capsys):
    summary = run_demo(seconds=2.0, out_dir=tmp_path / "report", train_batches=2, command=main)
    out = capsys.readouterr().out
    for command in ("$ dynemb train --data", "$ dynemb eval --model", "$ dynemb predict --model",
                    "$ dynemb export --model", "$ dynemb serve-bench --export"):
        assert command in out
    assert "latency p50 / p99" in out and "hit_rate_curve" not in out  # serve-bench's table, not its JSON
    assert 0.5 < summary["eval_file_auc"] <= summary["auc_ceiling"] + 0.02
    names = {p.name for p in (tmp_path / "report").iterdir()}
    assert {"summary.json", "summary.md", "tables.png", "cache_hit_rate.png", "predictions.parquet", "run"} <= names
    assert (tmp_path / "report" / "run" / "loss_auc.png").exists()
