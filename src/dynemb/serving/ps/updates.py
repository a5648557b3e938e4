"""Online updates: a serving export (a delta, or a full one) applied to the tables being served, and the replay of
an export chain into the rows of its last version.

An update applies only on top of the version served (see :mod:`.lineage`); it is checked for every table before
anything changes. A delta's deleted keys leave every tier first; a full export replaces the tables, so the keys it
does not have leave every tier. Then the rows are written to the stores, and replaced in the caches under each
table's cache lock, so that no lookup reads half of an old row and half of a new one. Each update moves the table's
epoch on and drops its pending write-backs: rows read before the update may be stale.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from ...checkpoint.row_codec import quantized_kind
from .cache import TableState
from .lineage import Lineage, update_targets
from .tiers import StoreTiers

__all__ = ["apply_update", "checked_targets", "replay"]


def apply_update(manifest: dict, payload: Mapping[str, dict], targets: dict[str, dict],
                 tiers: StoreTiers) -> dict[str, dict]:
    """Apply an export (``manifest`` and ``payload`` as :func:`~dynemb.checkpoint.read_export` returns them) to
    the served tables it updates, ``targets`` (``{model: {table: state}}``, from :func:`checked_targets`).

    Returns:
        ``targets``, the tables updated.
    """
    full = manifest["kind"] == "full"
    spaces: dict[str, list] = {}  # a shared volatile store's marker says the new version before its rows change
    for tables in targets.values():
        for t in tables.values():
            spaces.setdefault(t.namespace, []).append(t.store_name)
    for space, stores in spaces.items():
        tiers.begin_update(space, stores, manifest["version"], manifest.get("digest"))
    for tables in targets.values():
        for name, t in tables.items():
            _update_table(t, payload[name], full, tiers, quantized_kind(manifest["tables"][name]["dtype"]))
            t.lineage = Lineage.of(manifest)
    for space, stores in spaces.items():
        tiers.end_update(space, stores)
    return targets


def checked_targets(manifest: dict, served: Mapping[str, Mapping[str, TableState]]) -> dict[str, dict]:
    """:func:`.lineage.update_targets`, each of the tables also checked for its dim.

    Raises:
        LineageError: as :func:`.lineage.update_targets`. ValueError: a table of the export has another dim than the
            table served under its name.
    """
    targets = update_targets(manifest, served)
    for tables in targets.values():
        for name, t in tables.items():
            dim = manifest["tables"][name]["dim"]
            if dim != t.row_dim:
                raise ValueError(f"{manifest['path']}: table {name!r} has dim {dim}, served as {t.row_dim} "
                                 "(nothing was changed)")
    return targets


def _update_table(t: TableState, cols: dict, full: bool, tiers: StoreTiers, kind: Optional[str]) -> None:
    keys, values = cols["keys"].to(torch.int64), t.stored(cols["values"], kind)
    deleted = None if full else cols["deleted_keys"].to(torch.int64)
    if full:
        tiers.replace(t.store_name, keys, values)
    else:
        if deleted.numel():
            tiers.delete(t.store_name, deleted)
        tiers.put(t.store_name, keys, values)
    device = t.cache.device
    with t.cache_lock:
        with t.stats_lock:
            t.epoch += 1
            t.pending.clear()
        if full:  # the keys cached that the export no longer has
            cached = t.cache.keys()
            deleted = cached[~torch.isin(cached, keys.to(device))]
        if deleted.numel():
            t.cache.erase(deleted.to(device))
        present = t.cache.contains(keys.to(device)).cpu()
        if bool(present.any()):
            t.cache.insert_or_assign(keys[present].to(device), values[present].to(device))


def replay(chain: list[tuple[dict, dict]], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (int64 ``[N]``) and values (``[N, D]``) of table ``name`` after the exports of ``chain`` (a full
    export, then deltas, as :func:`~dynemb.checkpoint.read_chain` returns them): each delta deletes its deleted
    keys, then upserts its rows."""
    keys = values = None
    for manifest, payload in chain:
        cols = payload[name]
        if manifest["kind"] == "full":
            keys, values = cols["keys"], cols["values"]
            continue
        keep = ~torch.isin(keys, torch.cat([cols["deleted_keys"], cols["keys"]]))
        keys, values = torch.cat([keys[keep], cols["keys"]]), torch.cat([values[keep], cols["values"]])
    return keys.to(torch.int64), values
