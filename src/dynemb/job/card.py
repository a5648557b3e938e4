"""The run directory of ``dynemb train --out RUN`` and its model card.

Layout::

    RUN/
      model.json        the model card (below), written before training and again with the final metrics
      checkpoint/       dynemb.checkpoint root: step-*/ and latest, the last model (the 3 newest are kept)
      checkpoint-best/  the model of the evaluation with the lowest held-out log loss (one checkpoint)
      metrics.jsonl     one JSON object a line: {"kind": "train", "step", "loss", ...} after every step,
                        {"kind": "eval", "step", "auc", "loss"} after every evaluation, then {"kind": "final", ...}
      loss_auc.png      training loss and held-out AUC by step

The model card (format ``dynemb.run``, version 2) holds what scoring a new file needs: the preprocessing
(columns, dense normalization statistics from the training rows, the id rule and each column's null key), the
training config (which fixes the model's shape), where the data came from and how it was split (and the
``positive_label``, when labels are not 0/1), and the final held-out metrics, which are the best model's.

Scoring commands load the best model by default (``use="best"``) and the last with ``use="last"``; a run
without a best checkpoint (stopped before its first evaluation, or trained by an older dynemb) gives its last
model for either.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Optional

from ..checkpoint.fsutil import write_json
from ..checkpoint.progress import logger as checkpoint_logger
from ..data.preprocess import Preprocessing
from ..models import DLRM
from ..checks import resolve_device
from ..train import TrainConfig, build_dlrm

__all__ = ["ModelCard", "read_card", "write_card", "load_model", "model_checkpoint", "CARD", "CHECKPOINT",
           "CHECKPOINT_BEST", "METRICS", "PLOT", "USES"]

CARD, CHECKPOINT, METRICS, PLOT = "model.json", "checkpoint", "metrics.jsonl", "loss_auc.png"
CHECKPOINT_BEST = "checkpoint-best"
USES = ("best", "last")
"""Which model of a run the scoring commands load (``--use``)."""
FORMAT, VERSION = "dynemb.run", 2
# Version 1 held the training config without its "type" (it read the same: TrainConfig.from_dict needs none).
_READS = (1, 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCard:
    """What ``model.json`` holds.

    Attributes:
        preprocessing: the columns and the dense statistics.
        config: the training config; ``dim`` and the table settings fix the model's shape.
        data: the training data, the held-out data or fraction, the split seed, the format and row counts.
        metrics: the final held-out metrics of the best model, with ``model`` (``"best"``, or ``"last"`` for a run
            that never evaluated) and ``step`` (the best step); ``None`` until training ends.
    """

    preprocessing: Preprocessing
    config: TrainConfig
    data: dict
    metrics: Optional[dict] = None

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": "dlrm",
                "preprocessing": self.preprocessing.to_json(), "config": self.config.to_dict(),
                "data": self.data, "metrics": self.metrics}


def write_card(run: Path, card: ModelCard) -> None:
    """Write ``run/model.json`` atomically."""
    run.mkdir(parents=True, exist_ok=True)
    write_json(run / CARD, card.to_json(), atomic=True)


def read_card(run: Path) -> ModelCard:
    """The model card of a run directory.

    Raises:
        ValueError: ``run`` has no readable ``model.json`` of this format (the message names the path).
    """
    path = Path(run) / CARD
    if Path(run).is_file():
        raise ValueError(f"{run}: a file, not a run directory (a `dynemb train --out` directory, with a {CARD})")
    if not path.is_file():
        raise ValueError(f"{run}: no {CARD}; is this a `dynemb train --out` directory?{_parent_run(Path(run))}")
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable JSON ({exc})") from None
    if isinstance(obj, dict) and "format" not in obj and (Path(run) / "latest").is_file():
        raise ValueError(f"{run}: a serving export (`dynemb export --out`), not a `dynemb train --out` run directory; "
                         f"pass the run directory{_parent_run(Path(run))}")
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or obj.get("version") not in _READS:
        obj = obj if isinstance(obj, dict) else {}
        raise ValueError(f"{path}: format must be {FORMAT!r} version {' or '.join(map(str, _READS))}, got "
                         f"{obj.get('format')!r} version {obj.get('version')!r}")
    config = TrainConfig.from_dict({**obj["config"], "resume": False, "checkpoint_dir": None, "best_dir": None},
                                   f"{path}: config")
    return ModelCard(preprocessing=Preprocessing.from_json(obj["preprocessing"], obj.get("data")), config=config,
                     data=obj["data"], metrics=obj.get("metrics"))


def model_checkpoint(run: Path, use: str = "best") -> tuple[Path, str, int]:
    """``(checkpoint root, "best" or "last", step)`` of the model ``use`` names in run directory ``run``.

    Raises:
        ValueError: ``use`` is not one of :data:`USES`, ``run`` is no run directory, or it has no checkpoint yet.

    Example:
        >>> # model_checkpoint(Path("runs/clicks"))  ->  (Path("runs/clicks/checkpoint-best"), "best", 400)
    """
    from ..checkpoint.fsutil import read_json

    if use not in USES:
        raise ValueError(f"--use must be one of {', '.join(USES)}, got {use!r}")
    run = Path(run)
    if not (run / CARD).is_file():
        read_card(run)  # its error: not a run directory
    for kind, root in (("best", run / CHECKPOINT_BEST), ("last", run / CHECKPOINT)):
        if (kind == "best" and use == "last") or not (root / "latest").is_file():
            continue
        return root, kind, int(read_json(root / "latest")["step"])
    if (run / "latest").is_file():  # an export (its model.json is the export's) or a checkpoint root
        raise ValueError(f"{run}: a serving export or a checkpoint, not a `dynemb train --out` directory"
                         f"{_parent_run(run)}")
    raise ValueError(f"{run}: no checkpoint in {run / CHECKPOINT}; did the training run finish? (an interrupted "
                     "run continues with dynemb train ... --resume)")


def _parent_run(path: Path) -> str:
    """A hint when ``path`` lies inside a run directory (its ``checkpoint-best``, ``export``): pass the run."""
    parent = path.resolve().parent
    if (parent / CARD).is_file() and ((parent / CHECKPOINT).is_dir() or (parent / CHECKPOINT_BEST).is_dir()):
        return f" ({path} lies in the run directory {parent}: pass that)"
    return ""


def load_model(run: Path, device: str = "cpu", use: str = "best", optimizer: bool = True,
               card: Optional[ModelCard] = None) -> tuple[DLRM, ModelCard]:
    """The best model of a run directory, or with ``use="last"`` the last one (see :func:`model_checkpoint`), in
    eval mode on ``device``. ``optimizer`` False: its tables without their sparse optimizer and its state (the same
    rows and outputs, bit for bit; what scoring needs, about 2 s sooner in a fresh process). ``card``: the run's
    model card when the caller has read it already.

    Raises:
        ValueError: no model card, no checkpoint yet or a bad ``use`` (the message names the directory).

    Example:
        >>> # model, card = load_model("runs/clicks")                # the best model
        >>> # model, card = load_model("runs/clicks", use="last")    # the model of the last step
    """
    from ..checkpoint import load

    device = resolve_device(device, "device")  # before the work: a missing GPU is a clear error, not torch's
    run = Path(run)
    card = card or read_card(run)
    root, _, _ = model_checkpoint(run, use)
    prep = card.preprocessing
    model = build_dlrm(len(prep.dense), prep.features, card.config, optimizer=optimizer)
    skipped = None if optimizer else _SlotsSkipped()
    if skipped:  # the checkpoint's optimizer slots are left out on purpose: no warning for each table's
        checkpoint_logger.addFilter(skipped)
    try:
        load(root, model, strict=False)
    finally:
        if skipped:
            checkpoint_logger.removeFilter(skipped)
    return model.to(device).eval(), card


class _SlotsSkipped(logging.Filter):
    """Drops the checkpoint loader's "slot ... is only in the checkpoint" records (a model loaded to score)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is only in the checkpoint" not in record.getMessage()
