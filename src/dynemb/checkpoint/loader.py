"""``load``: verify a checkpoint (and its incremental chain) completely, then restore the model from it."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from torch import nn

from ..collection import EmbeddingCollection
from ..distributed.strategy import strategy_from_record
from ..optim.combined import CombinedOptimizer
from ..table import TieredTable
from . import write_marks
from .background import wait_for_saves
from .codec import read_state
from .shard_tensors import ADMISSION_COUNTS, ADMISSION_KEYS, KEYS, SLOT, VALUES, canonical_config, check_shard
from .dense import check_dense, load_dense, wrapper_free
from .errors import CheckpointError
from .manifest import MANIFEST, chain, file_record, resolve
from .progress import logger, transfer
from .ranks import RankContext, merge_states, rank_context
from .saver import STREAM
from .tiered_stream import StreamedShard, stream_into, verify_sources
from .tables import apply_delta, find_tables, restore, table_config, table_rows
from .tensorfile import read_tensors

__all__ = ["load"]

_ALWAYS_MATCH = ("dim", "dtype", "key_dtype", "vocabulary_size")
_STRICT_MATCH = ("eviction", "half_life")  # scores mean something else under another policy or half-life


def load(path, model: nn.Module, optimizer=None, strict: bool = True) -> dict:
    """Restore ``model`` (and ``optimizer``) from a checkpoint written by :func:`~dynemb.checkpoint.save`.

    Every file is read and its checksum checked, and every config compared, before anything in the model changes;
    tables are then *replaced* (not merged) with the saved rows, in the saved row order, with their counters,
    clock and seed, so training continues bit-identically. An incremental checkpoint is applied on top of its
    full checkpoint and the deltas between.

    Args:
        path: a checkpoint root (its ``latest`` pointer is followed) or one checkpoint directory.
        model: the model to restore; its tables are matched to saved tables by name (a collection's tables by
            their TableConfig names, a standalone embedding by module path), whatever layout either side used, and
            each table's own optimizer (``TableConfig.optimizer``) is restored with it.
        optimizer: restored with ``load_state_dict`` from the saved optimizer state.
        strict: require the same tables, slots and eviction policies, the same dense state_dict keys, and saved
            state for every optimizer the model owns and for ``optimizer`` when given. When False, a table absent
            on either side is skipped (each one named in a warning); the rows of a table on both sides are always
            loaded. Dim, dtype, key dtype and vocabulary size must match in any case.

    Returns:
        The manifest of the loaded checkpoint (``step``, ``extra``, table configs, ...), plus ``path``.

    Raises:
        CheckpointError: (a ValueError) a checksum mismatch, a missing file, or a config that does not match;
            the message names the file and the field.

    Example:
        >>> import tempfile, torch, dynemb
        >>> from dynemb.checkpoint import load, save
        >>> tmp, emb = tempfile.TemporaryDirectory(), dynemb.DynamicEmbedding(2, seed=0)
        >>> _ = emb(torch.tensor([5, -1]))
        >>> _ = save(tmp.name, emb, step=1, extra={"epoch": 3})
        >>> fresh = dynemb.DynamicEmbedding(2, seed=1)
        >>> load(tmp.name, fresh)["extra"], fresh.contains(torch.tensor([5, -1])).tolist()
        ({'epoch': 3}, [True, True])
        >>> tmp.cleanup()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    wait_for_saves()  # a background save still writing may be the checkpoint asked for
    ctx = rank_context(model)
    tables = find_tables(model)
    sharded = any(isinstance(m, EmbeddingCollection) and m.sharded for m in model.modules())
    try:
        directory = resolve(path)
        links = chain(directory)
        failed = None
    except CheckpointError as e:
        if not sharded:
            raise
        failed = e
    if sharded:  # a rank that cannot read its checkpoint fails every rank now, not its peers' check below at timeout
        _raise_any(ctx, failed)
    for _, saved in links:  # tables an older version named through a wrapper (``_orig_mod.emb``): the model's names
        saved["tables"] = {_model_name(k, tables, saved["tables"]): v for k, v in saved.get("tables", {}).items()}
    manifest = links[-1][1]
    if sharded:
        # every rank loads one checkpoint (each reads its part of it): a rank that named another, or another
        # step through ``latest``, would hold rows its peers' dense state and tables never saw
        ctx.agree("load", {"checkpoint": os.path.realpath(directory), "step": manifest.get("step"),
                           "strict": strict})
    failed = None  # a sharded model: an error of this rank, raised on every rank before any changes
    try:
        names = _matching_tables(manifest, directory, tables, strict)
        plan = {name: _sources(links, name, tables[name], ctx) for name in names}
        table_optimizers = {name: _optimizer_state(manifest, directory, name, tables[name], plan[name][0], strict, ctx)
                            for name in names}
        dense_file = _state_file(manifest, directory, "dense")
        opt_files = _optimizer_files(manifest, directory, optimizer, strict, ctx)
        total = sum(record.bytes for sources, _ in plan.values() for steps in sources.values()
                    for _, _, record, _ in steps)
        total += sum(record.bytes for _, record in [dense_file, *opt_files])
    except (CheckpointError, OSError) as e:
        if not sharded:
            raise
        failed, total = e, 0
    with transfer(f"loaded {directory}", total) as progress:
        if failed is None:
            try:
                configs = {name: manifest["tables"][name]["config"] for name in plan}
                shards = {name: _read_sources(sources, reshard, configs[name], tables[name], progress)
                          for name, (sources, reshard) in plan.items()}
                _check_capacity(shards, tables, manifest, directory, ctx)
                dense = check_dense(model, read_state(*dense_file, progress), strict, dense_file[0])
                opt_state = merge_states([read_state(*f, progress) for f in opt_files]) if opt_files else None
            except (CheckpointError, OSError) as e:
                if not sharded:
                    raise
                failed = e
        if sharded:  # a rank that raised alone left its peers' models loaded and theirs not: ranks out of step
            _raise_any(ctx, failed)
        # Everything is read and checked: from here on the model changes.
        if opt_state is not None:  # a collection's optimizer skips tables added since, as the tables do, unless strict
            load_kwargs = {"strict": strict} if isinstance(optimizer, CombinedOptimizer) else {}
            optimizer.load_state_dict(opt_state, **load_kwargs)
        load_dense(model, dense)
        for name, (cols, saved_counters) in shards.items():
            saved = {**saved_counters, "seed": configs[name]["seed"]}
            if isinstance(cols, StreamedShard):  # read again, a chunk at a time, into the tiers
                restore(tables[name], cols.admission, saved, stream_into(cols, tables[name], table_rows))
            else:
                restore(tables[name], cols, saved)
            if table_optimizers[name] is not None:
                tables[name].optimizer.load_state_dict(table_optimizers[name])
        for name, shard in tables.items():  # what training had looked up, counted on (by rank 0) from here
            seen = manifest["tables"].get(name, {}).get("observed")
            if isinstance(seen, dict):
                shard.observed_before = {k: seen.get(k, 0) for k in ("accesses", "unique_accesses", "steps")} \
                    if ctx.rank == 0 else None
    write_marks.record([tables[n].table for n in shards], STREAM, os.path.realpath(directory.parent),
                   directory.name, reset=True)
    return {**manifest, "path": str(directory)}


