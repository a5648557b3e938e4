"""File formats of the readers: which format a path holds, the files of a directory, and the Criteo TSV layout.

A format comes from ``format=`` or from the file suffix, after any compression suffix is set aside:

=============================  ========================================================================
suffix                         format
=============================  ========================================================================
``.parquet``, ``.pq``          ``parquet``; a codec suffix (``.parquet.brotli``, ``.parquet.snappy``,
                               ``.parquet.gz``, ...) names the codec of the pages inside, so the file is
                               read as it is
``.csv``, ``.tsv``             ``csv`` (comma-, or for ``.tsv`` tab-separated, with a header row)
``.criteo``, ``.txt``          ``criteo``: the Criteo display-advertising TSV layout (below); Kaggle's files
                               are ``train.txt`` and ``test.txt``
=============================  ========================================================================

Text formats (``csv``, ``criteo``) are decompressed on the fly when the name ends with ``.gz``/``.gzip``,
``.bz2``, ``.zst``/``.zstd``, ``.lz4`` or ``.br``/``.brotli``.

**Criteo TSV**: no header; tab-separated fields ``label, I1 .. I13, C1 .. C26``: a 0/1 label, 13 integer
counts and 26 categorical ids written as 8 hex digits (``BYTES`` ids: hashed as text, even when every digit is
decimal); any field but the label may be empty (a null). Files without
the label column (39 fields, as Kaggle's ``test.txt``) are recognized by their field count.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

__all__ = ["FORMATS", "CRITEO_LABEL", "CRITEO_DENSE", "CRITEO_CATEGORICAL", "CRITEO_COLUMNS", "file_format",
           "list_files", "open_text", "create_text", "delimiter_of"]

FORMATS = ("parquet", "csv", "criteo")
CRITEO_LABEL = "label"
CRITEO_DENSE = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
CRITEO_COLUMNS = (CRITEO_LABEL, *CRITEO_DENSE, *CRITEO_CATEGORICAL)

_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "csv", ".criteo": "criteo",
             ".txt": "criteo"}
_TEXT_CODECS = {".gz": "gzip", ".gzip": "gzip", ".bz2": "bz2", ".zst": "zstd", ".zstd": "zstd", ".lz4": "lz4",
                ".br": "brotli", ".brotli": "brotli"}
_PARQUET_CODECS = {*_TEXT_CODECS, ".snappy"}


def _suffixes(path: Path) -> tuple[str, str | None]:
    """``(format suffix, compression suffix or None)`` of a file name, lower case."""
    parts = [s.lower() for s in path.suffixes]
    if len(parts) >= 2 and parts[-1] in _PARQUET_CODECS and parts[-2] in _SUFFIXES:
        return parts[-2], parts[-1]
    return (parts[-1] if parts else ""), None


def file_format(path: Path) -> str | None:
    """The format that ``path``'s suffix names, or ``None``."""
    suffix, codec = _suffixes(path)
    fmt = _SUFFIXES.get(suffix)
    if fmt != "parquet" and codec is not None and codec not in _TEXT_CODECS:
        return None  # a .csv.snappy: snappy has no streaming format to read text from
    return fmt


def list_files(path: Path, format: str | None) -> tuple[list[Path], str]:
    """The files to read (one file, or a directory's files of one format, in name order) and their format.

    In a directory, names starting with ``.`` or ``_`` (``_SUCCESS``) are skipped; with ``format``, files without
    a format suffix are read too.

    Raises:
        ValueError: ``path`` does not exist, has an unknown suffix (and no ``format``), or is a directory with no
            readable file or with files of two formats (and no ``format``).
    """
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if not path.is_dir():
        fmt = format or file_format(path)
        if fmt is None:
            raise ValueError(f"{path}: unknown file type; use a .parquet, .csv or .criteo suffix, or pass format= "
                             f"(--format)")
        return [path], fmt
    found = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
    if format is None:
        found = [p for p in found if file_format(p) is not None]
    else:  # files of that format, and files with no format suffix (Criteo's day_0 .. day_23)
        found = [p for p in found if file_format(p) in (format, None)]
    kinds = {format or file_format(p) for p in found}
    if len(kinds) != 1:
        if not kinds:
            raise ValueError(f"{path}: the directory holds no .parquet, .csv or .criteo files")
        first = {}
        for p in found:
            first.setdefault(file_format(p), p.name)
        shown = ", ".join(f"{kind}: {name}" for kind, name in sorted(first.items()))
        raise ValueError(f"{path}: the directory holds files of several formats ({shown}); keep one format there, or "
                         "pass format= (--format) to read only the files of that one")
    return found, kinds.pop()


def open_text(path: Path) -> pa.NativeFile:
    """A stream of the text in ``path``, decompressed by its compression suffix."""
    codec = _TEXT_CODECS.get(_suffixes(path)[1] or "")
    return pa.CompressedInputStream(str(path), codec) if codec else pa.OSFile(str(path))


def create_text(path: Path) -> pa.NativeFile:
    """A new file at ``path`` to write text into, compressed by its compression suffix."""
    codec = _TEXT_CODECS.get(_suffixes(path)[1] or "")
    return pa.CompressedOutputStream(str(path), codec) if codec else pa.OSFile(str(path), "wb")


def delimiter_of(path: Path, format: str) -> str:
    """The field separator a text file's format implies: tab for ``.tsv`` and Criteo files, else comma."""
    return "\t" if format == "criteo" or _suffixes(path)[0] == ".tsv" else ","
