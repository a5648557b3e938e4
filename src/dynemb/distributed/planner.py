"""The planner: a sharding kind per table that balances memory and step time over ranks, from the configs or from
what training observed (a checkpoint's per-table row and access counts).

:func:`plan_tables` takes each table's expected rows from its config where known (``vocabulary_size``; for a
dynamic table the rows a checkpoint observed, else ``max_capacity`` or ``max_bytes``) and its unique ids looked up
per step from the observations (``observed``), and estimates, per rank, the rows and bytes it holds and the
lookups and bytes on the wire it has each step, through each kind's own estimate
(:meth:`~dynemb.distributed.strategy.ShardingStrategy.estimate`). The rule:

1. pinned tables (``pins``) take the kind given;
2. the rest, largest first: a table of at most ``small_fraction`` of a rank's mean share goes whole (``table``)
   to the least loaded rank; a larger one is row-sharded over the smallest group of ranks (a node of
   ``ranks_per_node`` ranks, or the world) that brings its share under that bound, on the least loaded such
   group (``table_row``, or ``row`` over the world); tables under ``replicate_bytes`` are replicated (``data``);
3. a kind that would overflow a rank's ``memory_per_rank`` gives way to the next one that spreads the table wider
   and fits: a replica to one rank, one rank to a node's ranks, a node's to every rank (``row``); when the tables
   still do not fit, the plan is made again without replicas, then with every table spread over its widest group.

Placing items no bigger than ``small_fraction`` of the mean onto the least loaded rank keeps the largest rank
within ``1 + small_fraction`` of the mean. A plan that does not fit ``memory_per_rank`` raises
:class:`PlanError` naming the table whose placement overflowed and by how many bytes.

Example:
    >>> from dynemb import TableConfig
    >>> plan = plan_tables([TableConfig(name="user", dim=16, max_capacity=10**6),
    ...                     TableConfig(name="country", dim=16, vocabulary_size=200)], world_size=2)
    >>> plan.shardings["user"], plan.shardings["country"]
    (Sharding('row'), Sharding('data'))
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import torch

from .sharding import Sharding
from .strategy import KINDS, TableLoad, TableStats, bytes_per_row

__all__ = ["plan_tables", "TablePlan", "PlanError", "table_stats"]


class PlanError(ValueError):
    """The tables do not fit the ranks' memory: the message names the table and by how many bytes."""


@dataclasses.dataclass
class TablePlan:
    """A plan: ``shardings`` (table name -> :class:`~.sharding.Sharding`, the ``plan=`` of a collection), the
    tables' ``stats`` and each rank's estimated ``loads`` (rank -> table name -> :class:`~.strategy.TableLoad`).
    ``str(plan)`` prints it."""

    shardings: dict
    stats: dict
    loads: list
    memory_per_rank: Optional[int] = None

    def rank_totals(self) -> list[TableLoad]:
        """Each rank's load over its tables."""
        out = []
        for per_table in self.loads:
            total = TableLoad()
            for load in per_table.values():
                total.rows += load.rows
                total.bytes += load.bytes
                total.lookups += load.lookups
                total.wire += load.wire
            out.append(total)
        return out

    def imbalance(self) -> float:
        """The largest rank's bytes over the mean rank's."""
        sizes = [t.bytes for t in self.rank_totals()]
        mean = sum(sizes) / len(sizes)
        return max(sizes) / mean if mean else 1.0

    def to_dict(self) -> dict:
        """The shardings as configs (:mod:`dynemb.serialization`), by table name."""
        return {name: s.to_dict() for name, s in self.shardings.items()}

    def __str__(self) -> str:
        lines = [f"{'table':<14} {'kind':<10} {'ranks':<16} {'rows':>14} {'bytes':>12} {'ids/step':>10}"]
        for name, sharding in self.shardings.items():
            st = self.stats[name]
            ranks = sorted(r for r, loads in enumerate(self.loads) if name in loads)
            shown = ",".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
            lines.append(f"{name:<14} {sharding.kind.value:<10} {shown:<16} {st.rows:>14,} "
                         f"{_size(st.rows * st.row_bytes):>12} {st.accesses:>10,.0f}")
        lines.append("")
        lines.append(f"{'rank':<5} {'tables':>6} {'rows':>14} {'bytes':>12} {'lookups/step':>13} {'wire/step':>12}")
        for rank, (per_table, total) in enumerate(zip(self.loads, self.rank_totals())):
            lines.append(f"{rank:<5} {len(per_table):>6} {total.rows:>14,.0f} {_size(total.bytes):>12} "
                         f"{total.lookups:>13,.0f} {_size(total.wire):>12}")
        budget = f" of {_size(self.memory_per_rank)} a rank" if self.memory_per_rank else ""
        largest = max(t.bytes for t in self.rank_totals())
        lines.append(f"largest rank {_size(largest)}{budget}, {self.imbalance():.3f}x the mean")
        return "\n".join(lines)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def table_stats(config, observed: Optional[Mapping] = None, accesses: Optional[float] = None) -> TableStats:
    """What the planner knows of ``config`` (a :class:`~dynemb.TableConfig`): its expected rows (the vocabulary
    size; for a dynamic table ``observed["rows"]``, else ``max_capacity``, else ``max_bytes`` over a row's bytes)
    and unique ids a step (``accesses``, else ``observed["accesses"]``, else 0)."""
    observed = observed or {}
    row_bytes = bytes_per_row(config.dim, config.dtype, config.key_dtype, config.optimizer)
    if config.vocabulary_size is not None:
        rows = config.vocabulary_size
    elif observed.get("rows") is not None:
        rows = int(observed["rows"])
    elif config.max_capacity is not None:
        rows = config.max_capacity
    elif config.max_bytes is not None:
        rows = config.max_bytes // row_bytes
    else:
        raise PlanError(f"table {config.name!r}: its rows are unknown (a dynamic table without max_capacity or "
                        "max_bytes): give one, or plan from a checkpoint that observed it")
    if accesses is None:
        accesses = observed.get("accesses", 0.0)
    row_statistic = bool(config.optimizer is not None and config.optimizer.row_statistic)
    value_bytes = torch.empty(0, dtype=config.dtype).element_size()
    columnar = sum(1 for width, _ in config.optimizer.slot_widths(config.dim).values() if width == config.dim) \
        if config.optimizer is not None else 0
    return TableStats(config.name, config.dim, int(rows), float(accesses), row_bytes, value_bytes, row_statistic,
                      value_bytes + 4 * columnar)