def _check_capacity(shards: dict, tables: dict, manifest: dict, directory: Path, ctx) -> None:
    """Each table's rows read on this rank fit its ``max_capacity`` (a tiered table is unbounded)."""
    for name, (cols, _) in shards.items():
        if isinstance(cols, StreamedShard):
            continue  # a tiered table: unbounded
        rows, capacity = cols[KEYS].numel(), tables[name].config.max_capacity
        if capacity is not None and rows > capacity:
            share = (f" (this rank's share on {ctx.world} ranks, saved by {manifest.get('world_size') or 1})"
                     if ctx.world > 1 or (manifest.get("world_size") or 1) > 1 else "")
            raise CheckpointError(f"{directory}: table {name!r}: {rows} rows{share} do not fit max_capacity="
                                  f"{capacity} of the model's table, which bounds the rows one rank holds: "
                                  "raise max_capacity, or load on more ranks")


def _raise_any(ctx, failed: Exception | None) -> None:
    """Raise on every rank when any rank failed (``failed``: this rank's error): a CheckpointError naming the first
    rank that failed and its error."""
    found = ctx.first_problem(None if failed is None else f"{type(failed).__name__}: {failed}")
    if found:
        rank, problem = found
        raise CheckpointError(f"load: rank {rank} could not read the checkpoint it was given ({problem}); "
                              "every rank loads one checkpoint, and no rank changed") from failed


