"""Which export each served table holds, and the checks that keep an update on top of it.

Every serving export names its model id, version and parent version, with a digest (see
:func:`~dynemb.checkpoint.export_for_serving`). Each served table remembers the :class:`Lineage` of the export it
holds. An update goes only onto tables of its own model, and only forward: a full export must be newer than the
version served, a delta must be a delta *of* the version served (its ``parent_version`` and ``parent_digest``).
Anything else raises a :class:`LineageError` before anything changes.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

__all__ = ["Lineage", "LineageError", "update_targets", "summary"]


class LineageError(ValueError):
    """An export does not follow the version served: another model's, an older or equal version, or a delta
    whose parent is not the version served. Nothing was changed."""


@dataclasses.dataclass(frozen=True)
class Lineage:
    """The export a served table holds: its ``model`` id, ``version`` and ``digest``."""

    model: Optional[str]
    version: int
    digest: Optional[str]

    @classmethod
    def of(cls, manifest: Mapping) -> "Lineage":
        return cls(manifest.get("model"), manifest["version"], manifest.get("digest"))

    def __str__(self) -> str:
        return f"version {self.version} of model {self.model!r}"


def update_targets(manifest: Mapping, served: Mapping[str, Mapping]) -> dict[str, dict]:
    """The served tables that the export of ``manifest`` updates: ``{model: {table: state}}``.

    Those are the tables of ``served`` (``{model: {table: state}}``, each state with a ``lineage``) named in the
    export and holding an export of the same model id.

    Raises:
        LineageError: the export's tables are served only from other models' exports; or for a table it
            updates, it is not newer than the version served, or it is a delta of another version.
    """
    export = Lineage.of(manifest)
    path = manifest.get("path", "the export")
    named = [(model, name, t) for model, tables in served.items() for name, t in tables.items()
             if name in manifest["tables"]]
    targets: dict[str, dict] = {}
    for model, name, t in named:
        if t.lineage.model == export.model:
            _check_order(manifest, export, t.lineage, f"{path}: refused; model {model!r} table {name!r}")
            targets.setdefault(model, {})[name] = t
    if named and not targets:
        model, name, t = named[0]
        raise LineageError(f"{path}: refused; it is {export}, but model {model!r} serves table {name!r} from "
                           f"{t.lineage}: another model's export (nothing was changed)")
    return targets


def _check_order(manifest: Mapping, export: Lineage, held: Lineage, where: str) -> None:
    if export.version <= held.version:
        raise LineageError(f"{where} holds {held}; {export} is not newer (nothing was changed)")
    if manifest.get("kind") == "full":
        return
    parent = (manifest.get("parent_version"), manifest.get("parent_digest"))
    if parent != (held.version, held.digest):
        raise LineageError(f"{where} holds {held} (digest {held.digest}); {export} is a delta of version "
                           f"{parent[0]} (digest {parent[1]}): a gap. Apply the deltas between them in order, or a "
                           "full export (nothing was changed)")


def summary(tables: Mapping) -> dict:
    """The version, model id and digest a model reports: its newest table's."""
    newest = max((t.lineage for t in tables.values()), key=lambda lineage: lineage.version)
    return {"version": newest.version, "model_id": newest.model, "digest": newest.digest}