def plan_tables(tables, world_size: int, *, memory_per_rank: Optional[int] = None,
                ranks_per_node: Optional[int] = None, pins: Optional[Mapping] = None,
                observed: Optional[Mapping] = None, accesses: Optional[Mapping] = None,
                small_fraction: float = 0.05, replicate_bytes: int = 64 << 10) -> TablePlan:
    """A sharding per table, balancing memory and estimated step time over ``world_size`` ranks (see the module
    docstring for the rule).

    Args:
        tables: :class:`~dynemb.TableConfig` s, or :class:`~.strategy.TableStats` (say, read from a checkpoint).
        world_size: ranks (>= 1).
        memory_per_rank: bytes each rank may hold; ``None``: unbounded.
        ranks_per_node: ranks of one node: row-sharded tables stay within a node where their share allows.
        pins: ``{table: kind}`` as a collection's ``plan`` takes it (``"column"``, ``("table", 3)``, a
            Sharding): these tables take that kind (``"table"`` alone: whole on the least loaded rank).
        observed: ``{table: {"rows": int, "accesses": float}}``: what training saw (unique ids a step).
        accesses: ``{table: float}``: unique ids a step, overriding ``observed``.
        small_fraction: tables up to this fraction of the mean rank's bytes go whole to one rank.
        replicate_bytes: tables up to this many bytes are replicated on every rank.

    Returns:
        A :class:`TablePlan`; ``print(plan)`` shows it per table and per rank.

    Raises:
        PlanError: a table's rows are unknown, or a placement overflows ``memory_per_rank`` (the message names
            the table and by how many bytes).
    """
    from .sharding import resolve_plan

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1
                                       or world_size % ranks_per_node):
        raise ValueError(f"ranks_per_node must be an int >= 1 dividing world_size={world_size}, got "
                         f"{ranks_per_node!r}")
    observed, accesses = dict(observed or {}), dict(accesses or {})
    stats = {}
    for t in tables:
        stats[t.name] = t if isinstance(t, TableStats) else table_stats(t, observed.get(t.name), accesses.get(t.name))
    pinned = {}
    if pins:
        configs = [t for t in tables if not isinstance(t, TableStats)]
        known = {t.name for t in tables}
        for name in pins:
            if name not in known:
                raise ValueError(f"pins name table {name!r}, which is not in tables {sorted(known)}")
        # resolve_plan checks the entries as a collection's plan does
        pinned = {n: s for n, s in resolve_plan(configs or [_Named(n) for n in known], world_size,
                                                dict(pins), what="pins").items() if n in pins}
    loads: list[dict] = [{} for _ in range(world_size)]
    totals = [0.0] * world_size
    shardings: dict = {}

    def fits(name: str, sharding: Sharding) -> bool:
        per_rank = KINDS[sharding.kind].estimate(sharding, stats[name], world_size)
        return memory_per_rank is None or all(totals[r] + load.bytes <= memory_per_rank for r, load in per_rank.items())

    def least_loaded_group(g: int) -> Sharding:
        if g == world_size:
            return Sharding("row")
        start = min(range(0, world_size, g), key=lambda s: (max(totals[s: s + g]), s))
        return Sharding("table_row", ranks=tuple(range(start, start + g)))

    def place_widening(name: str, preferred: Sharding) -> None:
        """``preferred``, or when it overflows a rank the next kind that spreads the table wider and fits (a
        replica, then one rank, then a node's ranks, then every rank); the widest one's error when none fits."""
        size = stats[name].rows * stats[name].row_bytes
        wider = [Sharding("table", owner=min(range(world_size), key=lambda r: (totals[r], r)))] if world_size > 1 \
            else []
        wider += [least_loaded_group(g) for g in groups if g > 1 and (preferred.kind != "table_row"
                                                                       or g > len(preferred.ranks))]
        if preferred.kind == "row":
            wider = []
        elif preferred.kind in ("table", "table_row"):
            wider = [w for w in wider if w.kind != "table"]
        for sharding in [preferred, *wider]:
            if fits(name, sharding) or size == 0:
                return place(name, sharding)
        place(name, wider[-1] if wider else preferred)  # raises, naming the widest kind tried

    def place(name: str, sharding: Sharding) -> None:
        per_rank = KINDS[sharding.kind].estimate(sharding, stats[name], world_size)
        for rank, load in per_rank.items():
            if memory_per_rank is not None and totals[rank] + load.bytes > memory_per_rank:
                over = totals[rank] + load.bytes - memory_per_rank
                if name in pinned:
                    hint = (f"it is pinned to {sharding!r}: pin a kind that spreads it wider, or give more ranks "
                            "or memory")
                elif len(per_rank) == world_size and sharding.kind != "data":
                    need = sum(st.rows * st.row_bytes for st in stats.values()) / world_size
                    hint = (f"it is already spread over all {world_size} ranks: give more ranks or memory (the "
                            f"tables need at least {_size(need)} a rank)")
                else:
                    hint = "give more ranks or memory, or pin it to a kind that spreads it wider"
                raise PlanError(f"table {name!r} ({sharding.kind.value}) does not fit: rank {rank} would hold "
                                f"{_size(totals[rank] + load.bytes)}, {_size(over)} ({int(over):,} bytes) over "
                                f"memory_per_rank={_size(memory_per_rank)}; {hint}")
        for rank, load in per_rank.items():
            loads[rank][name] = load
            totals[rank] += load.bytes
        shardings[name] = sharding

    for name, sharding in pinned.items():
        if pins[name] == "table":  # the kind alone: the planner picks the owner, as for the tables it places
            sharding = Sharding("table", owner=min(range(world_size), key=lambda r: (totals[r], r)))
        place(name, sharding)
    rest = sorted((n for n in stats if n not in pinned), key=lambda n: -stats[n].rows * stats[n].row_bytes)
    total = sum(s.rows * s.row_bytes for s in stats.values())
    bound = small_fraction * total / world_size
    groups = sorted({g for g in (ranks_per_node, world_size) if g} | {world_size})
    try:
        for name in rest:
            size = stats[name].rows * stats[name].row_bytes
            if size <= replicate_bytes and world_size > 1:
                place_widening(name, Sharding("data"))
            elif size <= bound or world_size == 1:
                place_widening(name, Sharding("table", owner=min(range(world_size), key=lambda r: (totals[r], r))))
            else:
                place_widening(name, least_loaded_group(next((g for g in groups if size / g <= bound), world_size)))
    except PlanError:
        # the larger tables, placed first, took memory the kinds that spread them less need: plan again with
        # no replicas, then with every table spread as wide as its group allows, before giving up
        if replicate_bytes <= 0 and small_fraction <= 0:
            raise
        return plan_tables(tables, world_size, memory_per_rank=memory_per_rank, ranks_per_node=ranks_per_node,
                           pins=pins, observed=observed, accesses=accesses,
                           small_fraction=small_fraction if replicate_bytes > 0 else 0.0, replicate_bytes=0)
    order = [t.name for t in tables]
    return TablePlan({n: shardings[n] for n in order}, {n: stats[n] for n in order}, loads, memory_per_rank)


@dataclasses.dataclass
class _Named:
    """A table known by name only (pins over :class:`TableStats`)."""

    name: str
    is_static: bool = True
    vocabulary_size: int = 0
    dim: int = 0
