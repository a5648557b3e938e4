"""``dynemb eval`` and ``dynemb predict``: a trained run's model over a file.

Files are read with the run's preprocessing (the columns and dense statistics of its model card); the model
runs in eval mode, so unseen ids read their initializer row and nothing is inserted.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..data import FileReader
from ..data.batch import Batch
from ..data.readers import column_names
from ..data.metrics import auc
from .card import ModelCard, load_model

__all__ = ["evaluate", "evaluate_file", "predict_file"]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch]) -> dict:
    """``{"auc", "logloss", "rows"}`` of ``model`` on ``batches`` (eval mode during the call; no rows inserted);
    a metric that is not finite (a model gone NaN) is ``None``, which JSON writes as ``null``.

    Raises:
        ValueError: ``batches`` is empty.
    """
    was_training = model.training
    model.eval()
    logits, labels = [], []
    try:
        for batch in batches:
            logits.append(model(batch).float().cpu())
            labels.append(batch.labels.cpu())
    finally:
        model.train(was_training)
    if not logits:
        raise ValueError("nothing to evaluate: no rows")
    z, y = torch.cat(logits), torch.cat(labels)
    logloss = torch.nn.functional.binary_cross_entropy_with_logits(z.double(), y.double())
    return {"auc": _finite(auc(z, y)), "logloss": _finite(logloss), "rows": int(y.numel())}


def _finite(value) -> Optional[float]:
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None


def _reader(card: ModelCard, data: str, format: Optional[str], batch_size: int, label: bool) -> FileReader:
    prep = card.preprocessing
    return FileReader(data, label=prep.label if label else None, categorical=prep.categorical,
                      multi_hot=prep.multi_hot, dense=prep.dense, batch_size=batch_size, format=format,
                      list_separator=prep.list_separator, id_types=prep.id_types)


def evaluate_file(run: str, data: str, *, format: Optional[str] = None, batch_size: int = 65536,
                  device: str = "cpu") -> dict:
    """``{"auc", "logloss", "rows"}`` of run ``run``'s model on every row of ``data`` (which needs the label)."""
    model, card = load_model(Path(run), device)
    reader = _reader(card, data, format, batch_size, label=True)
    prep = card.preprocessing
    return evaluate(model, (b.to(device) for b in prep.normalized(reader, str(data))))


@torch.no_grad()
def predict_file(run: str, data: str, out: str, *, format: Optional[str] = None, batch_size: int = 65536,
                 device: str = "cpu") -> dict:
    """Write ``out``, a Parquet file with a float32 column ``probability`` for each row of ``data`` in input
    order, and the label column (int8) when ``data`` has one. The file appears whole or not at all.

    Returns:
        ``{"rows", "seconds", "rows_per_s", "out"}``; ``seconds`` counts reading, scoring and writing.
    """
    started = time.perf_counter()
    model, card = load_model(Path(run), device)
    prep = card.preprocessing
    has_label = prep.label is not None and prep.label in column_names(data, format)
    reader = _reader(card, data, format, batch_size, label=has_label)
    fields = [pa.field("probability", pa.float32())] + ([pa.field(prep.label, pa.int8())] if has_label else [])
    schema = pa.schema(fields)
    target = Path(out)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    rows = 0
    try:
        with pq.ParquetWriter(tmp, schema) as writer:
            for batch in prep.normalized(reader, str(data)):  # the dense rule, its replacements counted
                p = torch.sigmoid(model(batch.to(device)).float()).cpu().numpy()
                columns = [pa.array(p)] + ([pa.array(batch.labels.numpy().astype("int8"))] if has_label else [])
                writer.write_batch(pa.record_batch(columns, schema=schema))
                rows += len(batch)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    return {"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / max(seconds, 1e-9)),
            "out": str(target)}
