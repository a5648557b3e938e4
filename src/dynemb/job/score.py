"""``dynemb eval`` and ``dynemb predict``: a trained run's model over a file.

Files are read with the run's preprocessing (the columns and dense statistics of its model card); the model
runs in eval mode, so unseen ids read their initializer row and nothing is inserted.
"""

from __future__ import annotations

import concurrent.futures
import gc
import math
import os
import queue
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch

from ..checkpoint.fsutil import fsync_dir
from ..data import FileReader
from ..data.arrow_columns import POSITIVE_LABEL_HINT
from ..data.preprocess import DataWarning
from ..data.batch import Batch
from ..data.formats import list_files
from ..data.readers import column_names
from ..data.metrics import held_out_auc
from ..table.index import HashIndex
from .card import ModelCard, load_model, model_checkpoint, read_card

__all__ = ["evaluate", "evaluate_file", "predict_file", "probabilities", "PROBABILITY_EPS", "OUT_FORMATS"]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch]) -> dict:
    """``{"auc", "logloss", "rows"}`` of ``model`` on ``batches`` (eval mode during the call; no rows inserted);
    a metric that is not finite (a model gone NaN, an AUC of rows of one class) is ``None``, which JSON writes as
    ``null``.

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
    return {"auc": _finite(held_out_auc(z, y)), "logloss": _finite(logloss), "rows": int(y.numel())}


def _finite(value) -> Optional[float]:
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None


def _reader(card: ModelCard, data: str, format: Optional[str], batch_size: int, label: bool) -> FileReader:
    prep = card.preprocessing
    return FileReader(data, label=prep.label if label else None, categorical=prep.categorical,
                      multi_hot=prep.multi_hot, dense=prep.dense, batch_size=batch_size, format=format,
                      list_separator=prep.list_separator, id_types=prep.id_types,
                      positive_label=card.data.get("positive_label") if label else None)


def _collect_from_here() -> None:
    """Turn the cycle collector back on once the model is loaded, where ``dynemb predict``/``eval`` as the
    process's command paused it (``cli._ONE_FILE``) for the imports and the load: a long file must not pile up
    cycles. What exists now is frozen out of every later collection, so collections stay cheap."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def evaluate_file(run: str, data: str, *, format: Optional[str] = None, batch_size: int = 65536,
                  device: str = "cpu", use: str = "best", progress: Optional[bool] = None) -> dict:
    """``{"auc", "logloss", "rows", "model", "step"}`` of run ``run``'s best model (``use="last"``: its last) on
    every row of ``data``, which needs the label; ``model`` and ``step`` say which checkpoint scored. ``progress``:
    a bar of rows scored on stderr (None: when stderr is a terminal).

    Example:
        >>> # evaluate_file("runs/clicks", "next_week.parquet")
        >>> # {"auc": 0.78, "logloss": 0.51, "rows": 6000, "model": "best", "step": 400}
    """
    _, kind, step = model_checkpoint(Path(run), use)
    model, card = load_model(Path(run), device, use, optimizer=False)
    _collect_from_here()
    positive = card.data.get("positive_label")
    try:
        reader = _reader(card, data, format, batch_size, label=True)
        prep = card.preprocessing
        positives = []
        with _RowsBar(data, format, progress, "scoring") as bar:
            scored = evaluate(model, (bar.counted(b).to(device) for b in positives_counted(
                prep.normalized(reader, str(data)), positives)))
    except ValueError as exc:
        if POSITIVE_LABEL_HINT not in str(exc):
            raise
        # eval has no --positive-label: the run's rule decides (train's hint sent users to an option eval lacks)
        raise ValueError(str(exc).replace(POSITIVE_LABEL_HINT, "; the run was trained on 0/1 labels (no "
                                          "--positive-label in its model.json), so its eval files need 0/1 labels "
                                          "or booleans too")) from None
    if positive is not None and not sum(positives):
        warnings.warn(f"{data}: column {prep.label!r}: no label equals the run's positive label {positive!r} (its "
                      "model.json; compared as text), so every row is read as 0: labels written otherwise (1 for "
                      f"{positive!r}) are not that label", DataWarning, stacklevel=2)
    return {**scored, "model": kind, "step": step}


