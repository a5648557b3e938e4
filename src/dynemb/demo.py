"""``dynemb demo``: train a DLRM on synthetic click logs, checkpoint, export, serve, and report.

Writes ``demo-report/``: PNG plots (loss and AUC, table growth and evictions, cache hit rate), ``summary.json``
and ``summary.md``; the checkpoint, the serving export and the LMDB store live there too.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from .checkpoint import export_for_serving, save
from .data import SyntheticClickLog, auc
from .serving.bench import serve_bench
from .train import Trainer, TrainConfig, build_dlrm

__all__ = ["run_demo"]

# Embedded defaults: a Criteo-shaped stream, tables bounded so that eviction shows within two minutes.
BATCH_SIZE = 2048
TRAIN = TrainConfig(steps=100_000, dim=16, optimizer="adagrad", lr=0.05, max_capacity=50_000, eviction="lfu",
                    eval_every=25)


def run_demo(seconds: float = 120.0, out_dir: str | Path = "demo-report", threads: int = 1) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    out = Path(out_dir)
    for sub in ("checkpoint", "export"):
        shutil.rmtree(out / sub, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    data = SyntheticClickLog(batch_size=BATCH_SIZE, seed=0)
    cfg = TrainConfig(**{**TRAIN.__dict__, "seconds": seconds})
    print(f"1/4 training a DLRM (26 dynamic tables, dim {cfg.dim}, <= {cfg.max_capacity:,} rows each, "
          f"{cfg.eviction} eviction) for {seconds:.0f} s")
    trainer = Trainer(build_dlrm(data.num_dense, data.categorical_names, cfg), cfg)
    evals = [data.batch(i, "eval") for i in range(8)]
    started = time.perf_counter()
    history = trainer.fit(data.batches("train"), evals)
    train_seconds = time.perf_counter() - started

    print("2/4 saving a checkpoint and exporting for serving")
    started = time.perf_counter()
    save(out / "checkpoint", trainer.model, trainer.optimizer, step=trainer.step)
    export = export_for_serving(out / "export", trainer.model)
    io_seconds = time.perf_counter() - started

    print("3/4 serving: in-process memory store + LMDB, 20% cache, power-law lookups (alpha 1.2)")
    serving = serve_bench(export, volatile="memory", persistent="lmdb", persistent_path=str(out / "lmdb"),
                          cache_fraction=0.2, batch_size=1024, batches=120, alpha=1.2, progress=True)
    shutil.rmtree(out / "lmdb", ignore_errors=True)

    tables = trainer.model.embeddings.dynemb_tables()
    last = history.steps[-1]
    ceiling = auc(torch.cat([data.logits(b) for b in evals]), torch.cat([b.labels for b in evals]))
    summary = {
        "auc": round(history.last_auc, 4),
        "auc_ceiling": round(float(ceiling), 4),
        "steps": trainer.step,
        "train_samples_per_s": round(trainer.step * BATCH_SIZE / train_seconds),
        "rows_total": sum(t.size() for t in tables),
        "rows_largest_table": max(t.size() for t in tables),
        "evicted_total": last["evicted"],
        "table_memory_mb": round(last["table_bytes"] / 2**20, 1),
        "checkpoint_and_export_s": round(io_seconds, 2),
        "serving_p50_ms": round(serving["p50_ms"], 2),
        "serving_p99_ms": round(serving["p99_ms"], 2),
        "serving_qps": round(serving["qps"], 1),
        "cache_hit_rate": round(serving["hit_rate"], 4),
    }
    print("4/4 writing the report to", out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(_markdown(summary))
    _plots(out, history, serving)
    print(_markdown(summary))
    return summary


def _markdown(summary: dict) -> str:
    labels = {
        "auc": "held-out AUC", "auc_ceiling": "AUC of the hidden ground-truth model (ceiling)", "steps": "training steps", "train_samples_per_s": "train throughput (samples/s)",
        "rows_total": "rows in all tables", "rows_largest_table": "rows in the largest table",
        "evicted_total": "rows evicted", "table_memory_mb": "table memory (MiB)",
        "checkpoint_and_export_s": "checkpoint + export (s)", "serving_p50_ms": "serving p50 (ms / 26x1024 ids)",
        "serving_p99_ms": "serving p99 (ms)", "serving_qps": "serving requests/s", "cache_hit_rate": "cache hit rate",
    }
    width = max(len(v) for v in labels.values())
    lines = ["| metric | value |", "|---|---|"] + [f"| {labels[k]:<{width}} | {v} |" for k, v in summary.items()]
    return "\n".join(lines) + "\n"


def _plots(out: Path, history, serving: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history.steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    window = 20
    loss = torch.tensor([r["loss"] for r in history.steps])
    smooth = loss.unfold(0, window, 1).mean(1).tolist() if len(loss) >= window else loss.tolist()
    ax.plot(steps[len(steps) - len(smooth):], smooth, label=f"train loss ({window}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("BCE loss")
    ax2 = ax.twinx()
    ax2.plot([e["step"] for e in history.evals], [e["auc"] for e in history.evals], "o-", color="tab:orange",
             label="held-out AUC")
    ax2.set_ylabel("AUC")
    fig.legend(loc="lower center", ncol=2)
    fig.suptitle("Training")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out / "loss_auc.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["rows"] for r in history.steps], label="rows in all tables")
    ax.set_xlabel("step")
    ax.set_ylabel("rows held")
    ax2 = ax.twinx()  # evictions grow without bound while rows stay capped: separate axes keep both readable
    ax2.plot(steps, [r["evicted"] for r in history.steps], color="tab:orange", label="rows evicted (cumulative)")
    ax2.set_ylabel("rows evicted")
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.88), ncol=2)
    ax.set_title("Table growth and eviction (max 50k rows per table, LFU)")
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
