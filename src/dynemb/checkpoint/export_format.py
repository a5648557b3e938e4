"""The serving export format, written and read in one place: :func:`export_for_serving` writes the keys and values
of every logical table for the parameter server, in full or as a delta, with its lineage (model id, version, parent
version, digest); :func:`read_export` reads one back with its checksums verified, :func:`read_chain` one with the
exports it builds on."""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from pathlib import Path

import torch
from torch import nn

from ..checks import VALUE_DTYPES, check_dtype
from ..serialization import dtype_name
from ..table import TieredTable
from .row_codec import QUANTIZED, encode_rows, packed_width, quantized_kind
from ..table.initializers import resolve_initializer
from . import write_marks
from .commit import commit, open_shared
from .shard_tensors import DELETED, KEYS, VALUES
from .dense import dense_state
from .errors import CheckpointError
from .fsutil import abandon, read_json, write_json
from .manifest import FORMAT_VERSION, MANIFEST, SERVING_FORMAT, chain, complete, file_record, read_manifest, resolve
from .ranks import rank_context
from .saver import incremental_parent, writes as _writes
from .tiered_stream import ColumnStream, stream_column, tiered_columns, tiered_delta_columns
from .tables import find_tables, shard_file
from .checksum import record_of, verify
from .tensorfile import read_tensors

__all__ = ["export_for_serving", "read_export", "read_chain", "read_dense", "read_attached", "export_files",
           "manifest_digest", "version_name"]

STREAM = "serving"
_FIELDS = {"format", "format_version", "model", "version", "kind", "parent", "parent_version", "parent_digest",
           "created_unix", "tables", "dense", "files", "digest", "path"}  # a manifest's own fields
MODEL_FILE = "model.json"  # in the export root: {"model": id}, written by its first export
DENSE_FILE = "dense.safetensors"  # in a version directory: the dense part, when the export carries one