def positives_counted(batches, positives: list):
    """``batches``, appending each one's count of positive labels to ``positives`` as it passes (training's
    statistics pass and eval check the run's positive label with it)."""
    for batch in batches:
        positives.append(int(batch.labels.sum()))
        yield batch


PROBABILITY_EPS = 1e-15
"""Written probabilities lie in ``[PROBABILITY_EPS, 1 - PROBABILITY_EPS]``: a log loss computed from them is at most
about 34.5 a row, never infinite (float64 holds both bounds exactly enough; float32 would round ``1 - 1e-15`` to 1)."""

OUT_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv"}
"""``dynemb predict --out`` suffixes and the format each one writes."""



def probabilities(logits: torch.Tensor) -> torch.Tensor:
    """``sigmoid(logits)`` in float64 on the CPU, within :data:`PROBABILITY_EPS` of 0 and 1: what ``predict`` writes
    and the endpoint answers, so that both give the same bits for the same logits.

    Shape: ``[B]`` -> ``[B]`` float64.

    Example:
        >>> probabilities(torch.tensor([0.0, 80.0])).tolist()
        [0.5, 0.999999999999999]
    """
    x = logits.double().cpu()
    extra = -x.shape[0] % _SIGMOID_ROWS
    if extra:  # the vector loop takes every value: its last partial vector would go through a scalar sigmoid
        x = torch.cat([x, x.new_zeros(extra)])
    return torch.sigmoid(x)[:logits.shape[0]].clamp_(PROBABILITY_EPS, 1.0 - PROBABILITY_EPS)


# torch's CPU sigmoid computes a tensor in whole vectors (8 float64 on AVX-512), then the rest one value at a time
# with another routine that can round differently in the last bit: padding each call to a multiple of 16 values makes
# a row's probability the same whatever the size of the request or block it comes in (tests/job/test_predict_served.py)
_SIGMOID_ROWS = 16


_MARK = {b"dynemb": b"predict"}  # Parquet metadata of a predictions file: what predict may replace


@torch.no_grad()
def predict_file(run: str, data: str, out: str, *, format: Optional[str] = None, batch_size: int = 65536,
                 device: str = "cpu", use: str = "best", progress: Optional[bool] = None) -> dict:
    """Write ``out``: a float64 ``probability`` for each row of ``data``, in input order, and the label column
    (int8, 0/1) when ``data`` has one; scored by the run's best model (``use="last"``: its last).

    ``out``'s suffix picks the format (:data:`OUT_FORMATS`: Parquet, or CSV with a header). Probabilities are
    ``sigmoid(logit)`` in float64 kept within :data:`PROBABILITY_EPS` of 0 and 1. The file appears whole or not
    at all (written beside it, fsynced, renamed). An existing ``out`` is replaced only when an earlier predict
    wrote it; an input file, a file in an input directory and anything in the run directory are refused.
    ``progress``: a bar of rows written on stderr (None: when stderr is a terminal).

    Returns:
        ``{"rows", "seconds", "rows_per_s", "out", "model", "step"}``; ``seconds`` counts reading, scoring and
        writing; ``model`` and ``step`` say which checkpoint scored.

    Raises:
        ValueError: a bad ``out`` (the message names it and the reason), or as :func:`evaluate_file`.

    Example:
        >>> # predict_file("runs/clicks", "to_score.parquet", "scores.csv")
        >>> # {"rows": 6000, "seconds": 0.4, "rows_per_s": 15000, "out": "scores.csv", "model": "best", "step": 400}
    """
    started = time.perf_counter()
    target = Path(out)
    out_format = _check_out(target, Path(run), Path(data), format)
    _, kind, step = model_checkpoint(Path(run), use)
    card = read_card(Path(run))
    prep = card.preprocessing
    has_label = prep.label is not None and prep.label in column_names(data, format)
    reader = _reader(card, data, format, batch_size, label=has_label)
    fields = [pa.field("probability", pa.float64())] + ([pa.field(prep.label, pa.int8())] if has_label else [])
    schema = pa.schema(fields, metadata=_MARK if out_format == "parquet" else None)
    # The model loads here while the thread reads and normalizes the first blocks (Arrow's reading releases the
    # GIL); the thread then looks up each block's tables too, so that this thread only runs the dense layers.
    loaded: concurrent.futures.Future = concurrent.futures.Future()
    blocks = _Ahead(_looked_up(prep.normalized(reader, str(data)), loaded, device, buffers=3), depth=1)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    rows = 0
    try:
        try:
            model = load_model(Path(run), device, use, optimizer=False, card=card)[0]
        except BaseException as error:
            loaded.set_exception(error)
            raise
        loaded.set_result(model)
        _collect_from_here()
        with open(tmp, "wb") as sink, _RowsBar(data, format, progress, "predict") as bar:
            writer = pq.ParquetWriter(sink, schema) if out_format == "parquet" else pcsv.CSVWriter(sink, schema)
            with writer:
                for batch, stacked in blocks:
                    logits = model(batch) if stacked is None else model.forward_stacked(batch.dense, stacked)
                    p = probabilities(logits).numpy()
                    columns = [pa.array(p)] + ([pa.array(batch.labels.numpy().astype("int8"))] if has_label else [])
                    writer.write_batch(pa.record_batch(columns, schema=schema))
                    rows += len(batch)
                    bar.counted(batch)
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    finally:
        blocks.close()
        tmp.unlink(missing_ok=True)
    seconds = time.perf_counter() - started
    return {"rows": rows, "seconds": round(seconds, 3), "rows_per_s": round(rows / max(seconds, 1e-9)),
            "out": str(target), "model": kind, "step": step}


