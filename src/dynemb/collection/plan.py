"""The execution plan: how the user's logical tables are laid out on this process.

The plan is the one place that builds physical tables. For each logical table (a :class:`TableConfig`) it holds a
:class:`TableShard`: the table's rows that live on this rank (all of them without sharding), the key transform
between the user's keys and the shard's keys, and the optimizer bound to that shard. Everything that saves,
loads or serves state asks the plan for logical tables and speaks the user's names and keys; only the executors
know about ranks.

How a table is spread over ranks, and which of its keys and columns live here, is its sharding strategy's
(:mod:`dynemb.distributed.strategy`, one module per kind: row, table, table_row, column, data); without sharding
the shard is the whole table and its keys are the user's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import torch

from ..distributed.sharding import Sharding
from ..distributed.strategy import ShardingStrategy, strategy_for
from ..embedding import DynamicEmbedding, StaticEmbedding
from ..functional.grouped import GroupedLookup, group_tables
from ..optim.base import SparseOptimizer
from ..table.policy import EvictionPolicy
from .config import TableConfig

__all__ = ["TableShard", "ExecutionPlan", "ExecutionGroup", "draw_seeds", "whole_table"]

Module = Union[DynamicEmbedding, StaticEmbedding]


@dataclasses.dataclass
class TableShard:
    """One logical table's part on this rank.

    Attributes:
        config: the user's table.
        seed: the initializer seed every rank uses.
        sharding: how the table is spread over ranks (``None``: not sharded).
        rank, world: this process in the sharding group.
        strategy: the sharding's strategy for this table on this rank (``None``: not sharded).
        module: the physical table's module (``None`` on a rank that holds none of the table: a table-sharded
            table's other ranks, and the ranks that own no id of a row-sharded static table whose vocabulary is
            smaller than the world).
        optimizer: the table's own bound sparse optimizer (``None`` without one or without a module).
    """

    config: TableConfig
    seed: int
    sharding: Optional[Sharding] = None
    rank: int = 0
    world: int = 1
    strategy: Optional[ShardingStrategy] = None
    module: Optional[Module] = None
    optimizer: Optional[SparseOptimizer] = None
    #: the rows' dtype after a cast of the collection (``.half()``); ``None``: the config's
    cast_dtype: Optional[torch.dtype] = None
    #: what training on this rank looked up (for the planner, saved in checkpoint manifests): ids, unique ids
    #: (sharded collections) and training steps; plus what a loaded checkpoint had seen (rank 0 keeps it)
    observed: dict = dataclasses.field(default_factory=lambda: {"accesses": 0, "unique_accesses": 0, "steps": 0})
    observed_before: Optional[dict] = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the table's rows, known on every rank (also one that holds none of it)."""
        return self.cast_dtype or self.config.dtype

    @property
    def trains(self) -> bool:
        """Whether the table takes inserts and gradients: False once frozen (``requires_grad_(False)``)."""
        return self.module is None or bool(self.module.table.requires_grad)

    @property
    def table(self):
        """The physical table (``KeyValueTable`` or ``StaticTable``), or None."""
        return self.module.table if self.module is not None else None

    def shard_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The user's keys (owned by this rank) -> this shard's keys, in the table's key dtype."""
        if self.strategy is not None:
            return self.strategy.shard_keys(keys)
        return keys.to(self.config.key_dtype)

    def user_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`shard_keys`."""
        return self.strategy.user_keys(keys) if self.strategy is not None else keys

    def owned(self, keys: torch.Tensor) -> torch.Tensor:
        """Bool mask of the user's ``keys`` whose rows (or columns of them) live on this rank."""
        if self.strategy is None:
            return torch.ones_like(keys, dtype=torch.bool)
        return self.strategy.owned(keys)

    def describe_sharding(self) -> Optional[dict]:
        return self.sharding.describe() if self.sharding is not None else None


@dataclasses.dataclass(frozen=True)
class ExecutionGroup:
    """Tables of this rank whose training lookups run as one call of each group kernel: their ``names`` (config
    order) and the :class:`~dynemb.functional.grouped.GroupedLookup` that runs them. An execution detail: nothing
    of it is saved, exported or named in an error."""

    names: tuple[str, ...]
    lookup: GroupedLookup


def whole_table(name: str, module: Module) -> TableShard:
    """A standalone Dynamic/StaticEmbedding as a logical table ``name`` (its config read from the module)."""
    t = module.table
    static = isinstance(module, StaticEmbedding)
    tiers = getattr(t, "tiers", None)
    # a policy is config only where it evicts (or moves rows down); an unbounded table's lru is the default's
    policy = t.policy if not static and (t.max_capacity is not None or tiers is not None) else None
    config = TableConfig(name=name, dim=t.dim, vocabulary_size=t.num_rows if static else None, dtype=t.dtype,
                         key_dtype=t.key_dtype, initializer=t.initializer,
                         max_capacity=None if static else t.max_capacity, eviction=policy, tiers=tiers,
                         admission=None if static else t.admission, seed=t.seed,
                         half_life=t.half_life if policy is EvictionPolicy.DECAYED_LFU else None)
    return TableShard(config, t.seed, module=module)


