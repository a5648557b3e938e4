"""``dynemb demo``: the main job end to end on synthetic files, through the same commands a user runs.

1. write a synthetic, Criteo-shaped click log (26 categorical, 13 dense columns, labels from a hidden model) as
   ``data/train.parquet`` and, from a separate split, ``data/eval.parquet``;
2. ``dynemb train`` on the training file (5% of its rows held out) into ``run/``; then, for the first
   ``BOUNDED_STEPS`` steps again, with every table bounded to ``BOUNDED_FRACTION`` of its ids (``--max-capacity``,
   the default eviction policy) into ``run-bounded/``: held-out AUC of both at that step, and evictions per row;
3. ``dynemb eval`` on the separate file, next to the hidden model's AUC on it (the ceiling);
4. ``dynemb predict`` on it into ``predictions.parquet``;
5. ``dynemb export`` and ``dynemb serve-bench`` (memory + LMDB, 20% cache, power-law traffic).

Each command is printed before it runs, as a user would type it. The report directory gets ``summary.json``,
``summary.md`` and plots: ``run/loss_auc.png``, ``tables.png`` (rows held by step), ``cache_hit_rate.png`` and
``eviction_hit_rate.png``: the hit rate of each eviction policy and of Belady's optimum at 10% and 30% capacity on a
drifting id trace (:func:`dynemb.data.replay.compare`), which is how the default policy was chosen.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from .data import SyntheticClickLog, auc
from .data.traces import DriftingTrace
from .data.writers import write_synthetic
from .serving.bench import summary_table
from .table.policy import DEFAULT_BOUNDED
from .data.replay import compare, summarize, unique_accesses

__all__ = ["run_demo", "plot_policies", "DEMO_LOG", "TRAIN_BATCHES", "EVAL_BATCHES"]

# Embedded defaults: Criteo's shape (26 categorical, 13 dense columns), 500 ids per feature under a power law.
DEMO_LOG = SyntheticClickLog(batch_size=8192, vocab_sizes=500, seed=0)
TRAIN_BATCHES, EVAL_BATCHES = 100, 4  # 819,200 training rows, 32,768 evaluation rows
# The bounded run: 90% of each table's ids. A 512-row batch holds ~176 of a table's 500 ids, so 30% (150 rows)
# cannot even hold one batch. Held-out AUC after 600 steps below the unbounded run's (8,192 rows, decayed_lfu):
# 0.014 at 50%, 0.006 at 70%, 0.005 at 80%, 0.002 at 90%; lfu is within 0.001 of it, lru 0.02-0.03 lower.
BOUNDED_FRACTION, BOUNDED_STEPS, EVAL_EVERY, PERIODIC_EVAL_BATCHES = 0.9, 600, 100, 16
# The trace of the policy comparison: 23,421 distinct ids; every policy and Belady in ~5 s.
EVICTION_TRACE = DriftingTrace(num_slots=20_000, batch_size=2048, num_batches=100, lifetime=100.0, seed=0)


def run_demo(seconds: float = 75.0, out_dir: str | Path = "demo-report", threads: int = 1,
             train_batches: int = TRAIN_BATCHES, *, command: Callable[[list[str]], int]) -> dict:
    """Run the steps of the module docstring; returns (and writes) the summary.

    ``command`` is the ``dynemb`` command's entry point, :func:`dynemb.cli.main` (``argv -> exit status``), which
    ``dynemb demo`` passes in: the demo runs the commands as a user would, yet sits below the cli that offers it.
    """
    out = Path(out_dir)
    for sub in ("data", "run", "run-bounded", "export", "lmdb", "predictions.parquet"):
        path = out / sub
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    (out / "data").mkdir(parents=True)
    log = DEMO_LOG
    started = time.perf_counter()
    print(f"1/5 writing synthetic click logs: {out / 'data/train.parquet'} ({train_batches * log.batch_size:,} rows)"
          f" and {out / 'data/eval.parquet'} ({EVAL_BATCHES * log.batch_size:,} rows of a separate split)")
    train_file = write_synthetic(log, out / "data/train.parquet", train_batches)
    eval_file = write_synthetic(log, out / "data/eval.parquet", EVAL_BATCHES, split="eval")
    evals = [log.batch(i, "eval") for i in range(EVAL_BATCHES)]
    ceiling = auc(torch.cat([log.logits(b) for b in evals]), torch.cat([b.labels for b in evals]))

    threads_arg = ["--threads", str(threads)]
    columns = ["--data", train_file, "--label", "label", "--categorical", ",".join(log.categorical_names),
               "--dense", ",".join(log.dense_names), "--eval-batches", PERIODIC_EVAL_BATCHES]
    rng = torch.get_rng_state()  # the dense layers of the bounded run start as these: runs differ by the bound only
    trained = _dynemb(command, "2/5", "train", *columns, "--out", out / "run", "--seconds", seconds, *threads_arg)
    torch.set_rng_state(rng)
    bounded = _bounded_run(command, out, columns, trained, threads_arg)
    evaluated = _dynemb(command, "3/5", "eval", "--model", out / "run", "--data", eval_file, *threads_arg)
    predicted = _dynemb(command, "4/5", "predict", "--model", out / "run", "--data", eval_file, "--out",
                        out / "predictions.parquet", *threads_arg)
    _dynemb(command, "5/5", "export", "--model", out / "run", "--out", out / "export", parse=False)
    serving = _dynemb(command, "   ", "serve-bench", "--export", out / "export", "--persistent-path", out / "lmdb",
                      "--batches", "120", "--json", echo=summary_table)
    shutil.rmtree(out / "lmdb", ignore_errors=True)
    print("   eviction policies on a drifting id trace (hit rate at 10% and 30% of its ids, and Belady's)", flush=True)
    policies = compare(unique_accesses(EVICTION_TRACE.batches()), (0.1, 0.3), warmup=10)

    summary = {
        "held_out_auc": trained["auc"], "eval_file_auc": evaluated["auc"], "auc_ceiling": round(float(ceiling), 4),
        "eval_file_logloss": evaluated["logloss"], "train_steps": trained["step"],
        "train_samples_per_s": round(trained["samples"] / max(trained["seconds"], 1e-9)),
        "table_rows": trained["table_rows"], "predict_rows_per_s": predicted["rows_per_s"],
        "serving_p50_ms": round(serving["p50_ms"], 2), "serving_p99_ms": round(serving["p99_ms"], 2),
        "serving_qps": round(serving["qps"], 1), "cache_hit_rate": round(serving["hit_rate"], 4),
        **bounded, **_eviction_summary(policies),
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(_markdown(summary))
    _plots(out, serving, policies)
    print(f"report in {out}:")
    print(_markdown(summary))
    return summary


def _bounded_run(command: Callable, out: Path, columns: list, trained: dict, threads_arg: list) -> dict:
    """Train the first steps again with every table bounded (default policy); compare held-out AUC at that step."""
    steps = min(BOUNDED_STEPS, trained["step"])
    if steps < trained["step"]:
        steps -= steps % EVAL_EVERY  # a step both runs evaluated
    capacity = max(1, round(BOUNDED_FRACTION * trained["table_rows"] / DEMO_LOG.num_categorical))
    run = _dynemb(command, "   ", "train", *columns, "--out", out / "run-bounded", "--steps", steps, "--max-capacity",
                  capacity, "--eval-every", EVAL_EVERY, *threads_arg)
    unbounded, bounded = _auc_at(out / "run", steps), _auc_at(out / "run-bounded", steps)
    return {"bounded_capacity": capacity, "bounded_steps": steps, "unbounded_auc_at_step": round(unbounded, 4),
            "bounded_auc_at_step": round(bounded, 4), "bounded_auc_below": round(unbounded - bounded, 4),
            "bounded_evicted_per_row": round(run["evicted"] / max(run["table_rows"], 1), 2)}


def _auc_at(run: Path, step: int) -> float:
    """The periodic held-out AUC a run logged at ``step``."""
    from .job.report import read_metrics

    return next(r["auc"] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "eval" and r["step"] == step)


def _eviction_summary(rows: list[dict]) -> dict:
    out = {"eviction_default": DEFAULT_BOUNDED.value}
    for s in summarize(rows, DEFAULT_BOUNDED.value):
        pct = round(100 * s["fraction"])
        out[f"eviction_below_best_{pct}"] = f"{s['default_below_best_points']} ({s['best_online']})"
        out[f"eviction_below_belady_{pct}"] = s["default_below_belady_points"]
    return out


def _dynemb(command: Callable[[list[str]], int], step: str, *args, parse: bool = True, echo=None):
    """Print ``$ dynemb ARGS``, run it in this process through ``command`` (the cli's ``main``), echo its output
    (through ``echo(result)`` when given); returns the last line as JSON when ``parse``."""
    argv = [str(a) for a in args]
    print(f"{step} $ dynemb {' '.join(argv)}", flush=True)
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = command(argv)
    text = captured.getvalue().strip()
    if code != 0:
        raise RuntimeError(f"dynemb {argv[0]} failed with status {code}")
    result = json.loads(text.splitlines()[-1]) if parse else text
    shown = echo(result) if echo else text
    print("\n".join("      " + line for line in shown.splitlines()), flush=True)
    return result


_LABELS = {
    "held_out_auc": "held-out AUC (5% of the training file)", "eval_file_auc": "AUC on the separate eval file",
    "auc_ceiling": "AUC of the hidden model on that file (ceiling)", "eval_file_logloss": "log loss on it",
    "train_steps": "training steps (batch 512)", "train_samples_per_s": "train throughput (samples/s)",
    "table_rows": "rows in all tables", "predict_rows_per_s": "predict: rows/s (read, score, write)",
    "serving_p50_ms": "serving p50 (ms / 26x1024 ids)", "serving_p99_ms": "serving p99 (ms)",
    "serving_qps": "serving requests/s", "cache_hit_rate": "cache hit rate",
    "bounded_capacity": f"bounded run: rows per table ({BOUNDED_FRACTION:.0%} of its ids)",
    "bounded_steps": "bounded run: steps (both runs evaluated there)",
    "unbounded_auc_at_step": "held-out AUC at that step, unbounded", "bounded_auc_at_step": "... bounded",
    "bounded_auc_below": "bounded AUC below unbounded (target <= 0.005)",
    "bounded_evicted_per_row": "bounded run: evictions per stored row",
    "eviction_default": "default eviction policy (bounded tables)",
    "eviction_below_best_10": "trace, 10% capacity: default below best (points)",
    "eviction_below_belady_10": "trace, 10% capacity: default below Belady (points)",
    "eviction_below_best_30": "trace, 30% capacity: default below best (points)",
    "eviction_below_belady_30": "trace, 30% capacity: default below Belady (points)",
    "total_seconds": "wall time (s)",
}


def _markdown(summary: dict) -> str:
    width = max(len(v) for v in _LABELS.values())
    lines = ["| metric | value |", "|---|---|"] + [f"| {_LABELS[k]:<{width}} | {v} |" for k, v in summary.items()]
    return "\n".join(lines) + "\n"


def _plots(out: Path, serving: dict, policies: list[dict]) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .job.report import read_metrics

    train = [r for r in read_metrics(out / "run" / "metrics.jsonl") if r["kind"] == "train"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["table_rows"] if "table_rows" in r else r["rows"] for r in train])
    ax.set_xlabel("step")
    ax.set_ylabel("rows in all tables")
    ax.set_title("Table growth (26 dynamic tables)")
    fig.tight_layout()
    fig.savefig(out / "tables.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(serving["hit_rate_curve"]) + 1), serving["hit_rate_curve"])
    ax.set_xlabel("request (26 tables x 1024 ids), after warm-up")
    ax.set_ylabel("cumulative cache hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Parameter server cache (20% of rows)")
    fig.tight_layout()
    fig.savefig(out / "cache_hit_rate.png", dpi=110)
    plt.close(fig)

    plot_policies(plt, policies, out / "eviction_hit_rate.png")


def plot_policies(plt, rows: list[dict], path: Path) -> None:
    """Grouped bars of :func:`~dynemb.data.replay.compare` rows: hit rate of each policy and of Belady's optimum
    at each capacity, one panel per ``trace`` (when the rows name traces); the default policy is marked."""
    traces = list(dict.fromkeys(r.get("trace", "") for r in rows))
    names = list(dict.fromkeys(r["policy"] for r in rows))
    fractions = list(dict.fromkeys(r["fraction"] for r in rows))
    width = 0.8 / len(fractions)
    fig, axes = plt.subplots(len(traces), 1, figsize=(8, 2.6 * len(traces) + 0.8), squeeze=False, sharex=True)
    for ax, trace in zip(axes[:, 0], traces):
        for j, fraction in enumerate(fractions):
            rates = {r["policy"]: r["hit_rate"] for r in rows
                     if r["fraction"] == fraction and r.get("trace", "") == trace}
            ax.bar([i + j * width for i in range(len(names))], [rates[n] for n in names], width,
                   label=f"capacity {fraction:.0%} of ids")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1)
        ax.set_title(trace or "Eviction policies on a drifting power-law trace", fontsize=9)
    labels = [f"{n}\n(default)" if n == DEFAULT_BOUNDED.value else n for n in names]
    axes[-1, 0].set_xticks([i + width * (len(fractions) - 1) / 2 for i in range(len(names))], labels, fontsize=8)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("Hit rate of distinct ids per batch (Belady: the offline optimum)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