def export_for_serving(path, model: nn.Module, dtype: torch.dtype = torch.float32, incremental: bool = False,
                       model_name: str | None = None, dense: bool = False, attach: dict | None = None) -> Path:
    """Export the keys and values (no slots, no scores) of every table of ``model`` for serving.

    Writes ``path/version-<n>/`` atomically (``n`` one above the newest export there) with one safetensors file
    per table holding ``keys [N]`` (the user's keys, in the table's key dtype) and ``values [N, D]`` (cast to
    ``dtype``), and a ``manifest.json`` the parameter server reads: per table (named as the user named it: a
    collection's TableConfig name, or a standalone embedding's module path) the file, ``dim``, ``dtype``,
    ``key_dtype``, ``rows``, ``size``, the file's ``algorithm`` and ``checksum`` (see :mod:`.checksum`),
    ``initializer`` and ``seed`` (for the default rows of unknown keys), plus ``version``, ``kind``, ``parent`` and
    ``created_unix``. Then ``path/latest`` points at it.

    Lineage: the manifest also names the ``model`` (the export root's model id, see ``model_name``), the
    ``parent_version`` and ``parent_digest`` (a delta's base; for a full export, the newest export it follows, or
    null) and its own ``digest``: the sha256 of the manifest without that field, which covers every file's checksum
    and, through ``parent_digest``, the chain it builds on. A parameter server applies an export only on top of
    the version it names (see :meth:`~dynemb.serving.ParameterServer.apply_update`).

    With a sharded collection this is a collective call: every rank calls it and writes the rows it holds, a chunk
    at a time, into the shard files of each table (``tables/<i>-<name>.rank-<r>-of-<w>.safetensors``; a
    replicated table's one copy by rank 0), and rank 0 writes the one manifest, which lists each table's
    ``shards`` (``rank``, ``file``, ``rows``, ``algorithm``, ``checksum``). No rank gathers another's rows: each
    holds its own rows and a chunk of ``CHUNK_ROWS`` of them at a time (:mod:`~dynemb.checkpoint.tiered_stream`). A
    table of one file also has its ``file`` and checksum in its entry, as exports of one process always had.
    :func:`read_export` reads either; the rows it returns do not depend on the world size or the sharding plan
    (their order does).

    A delta export (``incremental=True``) holds the rows written since the previous export of these tables to
    ``path`` and ``deleted_keys [K]``; a reader deletes those keys first, then upserts the rows. Without a
    previous export, a full export is written (with a warning).

    Args:
        path: the export root directory (created if needed); keep it apart from checkpoint roots.
        model: an ``nn.Module`` holding DynamicEmbeddings (or one itself).
        dtype: value dtype of the export: float32, float16 or bfloat16; or 8-bit rows, ``torch.int8`` (row-wise
            scale and bias), ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (row-wise scale), stored packed
            (``values`` ``uint8 [N, W]``, see :mod:`~dynemb.checkpoint.row_codec`) and served dequantized.
        incremental: write a delta against the previous export.
        model_name: the id of the model this root holds. The first export to ``path`` stores it in
            ``path/model.json`` (without ``model_name``, a new id: the root's name and a random suffix), and every
            later export to ``path`` names that id, so all exports of one training run share it.
        dense: also write the dense part (every parameter and buffer outside the tables, float32 as trained) to
            ``dense.safetensors`` in the version directory, named in the manifest's ``dense`` field and covered by
            its digest; :func:`read_dense` reads it back. A served model takes its MLPs from the newest version
            that has one, so a server following a training run serves the tables and the MLPs of one step.
        attach: ``{"files": {relative name: bytes}, "fields": {manifest field: JSON value}}``: more files of the
            version (their checksums in the manifest's ``files``, read back checked by :func:`read_attached`) and
            manifest fields, both covered by its digest; :func:`dynemb.serving.export_model` attaches the model's
            ``torch.export`` program this way.

    Returns:
        The new export directory.

    Raises:
        TypeError: ``model`` is not a module, ``dtype`` is not a float dtype, ``incremental`` is not a bool,
            ``model_name`` is not a non-empty str.
        ValueError: ``model_name`` differs from the model id ``path`` already holds.

    Example:
        >>> import json, tempfile, torch, dynemb
        >>> from dynemb.checkpoint import export_for_serving
        >>> emb = dynemb.DynamicEmbedding(4, seed=0)
        >>> _ = emb(torch.tensor([1, 2]))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> out = export_for_serving(tmp.name, emb, dtype=torch.float16)
        >>> table = json.loads((out / "manifest.json").read_text())["tables"]["embedding"]
        >>> table["rows"], table["dtype"], table["initializer"]["type"]
        (2, 'float16', 'uniform')
        >>> tmp.cleanup()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    root = Path(path)
    try:
        check_dtype(dtype, (*VALUE_DTYPES, *QUANTIZED.values()), "dtype")
        if not isinstance(incremental, bool):
            raise TypeError(f"incremental must be a bool, got {incremental!r}")
        if not isinstance(dense, bool):
            raise TypeError(f"dense must be a bool, got {dense!r}")
        if attach is not None and (not isinstance(attach, dict) or set(attach) - {"files", "fields"}
                                   or set(attach.get("fields") or {}) & _FIELDS):
            raise TypeError(f"attach must be a dict of 'files' and 'fields' (fields other than {sorted(_FIELDS)}), "
                            f"got {attach!r}"[:400])
        if model_name is not None and (not isinstance(model_name, str) or not model_name):
            raise TypeError(f"model_name must be a non-empty str or None, got {model_name!r}")
        if root.exists() and not root.is_dir():  # not "[Errno 17] File exists" from the mkdir below
            raise ValueError(f"path {root} is a file; a serving export root is a directory (new, empty or holding "
                             "exports)")
        refused = None
    except (TypeError, ValueError) as e:
        refused = e  # raised by agree below, once the other ranks know (they would wait in it until the timeout)
    root_key = os.path.realpath(root)
    ctx = rank_context(model)
    ctx.agree("export_for_serving", {"path": root_key, "dtype": str(dtype), "incremental": incremental,
                                     "model_name": model_name}, refused)
    shards = find_tables(model)
    local = {name: shard for name, shard in shards.items() if shard.module is not None}
    writing = {name: shard for name, shard in local.items() if _writes(shard, ctx)}
    previous = complete(root, SERVING_FORMAT) if ctx.rank == 0 else {}
    model_id = _model_id(root, model_name, bool(previous)) if ctx.rank == 0 else None
    version = ctx.gather(1 + max((m["version"] for m in previous.values()), default=0))[0]
    parent = None
    if incremental:
        current = {name: _fields(shard.config, dtype) for name, shard in shards.items()}
        parent = incremental_parent(root, root_key, local, STREAM, SERVING_FORMAT, current,
                                    f"serving export {version}")
        parents = ctx.gather(parent)
        parent = parent if all(p == parents[0] for p in parents) else None  # full unless every rank can chain
    name = version_name(version)
    tables = [shard.table for shard in local.values()]
    index = {n: i for i, n in enumerate(sorted({n for names in ctx.gather(sorted(writing)) for n in names}))}
    with write_marks.tick(tables):
        columnar = sorted(n for n, shard in shards.items() if _column_split(shard, ctx))
        payloads, entries = _table_payloads({n: s for n, s in writing.items() if n not in columnar}, parent, dtype,
                                            index, ctx)
        for table in columnar:  # the same order on every rank: each is a collective
            joined = _joined_payload(shards[table], parent, dtype, index[table], ctx)
            if joined is not None:
                payloads.update(joined[0])
                entries.update(joined[1])
        if dense and ctx.rank == 0:
            payloads[DENSE_FILE] = ({k: v.detach().cpu().contiguous() for k, v in dense_state(model).items()
                                     if isinstance(v, torch.Tensor)}, None)

        def manifest_of(parts: list) -> dict:
            files = {**{rel: rec for part in parts for rel, rec in part["files"].items()}, **attached}
            manifest = {
                "format": SERVING_FORMAT, "format_version": FORMAT_VERSION, "model": model_id,
                "version": version, "kind": "delta" if parent else "full", "parent": parent,
                **_parent_lineage(previous, parent), "created_unix": time.time(),
                "tables": _merge_entries(parts, files), "dense": {"file": DENSE_FILE} if dense else None,
                "files": files, **(attach or {}).get("fields", {}),
            }
            return {**manifest, "digest": manifest_digest(manifest)}

        tmp = open_shared(root, name, ctx)
        try:
            attached = _write_attached(tmp, attach) if ctx.rank == 0 else {}
        except BaseException:
            abandon(tmp)
            raise
        commit(ctx, root, name, tmp, payloads, entries, f"exported {root / name}", manifest_of, {"version": version})
        write_marks.record(tables, STREAM, root_key, name)
    return root / name


def _write_attached(directory: Path, attach: dict | None) -> dict:
    """Write ``attach``'s files into the version's staging ``directory``; their manifest file records."""
    records = {}
    for rel, data in ((attach or {}).get("files") or {}).items():
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        records[rel] = record_of(data).to_json()
    return records


def _table_payloads(shards: dict, parent: str | None, dtype: torch.dtype, index: dict, ctx) -> tuple[dict, dict]:
    """This rank's file of every table it writes (keys and values streamed a chunk at a time, in the user's keys)
    and its entry: ``{name: {fields..., "shards": [{"rank", "file", "rows", "deleted", "size"}]}}``."""
    payloads, entries = {}, {}
    for name, shard in shards.items():
        cfg = shard.config
        cols = _served_columns(shard, parent, dtype)
        rel = shard_file(index[name], name, ctx.rank, ctx.world)
        payloads[rel] = (cols, None)
        part = {"rank": ctx.rank, "file": rel, "rows": int(cols[KEYS].numel()),
                "deleted": int(cols[DELETED].numel()) if DELETED in cols else 0, "size": shard.table.size()}
        entries[name] = {**_fields(cfg, dtype), "initializer": resolve_initializer(cfg.initializer).describe(),
                         "seed": shard.seed, "shards": [part]}
    return payloads, entries


def _column_split(shard, ctx) -> bool:
    """Whether ``shard``'s ranks hold column parts of the same rows (joined side by side, not one file each)."""
    strategy = shard.strategy
    return bool(ctx.distributed and strategy is not None and not strategy.replicated
                and any(strategy.column_range(r) not in ((0, 0), (0, shard.config.dim)) for r in range(ctx.world)))