def _model_name(name: str, tables: dict, saved: dict) -> str:
    bare = wrapper_free(name, tables)
    return bare if bare == name or bare not in saved else name


def _matching_tables(manifest: dict, directory: Path, tables: dict, strict: bool) -> list[str]:
    """Names of the tables to load on this rank, after comparing configs with the model's."""
    file = directory / MANIFEST
    saved = manifest.get("tables", {})
    only_saved, only_model = sorted(set(saved) - set(tables)), sorted(set(tables) - set(saved))
    if only_saved or only_model:
        parts = ([f"tables only in the checkpoint (not loaded): {only_saved}"] if only_saved else []) + \
            ([f"tables only in the model (they keep their current rows): {only_model}"] if only_model else [])
        message = f"{file}: " + "; ".join(parts)
        if strict:
            raise CheckpointError(message + " (strict=True)")
        warnings.warn(message, stacklevel=3)
    names = [n for n, shard in tables.items() if n in saved and shard.module is not None]
    for name in names:
        _check_config(saved[name], tables[name], directory, name, strict)
    return names


def _check_config(saved: dict, shard, directory: Path, name: str, strict: bool) -> None:
    config, mine = canonical_config(saved["config"]), table_config(shard)
    where = f"{directory / saved['shards'][0]['file']}: table {name!r}"
    fields = _ALWAYS_MATCH + (_STRICT_MATCH if strict else ())
    for field in fields:
        if config.get(field) != mine.get(field):
            raise CheckpointError(f"{where}: {field} is {config.get(field)!r} in the checkpoint but "
                                  f"{mine.get(field)!r} in the model")
    if config.get("initializer") != mine["initializer"]:
        # The seed is restored from the checkpoint, the initializer cannot be: new keys will start differently.
        logger.warning("%s: initializer %s in the checkpoint, %s in the model; new keys use the model's", where,
                       config.get("initializer"), mine["initializer"])
    slots, my_slots = config.get("slots", {}), mine["slots"]
    for slot in sorted(set(slots) | set(my_slots)):
        if slot in slots and slot in my_slots and slots[slot] != my_slots[slot]:
            raise CheckpointError(f"{where}: slot {slot!r} is {slots[slot]} in the checkpoint but {my_slots[slot]} "
                                  "in the model")
        if (slot in slots) != (slot in my_slots):
            message = f"{where}: slot {slot!r} is only in the {'checkpoint' if slot in slots else 'model'}"
            if strict:
                raise CheckpointError(message + " (strict=True; create the optimizer before loading)")
            logger.warning("%s; %s", message, "skipped" if slot in slots else "it starts at its initial value")


