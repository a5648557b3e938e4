"""Online updates: a serving export (a delta, or a full one) applied to the tables being served.

Deleted keys leave every tier first; then the rows are written to the stores, and replaced in the caches under each
table's cache lock, so that no lookup reads half of an old row and half of a new one. Each update moves the table's
epoch on and drops its pending write-backs: rows read before the update may be stale.
"""

from __future__ import annotations

import time
from typing import Mapping

import torch

from ...checkpoint.export_format import read_export
from .cache import TableState
from .tiers import Tiers

__all__ = ["apply_update"]


def apply_update(export_dir, served: Mapping[str, Mapping[str, TableState]], tiers: Tiers) -> dict:
    """Apply the export at ``export_dir`` to every table of ``served`` (``{model: {table: state}}``) it holds.

    Returns:
        ``{model: {"version", "updated_unix"}}`` for the models updated.

    Raises:
        ValueError: a table of the export has another dim than the table served under its name.
    """
    manifest, payload = read_export(export_dir)
    touched = {}
    for model, tables in served.items():
        for name, t in tables.items():
            if name not in payload:
                continue
            _update_table(t, payload[name], manifest["path"], tiers)
            touched[model] = {"version": manifest["version"], "updated_unix": time.time()}
    return touched


def _update_table(t: TableState, cols: dict, path: str, tiers: Tiers) -> None:
    deleted = cols.get("deleted_keys")
    keys, values = cols["keys"].to(torch.int64), cols["values"].to(t.dtype)
    if values.shape[1:] != (t.dim,):
        raise ValueError(f"{path}: table {t.name!r} has dim {values.shape[1]}, served as {t.dim}")
    if deleted is not None and deleted.numel():
        tiers.delete(t.store_name, deleted.to(torch.int64))
    tiers.put(t.store_name, keys, values)
    with t.cache_lock:
        with t.stats_lock:
            t.epoch += 1
            t.pending.clear()
        if deleted is not None and deleted.numel():
            t.cache.erase(deleted.to(torch.int64).to(t.cache.device))
        present = t.cache.contains(keys.to(t.cache.device)).cpu()
        if bool(present.any()):
            t.cache.insert_or_assign(keys[present].to(t.cache.device), values[present].to(t.cache.device))
