"""A run's ``metrics.jsonl`` and its loss/AUC plot."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Optional

__all__ = ["MetricsLog", "json_line", "read_metrics", "plot_run", "plot_training"]

_SMOOTH = 20  # steps in the moving mean of the plotted training loss


def json_line(obj) -> str:
    """``obj`` as one line of strict JSON: a float that is not finite (NaN, ``±inf``) is ``null``, anywhere in it.

    Every JSON line ``dynemb`` prints or writes goes through this: ``json.dumps`` would write ``NaN``, which is not
    JSON.

    Example:
        >>> json_line({"auc": float("nan"), "rows": [1, float("inf"), 0.5]})
        '{"auc": null, "rows": [1, null, 0.5]}'
    """
    return json.dumps(_finite(obj), allow_nan=False)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


class MetricsLog:
    """Appends ``{"kind": kind, **row}`` lines to ``path``; a context manager that flushes at each evaluation.

    ``after_step`` (on resume) first drops the lines of steps after it, and every ``final`` line, so that the file
    reads as one run.
    """

    def __init__(self, path: Path, enabled: bool = True, after_step: Optional[int] = None) -> None:
        self.path, self.enabled = Path(path), enabled
        self.file = None
        if enabled and after_step is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r["kind"] != "final" and r.get("step", 0) <= after_step]
            tmp = self.path.with_name(f".tmp-{self.path.name}")
            tmp.write_text("".join(json_line(r) + "\n" for r in kept))
            os.replace(tmp, self.path)

    def __enter__(self) -> MetricsLog:
        if self.enabled:
            self.file = open(self.path, "a")
        return self

    def write(self, kind: str, row: dict) -> None:
        if self.file is not None:
            self.file.write(json_line({"kind": kind, **row}) + "\n")
            if kind != "train":
                self.file.flush()

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_run(run: Path) -> Optional[Path]:
    """Draw ``run/loss_auc.png`` from ``run/metrics.jsonl``; ``None`` (and a note on stderr) without matplotlib."""
    from .card import METRICS, PLOT

    rows = read_metrics(Path(run) / METRICS)
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    try:
        return plot_training(Path(run) / PLOT, train, evals)
    except ImportError:
        print("dynemb: no plot (matplotlib is missing: pip install 'dynemb[plot]')", file=sys.stderr)
        return None


def _number(value) -> float:
    """A metric as written by :func:`json_line`: ``null`` (not finite) plots as a gap."""
    return math.nan if value is None else value


def plot_training(path: Path, train: list[dict], evals: list[dict], title: str = "Training") -> Path:
    """Training loss (a moving mean) and held-out AUC by step, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in train]
    loss = [_number(r["loss"]) for r in train]
    window = min(_SMOOTH, max(len(loss), 1))
    smooth = [sum(loss[i - window + 1: i + 1]) / window for i in range(window - 1, len(loss))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps[window - 1:], smooth, label=f"train loss ({window}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("BCE loss")
    ax2 = ax.twinx()
    ax2.plot([e["step"] for e in evals], [_number(e["auc"]) for e in evals], "o-", color="tab:orange",
             label="held-out AUC")
    ax2.set_ylabel("AUC")
    fig.legend(loc="lower center", ncol=2)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
