"""``save``: write a full or incremental checkpoint of a model (and optimizer) atomically."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path

from torch import nn

from ..collection.plan import TableShard

from .._version import __version__
from ..checks import check_positive_int
from ..table import TieredTable
from . import write_marks
from .background import SaveHandle, fill, side_context, snapshot, wait_for_saves
from .codec import encode
from .commit import commit, open_shared
from .dense import dense_state
from .errors import CheckpointError
from .fsutil import LATEST, TMP_PREFIX, read_pointer, remove_dir
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST, checkpoint_name, complete, read_manifest
from .progress import logger
from .ranks import RankContext, rank_context
from .shard_tensors import canonical_config
from .tables import columns, counters, delta_columns, find_tables, shard_file, table_config

__all__ = ["save", "incremental_parent", "writes"]

DENSE_FILE = "dense.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
#: Rows of row-sharded tables are owned by ``key % world_size`` by default.
PARTITIONER = "mod"
STREAM = "checkpoint"


def optimizer_file(ctx: RankContext) -> str:
    return OPTIMIZER_FILE if not ctx.distributed else f"optimizer.rank-{ctx.rank:05d}-of-{ctx.world:05d}.safetensors"


def save(path, model: nn.Module, optimizer=None, *, step: int, extra=None, incremental: bool = False,
         keep_last: int | None = None, blocking: bool = True) -> Path | SaveHandle:
    """Save every table of ``model`` (with the optimizers it owns), its dense state and ``optimizer``, atomically.

    Writes ``path/step-<step>/`` (one safetensors shard per table per rank, ``dense.safetensors``,
    ``optimizer.safetensors`` and ``manifest.json`` last) through a temp directory that is fsynced and renamed,
    then points ``path/latest`` at it. A crash at any moment leaves ``latest`` at the previous complete checkpoint,
    and the next save in ``path`` removes what the crashed one left (on the same host).

    With ``blocking=False`` the save copies what it writes (a snapshot of the rows, the dense state and the
    optimizer state at this step, in host memory) and returns a :class:`~dynemb.checkpoint.background.SaveHandle`
    while a thread writes the files: training may go on, and the checkpoint equals a blocking save at this step.
    The snapshot costs host memory the size of the files' tensors until they are written. Saves and loads of a
    process run one at a time: the next one waits for a background save still running (a serving export does not).

    Args:
        path: the checkpoint root directory (created if needed).
        model: an ``nn.Module``. Its logical tables are saved by name (see
            :func:`~dynemb.checkpoint.tables.find_tables`): an EmbeddingCollection's tables by their TableConfig
            names, with the state of each table's own optimizer (``TableConfig.optimizer``: step counts and
            hyper-parameters); a standalone Dynamic/StaticEmbedding by its module path. Everything else is saved
            through its state_dict entries.
        optimizer: optional object with ``state_dict()``/``load_state_dict()`` (a torch.optim optimizer for the
            dense part, a dynemb sparse optimizer built by the user); its state must be tensors, numbers, strings,
            None, lists, tuples and dicts. Per-row
            optimizer state lives in table slots and is saved with the tables.
        step: training step (int >= 0); names the directory.
        extra: JSON-serializable user data kept in the manifest.
        incremental: write only the rows changed (and keys deleted) since the previous save or load of these
            tables under ``path``; falls back to a full save (with a warning) when there is none.
        keep_last: keep the ``keep_last`` most recent checkpoints (plus every checkpoint their incremental chains
            need) and delete the others; ``None`` keeps all.
        blocking: ``False`` writes in the background (see above) and returns a handle; under torch.distributed
            every rank gets one, and their ``wait()`` all return or all raise. A full save of a tiered table
            cannot be made in the background (its rows may not fit in memory): ``ValueError``.

    Returns:
        The new checkpoint directory; with ``blocking=False``, a handle whose ``wait()`` returns it.

    Raises:
        TypeError/ValueError: a bad argument, a state that is not serializable, or an existing ``step``.
        CheckpointError: another rank failed to write its part (every rank raises; nothing is published).

    Example:
        >>> import tempfile, torch, dynemb
        >>> from dynemb.checkpoint import save, load
        >>> emb = dynemb.DynamicEmbedding(4, seed=0)
        >>> _ = emb(torch.tensor([1, 2, 3]))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> save(tmp.name, emb, step=7).name
        'step-00000007'
        >>> fresh = dynemb.DynamicEmbedding(4, seed=0)
        >>> load(tmp.name, fresh)["step"], len(fresh)
        (7, 3)
        >>> tmp.cleanup()
    """
    try:
        _check_args(model, optimizer, step, extra, incremental, keep_last, blocking)
        refused = None
    except (TypeError, ValueError) as e:
        if not isinstance(model, nn.Module):
            raise
        refused = e  # raised by agree below, once the other ranks know (they would wait in it until the timeout)
    if refused is None:
        wait_for_saves()
    root = Path(path)
    root_key = os.path.realpath(root)
    ctx = rank_context(model)
    ctx.agree("save", {"path": root_key, "step": step, "incremental": incremental, "keep_last": keep_last,
                       "blocking": blocking}, refused)
    _check_root(root, ctx)
    every = find_tables(model)
    local = {name: shard for name, shard in every.items() if shard.module is not None}
    embeddings = {name: shard for name, shard in local.items() if writes(shard, ctx)}
    tables = [shard.table for shard in local.values()]  # replicas tick too, so they stay identical
    index = {n: i for i, n in enumerate(sorted({n for names in ctx.gather(sorted(embeddings)) for n in names}))}
    parent = None
    if incremental:
        current = {name: {"config": table_config(shard)} for name, shard in embeddings.items()}
        parent = incremental_parent(root, root_key, embeddings, STREAM, FORMAT, current, f"save of step {step}")
        parents = ctx.gather(parent)
        parent = parent if all(p == parents[0] for p in parents) else None  # full unless every rank can chain
    if not blocking and parent is None:
        _refuse_tiered_in_background(embeddings, ctx)
    name, created = checkpoint_name(step), time.time()
    with write_marks.tick(tables):
        payloads, entries = _table_payloads(embeddings, parent, index, ctx)
        if ctx.rank == 0:
            payloads[DENSE_FILE] = encode(dense_state(model), "the model's dense state")
        if optimizer is not None:
            payloads[optimizer_file(ctx)] = encode(optimizer.state_dict(), "optimizer.state_dict()")
        if not blocking:
            payloads = snapshot(payloads)  # laid out as the files; filled below, once the writing thread runs
            entries, extra = json.loads(json.dumps(entries)), json.loads(json.dumps(extra))  # and the caller's dicts

        # what training looked up so far, gathered now (a collective over the main group, and a background
        # save must record this step's counts, not later ones)
        observed = ctx.gather({n: _observed(shard) for n, shard in every.items()})

        def manifest_of(parts: list) -> dict:
            return {
                "format": FORMAT, "format_version": FORMAT_VERSION, "kind": "incremental" if parent else "full",
                "parent": parent, "step": step, "created_unix": created, "dynemb_version": __version__,
                "world_size": ctx.world, "partitioner": PARTITIONER,
                "tables": _with_observed(_merge_entries(parts), [{"observed": o} for o in observed], every),
                "dense": DENSE_FILE, "optimizer": _optimizer_entry(optimizer, ctx),
                "files": {rel: rec for part in parts for rel, rec in part["files"].items()}, "extra": extra,
            }

        after = (lambda: _prune(root, keep_last, name)) if keep_last is not None else None
        side = side_context(ctx) if not blocking else ctx
        tmp = open_shared(root, name, ctx)

        def write(over: RankContext) -> Path:
            return commit(over, root, name, tmp, payloads, entries, f"saved {root / name}", manifest_of,
                          {"step": step}, after)

        if blocking:
            write(ctx)
        else:
            handle = SaveHandle(root / name, lambda: write(side))
            _fill(payloads, handle)  # the rows of this step: training may change the tables from here on
        # A background save that fails leaves these marks naming a directory that never appears: the next
        # incremental save finds no readable parent there and writes a full checkpoint.
        write_marks.record(tables, STREAM, root_key, name)
    return handle if not blocking else root / name


def _fill(images: dict, handle: SaveHandle) -> None:
    """Copy this step's rows into the snapshot while ``handle``'s thread writes what is copied; if the copy fails,
    the thread fails too (nothing is published) and the error is raised here once it has cleaned up."""
    try:
        fill(images)
    except BaseException:
        with contextlib.suppress(Exception):  # its error is this one's consequence
            handle.wait()
        raise


def _refuse_tiered_in_background(embeddings: dict, ctx: RankContext) -> None:
    """A full background save of a tiered table is refused on every rank (its snapshot could exceed memory)."""
    tiered = sorted(name for name, shard in embeddings.items() if isinstance(shard.table, TieredTable))
    tiered = sorted({n for names in ctx.gather(tiered) for n in names})
    if tiered:
        raise ValueError(f"blocking=False: a full save of the tiered table(s) {tiered} cannot run in the background "
                         "(it copies every row it writes into memory, and a tiered table's rows may not fit); "
                         "save with blocking=True, or in the background incrementally once a full save exists")


def _optimizer_entry(optimizer, ctx: RankContext):
    if optimizer is None:
        return None
    if not ctx.distributed:
        return OPTIMIZER_FILE
    return [optimizer_file(RankContext(rank, ctx.world)) for rank in range(ctx.world)]


def _merge_entries(parts: list) -> dict:
    """One manifest entry per table with the shards of every rank, in rank order."""
    merged: dict = {}
    for part in parts:
        for name, entry in part["entries"].items():
            merged.setdefault(name, {**entry, "shards": []})["shards"].extend(entry["shards"])
    for entry in merged.values():
        entry["shards"].sort(key=lambda shard: shard["rank"])
    return merged


def _observed(shard: TableShard) -> list:
    """``[ids, unique ids, steps]`` this rank's training looked up in the table (with what a loaded checkpoint had
    seen, kept by rank 0)."""
    seen, before = shard.observed, shard.observed_before or {}
    return [int(seen["accesses"] + before.get("accesses", 0)),
            int(seen["unique_accesses"] + before.get("unique_accesses", 0)),
            int(seen["steps"] + before.get("steps", 0))]


def _with_observed(tables: dict, parts: list, shards: dict) -> dict:
    """Each table's entry with ``observed``: its rows (all ranks together, as its layout counts them), and the ids,
    unique ids (sharded collections) and steps training looked up, for the planner (:mod:`dynemb.distributed.
    planner`; ``dynemb plan --checkpoint``)."""
    for name, entry in tables.items():
        rows = [s["rows"] for s in entry["shards"]]
        strategy = shards[name].strategy if name in shards else None
        seen = [p["observed"].get(name, [0, 0, 0]) for p in parts]
        entry["observed"] = {"rows": strategy.logical_rows(rows) if strategy is not None else int(sum(rows)),
                             "accesses": sum(s[0] for s in seen), "unique_accesses": sum(s[1] for s in seen),
                             "steps": max(s[2] for s in seen)}
    return tables


def writes(shard: TableShard, ctx: RankContext) -> bool:
    """Whether this rank writes ``shard``: its own part of a sharded table, or rank 0 the one copy of a whole or
    replicated table."""
    if shard.strategy is None:
        return ctx.rank == 0
    return shard.strategy.writes(ctx.rank)


def _table_payloads(shards: dict, parent: str | None, index: dict, ctx: RankContext) -> tuple[dict, dict]:
    """Shard tensors (views of the live rows, or a delta against ``parent``) and manifest entries per table."""
    payloads, entries = {}, {}
    for name, shard in shards.items():
        rel = shard_file(index[name], name, ctx.rank, ctx.world)
        t = shard.table
        cols = columns(shard) if parent is None else delta_columns(shard, write_marks.since(t, STREAM))
        payloads[rel] = (cols, None)
        entry = {"rank": ctx.rank, "file": rel, "rows": t.size(), "counters": counters(t),
                 "sharding": shard.describe_sharding()}
        if shard.optimizer is not None:
            entry["optimizer"] = shard.optimizer.state_dict()
        if parent is not None:
            entry.update(changed_rows=int(cols["keys"].numel()), deleted=int(cols["deleted_keys"].numel()))
        entries[name] = {"config": table_config(shard), "shards": [entry]}
    return payloads, entries


def incremental_parent(root: Path, root_key: str, embeddings: dict[str, TableShard], stream: str, fmt: str,
                       current: dict, what: str) -> str | None:
    """The directory an incremental write can build on, or None (the reason logged) to write a full one.

    ``current`` maps each table name to the manifest fields that must equal the parent's (configs, dtypes).
    """
    parent = write_marks.parent([shard.table for shard in embeddings.values()], stream, root_key)
    reason = None
    if parent is None:
        reason = "these tables were not written to (or loaded from) this path before"
    else:
        try:
            saved = read_manifest(root / parent, fmt)["tables"]
        except CheckpointError as e:
            saved, reason = {}, f"its parent is unreadable ({e})"
        fields = {name: _canonical({k: entry.get(k) for k in current.get(name, {})}) for name, entry in saved.items()}
        if reason is None and fields != current:
            reason = f"the tables or their configs (e.g. slots, dtype) changed since {parent}"
    if reason is not None:
        logger.warning("incremental %s: %s; writing a full one", what, reason)
    return parent if reason is None else None


def _canonical(fields: dict) -> dict:
    """Saved manifest fields of a table (its ``config``, or an export's dtypes) as this dynemb writes them: older
    manifests spelled dtypes and initializers otherwise."""
    return {k: canonical_config(v) if k == "config" else v for k, v in canonical_config(fields).items()}


def _prune(root: Path, keep_last: int, current: str) -> None:
    """Delete all but the ``keep_last`` most recent checkpoints and what their chains need, and stale temp files."""
    try:
        manifests = complete(root)
    except CheckpointError as e:
        logger.warning("not pruning %s: %s", root, e)
        return
    created = {name: (m.get("created_unix", 0.0), m.get("step", -1)) for name, m in manifests.items()}
    recent = sorted(manifests, key=created.__getitem__, reverse=True)
    needed: set[str] = set()
    for name in [current, *recent[:keep_last]]:
        while name in manifests and name not in needed:
            needed.add(name)
            name = manifests[name].get("parent")
    for name in sorted(set(manifests) - needed):
        remove_dir(root / name)
    # Leftovers of crashed writes are older than every checkpoint kept; newer ones may belong to a live writer.
    oldest = min(created[n][0] for n in needed)
    for stale in root.glob(TMP_PREFIX + "*"):
        if stale.stat().st_mtime >= oldest:
            continue
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()


def _check_root(root: Path, ctx: RankContext) -> None:
    """Refuse a ``path`` that is a file, or a directory of the user's that holds no checkpoint: a save writes
    ``latest`` there (it replaced a user's file of that name), and mixes step directories into the user's files.
    Every rank raises when any rank's path is refused (ranks may see different file systems)."""
    try:
        problem = _root_problem(root)
    except OSError as e:  # this rank cannot read the root: every rank hears of it (not its peers' gather at timeout)
        problem = f"path {root} cannot be read here ({e})"
    found = ctx.first_problem(problem)
    if found:
        raise ValueError(found[1])


def _root_problem(root: Path) -> str | None:
    """Why ``root`` cannot take a checkpoint, or None (see :func:`_check_root`)."""
    problem = None
    if root.exists() and not root.is_dir():
        problem = f"path {root} is a file; a checkpoint root is a directory (new, empty or holding checkpoints)"
    elif root.is_dir():
        names = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        if LATEST in names and not (root / LATEST).is_file():
            problem = f"{root / LATEST} is not a checkpoint pointer (a directory); save into another directory"
        elif LATEST in names:
            try:
                read_pointer(root)
            except CheckpointError as e:
                problem = (f"{root / LATEST} is not a checkpoint pointer ({e}); {root} holds no checkpoint: save "
                           "into a new or empty directory")
        elif names and not any((root / name / MANIFEST).is_file() for name in names):
            problem = (f"path {root} is not empty and holds no checkpoint ({', '.join(names[:5])}"
                       f"{', ...' if len(names) > 5 else ''}); save into a new or empty directory")
    return problem


def _check_args(model, optimizer, step, extra, incremental, keep_last, blocking) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not (callable(getattr(optimizer, "state_dict", None))
                                      and callable(getattr(optimizer, "load_state_dict", None))):
        raise TypeError(f"optimizer must have state_dict() and load_state_dict(), got {type(optimizer).__name__}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(incremental, bool):
        raise TypeError(f"incremental must be a bool, got {incremental!r}")
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, got {blocking!r}")
    check_positive_int(keep_last, "keep_last", allow_none=True)
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra must be JSON-serializable (dicts with str keys, lists, str, finite numbers, bool, "
                        f"None), got {type(extra).__name__}: {e}") from None

