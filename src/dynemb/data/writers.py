"""Write synthetic click logs to files: Parquet for the demo, Criteo TSV for the Criteo reader at scale.

Parquet columns: ``label`` (int8), ``I1 ..`` (float32 dense), ``C1 ..`` (int64 ids; ``list<int64>`` bags when
the log is multi-hot). Criteo TSV: the label, each dense value as ``round(10 * x)`` (Criteo's fields are integers),
and each id's low 32 bits as 8 hex digits, Criteo's layout (see :mod:`dynemb.data.formats`); one id per feature;
compressed by the file's suffix (``day_0.criteo.gz``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch

from ..checks import check_int
from .batch import Batch
from .formats import create_text
from .synthetic import SyntheticClickLog

__all__ = ["write_synthetic"]

_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_SHIFTS = np.arange(28, -4, -4, dtype=np.uint32)


def write_synthetic(log: SyntheticClickLog, path: str | os.PathLike, batches: int, *, split: str = "train",
                    format: str = "parquet") -> Path:
    """Write batches ``0 .. batches - 1`` of ``split`` of ``log`` to ``path`` (``"parquet"`` or ``"criteo"``).

    Rows follow the batches' order, so row ``i`` of the file is sample ``i % B`` of batch ``i // B``.

    Raises:
        ValueError: a bad format, or a multi-hot log written as Criteo TSV.
    """
    check_int(batches, "batches", minimum=1)
    if format not in ("parquet", "criteo"):
        raise ValueError(f"format must be 'parquet' or 'criteo', got {format!r}")
    if format == "criteo" and log.ids_per_feature > 1:
        raise ValueError("Criteo TSV has one id per feature; write a multi-hot log (ids_per_feature > 1) as parquet")
    path = Path(path)
    stream = log.batches(split, num_batches=batches)
    if format == "parquet":
        first = next(stream)
        table = _parquet_table(log, first)
        with pq.ParquetWriter(path, table.schema) as writer:
            writer.write_table(table)
            for batch in stream:
                writer.write_table(_parquet_table(log, batch))
    else:
        options = pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
        with create_text(path) as sink:
            for batch in stream:
                pcsv.write_csv(_criteo_table(log, batch), sink, options)
    return path


def _parquet_table(log: SyntheticClickLog, batch: Batch) -> pa.Table:
    columns = {"label": pa.array(batch.labels.numpy().astype(np.int8))}
    columns.update({name: pa.array(batch.dense[:, i].numpy()) for i, name in enumerate(log.dense_names)})
    for name in log.categorical_names:
        ids = pa.array(batch.sparse[name].numpy())
        if name in batch.offsets:
            ids = pa.ListArray.from_arrays(pa.array(batch.offsets[name].numpy().astype(np.int32)), ids)
        columns[name] = ids
    return pa.table(columns)


def _criteo_table(log: SyntheticClickLog, batch: Batch) -> pa.Table:
    columns = {"label": pa.array(batch.labels.numpy().astype(np.int8))}
    counts = torch.round(batch.dense * 10).to(torch.int64).numpy()
    columns.update({name: pa.array(counts[:, i]) for i, name in enumerate(log.dense_names)})
    columns.update({name: _hex8(batch.sparse[name].numpy()) for name in log.categorical_names})
    return pa.table(columns)


def _hex8(ids: np.ndarray) -> pa.Array:
    """The low 32 bits of each id as 8 lower-case hex digits, vectorized."""
    low = (ids & 0xFFFFFFFF).astype(np.uint32)
    digits = _HEX[(low[:, None] >> _SHIFTS) & 15]  # [N, 8] ASCII codes
    return pa.array(np.ascontiguousarray(digits).view("S8").ravel()).cast(pa.string())
