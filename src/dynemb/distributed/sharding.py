"""Sharding plans: which rank owns which rows of each table.

=========  ====================================================================================================
kind       meaning
=========  ====================================================================================================
row        rows spread over all ranks by a partitioner ``(keys, world_size) -> owner``; default ``key % world``
table      the whole table on one rank (``owner``); ranks are balanced by table bytes in the automatic plan
data       replicated on every rank; each step's keys and gradients are all-gathered so replicas stay identical
column     the table's dim split into column shards on ``ranks`` (default: every rank), each shard holding every
           key (the same inserts, evictions and admissions); ``columns`` gives the widths (default: even)
table_row  rows spread by the partitioner over ``ranks`` only (a group, say the ranks of one node)
=========  ====================================================================================================

Write a plan by hand as ``{"user": "row", "country": "data", "item": ("table", 1)}``; :func:`auto_plan` fills in
what is missing: dynamic tables go row-wise, small static tables are replicated, large static ones go whole to
the least loaded rank. :func:`~dynemb.distributed.planner.plan_tables` balances memory and traffic instead. Each
kind is a strategy module (:mod:`dynemb.distributed.strategy`); a new kind is its module and one registration.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable, Optional

import torch

from ..serialization import Serializable, serializable

__all__ = ["Sharding", "ShardingKind", "auto_plan", "mod_partitioner", "resolve_plan"]

Partitioner = Callable[[torch.Tensor, int], torch.Tensor]


def mod_partitioner(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """``key mod world_size`` as a non-negative owner (negative keys included), like SOK's ``key % world``."""
    return torch.remainder(keys.to(torch.int64), world_size)


class ShardingKind(str, enum.Enum):
    """How a table's rows are spread over ranks; see the module docstring. Printed, a kind is its name.

    Example:
        >>> print(ShardingKind.ROW, f"{ShardingKind.DATA}")
        row data
    """

    ROW = "row"
    TABLE = "table"
    DATA = "data"
    COLUMN = "column"
    TABLE_ROW = "table_row"

    def __str__(self) -> str:  # what the user wrote in the plan ("row"), not "ShardingKind.ROW"
        return self.value