def _sources(links: list, name: str, shard, ctx: RankContext) -> tuple[dict, bool]:
    """``({saved rank: steps}, reshard)`` for one table: each step is ``(path, is_delta, record, shard entry)``,
    oldest first, and every file is checked to exist before any is read.

    With the same world size and sharding, a rank reads only its own shard (exact resume); otherwise it reads every
    saved rank's shard and keeps the rows it owns now (``reshard``).
    """
    last_dir, last = links[-1]
    shards = last["tables"][name].get("shards", [])
    ranks = [s.get("rank") for s in shards]
    world = last.get("world_size")
    if not isinstance(world, int) or world < 1 or sorted(ranks) != ranks or not set(ranks) <= set(range(world)):
        raise CheckpointError(f"{last_dir / MANIFEST}: table {name!r} lists shards of ranks {ranks} for "
                              f"world_size={world!r}")
    mine = [s for s in shards if s["rank"] == ctx.rank]
    if world == ctx.world and mine and mine[0].get("sharding") == shard.describe_sharding():
        wanted, reshard = [ctx.rank], False
    elif ranks == [0] and (shard.strategy is None or shard.strategy.replicated):
        wanted, reshard = [0], False  # one copy of a replicated (or whole) table
    else:
        wanted, reshard = ranks, True
    sources = {}
    for rank in wanted:
        steps = []
        for directory, manifest in links:
            entry = manifest.get("tables", {}).get(name)
            if entry is None:
                raise CheckpointError(f"{directory / MANIFEST}: table {name!r} is missing from this checkpoint of "
                                      "the chain")
            record = next((s for s in entry.get("shards", []) if s.get("rank") == rank), None)
            if record is None:
                raise CheckpointError(f"{directory / MANIFEST}: table {name!r} has no shard of rank {rank}")
            rel = record["file"]
            if not (directory / rel).is_file():
                raise CheckpointError(f"{directory / rel}: shard file of table {name!r} rank {rank} is missing")
            steps.append((directory / rel, manifest["kind"] != "full", file_record(manifest, directory, rel),
                          {**record, "world_size": manifest.get("world_size")}))
        sources[rank] = steps
    return sources, reshard


def _optimizer_state(manifest: dict, directory: Path, name: str, shard, sources: dict, strict: bool,
                     ctx: RankContext):
    """The saved state of the table's own optimizer (this rank's shard's, else the first saved one's), or None."""
    if shard.optimizer is None:
        return None
    entries = manifest["tables"][name].get("shards", [])
    saved = [e["optimizer"] for e in entries if isinstance(e.get("optimizer"), dict)]
    own = [e["optimizer"] for e in entries if e.get("rank") in sources and isinstance(e.get("optimizer"), dict)]
    if saved:
        return own[0] if own else saved[0]
    message = f"{directory / MANIFEST}: table {name!r} has no saved state of its optimizer {shard.optimizer!r}"
    if strict:
        raise CheckpointError(message + " (strict=True; a checkpoint of the tables alone loads with strict=False)")
    logger.warning("%s; it starts fresh", message)
    return None


def _read_sources(sources: dict, reshard: bool, config: dict, shard, progress):
    """``(columns, counters)`` of this rank's part of the table; for a tiered table (any chain of files),
    a :class:`~dynemb.checkpoint.tiered_stream.StreamedShard` (files verified, rows not read) instead of columns."""
    if isinstance(shard.table, TieredTable):
        streamed = verify_sources(sources, reshard, config, progress)
        if reshard and streamed.admission:
            pending = shard.owned(streamed.admission[ADMISSION_KEYS]).nonzero().squeeze(1)
            streamed = streamed._replace(admission={k: t.index_select(0, pending)
                                                    for k, t in streamed.admission.items()})
        return streamed, _counters(sources, reshard, None)
    # the saved layout's strategy reads its parts (a column shard's file holds its columns) and joins them; the
    # current one keeps this rank's rows and columns of the whole
    saved = _saved_strategy(sources, shard)
    parts = {rank: _read_shard(steps, saved.part_config(config, rank), progress) for rank, steps in sources.items()}
    if not reshard:
        return next(iter(parts.values())), _counters(sources, reshard, None)
    columnar = {VALUES} | {SLOT + n for n, s in config.get("slots", {}).items() if s["dim"] == config["dim"]}
    admission = {}
    if all(ADMISSION_KEYS in p for p in parts.values()):
        pending = saved.join({r: {KEYS: p.pop(ADMISSION_KEYS), ADMISSION_COUNTS: p.pop(ADMISSION_COUNTS)}
                              for r, p in parts.items()}, set())
        admission = _select(shard, pending, set())
        admission = {ADMISSION_KEYS: admission[KEYS], ADMISSION_COUNTS: admission[ADMISSION_COUNTS]}
    cols = _select(shard, saved.join(parts, columnar), columnar)
    return {**cols, **admission}, _counters(sources, reshard, int(cols[KEYS].numel()))


