"""The serving export format, written and read in one place: :func:`export_for_serving` writes the keys and values
of every logical table for the parameter server, in full or as a delta; :func:`read_export` reads one back with its
checksums verified."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import nn

from ..distributed.plan import ShardingKind
from ..table.checks import VALUE_DTYPES, check_dtype
from ..table.initializers import resolve_initializer
from . import lineage
from .fsutil import staging, write_json, write_pointer
from .manifest import FORMAT_VERSION, MANIFEST, SERVING_FORMAT, complete, file_record, read_manifest, resolve
from .ranks import rank_context
from .saver import incremental_parent, write_payloads, writes as _writes
from .tables import DELETED, KEYS, VALUES, columns, delta_columns, find_tables, shard_file
from .tensorfile import read_tensors

__all__ = ["export_for_serving", "read_export"]

STREAM = "serving"


def export_for_serving(path, model: nn.Module, dtype: torch.dtype = torch.float32, incremental: bool = False) -> Path:
    """Export the keys and values (no slots, no scores) of every table of ``model`` for serving.

    Writes ``path/version-<n>/`` atomically (``n`` one above the newest export there) with one safetensors file
    per table holding ``keys [N]`` (the user's keys, in the table's key dtype) and ``values [N, D]`` (cast to
    ``dtype``), and a ``manifest.json`` the parameter server reads: per table (named as the user named it: a
    collection's TableConfig name, or a standalone embedding's module path) the file, ``dim``, ``dtype``,
    ``key_dtype``, ``rows``, ``size``, ``sha256``, ``initializer`` and ``seed`` (for the default rows of unknown
    keys), plus ``version``, ``kind``, ``parent`` and ``created_unix``. Then ``path/latest`` points at it.

    With a sharded collection this is a collective call: every rank calls it, the rows of every rank are gathered
    and rank 0 writes the one export. Nothing in it depends on the world size or the sharding plan.

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
    ctx = rank_context(model)
    shards = find_tables(model)
    local = {name: shard for name, shard in shards.items() if shard.module is not None}
    version = 1 + max((m["version"] for m in complete(root, SERVING_FORMAT).values()), default=0) \
        if ctx.rank == 0 else 0
    version = ctx.gather(version)[0]
    parent = None
    if incremental:
        current = {name: _fields(shard.config, dtype) for name, shard in shards.items()}
        parent = incremental_parent(root, root_key, local, STREAM, SERVING_FORMAT, current,
                                    f"serving export {version}")
        parents = ctx.gather(parent)
        parent = parent if all(p == parents[0] for p in parents) else None  # full unless every rank can chain
    name = f"version-{version:08d}"
    tables = [shard.table for shard in local.values()]
    with lineage.tick(tables):
        payloads, entries = _table_payloads(shards, parent, dtype, ctx)
        if ctx.rank == 0:
            with staging(root, name) as tmp:
                files = write_payloads(tmp, payloads, f"exported {root / name}")
                for entry in entries.values():
                    entry["sha256"] = files[entry["file"]]["sha256"]
                write_json(tmp / MANIFEST, {
                    "format": SERVING_FORMAT, "format_version": FORMAT_VERSION, "version": version,
                    "kind": "delta" if parent else "full", "parent": parent, "created_unix": time.time(),
                    "tables": entries, "files": files,
                })
            write_pointer(root, name, version=version)
        ctx.barrier()
        lineage.record(tables, STREAM, root_key, name)
    return root / name


def _table_payloads(shards: dict, parent: str | None, dtype: torch.dtype, ctx) -> tuple[dict, dict]:
    """Every table's rows in the user's keys, gathered from every rank to rank 0 (which alone writes them)."""
    payloads, entries = {}, {}
    for i, (name, shard) in enumerate(shards.items()):
        cfg = shard.config
        cols = _local_columns(shard, parent, ctx)
        if ctx.distributed and shard.sharding is not None and shard.sharding.kind != ShardingKind.DATA:
            cols = {col: torch.cat(ctx.gather_tensor(t, f"gathering {col} of table {name!r} for serving"))
                    for col, t in cols.items()}
        size = sum(ctx.gather(shard.table.size() if shard.module is not None and _writes(shard, ctx) else 0))
        if ctx.rank != 0:
            continue
        cols[VALUES] = cols[VALUES].to(dtype)
        rel = shard_file(i, name, 0, 1)
        payloads[rel] = (cols, None)
        entries[name] = {**_fields(cfg, dtype), "file": rel, "rows": int(cols[KEYS].numel()), "size": size,
                         "deleted": int(cols[DELETED].numel()) if DELETED in cols else 0,
                         "initializer": resolve_initializer(cfg.initializer).describe(), "seed": shard.seed}
    return payloads, entries


def _local_columns(shard, parent: str | None, ctx) -> dict:
    """This rank's keys and values of ``shard`` (empty where another rank writes them)."""
    cfg = shard.config
    if shard.module is None or not _writes(shard, ctx):
        cols = {KEYS: torch.empty(0, dtype=cfg.key_dtype), VALUES: torch.empty(0, cfg.dim, dtype=cfg.dtype)}
        if parent is not None:
            cols[DELETED] = torch.empty(0, dtype=cfg.key_dtype)
        device = shard.table.device if shard.module is not None else None
        return {k: v.to(device) if device is not None else v for k, v in cols.items()}
    if parent is None:
        return columns(shard, state=False)
    return delta_columns(shard, lineage.since(shard.table, STREAM), state=False)


def _fields(cfg, dtype: torch.dtype) -> dict:
    return {"dim": cfg.dim, "dtype": str(dtype), "key_dtype": str(cfg.key_dtype)}


def read_export(path) -> tuple[dict, dict]:
    """Read a serving export (its ``latest`` version, or the version directory given) with checksums verified.

    Returns ``(manifest, {table: {"keys": [N], "values": [N, D], "deleted_keys": [K] (deltas)}})``, tables named
    as the user named them and keys in each table's key dtype.
    """
    directory = resolve(path)
    manifest = read_manifest(directory, SERVING_FORMAT)
    tables = {}
    for name, entry in manifest["tables"].items():
        tensors, _ = read_tensors(directory / entry["file"], file_record(manifest, directory, entry["file"]))
        tables[name] = tensors
    manifest["path"] = str(directory)
    return manifest, tables