@serializable("sharding")
@dataclasses.dataclass(frozen=True)
class Sharding(Serializable):
    """How one table is sharded. ``partitioner`` applies to ``row`` and ``table_row``; ``owner`` to ``table``;
    ``ranks`` to ``column`` and ``table_row`` (the ranks holding the table; ``None``: every rank); ``columns`` to
    ``column`` (each shard's width, in ``ranks`` order, one per rank of the world when ``ranks`` is ``None``;
    ``None``: as even as the dim allows).

    ``to_dict`` leaves out the default partitioner and refuses any other (a callable), naming the field.

    Example:
        >>> Sharding("table", owner=1).to_dict()
        {'type': 'sharding', 'kind': 'table', 'owner': 1}
        >>> Sharding.from_dict(Sharding("column", ranks=(0, 1), columns=(96, 32)).to_dict())
        Sharding('column', ranks=(0, 1), columns=(96, 32))
    """

    kind: ShardingKind
    owner: Optional[int] = None
    partitioner: Partitioner = mod_partitioner
    ranks: Optional[tuple] = None
    columns: Optional[tuple] = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "kind", ShardingKind(self.kind))
        except ValueError:
            raise ValueError(f"sharding kind must be one of {[k.value for k in ShardingKind]}, got "
                             f"{self.kind!r}") from None
        if self.kind == ShardingKind.TABLE and (isinstance(self.owner, bool) or not isinstance(self.owner, int)
                                                or self.owner < 0):
            raise ValueError(f"a 'table' sharding needs an owner rank >= 0, got {self.owner!r}")
        for field in ("ranks", "columns"):
            value = getattr(self, field)
            if value is None:
                continue
            if not isinstance(value, (list, tuple)) or not value or any(
                    isinstance(v, bool) or not isinstance(v, int) or v < (0 if field == "ranks" else 1)
                    for v in value):
                low = "ranks >= 0" if field == "ranks" else "widths >= 1"
                raise ValueError(f"Sharding.{field} must be None or a non-empty tuple of {low}, got {value!r}")
            object.__setattr__(self, field, tuple(value))
        if self.ranks is not None and len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"Sharding.ranks must not repeat a rank, got {self.ranks!r}")
        if self.ranks is not None and self.kind not in (ShardingKind.COLUMN, ShardingKind.TABLE_ROW):
            raise ValueError(f"Sharding.ranks applies to 'column' and 'table_row', not {self.kind.value!r}")
        if self.columns is not None:
            if self.kind != ShardingKind.COLUMN:
                raise ValueError(f"Sharding.columns applies to 'column', not {self.kind.value!r}")
            # without ranks, one width per rank of the world: checked where the world is known (resolve_plan)
            if self.ranks is not None and len(self.ranks) != len(self.columns):
                raise ValueError(f"Sharding.columns {self.columns!r} needs ranks of the same length, got "
                                 f"ranks={self.ranks!r}")

    def _config_fields(self) -> dict:
        # ranks and columns only where given: the dicts of the row, table and data kinds stay as they were
        fields = super()._config_fields()
        return {k: v for k, v in fields.items() if k not in ("ranks", "columns") or v is not None}

    def __repr__(self) -> str:
        """As the plan entry would be written: ``Sharding('row')``, ``Sharding('table', owner=1)``."""
        parts = [repr(self.kind.value)]
        if self.owner is not None:
            parts.append(f"owner={self.owner}")
        if self.partitioner is not mod_partitioner:
            parts.append(f"partitioner={getattr(self.partitioner, '__qualname__', repr(self.partitioner))}")
        parts += [f"{f}={getattr(self, f)!r}" for f in ("ranks", "columns") if getattr(self, f) is not None]
        return f"Sharding({', '.join(parts)})"

    def group(self, world_size: int) -> tuple:
        """The ranks holding the table: ``ranks``, ``(owner,)`` or every rank."""
        if self.kind == ShardingKind.TABLE:
            return (self.owner,)
        return self.ranks if self.ranks is not None else tuple(range(world_size))

    def owners(self, keys: torch.Tensor, world_size: int) -> torch.Tensor:
        """The rank each of ``keys`` goes to (``row``, ``table``, ``table_row``; a column shard's key goes to
        every rank of the group)."""
        if self.kind == ShardingKind.TABLE:
            return torch.full(keys.shape, self.owner, dtype=torch.int64, device=keys.device)
        group = self.group(world_size)
        owners = self.partitioner(keys, len(group))
        if owners.shape != keys.shape:
            raise ValueError(f"partitioner returned shape {tuple(owners.shape)} for keys {tuple(keys.shape)}")
        owners = owners.to(torch.int64)
        if self.ranks is not None:
            owners = torch.tensor(group, dtype=torch.int64, device=keys.device)[owners]
        return owners

    def describe(self) -> dict:
        """The record kept in checkpoint manifests (and compared across ranks)."""
        name = getattr(self.partitioner, "__qualname__", repr(self.partitioner))
        record = {"kind": self.kind.value, "owner": self.owner,
                  "partitioner": name if self.kind in (ShardingKind.ROW, ShardingKind.TABLE_ROW) else None}
        record.update({f: list(getattr(self, f)) for f in ("ranks", "columns") if getattr(self, f) is not None})
        return record


def auto_plan(tables, world_size: int, data_max_bytes: int = 16 << 20) -> dict[str, Sharding]:
    """A plan by size: dynamic -> row; static <= ``data_max_bytes`` -> data; larger static -> table, balanced.

    Example:
        >>> from dynemb import TableConfig
        >>> auto_plan([TableConfig(name="user", dim=8), TableConfig(name="country", dim=8, vocabulary_size=200),
        ...            TableConfig(name="ad", dim=64, vocabulary_size=10**7)], world_size=2)
        {'ad': Sharding('table', owner=0), 'country': Sharding('data'), 'user': Sharding('row')}
    """
    plan, load = {}, [0] * world_size
    for cfg in sorted(tables, key=lambda t: -(t.vocabulary_size or 0) * t.dim):
        if not cfg.is_static:
            plan[cfg.name] = Sharding("row")
            continue
        size = cfg.vocabulary_size * cfg.dim * 4
        if size <= data_max_bytes:
            plan[cfg.name] = Sharding("data")
        else:
            owner = min(range(world_size), key=lambda r: load[r])
            load[owner] += size
            plan[cfg.name] = Sharding("table", owner)
    return plan