def _joined_payload(shard, parent: str | None, dtype: torch.dtype, i: int, ctx):
    """A column-sharded table gathered to rank 0 and joined by its strategy (column shards side by side) into one
    file: ``(payloads, entries)`` on rank 0, None elsewhere. A collective over every rank."""
    strategy, name = shard.strategy, shard.config.name
    if shard.module is not None and _writes(shard, ctx):
        cols = _served_columns(shard, parent, None)  # encoded once joined (8-bit rows pack whole rows)
    else:
        cfg = shard.config
        cols = {KEYS: torch.empty(0, dtype=cfg.key_dtype), VALUES: torch.empty(0, 0, dtype=cfg.dtype)}
        if parent is not None:
            cols[DELETED] = torch.empty(0, dtype=cfg.key_dtype)
    # (2-D columns travel flat: column shards' widths differ by rank; streamed columns are materialized here)
    gathered = {col: ctx.gather_tensor((t.materialize() if isinstance(t, ColumnStream) else t).reshape(-1),
                                       f"gathering {col} of table {name!r} for serving")
                for col, t in cols.items()}
    sizes = ctx.gather(shard.table.size() if shard.module is not None and _writes(shard, ctx) else 0)
    if ctx.rank != 0:
        return None
    widths = [hi - lo for lo, hi in (strategy.column_range(r) for r in range(ctx.world))]
    cols = strategy.join({r: {col: parts[r].view(-1, widths[r]) if col == VALUES else parts[r]
                              for col, parts in gathered.items()}
                          for r in range(ctx.world) if strategy.writes(r)}, {VALUES})
    cols[VALUES] = _encoded(cols[VALUES], dtype)
    rel = shard_file(i, name, 0, 1)
    part = {"rank": 0, "file": rel, "rows": int(cols[KEYS].numel()),
            "deleted": int(cols[DELETED].numel()) if DELETED in cols else 0,
            "size": strategy.logical_rows([n for r, n in enumerate(sizes) if strategy.writes(r)])}
    entry = {**_fields(shard.config, dtype), "initializer": resolve_initializer(shard.config.initializer).describe(),
             "seed": shard.seed, "shards": [part]}
    return {rel: (cols, None)}, {name: entry}


