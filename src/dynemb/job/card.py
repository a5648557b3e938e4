"""The run directory of ``dynemb train --out RUN`` and its model card.

Layout::

    RUN/
      model.json        the model card (below), written before training and again with the final metrics
      checkpoint/       dynemb.checkpoint root: step-*/ and latest (the final model is the latest step)
      metrics.jsonl     one JSON object a line: {"kind": "train", "step", "loss", ...} after every step,
                        {"kind": "eval", "step", "auc", "loss"} after every evaluation, then {"kind": "final", ...}
      loss_auc.png      training loss and held-out AUC by step

The model card (format ``dynemb.run``, version 1) holds what scoring a new file needs: the preprocessing
(columns, dense normalization statistics from the training rows, the id rule and each column's null key), the
training config (which fixes the model's shape), where the data came from and how it was split, and the final
held-out metrics.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint.fsutil import write_json
from ..data.preprocess import Preprocessing
from ..models import DLRM
from ..train import TrainConfig, build_dlrm

__all__ = ["ModelCard", "read_card", "write_card", "load_model", "CARD", "CHECKPOINT", "METRICS", "PLOT"]

CARD, CHECKPOINT, METRICS, PLOT = "model.json", "checkpoint", "metrics.jsonl", "loss_auc.png"
FORMAT, VERSION = "dynemb.run", 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelCard:
    """What ``model.json`` holds.

    Attributes:
        preprocessing: the columns and the dense statistics.
        config: the training config; ``dim`` and the table settings fix the model's shape.
        data: the training data, the held-out data or fraction, the split seed, the format and row counts.
        metrics: the final held-out metrics (``None`` until training ends).
    """

    preprocessing: Preprocessing
    config: TrainConfig
    data: dict
    metrics: Optional[dict] = None

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "model": "dlrm",
                "preprocessing": self.preprocessing.to_json(), "config": dataclasses.asdict(self.config),
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
    if not path.is_file():
        raise ValueError(f"{run}: no {CARD}; is this a `dynemb train --out` directory?")
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable JSON ({exc})") from None
    if obj.get("format") != FORMAT or obj.get("version") != VERSION:
        raise ValueError(f"{path}: format must be {FORMAT!r} version {VERSION}, got {obj.get('format')!r} "
                         f"version {obj.get('version')!r}")
    config = TrainConfig(**{**obj["config"], "resume": False, "checkpoint_dir": None})
    return ModelCard(preprocessing=Preprocessing.from_json(obj["preprocessing"], obj.get("data")), config=config,
                     data=obj["data"], metrics=obj.get("metrics"))


def load_model(run: Path, device: str = "cpu") -> tuple[DLRM, ModelCard]:
    """The final model of a run directory (its latest checkpoint), in eval mode on ``device``.

    Raises:
        ValueError: no model card, or no checkpoint yet (the message names the directory).
    """
    from ..checkpoint import load

    run = Path(run)
    card = read_card(run)
    if not (run / CHECKPOINT / "latest").is_file():
        raise ValueError(f"{run}: no checkpoint in {run / CHECKPOINT}; did the training run finish?")
    prep = card.preprocessing
    model = build_dlrm(len(prep.dense), prep.features, card.config)
    load(run / CHECKPOINT, model, strict=False)
    return model.to(torch.device(device)).eval(), card
