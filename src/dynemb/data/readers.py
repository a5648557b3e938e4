"""Stream batches (:class:`~dynemb.data.Batch`) from the user's Parquet or CSV files.

The user names the label column, the categorical columns and the dense columns; other columns are not read. How
values become ids, dense values and labels, and what a null becomes, is in :mod:`dynemb.data.columns`. In short:
integer ids are taken as they are, string ids are hashed with XXH64 (:func:`dynemb.data.hash_strings`), a null id
becomes :func:`dynemb.data.null_key` of its column, a null or NaN dense value becomes 0.0, and labels must be 0/1.

CSV files need a header row and UTF-8 text; an empty field is a null. ``.csv`` files are comma-separated and
``.tsv`` tab-separated unless ``delimiter`` says otherwise; a compression suffix (``.gz``, ``.bz2``, ``.zst``,
``.lz4``) is decompressed on the fly. Rows in error messages count a file's data rows from 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch

from ..table.checks import check_int
from .batch import Batch
from .columns import categorical_ids, dense_values, first_line, label_values

__all__ = ["FileReader", "FORMATS"]

FORMATS = ("parquet", "csv")
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv"}
_COMPRESSION = {".gz", ".bz2", ".zst", ".lz4"}
# Arrow reads in large chunks that _rebatch cuts to size: per-chunk costs (Parquet page decoding, the per-distinct-id
# hash calls) shrink as chunks grow, since more ids repeat within a chunk.
_PARQUET_ROWS = 1 << 16
_CSV_BLOCK_BYTES = 16 << 20
_PEEK_BLOCK_BYTES = 1 << 20


def _suffix(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if len(suffixes) >= 2 and suffixes[-1] in _COMPRESSION:
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


class FileReader:
    """Batches of user data from a Parquet or CSV file, or from a directory of them (read in name order).

    Each iteration reads the files again from the start, so a reader serves several epochs. Files are checked
    when the reader is made: they exist, they can be opened, they hold every named column and some rows. Values
    are checked as they stream, so a bad label far into a file raises when its batch is reached.

    Args:
        path: a ``.parquet``/``.pq``/``.csv``/``.tsv`` file (optionally compressed), or a directory of them.
        label: the label column (values 0/1).
        categorical: the categorical columns; each becomes a feature of ``Batch.sparse`` under its own name.
        dense: the dense columns, stacked in this order into ``Batch.dense``.
        batch_size: samples per batch ``B``; batches span file boundaries, and the last one may be smaller.
        format: ``"parquet"`` or ``"csv"``; ``None`` infers it from the file suffix.
        delimiter: CSV field separator; ``None`` means tab for ``.tsv`` and comma otherwise.
        drop_last: drop the last batch when it has fewer than ``B`` samples.

    Raises:
        TypeError: a column argument is not a string or a sequence of strings.
        ValueError: one line naming the file and the problem: no such file, a file that cannot be read, a
            missing column, an empty data set, a bad argument; while iterating, a label that is not 0/1, a dense
            value that is not a number, or a categorical column that is neither integer nor string.

    Shape:
        Each batch: ``dense`` ``[B, len(dense)]`` float32, ``sparse[name]`` ``[B]`` int64, ``labels`` ``[B]``.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = tmp.name + "/clicks.parquet"
        >>> pq.write_table(pa.table({"y": [0, 1, 1], "user": ["a", None, "a"], "age": [31.0, None, 40.0]}), path)
        >>> batch = next(iter(FileReader(path, label="y", categorical=["user"], dense=["age"], batch_size=8)))
        >>> batch.labels.tolist(), batch.dense[:, 0].tolist()
        ([0.0, 1.0, 1.0], [31.0, 0.0, 40.0])
        >>> from dynemb.data import null_key
        >>> ids = batch.sparse["user"]
        >>> bool(ids[0] == ids[2] != ids[1]), ids[1].item() == null_key("user")
        (True, True)
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        label: str,
        categorical: Sequence[str],
        dense: Sequence[str] = (),
        batch_size: int = 4096,
        format: str | None = None,
        delimiter: str | None = None,
        drop_last: bool = False,
    ) -> None:
        self.label = _check_name(label, "label")
        self.categorical = _check_names(categorical, "categorical", allow_empty=False)
        self.dense = _check_names(dense, "dense", allow_empty=True)
        _check_distinct(self.label, self.categorical, self.dense)
        self.batch_size = check_int(batch_size, "batch_size", minimum=1)
        if format is not None and format not in FORMATS:
            raise ValueError(f"format must be None or one of {FORMATS}, got {format!r}")
        if delimiter is not None and (not isinstance(delimiter, str) or len(delimiter) != 1):
            raise ValueError(f"delimiter must be None or one character, got {delimiter!r}")
        self.path = Path(path)
        self.files, self.format = _list_files(self.path, format)
        self.delimiter = delimiter
        self.drop_last = bool(drop_last)
        self._check_files()

    @property
    def columns(self) -> list[str]:
        """Every column read: the label, the categorical columns, then the dense columns."""
        return [self.label, *self.categorical, *self.dense]

    def __iter__(self) -> Iterator[Batch]:
        return _rebatch(self._chunks(), self.batch_size, self.drop_last)

    # ------------------------------------------------------------------ files
    def _check_files(self) -> None:
        has_rows = False
        for file in self.files:
            names, rows = self._guarded(file, self._peek, file)
            if not names:  # a 0-byte CSV file: nothing to check, and nothing to read
                continue
            missing = [c for c in self.columns if c not in names]
            if missing:
                shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
                raise ValueError(f"{file}: missing column {missing[0]!r} (the file has: {shown or 'no columns'})")
            has_rows = has_rows or rows
        if not has_rows:
            raise ValueError(f"{self.path}: the data set is empty (no data rows)")

    def _peek(self, file: Path) -> tuple[list[str], bool]:
        """Column names of ``file`` and whether it has a data row, reading at most one block."""
        if self.format == "parquet":
            meta = pq.ParquetFile(file)
            return meta.schema_arrow.names, meta.metadata.num_rows > 0
        try:
            peek = pcsv.ReadOptions(block_size=_PEEK_BLOCK_BYTES)
            reader = pcsv.open_csv(file, read_options=peek, parse_options=self._csv_parse(file))
        except pa.ArrowInvalid as exc:
            if "Empty CSV file" in str(exc):
                return [], False
            raise
        first = next(iter(reader), None)
        return reader.schema.names, first is not None and first.num_rows > 0

    def _record_batches(self, file: Path) -> Iterator[pa.RecordBatch]:
        if self.format == "parquet":
            rows = max(self.batch_size, _PARQUET_ROWS)
            return pq.ParquetFile(file).iter_batches(batch_size=rows, columns=self.columns)
        convert = pcsv.ConvertOptions(
            include_columns=self.columns,
            column_types={c: pa.string() for c in self.columns},
            null_values=[""],
            strings_can_be_null=True,
        )
        return iter(
            pcsv.open_csv(
                file,
                read_options=pcsv.ReadOptions(block_size=_CSV_BLOCK_BYTES),
                parse_options=self._csv_parse(file),
                convert_options=convert,
            )
        )

    def _csv_parse(self, file: Path) -> pcsv.ParseOptions:
        default = "\t" if _suffix(file) == ".tsv" else ","
        return pcsv.ParseOptions(delimiter=self.delimiter or default)

    def _guarded(self, file: Path, fn, *args):
        """``fn(*args)``, with any read failure turned into a one-line ValueError naming ``file``."""
        try:
            return fn(*args)
        except (pa.ArrowException, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
            raise ValueError(f"{file}: cannot read it as {self.format} ({reason})") from None

    # ------------------------------------------------------------------ conversion
    def _chunks(self) -> Iterator[Batch]:
        for file in self.files:
            batches = self._guarded(file, self._record_batches, file)
            row = 0
            while True:
                record = self._guarded(file, next, batches, None)
                if record is None:
                    break
                if record.num_rows:
                    yield self._convert(record, file, row)
                row += record.num_rows

    def _convert(self, record: pa.RecordBatch, file: Path, first_row: int) -> Batch:
        def where(column: str) -> str:
            return f"{file}: column {column!r}"

        text = self.format == "csv"
        labels = label_values(record.column(self.label), where(self.label), first_row)
        sparse = {
            c: torch.from_numpy(categorical_ids(record.column(c), c, where(c), decimal_text=text))
            for c in self.categorical
        }
        dense = [dense_values(record.column(c), where(c)) for c in self.dense]
        matrix = np.stack(dense, axis=1) if dense else np.zeros((record.num_rows, 0), dtype=np.float32)
        return Batch(torch.from_numpy(matrix), sparse, torch.from_numpy(labels))


def _check_name(name, arg: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{arg} must be a non-empty column name (str), got {name!r}")
    return name


def _check_names(names, arg: str, allow_empty: bool) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"{arg} must be a list of column names, got {type(names).__name__} {names!r}")
    names = tuple(_check_name(n, f"every entry of {arg}") for n in names)
    if not names and not allow_empty:
        raise ValueError(f"{arg} must name at least one column, got an empty list")
    return names


def _check_distinct(label: str, categorical: tuple[str, ...], dense: tuple[str, ...]) -> None:
    seen = set()
    for name in (label, *categorical, *dense):
        if name in seen:
            raise ValueError(f"column {name!r} is named twice among label, categorical and dense")
        seen.add(name)


def _list_files(path: Path, format: str | None) -> tuple[list[Path], str]:
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if not path.is_dir():
        fmt = format or _SUFFIXES.get(_suffix(path))
        if fmt is None:
            raise ValueError(f"{path}: unknown file type; use a .parquet or .csv suffix, or pass format=")
        return [path], fmt
    found = sorted(p for p in path.iterdir() if p.is_file() and _suffix(p) in _SUFFIXES)
    if format is not None:
        found = [p for p in found if _SUFFIXES[_suffix(p)] == format]
    kinds = {_SUFFIXES[_suffix(p)] for p in found}
    if len(kinds) != 1:
        what = "no .parquet or .csv files" if not kinds else "both Parquet and CSV files; pass format="
        raise ValueError(f"{path}: the directory holds {what}")
    return found, kinds.pop()


def _rebatch(chunks: Iterator[Batch], size: int, drop_last: bool) -> Iterator[Batch]:
    """Regroup one-id-per-sample batches of any sizes into batches of ``size`` samples."""
    pending: list[Batch] = []
    count = 0
    for chunk in chunks:
        pending.append(chunk)
        count += len(chunk)
        while count >= size:
            merged = _concat(pending)
            yield _slice(merged, 0, size)
            pending = [_slice(merged, size, count)] if count > size else []
            count -= size
    if pending and not drop_last:
        yield _concat(pending)


def _concat(batches: list[Batch]) -> Batch:
    if len(batches) == 1:
        return batches[0]
    names = batches[0].sparse
    return Batch(
        torch.cat([b.dense for b in batches]),
        {n: torch.cat([b.sparse[n] for b in batches]) for n in names},
        torch.cat([b.labels for b in batches]),
    )


def _slice(batch: Batch, start: int, stop: int) -> Batch:
    return Batch(
        batch.dense[start:stop],
        {n: ids[start:stop] for n, ids in batch.sparse.items()},
        batch.labels[start:stop],
    )