def _encoded(values, dtype: torch.dtype):
    """``values`` (a tensor or a stream) as served in ``dtype``: cast, or 8-bit rows packed a piece at a time."""
    kind = quantized_kind(dtype)  # 8-bit rows: packed bytes (row_codec)
    if kind is None:
        return values.to(dtype)
    if isinstance(values, ColumnStream):
        rows, dim = values.shape
        return ColumnStream(torch.uint8, (rows, packed_width(kind, dim)),
                            lambda: (encode_rows(p, kind) for p in values.pieces()))
    return encode_rows(values, kind)


def _served_columns(shard, parent: str | None, dtype: torch.dtype | None) -> dict:
    """``keys`` and ``values`` (as served in ``dtype``; None: as stored) of the table's live rows, or of the rows
    written since the last export (with ``deleted_keys``), as streams: no copy of the rows is made, only of one
    chunk at a time."""
    t = shard.table
    rows = deleted = None
    if parent is not None:
        rows, deleted = t.changes_since(write_marks.since(t, STREAM))
    if isinstance(t, TieredTable):
        cols = tiered_columns(shard, state=False) if rows is None else tiered_delta_columns(shard, rows, state=False)
    else:
        n = t.size()
        cols = {KEYS: stream_column([t.row_keys[:n]], rows).map(shard.user_keys),
                VALUES: stream_column([t.values[:n]], rows)}
    if dtype is not None:
        cols[VALUES] = _encoded(cols[VALUES], dtype)
    if deleted is not None:
        cols[DELETED] = shard.user_keys(deleted)
    return cols


