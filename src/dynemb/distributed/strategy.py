"""The sharding strategy interface: one object per table and kind, one module per kind.

A strategy answers, for one table on this rank, everything that depends on how the table is sharded:

==================  ==================================================================================================
part                methods
==================  ==================================================================================================
placement           :meth:`~ShardingStrategy.holds`, :meth:`~ShardingStrategy.column_range`,
                    :meth:`~ShardingStrategy.shard_keys` / :meth:`~ShardingStrategy.user_keys`,
                    :meth:`~ShardingStrategy.owned`, :meth:`~ShardingStrategy.build` (the physical table)
exchange            keyed kinds: :meth:`~ShardingStrategy.route` (input_dist: where each unique key goes),
                    :meth:`~ShardingStrategy.assemble` (output_dist: rows back into ``[U, D]``),
                    :meth:`~ShardingStrategy.split` (its gradient), :meth:`~ShardingStrategy.before_delivery`
                    (what an owner shares before its optimizer runs); replicated kinds gather instead
                    (:mod:`.shard_data`). The owner-side lookup is the collection's, passed in.
checkpoints         :meth:`~ShardingStrategy.writes`, :meth:`~ShardingStrategy.select` (this rank's part of a
                    whole table), :meth:`~ShardingStrategy.join` (a whole table from the saved ranks' parts),
                    :meth:`~ShardingStrategy.part_config`, :meth:`~ShardingStrategy.logical_rows`
estimates           :meth:`~ShardingStrategy.estimate` (per rank: rows, bytes, lookups and bytes on the wire a step)
                    and :meth:`~ShardingStrategy.wire_floor`, used by :mod:`.planner`
==================  ==================================================================================================

Kinds register with :func:`register`; :func:`strategy_for` builds the strategy of a :class:`~.sharding.Sharding`.
A new kind is its module (a subclass here) and one ``@register``. The executor that drives any strategy is
:class:`dynemb.collection.sharded.ShardedExecutor`; the exchange records it keeps between forward and backward are
the typed records below.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import torch

from ..embedding import DynamicEmbedding, StaticEmbedding
from ..table.initializers import Initializer, resolve_initializer
from .sharding import Sharding, ShardingKind

__all__ = ["ShardingStrategy", "Route", "KeyedRecord", "ReplicatedRecord", "TableLoad", "TableStats", "register",
           "strategy_for", "strategy_from_record", "KINDS", "bytes_per_row", "even_widths"]

#: kind -> strategy class (filled by :func:`register`)
KINDS: dict[ShardingKind, type] = {}


def register(cls):
    """Class decorator: make ``cls`` the strategy of ``cls.kind``."""
    KINDS[ShardingKind(cls.kind)] = cls
    return cls


# ---------------------------------------------------------------------------------------------- exchange records
@dataclasses.dataclass(frozen=True)
class Route:
    """input_dist of one table on the requesting rank: copy ``c`` of its unique keys goes to rank ``dest[c]`` and
    is unique key ``index[c]`` (a row-like kind sends each key once; a column kind once to every column shard)."""

    dest: torch.Tensor  # [C] int64
    index: torch.Tensor  # [C] int64


@dataclasses.dataclass
class KeyedRecord:
    """A keyed exchange (every table of a keyed kind together) saved from forward for backward.

    ``sent[r, t]`` / ``recv[r, t]``: key copies of table ``t`` this rank sent to / received from rank ``r``;
    ``widths[r, t]``: the columns rank ``r`` holds of table ``t``; ``copies[t]``: table ``t``'s routed copies in
    send order (sorted by destination) as positions among its unique keys; ``received[t]``: the shard keys this
    rank received of table ``t`` (arrival order); ``owner``: the owner-side lookup's
    :class:`~dynemb.functional.owner.OwnerRows` (its ``values`` and ``backward``)."""

    strategies: list
    shards: list
    sent: torch.Tensor
    recv: torch.Tensor
    widths: torch.Tensor
    copies: list
    received: list
    owner: object
    values: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ReplicatedRecord:
    """A replicated table's forward, saved for backward: the owner-side lookup of every rank's keys."""

    shard: object
    owner: object


# ---------------------------------------------------------------------------------------------- estimates
@dataclasses.dataclass
class TableStats:
    """What the planner knows of one table: ``rows`` (expected live rows), ``accesses`` (unique ids looked up per
    step over all ranks), ``dim`` and ``row_bytes`` (a row with its key, score and optimizer slots), of which
    ``column_bytes`` a column."""

    name: str
    dim: int
    rows: int
    accesses: float
    row_bytes: int
    value_bytes: int = 4
    row_statistic: bool = False
    #: bytes a column takes in a row (its value and the per-column optimizer slots; 0: ``value_bytes``)
    column_bytes: int = 0


@dataclasses.dataclass
class TableLoad:
    """One table's estimated load on one rank: rows held, bytes held, lookups a step (keys this rank's shard
    finds) and bytes this rank sends a step (keys, rows and gradients)."""

    rows: float = 0.0
    bytes: float = 0.0
    lookups: float = 0.0
    wire: float = 0.0


def bytes_per_row(dim: int, dtype=torch.float32, key_dtype=torch.int64, optimizer=None) -> int:
    """Bytes a stored row of ``dim`` columns takes: values, key, score and the optimizer's slots (float32)."""
    size = dim * torch.empty(0, dtype=dtype).element_size() + torch.empty(0, dtype=key_dtype).element_size() + 8
    if optimizer is not None:
        size += 4 * sum(width for width, _ in optimizer.slot_widths(dim).values())
    return size