def draw_seeds(tables: list[TableConfig], agree: Optional[Callable[[dict], dict]] = None) -> dict[str, int]:
    """Each table's seed: its config's, else one drawn from torch's RNG (``agree`` makes ranks use rank 0's)."""
    seeds = {t.name: t.seed if t.seed is not None else int(torch.randint(0, 2**31, (1,)).item()) for t in tables}
    return agree(seeds) if agree is not None else seeds


class ExecutionPlan:
    """Every logical table's :class:`TableShard` on this rank, in config order.

    Args:
        tables: the user's tables.
        seeds: ``{name: seed}`` (see :func:`draw_seeds`).
        shardings: ``{name: Sharding}`` for a sharded collection; ``None`` keeps every table whole here.
        rank, world: this process in the sharding group.
        device: where the physical tables live.
    """

    def __init__(self, tables: list[TableConfig], seeds: dict[str, int], *,
                 shardings: Optional[dict[str, Sharding]] = None, rank: int = 0, world: int = 1,
                 device=None) -> None:
        self.rank, self.world = rank, world
        self.sharded = shardings is not None
        self.shards: dict[str, TableShard] = {}
        for cfg in tables:
            sharding = shardings[cfg.name] if shardings is not None else None
            strategy = strategy_for(sharding, cfg, rank, world) if sharding is not None else None
            shard = TableShard(cfg, seeds[cfg.name], sharding, rank, world, strategy)
            shard.module = self._build(shard, device)
            if shard.module is not None:
                shard.module.table.name = cfg.name  # for messages about the table (gradients with no optimizer)
            if shard.module is not None and cfg.optimizer is not None:
                shard.optimizer = cfg.optimizer.bind([shard.module])
            self.shards[cfg.name] = shard
        self.groups = self._groups()

    def _groups(self) -> list[ExecutionGroup]:
        """The tables on this rank whose training lookups run together, one kernel call an operation for a group
        (:mod:`dynemb.functional.grouped`): dynamic tables of one device and key dtype whose fused optimizers share
        an update kernel (dims may differ). A table in no group runs its own lookups; so does a grouped table on a
        call the group cannot take it (frozen, a bound it would pass)."""
        # a column shard whose optimizer shares a row statistic updates through the optimizer's own path, which
        # takes the other shards' parts of it (the group kernels cannot)
        tables = {name: s.table for name, s in self.shards.items() if s.table is not None
                  and not (s.strategy is not None and s.strategy.shares_row_statistic)}
        return [ExecutionGroup(tuple(names), GroupedLookup([tables[n] for n in names]))
                for names in group_tables(tables)]

    def describe_groups(self) -> list[list[str]]:
        """The execution groups by table name (see :meth:`_groups`). Every backend runs them grouped: numba and
        Triton with their group kernels, torch with the group family's torch reference
        (:mod:`~dynemb.table.group_reference`)."""
        return [list(g.names) for g in self.groups]

    def __getitem__(self, name: str) -> TableShard:
        return self.shards[name]

    def __iter__(self):
        return iter(self.shards.values())

    def _build(self, shard: TableShard, device) -> Optional[Module]:
        """The physical table of ``shard`` on this rank (the only place one is built): its strategy's part, or the
        whole table."""
        if shard.strategy is not None:
            return shard.strategy.build(shard.seed, device)
        cfg = shard.config
        if cfg.is_static:
            return StaticEmbedding(cfg.vocabulary_size, cfg.dim, dtype=cfg.dtype, key_dtype=cfg.key_dtype,
                                   device=device, initializer=cfg.initializer, seed=shard.seed)
        return DynamicEmbedding(cfg.dim, key_dtype=cfg.key_dtype, dtype=cfg.dtype, initializer=cfg.initializer,
                                device=device, init_capacity=cfg.init_capacity, max_capacity=cfg.max_capacity,
                                max_bytes=cfg.max_bytes, tiers=cfg.tiers, eviction=cfg.eviction,
                                half_life=cfg.half_life, admission=cfg.admission, seed=shard.seed)

    def modules(self) -> dict[str, Module]:
        """The physical modules on this rank by table name."""
        return {name: s.module for name, s in self.shards.items() if s.module is not None}

    def optimizers(self) -> dict[str, SparseOptimizer]:
        """The tables' own bound optimizers by table name."""
        return {name: s.optimizer for name, s in self.shards.items() if s.optimizer is not None}