def _saved_strategy(sources: dict, shard):
    """The strategy of the layout the table was saved in (from its shard records)."""
    record = next(iter(sources.values()))[-1][3]
    return strategy_from_record(record.get("sharding"), shard.config, None, record.get("world_size") or 1)


def _select(shard, cols: dict, columnar: set) -> dict:
    """This rank's part of the whole table's ``cols`` (the whole of it without sharding)."""
    return shard.strategy.select(cols, columnar) if shard.strategy is not None else cols


def _counters(sources: dict, reshard: bool, kept: int | None) -> dict:
    """The counters to restore: the saved ones, or when resharding the largest clock/epoch/init calls of the saved
    ranks (``kept`` rows inserted; when None, the count the table's load leaves)."""
    saved = [steps[-1][3]["counters"] for steps in sources.values()]
    if not reshard:
        return saved[0]
    clocks = [key for key in ("clock", "save_ticks", "epoch", "_init_calls") if key in saved[0]]
    merged = {key: max(c[key] for c in saved) for key in clocks}
    return {**merged, **({} if kept is None else {"inserted": kept, "removed": 0, "evicted": 0})}


def _read_shard(steps: list, config: dict, progress) -> dict:
    cols = None
    for file, is_delta, record, entry in steps:
        tensors, _ = read_tensors(file, record, progress)
        check_shard(tensors, config, file, delta=is_delta)
        cols = tensors if cols is None else apply_delta(cols, tensors, file)
        if cols[KEYS].numel() != entry["rows"]:
            raise CheckpointError(f"{file}: the table has {cols[KEYS].numel()} rows here, the manifest says "
                                  f"{entry['rows']}")
    return cols


def _state_file(manifest: dict, directory: Path, field: str) -> tuple:
    rel = manifest.get(field)
    if not isinstance(rel, str):
        raise CheckpointError(f"{directory / MANIFEST}: {field!r} must name a file, got {rel!r}")
    if not (directory / rel).is_file():
        raise CheckpointError(f"{directory / rel}: {field} state file is missing")
    return directory / rel, file_record(manifest, directory, rel)


def _optimizer_files(manifest: dict, directory: Path, optimizer, strict: bool, ctx: RankContext) -> list:
    """The optimizer state files to read: this rank's own (same world size), or every rank's, to merge."""
    if optimizer is None:
        return []
    if not callable(getattr(optimizer, "load_state_dict", None)):
        raise TypeError(f"optimizer must have load_state_dict(), got {type(optimizer).__name__}")
    entry = manifest.get("optimizer")
    if isinstance(entry, list):
        wanted = [entry[ctx.rank]] if len(entry) == ctx.world else entry
        return [_state_file({**manifest, "optimizer": rel}, directory, "optimizer") for rel in wanted]
    if entry is not None:
        return [_state_file(manifest, directory, "optimizer")]
    message = f"{directory / MANIFEST}: no optimizer state was saved, but an optimizer was given"
    if strict:
        raise CheckpointError(message + " (strict=True)")
    logger.warning("%s; the optimizer is left as it is", message)
    return []