def _looked_up(batches: Iterator[Batch], loaded: concurrent.futures.Future, device: str, buffers: int
               ) -> Iterator[tuple[Batch, Optional[torch.Tensor]]]:
    """``(batch on device, stacked)`` of each of ``batches``: ``stacked [B, F + 1, D]`` holds the features' pooled
    rows after a free first slot (what :meth:`DLRM.forward_stacked` takes), or is None on a GPU (or with no
    categorical feature), where the model looks them up itself in the scoring thread. The model comes from
    ``loaded`` once it is there (``predict_file`` runs this in its reading thread while it loads the model).

    ``stacked`` is one of ``buffers`` tensors used in turn, allocated once: a block's (about 110 MB at the default
    batch size) freshly mapped each time cost more system time than its lookups (and on huge pages, more than
    small pages touched once). The consumer must
    be done with a block before the one ``buffers`` later is produced (the reading thread's queue holds
    ``buffers - 2``)."""
    if torch.device(device).type == "cpu":
        # numba's first use, here while the model loads (its tables' restore then finds the index kernels loaded)
        HashIndex.load_kernels()
    model, ring = None, []
    for i, batch in enumerate(batches):
        if model is None:
            model = loaded.result()
        batch = batch.to(device)
        if batch.dense.device.type != "cpu" or not model.features:
            yield batch, None
            continue
        with torch.no_grad():  # grad mode is per thread: this one's too
            pooled = model.embeddings(model.sparse_inputs(batch))
            rows = [pooled[f] for f in model.features]
            shape = (len(batch), len(rows) + 1, rows[0].shape[1])
            if len(ring) < buffers:
                ring.append(None)
            out = ring[i % buffers]
            if out is None or out.shape[0] < shape[0] or out.shape[1:] != shape[1:] or out.dtype != rows[0].dtype:
                out = ring[i % buffers] = torch.empty(shape, dtype=rows[0].dtype)
            stacked = out[:shape[0]]
            torch.stack(rows, 1, out=stacked[:, 1:])
        yield batch, stacked


