"""How the user's logical tables become shard tensors, and shard tensors become tables again.

Tables are found by :func:`find_tables`: the tables of every :class:`~dynemb.EmbeddingCollection` by their
``TableConfig`` name, and every standalone Dynamic/StaticEmbedding by its module path. Nothing of the layout
(grouping, sharding, world size) appears in a name or a key: keys are the user's keys.

A shard is a dict of *columns* named as in the files: ``keys [N]``, ``values [N, D]``, ``scores [N]`` and
``slot.<name> [N, d]``, row-aligned; a delta shard adds ``deleted_keys [K]`` and, when rows were deleted,
``order [N']``, the key of every live row in row order. A table with admission adds the pending candidates'
``admission.keys [M]`` and ``admission.counts [M]`` (whole in every file, full or delta). The names, and
:func:`~.shard_tensors.check_shard`, are in :mod:`.shard_tensors`.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..collection import EmbeddingCollection
from ..collection.plan import TableShard, whole_table
from ..embedding import DynamicEmbedding, StaticEmbedding
from ..serialization import dtype_name
from ..table import Rows, TieredTable
from ..table.ops import gather_rows
from .shard_tensors import ADMISSION_COUNTS, ADMISSION_KEYS, DELETED, KEYS, ORDER, SCORES, SLOT, VALUES
from .dense import unwrap
from .errors import CheckpointError
from .tiered_stream import tiered_columns, tiered_delta_columns

__all__ = ["find_tables", "table_config", "counters", "columns", "delta_columns", "apply_delta", "restore",
           "shard_file", "ROOT_NAME", "COUNTERS"]

#: Table name used when the model itself is a DynamicEmbedding (its module name is empty).
ROOT_NAME = "embedding"
#: Table counters a bit-exact resume needs (the ones a table has).
COUNTERS = ("clock", "save_ticks", "epoch", "inserted", "removed", "evicted", "_init_calls")


def find_tables(model: nn.Module) -> dict[str, TableShard]:
    """Every logical table of ``model`` on this rank, by name: each collection's tables by their config names,
    and each standalone Dynamic/StaticEmbedding by its module path (``"embedding"`` for the model itself), the
    path without wrappers (``torch.compile``, DistributedDataParallel: ``emb``, never ``_orig_mod.emb``).

    Raises:
        TypeError: ``model`` is not a module.
        ValueError: two tables have the same name (say, two collections with a table ``"user"``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found: dict[str, TableShard] = {}
    where: dict[str, str] = {}
    for path, module in _table_modules(model):
        if isinstance(module, EmbeddingCollection):
            tables = module.logical_tables()
        elif isinstance(module, (DynamicEmbedding, StaticEmbedding)):
            tables = {path or ROOT_NAME: whole_table(path or ROOT_NAME, module)}
        else:
            continue
        for name, shard in tables.items():
            if name in found:
                raise ValueError(f"two tables are named {name!r} (in {where[name] or 'the model'} and in "
                                 f"{path or 'the model'}); table names must be unique within a model")
            found[name], where[name] = shard, path
    return found


def _table_modules(module: nn.Module, path: str = "", seen: set | None = None):
    """``(path, module)`` of ``module`` and every submodule once (as ``named_modules``), through wrappers
    (:func:`~.dense.unwrap`: a compiled or DistributedDataParallel model names its tables as the plain model
    does), not into tables."""
    seen = set() if seen is None else seen
    module = unwrap(module)
    if id(module) in seen:
        return
    seen.add(id(module))
    yield path, module
    if isinstance(module, (EmbeddingCollection, DynamicEmbedding, StaticEmbedding)):
        return
    for name, child in module._modules.items():
        if child is not None:
            yield from _table_modules(child, f"{path}.{name}" if path else name, seen)


def shard_file(index: int, name: str, rank: int, world_size: int, suffix: str = "") -> str:
    """Relative path of one table's shard; the index keeps names unique after unsafe characters are replaced."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return f"tables/{index:03d}-{safe}{suffix}.rank-{rank:05d}-of-{world_size:05d}.safetensors"


def table_config(shard: TableShard) -> dict:
    """The table's config as saved: dim, dtypes, vocabulary, policy, initializer, seed, slots, admission.

    Dtypes are named by :func:`~dynemb.serialization.dtype_name`, the initializer and admission filter are their
    ``describe()`` records (``to_dict()``; a callable initializer by name)."""
    cfg, t = shard.config, shard.table
    # a slot's width in the user's table (a column shard holds its columns of a per-column slot): the optimizer's
    # own slots by its widths at the table's dim, any other by whether it spans the shard's columns
    opt = shard.optimizer
    logical = {opt.slot_key(n): w for n, (w, _) in opt.slot_widths(cfg.dim).items()} if opt is not None else {}
    config = {"dim": cfg.dim, "key_dtype": dtype_name(cfg.key_dtype), "dtype": dtype_name(t.dtype),  # .half() casts
              "vocabulary_size": cfg.vocabulary_size, "max_capacity": cfg.max_capacity,
              "eviction": t.policy.value if cfg.vocabulary_size is None else None,
              "initializer": t.initializer.describe(), "seed": shard.seed,
              "slots": {n: {"dim": logical.get(n) or _slot_width(t.slot(n).shape[1], t.dim, cfg.dim),
                            "dtype": dtype_name(t.slot(n).dtype)} for n in t.slot_names}}
    if getattr(t, "admission", None) is not None:
        config["admission"] = t.admission.describe()
    if config["eviction"] == "decayed_lfu":  # its scores are in units of the half-life
        config["half_life"] = t.half_life
    return config


def _slot_width(width: int, shard_dim: int, dim: int) -> int:
    """A slot's width in the user's table: a column shard's per-column slot spans the whole dim there."""
    return dim if width == shard_dim else width


def counters(table) -> dict:
    """The table counters a bit-exact resume needs (clock, epoch, insert/remove/evict counts, init calls)."""
    return {k: int(getattr(table, k)) for k in COUNTERS if hasattr(table, k)}


def columns(shard: TableShard, *, state: bool = True) -> dict[str, torch.Tensor]:
    """The live rows of every column, keys in the user's keys (views where no key transform is needed); with
    ``state=False`` keys and values only (serving). A tiered table's row columns are streamed columns
    (:class:`~dynemb.checkpoint.tiered_stream.ColumnStream`), read a chunk at a time as they are written."""
    table = shard.table
    if isinstance(table, TieredTable):  # streamed a chunk at a time: the table may be far bigger than memory
        return {**tiered_columns(shard, state=state), **(admission_columns(table) if state else {})}
    live = _live_rows(table)
    cols = {KEYS: shard.user_keys(live.keys), VALUES: live.values}
    if state:
        cols[SCORES] = live.scores
        cols.update({SLOT + s: live.slots[s] for s in table.slot_names})
        cols.update(admission_columns(table))
    return cols


def _live_rows(table) -> Rows:
    """Views of the live rows."""
    n = table.size()
    slots = {s: table.slot(s)[:n] for s in table.slot_names}
    return Rows(table.row_keys[:n], table.values[:n], table.scores[:n], slots)


def admission_columns(table) -> dict[str, torch.Tensor]:
    """The admission candidates' keys and counts, when the table has pending ones."""
    counts = getattr(getattr(table, "admission", None), "counter", None)
    if counts is None:
        return {}
    n = counts.size()
    return {ADMISSION_KEYS: counts.row_keys[:n], ADMISSION_COUNTS: counts.scores[:n]}


def delta_columns(shard: TableShard, since: int, *, state: bool = True) -> dict[str, torch.Tensor]:
    """Rows written after clock ``since`` (in row order) and the keys deleted after it; with ``state``, every
    column and, when rows were deleted, the key order."""
    rows, deleted = shard.table.changes_since(since)
    cols = columns(shard, state=state)
    admission = {k: cols.pop(k) for k in (ADMISSION_KEYS, ADMISSION_COUNTS) if k in cols}
    if isinstance(shard.table, TieredTable):  # rows are positions in the tiers' order, gathered chunk by chunk
        delta = tiered_delta_columns(shard, rows, state=state)
    else:
        delta = {name: gather_rows(col, rows) for name, col in cols.items()}
    delta.update(admission)
    delta[DELETED] = shard.user_keys(deleted)
    if state and deleted.numel():
        # erase/evict fill holes with the last rows, which keep their stamps: only the full key order lets a
        # loader put every row back in its position (positions break eviction ties, so exact resume needs them).
        delta[ORDER] = cols[KEYS]
    return delta


def apply_delta(base: dict, delta: dict, file) -> dict:
    """The shard after ``delta``: deleted keys dropped, changed rows replaced or added, rows in table order."""
    admission = {k: delta[k] for k in (ADMISSION_KEYS, ADMISSION_COUNTS) if k in delta}
    base = {k: v for k, v in base.items() if k not in (ADMISSION_KEYS, ADMISSION_COUNTS)}
    delta = {k: v for k, v in delta.items() if k not in admission}
    changed = delta[KEYS]
    order = delta.get(ORDER)
    if order is None:  # nothing was deleted, so old rows kept their positions and new rows were appended in order
        order = torch.cat([base[KEYS], changed[~torch.isin(changed, base[KEYS])]])
    kept = (~torch.isin(base[KEYS], changed)).nonzero().squeeze(1)
    pool = {name: torch.cat([gather_rows(col, kept), delta[name]]) for name, col in base.items()}
    sorted_keys, perm = torch.sort(pool[KEYS])
    at = torch.searchsorted(sorted_keys, order).clamp_(max=max(sorted_keys.numel() - 1, 0))
    if order.numel() and (sorted_keys.numel() == 0 or not torch.equal(sorted_keys[at], order)):
        raise CheckpointError(f"{file}: 'order' lists keys found neither in this delta nor in the checkpoints "
                              "before it")
    rows = perm[at]
    return {**{name: gather_rows(col, rows) for name, col in pool.items()}, **admission}


def table_rows(shard: TableShard, cols: dict, device=None) -> Rows:
    """The rows of ``cols`` (a file's columns, user keys) as the table holds them: shard keys, on ``device`` (by
    default the table's)."""
    t = shard.table
    device = t.device if device is None else device
    slots = {s: cols[SLOT + s].to(device) for s in t.slot_names if SLOT + s in cols}
    keys = shard.shard_keys(cols[KEYS].to(device))
    return Rows(keys, cols[VALUES].to(device), cols[SCORES].to(device), slots)


def restore(shard: TableShard, cols: dict, saved: dict, load_rows=None) -> None:
    """Make the table hold exactly ``cols``, with the saved counters and seed, so training continues bit-exactly.

    ``load_rows(table)``: loads the rows instead of ``cols`` (which then holds only the admission columns), a chunk
    at a time for a tiered table (see :func:`~dynemb.checkpoint.tiered_stream.stream_into`)."""
    t = shard.table
    device = t.device
    previous = t.clock
    # replace() stamps every row with the current clock; the save closed its tick, so one below the saved clock
    # is what the rows carried right after that save (see write_marks), and a later delta skips them.
    t.clock = saved["clock"] - 1
    try:
        if load_rows is None:
            t.replace(table_rows(shard, cols))
        else:
            load_rows(t)
    except (TypeError, ValueError):
        t.clock = previous
        raise
    for name in counters(t):  # only known counter names: the manifest never sets arbitrary attributes
        if name in saved:
            setattr(t, name, int(saved[name]))
    t.seed = shard.seed = int(saved.get("seed", shard.seed))
    admission = getattr(t, "admission", None)
    if admission is not None:
        none = torch.empty(0, dtype=t.key_dtype, device=device)
        admission.restore(cols.get(ADMISSION_KEYS, none).to(device), cols.get(ADMISSION_COUNTS, none.long()).to(device))
