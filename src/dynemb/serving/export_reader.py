"""Reading the serving export format that :func:`dynemb.checkpoint.export_for_serving` writes.

The writer lives in ``dynemb/checkpoint/serving.py``; this reader is kept in a module of its own so that the two can
later become one module for the format.
"""

from __future__ import annotations

from ..checkpoint.manifest import SERVING_FORMAT, file_record, read_manifest, resolve
from ..checkpoint.tensorfile import read_tensors

__all__ = ["read_export"]


def read_export(path) -> tuple[dict, dict]:
    """Read a serving export (its ``latest`` version, or the version directory given) with checksums verified.

    Returns ``(manifest, {table: {"keys": [N], "values": [N, D], "deleted_keys": [K] (deltas)}})``.
    """
    directory = resolve(path)
    manifest = read_manifest(directory, SERVING_FORMAT)
    tables = {}
    for name, entry in manifest["tables"].items():
        tensors, _ = read_tensors(directory / entry["file"], file_record(manifest, directory, entry["file"]))
        tables[name] = tensors
    manifest["path"] = str(directory)
    return manifest, tables