def resolve_plan(tables, world_size: int, plan: Optional[dict] = None, *, what: str = "plan") -> dict[str, Sharding]:
    """The automatic plan with the explicit entries of ``plan`` (a str kind, ``("table", rank)``, a Sharding or
    its ``to_dict``);
    errors name an entry as ``what[table]``."""
    result = auto_plan(tables, world_size)
    names = {t.name for t in tables}
    unowned = []  # entries written as the kind alone, "table": placed once every owner given is known
    for name, entry in (plan or {}).items():
        if name not in names:
            raise ValueError(f"{what} names table {name!r}, which is not in tables {sorted(names)}")
        try:
            if isinstance(entry, str):
                if entry == "table":
                    unowned.append(name)
                entry = Sharding(entry, owner=0 if entry == "table" else None)
            elif isinstance(entry, tuple) and len(entry) == 2 and entry[0] in ("column", "table_row"):
                entry = Sharding(entry[0], ranks=entry[1])  # ("table_row", (0, 1, 2, 3))
            elif isinstance(entry, tuple):
                entry = Sharding(*entry)
            elif isinstance(entry, dict):  # a Sharding's to_dict, as `dynemb plan --json` prints it
                entry = Sharding.from_dict(entry)
        except ValueError as e:
            raise ValueError(f"{what}[{name!r}]: {e}") from None
        if not isinstance(entry, Sharding):
            raise TypeError(f"{what}[{name!r}] must be 'row', 'data', 'column', 'table_row', 'table', ('table', "
                            f"rank), a Sharding or its to_dict, got {entry!r}")
        if entry.kind == "table" and entry.owner >= world_size:
            raise ValueError(f"{what}[{name!r}] owner {entry.owner} is not a rank of a world of size {world_size}")
        outside = [r for r in entry.ranks or () if r >= world_size]
        if outside:
            raise ValueError(f"{what}[{name!r}] ranks {outside} are not ranks of a world of size {world_size}")
        if entry.columns is not None and len(entry.group(world_size)) != len(entry.columns):
            raise ValueError(f"{what}[{name!r}] columns {entry.columns!r} need one width per rank: give ranks= of "
                             f"the same length, or {world_size} widths (one per rank of the world)")
        result[name] = entry
    if unowned:
        _place_whole(tables, world_size, result, unowned)
    return result


def _place_whole(tables, world_size: int, result: dict, names: list) -> None:
    """Owners for the tables ``names`` written as ``"table"`` alone: each on the rank holding the fewest bytes of
    whole tables so far (then the fewest such tables, then the lowest rank), the largest first, as
    :func:`auto_plan` places large static tables and the planner a pinned ``"table"``; every rank computes the same
    owners from the same configs. Rank 0 for all of them would leave the other ranks idle."""
    configs = {t.name: t for t in tables}

    def size(name: str) -> int:
        cfg = configs[name]
        rows = getattr(cfg, "vocabulary_size", None) or getattr(cfg, "max_capacity", None) or 0
        return rows * getattr(cfg, "dim", 0) * 4 or (getattr(cfg, "max_bytes", None) or 0)

    load, count = [0] * world_size, [0] * world_size
    for name, sharding in result.items():
        if name not in names and sharding.kind == ShardingKind.TABLE:
            load[sharding.owner] += size(name)
            count[sharding.owner] += 1
    order = {n: i for i, n in enumerate(names)}
    for name in sorted(names, key=lambda n: (-size(n), order[n])):
        owner = min(range(world_size), key=lambda r: (load[r], count[r], r))
        load[owner] += size(name)
        count[owner] += 1
        result[name] = Sharding("table", owner=owner)
