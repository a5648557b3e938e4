"""Stream batches (:class:`~dynemb.data.Batch`) from the user's Parquet, CSV or Criteo TSV files.

The user names the label column, the categorical columns, the multi-hot (list) columns and the dense columns;
other columns are not read. How values become ids, bags, dense values and labels, and what a null becomes, is in
:mod:`dynemb.data.arrow_columns` (the rules are tables in docs/cli.md, "Ids, nulls and non-finite values"). In short:
each id column is of type ``INT64`` (integers, and text that is a canonical decimal integer) or ``BYTES`` (text
hashed with XXH64, :func:`dynemb.data.hash_strings`; integers hashed as their decimal text), given by the model or
decided from the data (:class:`FileReader`'s ``id_types``); a null id becomes :func:`dynemb.data.null_key` of its
column; dense values come out raw (a null is NaN) for the model's preprocessing; labels must be 0/1.

Formats and suffixes are in :mod:`dynemb.data.formats`. CSV files need a header row and UTF-8 text; an empty
field is a null, and a multi-hot CSV field lists its ids separated by ``list_separator`` (``"a|b|c"``). Rows in
error messages count a file's data rows from 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import torch

from ..checks import check_int
from .arrow_columns import (ID_TYPES, categorical_ids, decimal_int64, dense_values, first_line, label_values,
                            multi_hot_ids)
from .batch import Batch
from .formats import CRITEO_COLUMNS, FORMATS, delimiter_of, list_files, open_text
from .stream import rebatch

__all__ = ["FileReader", "FORMATS", "column_names", "ID_ROWS"]

ID_ROWS = 1_000_000
"""The rows of a CSV file that decide its id types by default (as many as ``dynemb train``'s ``stats_rows``)."""

# Arrow reads in large chunks that rebatch cuts to size: per-chunk costs (Parquet page decoding, the per-distinct-id
# hash calls) shrink as chunks grow, since more ids repeat within a chunk.
_PARQUET_ROWS = 1 << 16
_CSV_BLOCK_BYTES = 16 << 20
_PEEK_BLOCK_BYTES = 1 << 20


class FileReader:
    """Batches of user data from a Parquet, CSV or Criteo TSV file, or from a directory of them (in name order).

    Each iteration reads the files again from the start, so a reader serves several epochs. Files are checked
    when the reader is made: they exist, they can be opened, they hold every named column and some rows. Values
    are checked as they stream, so a bad label far into a file raises when its batch is reached.

    Args:
        path: a file (see :mod:`dynemb.data.formats` for suffixes and compression), or a directory of them.
        label: the label column (values 0/1); ``None`` reads no label and gives NaN labels (for scoring).
        positive_label: when given, a label whose text equals it is 1 and any other non-null label 0 (string
            or bool labels such as ``">50K"``, ``"yes"``, ``"true"``).
        categorical: the one-id-per-row categorical columns; each becomes a feature of ``Batch.sparse``.
        dense: the dense columns, stacked in this order into ``Batch.dense``.
        multi_hot: list columns; each becomes a feature of ``Batch.sparse`` with its bags in ``Batch.offsets``.
        batch_size: samples per batch ``B``; batches span file boundaries, and the last one may be smaller.
        format: ``"parquet"``, ``"csv"`` or ``"criteo"``; ``None`` infers it from the file suffix.
        delimiter: CSV field separator; ``None`` means tab for ``.tsv`` and Criteo files and comma otherwise.
        list_separator: separator of the ids in a multi-hot CSV field.
        drop_last: drop the last batch when it has fewer than ``B`` samples.
        id_types: each categorical and multi-hot column's id type, ``"INT64"`` or ``"BYTES"`` (a trained model's,
            :attr:`dynemb.data.preprocess.Preprocessing.id_types`), which every file is read with whatever its
            format. ``None`` decides them from the data, once, when the reader is made (then in
            :attr:`id_types`): a Parquet column of integers or bools (or lists of them) is ``INT64``, of strings or
            binary ``BYTES``, from the first file's schema; a CSV column is ``INT64`` when its first ``id_rows``
            rows hold a value and every value is a canonical decimal int64 (elements, for a multi-hot column),
            else ``BYTES``; Criteo ids (hex text) are ``BYTES``.
        id_rows: the rows of CSV read to decide ``id_types`` when it is ``None``.

    Raises:
        TypeError: a column argument is not a string or a sequence of strings.
        ValueError: one line naming the file and the problem: no such file, a file that cannot be read, a
            missing column, an empty data set, a bad argument, an id column of floats; while iterating, a label
            that is not 0/1, a dense value that is not a number, text of an ``INT64`` id column that is not a
            canonical decimal integer (the message names the column, the row and the value), a categorical column
            that is neither integer nor string, or a multi-hot column that is not a list.

    Shape:
        Each batch: ``dense`` ``[B, len(dense)]`` float32, ``sparse[name]`` ``[B]`` int64 (``[N]`` with
        ``offsets[name]`` ``[B + 1]`` for a multi-hot column), ``labels`` ``[B]`` float32.

    Example:
        >>> import tempfile, pyarrow as pa, pyarrow.parquet as pq
        >>> tmp = tempfile.TemporaryDirectory()
        >>> path = tmp.name + "/clicks.parquet"
        >>> pq.write_table(pa.table({"y": [0, 1, 1], "user": ["a", None, "a"], "age": [31.0, None, 40.0],
        ...                          "tags": [["x", "y"], [], None]}), path)
        >>> reader = FileReader(path, label="y", categorical=["user"], dense=["age"], multi_hot=["tags"])
        >>> batch = next(iter(reader))
        >>> batch.labels.tolist(), batch.dense[:, 0].tolist(), batch.offsets["tags"].tolist()
        ([0.0, 1.0, 1.0], [31.0, nan, 40.0], [0, 2, 2, 3])
        >>> reader.id_types
        {'user': 'BYTES', 'tags': 'BYTES'}
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
        label: str | None,
        categorical: Sequence[str],
        dense: Sequence[str] = (),
        multi_hot: Sequence[str] = (),
        batch_size: int = 4096,
        format: str | None = None,
        delimiter: str | None = None,
        list_separator: str = "|",
        drop_last: bool = False,
        id_types: Mapping[str, str] | None = None,
        id_rows: int = ID_ROWS,
        positive_label: str | None = None,
    ) -> None:
        self.label = None if label is None else _check_name(label, "label")
        if positive_label is not None and (not isinstance(positive_label, str) or not positive_label):
            raise ValueError(f"positive_label must be None or a non-empty string, got {positive_label!r}")
        self.positive_label = positive_label
        self.categorical = _check_names(categorical, "categorical")
        self.multi_hot = _check_names(multi_hot, "multi_hot")
        if not self.categorical and not self.multi_hot:
            raise ValueError("categorical must name at least one column (or multi_hot), got an empty list")
        self.dense = _check_names(dense, "dense")
        _check_distinct(self.columns)
        self.batch_size = check_int(batch_size, "batch_size", minimum=1)
        if format is not None and format not in FORMATS:
            raise ValueError(f"format must be None or one of {FORMATS}, got {format!r}")
        for name, value in (("delimiter", delimiter), ("list_separator", list_separator)):
            if value is not None and (not isinstance(value, str) or len(value) != 1):
                raise ValueError(f"{name} must be {'None or ' if name == 'delimiter' else ''}one character, "
                                 f"got {value!r}")
        self.path = Path(path)
        self.files, self.format = list_files(self.path, format)
        self.delimiter = delimiter
        self.list_separator = list_separator
        self.drop_last = bool(drop_last)
        self._check_files()
        if id_types is None:
            self.id_types = self._decide_id_types(check_int(id_rows, "id_rows", minimum=1))
        else:
            self.id_types = _check_id_types(id_types, [*self.categorical, *self.multi_hot])

    @property
    def columns(self) -> list[str]:
        """Every column read: the label (if any), the categorical, multi-hot and dense columns."""
        return [*([self.label] if self.label else []), *self.categorical, *self.multi_hot, *self.dense]

    def __iter__(self) -> Iterator[Batch]:
        return rebatch((batch for _, batch in self.chunks()), self.batch_size, self.drop_last)

    def chunks(self) -> Iterator[tuple[int, Batch]]:
        """The data as read, in chunks of any size: ``(number of the chunk's first row, batch)`` pairs.

        Rows are numbered from 0 over all files, in order; see :func:`dynemb.data.stream.split`.
        """
        first = 0
        for file in self.files:
            batches = self._guarded(file, self._record_batches, file)
            row = 0
            while True:
                record = self._guarded(file, next, batches, None)
                if record is None:
                    break
                if record.num_rows:
                    yield first + row, self._convert(record, file, row)
                row += record.num_rows
            first += row

    # ------------------------------------------------------------------ files
    def _check_files(self) -> None:
        has_rows = False
        for file in self.files:
            names, rows = self._guarded(file, _peek, file, self.format, self.delimiter)
            if not names:  # a 0-byte text file: nothing to check, and nothing to read
                continue
            missing = [c for c in self.columns if c not in names]
            if missing:
                shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
                hint = " (read as Criteo TSV: pass --format csv for a CSV file)" if self.format == "criteo" else ""
                other = [c for c in ";|\t," if len(names) == 1 and c in names[0]]
                if other and self.format == "csv":  # a file of another separator reads as one column
                    used = self.delimiter or delimiter_of(file, self.format)
                    hint = (f" (one column, whose name holds {other[0]!r}: fields separated by {other[0]!r}? it is "
                            f"read with the separator {used!r}: comma for .csv, tab for .tsv)")
                raise ValueError(f"{file}: missing column {missing[0]!r} (the file has: {shown or 'no columns'})"
                                 f"{hint}")
            has_rows = has_rows or rows
        if not has_rows:
            raise ValueError(f"{self.path}: the data set is empty (no data rows)")

    def _record_batches(self, file: Path, columns: list[str] | None = None) -> Iterator[pa.RecordBatch]:
        columns = self.columns if columns is None else columns
        if self.format == "parquet":
            rows = max(self.batch_size, _PARQUET_ROWS)
            return pq.ParquetFile(file).iter_batches(batch_size=rows, columns=columns)
        convert = pcsv.ConvertOptions(
            include_columns=columns,
            column_types={c: pa.string() for c in columns},
            null_values=[""],
            strings_can_be_null=True,
        )
        return iter(_open_csv(file, self.format, self.delimiter, convert, _CSV_BLOCK_BYTES))

    def _decide_id_types(self, max_rows: int) -> dict[str, str]:
        """Each id column's type, from the data (see ``id_types`` in the class docstring)."""
        ids = [*self.categorical, *self.multi_hot]
        if self.format == "criteo":
            return dict.fromkeys(ids, "BYTES")
        if self.format == "parquet":
            schema = self._guarded(self.files[0], pq.read_schema, self.files[0])
            return {c: _parquet_id_type(schema.field(c).type, f"{self.files[0]}: column {c!r}") for c in ids}
        decimal: dict[str, bool | None] = dict.fromkeys(ids)  # every value so far a decimal int64 (None: no value)
        rows = 0
        for file in self.files:
            batches = self._guarded(file, self._record_batches, file, ids)
            while rows < max_rows and not all(v is False for v in decimal.values()):
                record = self._guarded(file, next, batches, None)
                if record is None:
                    break
                record = record.slice(0, max_rows - rows)
                rows += record.num_rows
                for c in [c for c, v in decimal.items() if v is not False]:
                    text = record.column(c)
                    if c in self.multi_hot:
                        text = pc.split_pattern(text, self.list_separator).flatten()
                    text = text.drop_null()
                    if len(text):
                        decimal[c] = bool(decimal_int64(text).all())
            if rows >= max_rows or all(v is False for v in decimal.values()):
                break
        return {c: "INT64" if decimal[c] else "BYTES" for c in ids}

    def _guarded(self, file: Path, fn, *args):
        """``fn(*args)``, with any read failure turned into a one-line ValueError naming ``file``."""
        try:
            return fn(*args)
        except (pa.ArrowException, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc)
            raise ValueError(f"{file}: cannot read it as {self.format} ({reason})") from None

    # ------------------------------------------------------------------ conversion
    def _convert(self, record: pa.RecordBatch, file: Path, first_row: int) -> Batch:
        def where(column: str) -> str:
            return f"{file}: column {column!r}"

        if self.label is None:
            labels = np.full(record.num_rows, np.nan, dtype=np.float32)
        else:
            labels = label_values(record.column(self.label), where(self.label), first_row, self.positive_label)
        sparse = {
            c: torch.from_numpy(categorical_ids(record.column(c), c, where(c), self.id_types[c], first_row))
            for c in self.categorical
        }
        offsets = {}
        for c in self.multi_hot:
            separator = None if self.format == "parquet" else self.list_separator
            ids, bounds = multi_hot_ids(record.column(c), c, where(c), self.id_types[c], separator, first_row)
            sparse[c], offsets[c] = torch.from_numpy(ids), torch.from_numpy(bounds)
        dense = [dense_values(record.column(c), where(c), first_row) for c in self.dense]
        matrix = np.stack(dense, axis=1) if dense else np.zeros((record.num_rows, 0), dtype=np.float32)
        return Batch(torch.from_numpy(matrix), sparse, torch.from_numpy(labels), offsets)


def column_names(path: str | os.PathLike, format: str | None = None, delimiter: str | None = None) -> list[str]:
    """The column names of the first file of ``path`` (for a Criteo file: with the label when it has one).

    Raises:
        ValueError: as :class:`FileReader` for a missing or unreadable file.
    """
    files, fmt = list_files(Path(path), format)
    try:
        return _peek(files[0], fmt, delimiter)[0]
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{files[0]}: cannot read it as {fmt} ({first_line(exc)})") from None


def _peek(file: Path, fmt: str, delimiter: str | None) -> tuple[list[str], bool]:
    """Column names of ``file`` and whether it has a data row, reading at most one block."""
    if fmt == "parquet":
        meta = pq.ParquetFile(file)
        return meta.schema_arrow.names, meta.metadata.num_rows > 0
    try:
        reader = _open_csv(file, fmt, delimiter, None, _PEEK_BLOCK_BYTES)
    except pa.ArrowInvalid as exc:
        if "Empty CSV file" in str(exc):
            return [], False
        raise
    first = next(iter(reader), None)
    return reader.schema.names, first is not None and first.num_rows > 0


def _criteo_names(file: Path) -> list[str]:
    """Criteo files have no header: 40 fields with the label, 39 without (read from the first line)."""
    with open_text(file) as stream:
        line = stream.read(_PEEK_BLOCK_BYTES).split(b"\n", 1)[0]
    fields = line.count(b"\t") + 1 if line else len(CRITEO_COLUMNS)
    return list(CRITEO_COLUMNS[1:] if fields == len(CRITEO_COLUMNS) - 1 else CRITEO_COLUMNS)


def _open_csv(file: Path, fmt: str, delimiter: str | None, convert: pcsv.ConvertOptions | None, block_bytes: int):
    names = _criteo_names(file) if fmt == "criteo" else None
    read = pcsv.ReadOptions(block_size=block_bytes, column_names=names)
    quote = False if fmt == "criteo" else '"'
    parse = pcsv.ParseOptions(delimiter=delimiter or delimiter_of(file, fmt), quote_char=quote)
    return pcsv.open_csv(open_text(file), read_options=read, parse_options=parse, convert_options=convert)


def _check_name(name, arg: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{arg} must be a non-empty column name (str), got {name!r}")
    return name


def _check_names(names, arg: str) -> tuple[str, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"{arg} must be a list of column names, got {type(names).__name__} {names!r}")
    return tuple(_check_name(n, f"every entry of {arg}") for n in names)


def _parquet_id_type(t: pa.DataType, where: str) -> str:
    """``INT64`` for integers or bools (or lists of them), ``BYTES`` for strings and binary."""
    while pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        t = t.value_type
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return "INT64"
    if pa.types.is_floating(t) or pa.types.is_decimal(t):
        raise ValueError(f"{where} has type {t}; categorical ids must be integers or strings")
    return "BYTES"


def _check_id_types(id_types, columns: list[str]) -> dict[str, str]:
    if not isinstance(id_types, Mapping):
        raise TypeError(f"id_types must be a mapping of column -> 'INT64' or 'BYTES', got {type(id_types).__name__}")
    for c in columns:
        if id_types.get(c) not in ID_TYPES:
            raise ValueError(f"id_types must give id column {c!r} a type in {ID_TYPES}, got {id_types.get(c)!r}")
    extra = sorted(set(id_types) - set(columns))
    if extra:
        raise ValueError(f"id_types names {extra[0]!r}, which is no categorical or multi-hot column of the reader")
    return {c: id_types[c] for c in columns}


def _check_distinct(columns: list[str]) -> None:
    seen = set()
    for name in columns:
        if name in seen:
            raise ValueError(f"column {name!r} is named twice among label, categorical, multi_hot and dense")
        seen.add(name)