class ColumnSlice(Initializer):
    """The columns ``[lo, hi)`` of ``init``'s full-width rows: a column shard's rows start as its part of the whole
    table's (an initializer is a function of (seed, key, dim))."""

    def __init__(self, init, dim: int, lo: int, hi: int) -> None:
        self.init, self.dim, self.lo, self.hi = resolve_initializer(init), dim, lo, hi

    def __call__(self, keys, dim, dtype, seed):
        from ..table.initializers import initial_rows

        return initial_rows(self.init, keys, self.dim, dtype, seed)[:, self.lo: self.hi].contiguous()

    def kernel_spec(self):
        return None

    def describe(self) -> dict:
        return self.init.describe()  # the table's initializer, as the user configured it

    def to_dict(self) -> dict:
        return self.init.to_dict()

    def __repr__(self) -> str:
        return f"{self.init!r}[:, {self.lo}:{self.hi}]"


class ShardingStrategy:
    """One table's sharding on this rank (``rank``; ``None`` for a saved layout read back by a loader).

    Subclasses set :attr:`kind`, and :attr:`replicated` when the table is exchanged by all-gathers rather than
    routed keys. The defaults here are those of a row-like kind: each key on one rank of :meth:`group`, every
    column there.
    """

    kind: ClassVar[str] = ""
    replicated: ClassVar[bool] = False

    def __init__(self, sharding: Sharding, config, rank: Optional[int], world: int) -> None:
        self.sharding, self.config, self.rank, self.world = sharding, config, rank, world
        self.group = tuple(sharding.group(world))
        self.position = self.group.index(rank) if rank in self.group else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sharding!r}, rank={self.rank}, world={self.world})"

    # ------------------------------------------------------------------ placement
    def holds(self, rank: Optional[int] = None) -> bool:
        """Whether ``rank`` (default: this one) holds a part of the table."""
        return (self.rank if rank is None else rank) in self.group

    def column_range(self, rank: int) -> tuple[int, int]:
        """The table's columns ``[lo, hi)`` that ``rank`` holds (``(0, 0)``: none)."""
        return (0, self.config.dim) if self.holds(rank) else (0, 0)

    @property
    def width(self) -> int:
        lo, hi = self.column_range(self.rank)
        return hi - lo

    @property
    def _row_static(self) -> bool:
        return False

    def shard_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The user's keys (owned by this rank) -> this shard's keys, in the table's key dtype."""
        if self._row_static:
            keys = torch.div(keys.to(torch.int64), len(self.group), rounding_mode="floor")
        return keys.to(self.config.key_dtype)

    def user_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`shard_keys`."""
        if self._row_static:
            return (keys.to(torch.int64) * len(self.group) + self.position).to(self.config.key_dtype)
        return keys

    def owned(self, keys: torch.Tensor) -> torch.Tensor:
        """Bool mask of the user's ``keys`` whose rows (or this rank's columns of them) live on this rank."""
        return self.sharding.owners(keys.to(torch.int64), self.world) == self.rank

    def static_rows(self) -> int:
        """Rows of a static table on this rank."""
        return self.config.vocabulary_size

    def initializer(self):
        """The initializer of this rank's physical table (a column shard's: its columns of the whole rows)."""
        return self.config.initializer

    def check(self) -> None:
        """Refuse a table this kind cannot shard (raises ValueError naming the table and the field)."""

    def build(self, seed: int, device):
        """This rank's physical table (a Dynamic/StaticEmbedding), or None where it holds none of the table."""
        cfg = self.config
        if not self.holds():
            return None
        self.check()
        width, init = self.width, self.initializer()
        if cfg.is_static:
            rows = self.static_rows()
            if rows == 0:  # no id here: a row would stand for an id past the vocabulary, saved and served
                return None
            module = StaticEmbedding(rows, width, dtype=cfg.dtype, key_dtype=cfg.key_dtype, device=device,
                                     initializer=init, seed=seed)
            if self._row_static:  # rows start as the user's ids would: a shard equals its part of the whole
                ids = self.user_keys(module.table.row_keys)
                module.table.values.copy_(module.table.initial_rows(ids))
            return module
        return DynamicEmbedding(width, key_dtype=cfg.key_dtype, dtype=cfg.dtype, initializer=init, device=device,
                                init_capacity=cfg.init_capacity, max_capacity=cfg.max_capacity,
                                max_bytes=cfg.max_bytes, tiers=cfg.tiers, eviction=cfg.eviction,
                                half_life=cfg.half_life, admission=cfg.admission, seed=seed)

    # ------------------------------------------------------------------ keyed exchange
    def route(self, keys: torch.Tensor) -> Route:
        """input_dist: where each of the unique ``keys [U]`` (int64, the user's) goes."""
        return Route(self.sharding.owners(keys, self.world), torch.arange(keys.numel(), device=keys.device))

    def assemble(self, size: int, copies: torch.Tensor, pieces: list, dtype) -> torch.Tensor:
        """output_dist: ``[size, D]`` rows from ``pieces[r]`` (the rows rank ``r`` returned, float32, width of its
        columns) of the copies ``copies`` (positions among the unique keys, ranks in order)."""
        out = torch.empty(size, self.config.dim, device=copies.device)
        out[copies] = torch.cat(pieces) if pieces else out[:0]
        return out.to(dtype)

    def split(self, grad: torch.Tensor, copies: torch.Tensor, counts: list) -> list:
        """The gradient ``grad [U, D]`` of the unique keys as pieces for each rank (``counts[r]`` copies each)."""
        return list(grad.float().index_select(0, copies).split(counts))

    #: whether owners share a row statistic before updating (see :meth:`before_delivery`); fixed by the plan
    shares_row_statistic: bool = False

    def before_delivery(self, shard, keys: torch.Tensor, values: torch.Tensor, grad: torch.Tensor):
        """What this owner shares with the table's other owners before its optimizer runs (a column shard: its part
        of each row's statistic), from the received ``keys [N]`` (shard keys), their rows ``values [N, d]`` and
        gradients ``grad [N, d]``: ``(unique keys [U], part [U])``, the same keys in the same order on every owner
        of the table, or None."""
        return None

    def deliver(self, shard, unique: torch.Tensor, shared: torch.Tensor) -> None:
        """Before the owner-side backward: hand the table the other owners' parts of :meth:`before_delivery`,
        summed (``shared [U]`` for ``unique``)."""

    # ------------------------------------------------------------------ checkpoints and exports
    def writes(self, rank: Optional[int] = None) -> bool:
        """Whether ``rank`` writes its part of the table to a checkpoint (every holder of a sharded table)."""
        return self.holds(rank)

    def select(self, cols: dict, columnar: set) -> dict:
        """This rank's part of a whole table's ``cols`` (the user's keys, every column; ``columnar``: the names
        of the columns that are ``[N, dim]``): the rows it owns and the columns it holds."""
        kept = self.owned(cols["keys"]).nonzero().squeeze(1)
        return self._columns({name: t.index_select(0, kept) for name, t in cols.items()}, columnar)

    def _columns(self, cols: dict, columnar: set) -> dict:
        lo, hi = self.column_range(self.rank)
        if (lo, hi) == (0, self.config.dim):
            return cols
        return {name: t[:, lo:hi].contiguous() if name in columnar else t for name, t in cols.items()}

    def join(self, parts: dict, columnar: set) -> dict:
        """The whole table from the saved parts ``{rank: cols}`` (rank order) of this layout."""
        parts = list(parts.values())
        return {name: torch.cat([p[name] for p in parts]) for name in parts[0]}

    def part_config(self, config: dict, rank: int) -> dict:
        """A saved table config (``dim``, ``slots``) as the part of ``rank`` holds it."""
        return config

    def logical_rows(self, rows: list) -> int:
        """The table's rows from each writing rank's row count."""
        return int(sum(rows))

    # ------------------------------------------------------------------ estimates
    @classmethod
    def estimate(cls, sharding: Sharding, stats: TableStats, world: int) -> dict[int, TableLoad]:
        """Per rank (those holding the table), the estimated load of this table: rows and bytes spread evenly
        over the group, its share of the accesses, and on the wire keys in and rows out and gradients in."""
        group = sharding.group(world)
        share = 1.0 / len(group)
        per_key = 8 + 2 * stats.dim * stats.value_bytes
        return {r: TableLoad(stats.rows * share, stats.rows * share * stats.row_bytes, stats.accesses * share,
                             stats.accesses * share * per_key) for r in group}

    @classmethod
    def wire_floor(cls, sharding: Sharding, stats: TableStats, world: int) -> float:
        """Bytes a step must move over the wire for this table (all ranks together): each unique key not held by
        its requester once to its owner, its row back and its gradient there (key 8 bytes, row and gradient
        ``dim`` floats), assuming the requesters are spread evenly."""
        group = sharding.group(world)
        remote = 1.0 - 1.0 / world if len(group) > 1 or world > 1 else 0.0
        return stats.accesses * remote * (8 + 2 * stats.dim * stats.value_bytes)


def strategy_for(sharding: Sharding, config, rank: Optional[int], world: int) -> ShardingStrategy:
    """The strategy of ``sharding`` for table ``config`` on ``rank`` of ``world`` (the kinds register when
    :mod:`dynemb.distributed` is imported, which importing this module does first)."""
    if sharding.kind not in KINDS:
        raise ValueError(f"no strategy is registered for sharding kind {sharding.kind.value!r}; registered: "
                         f"{sorted(k.value for k in KINDS)}")
    return KINDS[sharding.kind](sharding, config, rank, world)


def strategy_from_record(record: Optional[dict], config, rank: Optional[int], world: int) -> ShardingStrategy:
    """The strategy of a saved layout (a manifest's ``sharding`` record; ``None``: one process, a whole table)."""
    if record is None:
        return strategy_for(Sharding("data"), config, rank, 1)
    fields = {k: v for k, v in record.items() if k in ("owner", "ranks", "columns") and v is not None}
    return strategy_for(Sharding(record["kind"], **fields), config, rank, world)


def even_widths(dim: int, parts: int) -> list[int]:
    """``dim`` columns over ``parts`` shards, the first ``dim % parts`` one wider."""
    return [dim // parts + (i < dim % parts) for i in range(parts)]