def _merge_entries(parts: list, files: dict) -> dict:
    """One entry per table from every rank's: its shards in rank order (with their file's ``algorithm`` and
    ``checksum``), their rows, sizes and deleted keys summed; a table of one file also names it in ``file``,
    ``algorithm`` and ``checksum``."""
    merged: dict = {}
    for part in parts:
        for name, entry in part["entries"].items():
            merged.setdefault(name, {**entry, "shards": []})["shards"].extend(entry["shards"])
    for entry in merged.values():
        shards = sorted(entry["shards"], key=lambda s: s["rank"])
        entry["shards"] = [{**{k: s[k] for k in ("rank", "file", "rows", "deleted")},
                            **{k: v for k, v in files[s["file"]].items() if k != "bytes"}} for s in shards]
        entry.update(rows=sum(s["rows"] for s in shards), deleted=sum(s["deleted"] for s in shards),
                     size=sum(s["size"] for s in shards))
        if len(shards) == 1:  # what readers of one-process exports before per-rank files read
            entry.update({k: v for k, v in entry["shards"][0].items() if k not in ("rank", "rows", "deleted")})
    return merged


def version_name(version: int) -> str:
    """The directory name of export ``version`` in its root: ``version-<n>``."""
    return f"version-{version:08d}"


def _model_id(root: Path, model_name: str | None, has_versions: bool) -> str:
    """The model id ``root`` holds (``root/model.json``), stored there by its first export. A first export goes
    only into a new or empty directory: it writes ``model.json`` and ``latest``, names a user's files may have."""
    file = root / MODEL_FILE
    held = read_json(file) if file.is_file() else {}
    stored = held.get("model") if isinstance(held, dict) else None
    if file.is_file() and (not isinstance(stored, str) or "format" in held):
        # a run directory's model card is model.json too (with "model": "dlrm"): never an export root
        what = "a `dynemb train` run directory's model card" if _is_run_card(held) else \
            "not a serving export's model file"
        raise ValueError(f"{file} is {what}: {root} is not an export root; export to a new or empty directory")
    if stored is None and not has_versions and root.is_dir():
        foreign = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        if foreign:
            raise ValueError(f"path {root} is not empty and holds no serving export ({', '.join(foreign[:5])}"
                             f"{', ...' if len(foreign) > 5 else ''}); export to a new or empty directory")
    if stored is not None:
        if model_name is not None and model_name != stored:
            raise ValueError(f"model_name is {model_name!r} but {root} holds exports of model {stored!r} "
                             f"({file}); export another model to another path")
        return stored
    stored = model_name if model_name is not None else f"{root.name}-{uuid.uuid4().hex[:12]}"
    root.mkdir(parents=True, exist_ok=True)
    write_json(file, {"model": stored}, atomic=True)
    return stored


def is_run_directory(path) -> bool:
    """Whether ``path`` holds a ``dynemb train`` run's model card (its ``model.json``), where an export root keeps
    its model file of the same name."""
    file = Path(path) / MODEL_FILE
    try:
        return file.is_file() and _is_run_card(read_json(file))
    except (OSError, ValueError):
        return False


def _is_run_card(held) -> bool:
    return isinstance(held, dict) and held.get("format") == "dynemb.run"  # job.card.FORMAT (a layer above)


def _parent_lineage(previous: dict, parent: str | None) -> dict:
    """``parent_version`` and ``parent_digest``: of a delta's base, or of the newest export a full one follows."""
    base = previous.get(parent) if parent else max(previous.values(), key=lambda m: m["version"], default=None)
    return {"parent_version": base["version"] if base else None, "parent_digest": base.get("digest") if base else None}