class _RowsBar:
    """A tqdm bar of rows over ``data`` on stderr when ``progress`` (None: when stderr is a terminal), else
    nothing; its total is the files' row count where their metadata holds it (Parquet), else open-ended.
    :meth:`counted` adds a batch's rows and returns the batch."""

    def __init__(self, data: str, format: Optional[str], progress: Optional[bool], what: str) -> None:
        self._bar = None
        if progress or (progress is None and sys.stderr.isatty()):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=_rows_in(data, format), desc=what, unit="row", unit_scale=True,
                             dynamic_ncols=True, mininterval=0.5, leave=False)

    def counted(self, batch: Batch) -> Batch:
        if self._bar is not None:
            self._bar.update(len(batch))
        return batch

    def __enter__(self) -> "_RowsBar":
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.close()


def _rows_in(data: str, format: Optional[str]) -> Optional[int]:
    """The rows of ``data``'s files from their Parquet metadata; None for other formats (counting would read
    them) or a file that cannot be read here (the reader reports it)."""
    try:
        files, fmt = list_files(Path(data), format)
        return sum(pq.ParquetFile(f).metadata.num_rows for f in files) if fmt == "parquet" else None
    except (OSError, ValueError, pa.ArrowException):
        return None


class _Ahead:
    """``items``, produced in a thread that starts at once and keeps up to ``depth`` of them waiting for the
    consumer; an exception raised while producing is raised by the iteration, in order. :meth:`close` stops the
    thread at its next item (call it whether or not the items were iterated)."""

    _DONE = object()

    def __init__(self, items: Iterator, depth: int = 1) -> None:
        self._ready: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._worker = threading.Thread(target=self._produce, args=(items,), name="dynemb-read-ahead", daemon=True)
        self._worker.start()

    def _produce(self, items: Iterator) -> None:
        try:
            for item in items:
                if self._stop.is_set():
                    return
                self._ready.put((item, None))
            self._ready.put((self._DONE, None))
        except BaseException as error:  # handed to the consumer, which raises it
            self._ready.put((self._DONE, error))

    def __iter__(self) -> Iterator:
        while True:
            item, error = self._ready.get()
            if error is not None:
                raise error
            if item is self._DONE:
                return
            yield item

    def close(self) -> None:
        self._stop.set()
        while self._worker.is_alive():  # unblock a producer waiting on a full queue
            try:
                self._ready.get(timeout=0.05)
            except queue.Empty:
                pass
        self._worker.join()


def _check_out(out: Path, run: Path, data: Path, format: Optional[str]) -> str:
    """The format ``out`` is written in; a ValueError when writing it could destroy a file that is not an earlier
    prediction: an input, the run's, or anything else already there."""
    suffix = out.suffix.lower()
    if suffix not in OUT_FORMATS:
        raise ValueError(f"--out {out}: the suffix picks the format; use {', '.join(OUT_FORMATS)} (got "
                         f"{suffix or 'no suffix'!r}; compressed output is not written)")
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory; name a file")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: no directory {out.parent}")
    where = out.resolve()  # through symlinks: a link to an input is that input
    if data.is_dir() and where.is_relative_to(data.resolve()):
        raise ValueError(f"--out {out} is inside the input directory --data {data}; write elsewhere")
    for path in list_files(data, format)[0]:
        if where == path.resolve() or (out.exists() and os.path.samefile(out, path)):
            raise ValueError(f"--out {out} is the input file {path}; predict never overwrites its input")
    if where.is_relative_to(run.resolve()):
        raise ValueError(f"--out {out} is inside the run directory --model {run}, which holds the model; write "
                         "elsewhere")
    fmt = OUT_FORMATS[suffix]
    if out.exists() and not _is_prediction(out, fmt):
        raise ValueError(f"--out {out} exists and is not a file `dynemb predict` wrote as {fmt}; predict replaces "
                         "only its own output (remove it or choose another name)")
    return fmt


def _is_prediction(path: Path, fmt: str) -> bool:
    """Whether ``path`` is what predict writes as ``fmt``: Parquet with its metadata mark, CSV with its header."""
    try:
        if fmt == "parquet":
            metadata = pq.read_schema(path).metadata or {}
            return metadata.get(b"dynemb") == _MARK[b"dynemb"]
        with open(path, "rb") as f:
            header = f.readline().rstrip(b"\r\n").split(b",")
        return header[0] == b'"probability"' and len(header) <= 2
    except (OSError, pa.ArrowException):
        return False
