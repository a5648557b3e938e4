"""How the tables of a model become shard tensors, and shard tensors become tables again.

A shard is a dict of *columns* named as in the files: ``keys [N]``, ``values [N, D]``, ``scores [N]`` and
``slot.<name> [N, d]``, row-aligned; a delta shard adds ``deleted_keys [K]`` and, when rows were deleted,
``order [N']``, the key of every live row in row order.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..embedding import DynamicEmbedding
from ..table import Rows
from ..table.ops import gather_rows
from .errors import CheckpointError

__all__ = ["find_embeddings", "find_served", "table_config", "counters", "columns", "delta_columns", "check_shard",
           "apply_delta", "restore", "shard_file", "ROOT_NAME"]

#: Table name used when the model itself is a DynamicEmbedding (its module name is empty).
ROOT_NAME = "embedding"
KEYS, VALUES, SCORES, DELETED, ORDER, SLOT = "keys", "values", "scores", "deleted_keys", "order", "slot."


def find_embeddings(model: nn.Module) -> dict[str, DynamicEmbedding]:
    """Every DynamicEmbedding in ``model`` (itself included) by module name; a shared one appears once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return {name or ROOT_NAME: m for name, m in model.named_modules() if isinstance(m, DynamicEmbedding)}


def find_served(model: nn.Module) -> dict:
    """Every table a serving export holds: the DynamicEmbeddings and the StaticEmbeddings (ids ``0 .. V-1``)."""
    from ..embedding import StaticEmbedding

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return {name or ROOT_NAME: m for name, m in model.named_modules()
            if isinstance(m, (DynamicEmbedding, StaticEmbedding))}


def shard_file(index: int, name: str, rank: int, world_size: int, suffix: str = "") -> str:
    """Relative path of one table's shard; the index keeps names unique after unsafe characters are replaced."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return f"tables/{index:03d}-{safe}{suffix}.rank-{rank:05d}-of-{world_size:05d}.safetensors"


def table_config(emb: DynamicEmbedding) -> dict:
    """The embedding's config (dim, dtypes, policy, initializer, seed) with each slot's width and dtype."""
    t = emb.table
    config = emb.config()
    config["slots"] = {n: {"dim": t.slot(n).shape[1], "dtype": str(t.slot(n).dtype)} for n in t.slot_names}
    if getattr(t, "admission", None) is not None:
        config["admission"] = t.admission.describe()
    return config


def counters(emb: DynamicEmbedding) -> dict:
    """The table counters a bit-exact resume needs (clock, epoch, insert/remove/evict counts, init calls)."""
    return {k: int(v) for k, v in emb._counters().items()}


def columns(table, *, state: bool = True) -> dict[str, torch.Tensor]:
    """Views (no copies) of the live rows of every column; with ``state=False`` keys and values only (serving)."""
    n = table.size()
    cols = {KEYS: table.row_keys[:n], VALUES: table.values[:n]}
    if state:
        cols[SCORES] = table.scores[:n]
        cols.update({SLOT + s: table.slot(s)[:n] for s in table.slot_names})
    return cols


def delta_columns(table, since: int, *, state: bool = True) -> dict[str, torch.Tensor]:
    """Rows written after clock ``since`` (in row order) and the keys deleted after it; with ``state``, every
    column and, when rows were deleted, the key order."""
    rows, deleted = table.changes_since(since)
    cols = columns(table, state=state)
    delta = {name: gather_rows(col, rows) for name, col in cols.items()}
    delta[DELETED] = deleted
    if state and deleted.numel():
        # erase/evict fill holes with the last rows, which keep their stamps: only the full key order lets a
        # loader put every row back in its position (positions break eviction ties, so exact resume needs them).
        delta[ORDER] = cols[KEYS]
    return delta


def check_shard(cols: dict, config: dict, file, *, delta: bool) -> int:
    """Check names, dtypes and shapes of a shard's tensors against the table config; returns its row count.

    Raises:
        CheckpointError: naming ``file`` and the tensor.
    """
    if KEYS not in cols or cols[KEYS].dim() != 1:
        raise CheckpointError(f"{file}: tensor 'keys' is missing or not 1-D")
    n = cols[KEYS].shape[0]
    expected = {KEYS: (config["key_dtype"], [n]), VALUES: (config["dtype"], [n, config["dim"]]),
                SCORES: ("torch.int64", [n])}
    expected.update({SLOT + s: (spec["dtype"], [n, spec["dim"]]) for s, spec in config["slots"].items()})
    if delta:
        expected[DELETED] = (config["key_dtype"], [len(cols.get(DELETED, ()))])
        if ORDER in cols:
            expected[ORDER] = (config["key_dtype"], [len(cols[ORDER])])
    for name in sorted(set(cols) | set(expected)):
        if name not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {name!r}")
        if name not in cols:
            raise CheckpointError(f"{file}: tensor {name!r} is missing")
        got, (dtype, shape) = cols[name], expected[name]
        if str(got.dtype) != dtype or list(got.shape) != shape:
            raise CheckpointError(f"{file}: tensor {name!r} is {got.dtype} {list(got.shape)}, expected {dtype} {shape}")
    return n


def apply_delta(base: dict, delta: dict, file) -> dict:
    """The shard after ``delta``: deleted keys dropped, changed rows replaced or added, rows in table order."""
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
    return {name: gather_rows(col, rows) for name, col in pool.items()}


def restore(emb: DynamicEmbedding, cols: dict, saved: dict, seed: int) -> None:
    """Make the table hold exactly ``cols``, with the saved counters and seed, so training continues bit-exactly."""
    t = emb.table
    slots = {s: cols[SLOT + s].to(t.device) for s in t.slot_names if SLOT + s in cols}
    rows = Rows(cols[KEYS].to(t.device), cols[VALUES].to(t.device), cols[SCORES].to(t.device), slots)
    previous = t.clock
    # replace() stamps every row with the current clock; the save closed its tick, so one below the saved clock
    # is what the rows carried right after that save (see lineage), and a later delta skips them.
    t.clock = saved["clock"] - 1
    try:
        t.replace(rows)
    except (TypeError, ValueError):
        t.clock = previous
        raise
    for name in counters(emb):  # only known counter names: the manifest never sets arbitrary attributes
        if name in saved:
            setattr(t, name, int(saved[name]))
    t.seed = seed