def manifest_digest(manifest: dict) -> str:
    """The sha256 of ``manifest`` (its canonical JSON) without its ``digest`` field: the version's identity, which
    lineage compares (``parent_digest``); it stays sha256 so that digests of versions written before still match.
    It covers the file records, so it changes with any file's checksum."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _fields(cfg, dtype: torch.dtype) -> dict:
    return {"dim": cfg.dim, "dtype": quantized_kind(dtype) or dtype_name(dtype), "key_dtype": dtype_name(cfg.key_dtype)}


def read_export(path) -> tuple[dict, dict]:
    """Read a serving export (its ``latest`` version, or the version directory given) with checksums verified.

    Returns ``(manifest, {table: {"keys": [N], "values": [N, D], "deleted_keys": [K] (deltas)}})``, tables named
    as the user named them and keys in each table's key dtype; ``manifest["path"]`` is the version directory.

    Raises:
        CheckpointError: no export there, a file or the manifest's ``digest`` does not match its checksum.
    """
    directory = resolve(path)
    manifest = _checked_manifest(directory)
    tables = {}
    for name in manifest["tables"]:
        parts = [read_tensors(directory / rel, file_record(manifest, directory, rel))[0]
                 for rel in export_files(manifest, name)]
        tables[name] = parts[0] if len(parts) == 1 else {col: torch.cat([p[col] for p in parts]) for col in parts[0]}
    manifest["path"] = str(directory)
    return manifest, tables


def export_files(manifest: dict, name: str) -> list[str]:
    """The files of table ``name`` of an export's ``manifest``, in rank order: one per rank that wrote a part of
    it (an export from N ranks), or its one ``file``.

    Raises:
        CheckpointError: the entry lists neither a non-empty ``shards`` list of files nor a ``file``.
    """
    entry = manifest["tables"][name]
    shards = entry.get("shards")
    if shards is None:
        files = [entry.get("file")]
    else:
        files = [s.get("file") if isinstance(s, dict) else None for s in shards] if isinstance(shards, list) else []
    if not files or not all(isinstance(f, str) and f for f in files):
        raise CheckpointError(f"{manifest.get('path', 'the export')}: table {name!r} must list its files as "
                              f"'shards' [{{'file': ...}}, ...] or 'file', got shards={shards!r}, "
                              f"file={entry.get('file')!r}")
    return files


def _checked_manifest(directory: Path) -> dict:
    manifest = read_manifest(directory, SERVING_FORMAT)
    if "digest" in manifest and manifest["digest"] != manifest_digest(manifest):
        raise CheckpointError(f"{directory / MANIFEST}: its digest {manifest['digest']!r} does not match its "
                              f"content ({manifest_digest(manifest)!r}); the manifest was changed after it was written")
    return manifest


def read_chain(path) -> list[tuple[dict, dict]]:
    """Read the serving export ``path`` names (its ``latest`` version, or a version directory) with the exports
    it builds on: the last full export and every delta after it up to this one, oldest first, each as
    :func:`read_export` returns it. Replaying them in order (each delta: delete, then upsert) gives the tables
    as of this version.

    Raises:
        CheckpointError: an export of the chain is missing or does not match its checksums.
    """
    return [read_export(directory) for directory, _ in chain(resolve(path), SERVING_FORMAT)]


def read_attached(version_dir, rel: str) -> tuple[dict, bytes]:
    """``(manifest, bytes)`` of file ``rel`` that an export version carries (``export_for_serving(attach=...)``),
    its checksum and the manifest's digest verified.

    Raises:
        CheckpointError: the manifest does not list ``rel``, or a checksum does not match.
    """
    directory = resolve(version_dir)
    manifest = _checked_manifest(directory)
    record = manifest.get("files", {}).get(rel)
    if not isinstance(record, dict) or not (directory / rel).is_file():
        raise CheckpointError(f"{directory}: the export has no file {rel!r} (its manifest lists "
                              f"{sorted(manifest.get('files', {}))})")
    data = (directory / rel).read_bytes()
    verify(directory / rel, file_record(manifest, directory, rel), data=data)
    manifest["path"] = str(directory)
    return manifest, data


def read_dense(version_dir) -> dict | None:
    """The dense state an export version carries (see ``export_for_serving(dense=True)``), checksum verified, or
    ``None`` when it has none.

    Raises:
        CheckpointError: the version's manifest or its dense file does not match its checksums.
    """
    directory = resolve(version_dir)
    manifest = _checked_manifest(directory)
    if not manifest.get("dense"):
        return None
    rel = manifest["dense"]["file"]
    tensors, _ = read_tensors(directory / rel, file_record(manifest, directory, rel))
    return tensors
