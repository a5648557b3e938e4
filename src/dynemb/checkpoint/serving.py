"""``export_for_serving``: keys and values of every table for the parameter server, in full or as a delta."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

from ..table.checks import VALUE_DTYPES, check_dtype
from . import lineage
from .fsutil import staging, write_json, write_pointer
from .manifest import FORMAT_VERSION, MANIFEST, SERVING_FORMAT, complete
from .saver import RANK, WORLD_SIZE, incremental_parent, write_payloads
from .tables import DELETED, KEYS, VALUES, columns, delta_columns, find_served, shard_file

__all__ = ["export_for_serving"]

STREAM = "serving"


def export_for_serving(path, model: nn.Module, dtype: torch.dtype = torch.float32, incremental: bool = False) -> Path:
    """Export the keys and values (no slots, no scores) of every Dynamic/StaticEmbedding of ``model`` for serving.

    Writes ``path/version-<n>/`` atomically (``n`` one above the newest export there) with one safetensors file
    per table per rank holding ``keys [N]`` and ``values [N, D]`` (cast to ``dtype``), and a ``manifest.json``
    the parameter server reads: per table (named by module name) the file, ``dim``, ``dtype``, ``key_dtype``,
    ``rows``, ``size``, ``sha256``, ``initializer`` and ``seed`` (for the default rows of unknown keys), plus
    ``version``, ``kind``, ``parent`` and ``created_unix``. Then ``path/latest`` points at it.

    A delta export (``incremental=True``) holds the rows written since the previous export of these tables to
    ``path`` and ``deleted_keys [K]``; a reader deletes those keys first, then upserts the rows. Without a
    previous export, a full export is written (with a warning).

    Args:
        path: the export root directory (created if needed); keep it apart from checkpoint roots.
        model: an ``nn.Module`` holding DynamicEmbeddings (or one itself).
        dtype: value dtype of the export: float32, float16 or bfloat16.
        incremental: write a delta against the previous export.

    Returns:
        The new export directory.

    Raises:
        TypeError: ``model`` is not a module, ``dtype`` is not a float dtype, ``incremental`` is not a bool.

    Example:
        >>> import json, tempfile, torch, dynemb
        >>> from dynemb.checkpoint import export_for_serving
        >>> emb = dynemb.DynamicEmbedding(4, seed=0)
        >>> _ = emb(torch.tensor([1, 2]))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> out = export_for_serving(tmp.name, emb, dtype=torch.float16)
        >>> table = json.loads((out / "manifest.json").read_text())["tables"]["embedding"]
        >>> table["rows"], table["dtype"]
        (2, 'torch.float16')
        >>> tmp.cleanup()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_dtype(dtype, VALUE_DTYPES, "dtype")
    if not isinstance(incremental, bool):
        raise TypeError(f"incremental must be a bool, got {incremental!r}")
    root = Path(path)
    root_key = os.path.realpath(root)
    embeddings = find_served(model)
    version = 1 + max((m["version"] for m in complete(root, SERVING_FORMAT).values()), default=0)
    parent = None
    if incremental:
        current = {name: _fields(emb, dtype) for name, emb in embeddings.items()}
        parent = incremental_parent(root, root_key, embeddings, STREAM, SERVING_FORMAT, current,
                                    f"serving export {version}")
    name = f"version-{version:08d}"
    tables = [emb.table for emb in embeddings.values()]
    with lineage.tick(tables):
        payloads, entries = _table_payloads(embeddings, parent, dtype)
        with staging(root, name) as tmp:
            files = write_payloads(tmp, payloads, f"exported {root / name}")
            for entry in entries.values():
                entry["sha256"] = files[entry["file"]]["sha256"]
            write_json(tmp / MANIFEST, {
                "format": SERVING_FORMAT, "format_version": FORMAT_VERSION, "version": version,
                "kind": "delta" if parent else "full", "parent": parent, "created_unix": time.time(),
                "world_size": WORLD_SIZE, "tables": entries, "files": files,
            })
        write_pointer(root, name, version=version)
        lineage.record(tables, STREAM, root_key, name)
    return root / name


def _table_payloads(embeddings: dict, parent: str | None, dtype: torch.dtype) -> tuple[dict, dict]:
    payloads, entries = {}, {}
    for i, (name, emb) in enumerate(embeddings.items()):
        t = emb.table
        if parent is None:
            cols = columns(t, state=False)
        else:
            cols = delta_columns(t, lineage.since(t, STREAM), state=False)
        cols[VALUES] = cols[VALUES].to(dtype)
        rel = shard_file(i, name, RANK, WORLD_SIZE)
        payloads[rel] = (cols, None)
        config = emb.config()
        entries[name] = {**_fields(emb, dtype), "file": rel, "rows": int(cols[KEYS].numel()), "size": t.size(),
                         "deleted": int(cols[DELETED].numel()) if DELETED in cols else 0,
                         "initializer": config["initializer"], "seed": config["seed"]}
    return payloads, entries


def _fields(emb, dtype: torch.dtype) -> dict:
    t = emb.table
    return {"dim": t.dim, "dtype": str(dtype), "key_dtype": str(t.key_dtype)}
