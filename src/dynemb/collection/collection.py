"""EmbeddingCollection: many features over the user's tables, run locally or sharded over ranks."""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.comm import all_gather, check_agreement
from ..distributed.sharding import Sharding, resolve_plan
from ..embedding import DynamicEmbedding, check_cuda, check_move
from ..optim.combined import CombinedOptimizer
from ..checks import resolve_device
from .config import FeatureConfig, TableConfig
from .features import as_feature_dict, prepare_features
from .local import LocalExecutor
from .plan import ExecutionPlan, TableShard, draw_seeds
from .sharded import ShardedExecutor

__all__ = ["EmbeddingCollection"]

PlanSpec = Union[str, Mapping[str, Union[str, tuple, dict, Sharding]], Any]
_TABLES = "tables."  # state_dict keys: tables.<table name>.<column>


class EmbeddingCollection(nn.Module):
    """Embeddings for many features over the user's tables, on one process or sharded over ranks.

    Each table is looked up once per forward with the ids of all its features concatenated: one dedup, one
    find/insert, one gather and one (fused) optimizer update per table and step. Each table keeps its own rows,
    seed, optimizer state and step count; what is saved, exported and named in errors is the table by its name,
    whatever the layout.

    Args:
        tables: the :class:`TableConfig` s (names unique).
        features: the :class:`FeatureConfig` s; several may share a table.
        plan: ``None`` keeps every table whole on this process. Otherwise the tables are sharded over
            ``process_group``: ``"auto"`` (dynamic tables row-wise, small static tables replicated, large ones
            whole on one rank), or ``{table: "row" | "data" | "column" | "table" | ("table", rank) | ("table_row",
            ranks) | Sharding | a Sharding's to_dict}`` with the rest automatic (``"table"`` alone: whole on the
            rank holding the fewest bytes of whole tables), or a planned one
            (:func:`dynemb.distributed.plan_tables`' result, or ``json.load`` of ``dynemb plan --json``).
            Every rank must then call ``forward`` and ``backward`` each step (batches may differ).
        process_group: the group to shard over (default: the world); only with ``plan``.
        timeout: seconds (> 0) before a collective gives up with :class:`~dynemb.distributed.DistributedError`.
        device: where the tables live (``cuda`` for NCCL); one this process cannot use (``cuda`` where
            ``torch.cuda.is_available()`` is False, ``cuda:3`` on a machine with two GPUs) is a ``ValueError``.
        validate: check on every forward that a static table's ids are in ``[0, V)``, and that the int64 ids of
            an int32 table fit in int32 (they are then cast). The checks read the ids' min and max, a device sync
            on CUDA, so ``None`` (default) checks on CPU only; ``True`` checks everywhere (debugging a CUDA job:
            an out-of-range id there is a device-side assert, not an error), ``False`` nowhere. Dtypes, devices
            and shapes are always checked, and an id that does not fit is never wrapped onto another: without the
            check it fails a device-side assert.

    Shape:
        ``forward({name: ids})`` -> ``{name: [B, D]}`` for pooled features; sequence features give
        ``ids.shape + (D,)`` for dense ids and :class:`Jagged` for ``(ids, offsets)``.

    Example:
        >>> import dynemb
        >>> tables = [TableConfig(name="item", dim=4, optimizer=dynemb.optim.Adagrad(lr=0.1))]
        >>> features = [FeatureConfig(name="clicked", table="item"), FeatureConfig(name="viewed", table="item")]
        >>> ec = EmbeddingCollection(tables, features)
        >>> out = ec({"clicked": torch.tensor([[1, 2], [3, 3]]), "viewed": torch.tensor([7, 1])})
        >>> out["clicked"].shape, out["viewed"].shape
        (torch.Size([2, 4]), torch.Size([2, 4]))
        >>> sum(o.sum() for o in out.values()).backward(); ec.optimizer.step()
        >>> sorted(ec.state_dict())[:2]
        ['tables.item._extra_state', 'tables.item.keys']
    """

    def __init__(self, tables: list[TableConfig], features: list[FeatureConfig], *, plan: Optional[PlanSpec] = None,
                 process_group=None, timeout: float = 300.0, device=None, validate: Optional[bool] = None) -> None:
        super().__init__()
        if validate is not None and not isinstance(validate, bool):
            raise TypeError(f"validate must be None, True or False, got {validate!r}")
        _check_timeout(timeout)
        self.validate = validate
        self._device = resolve_device(device)
        self.table_configs, self.feature_configs = _index_configs(tables, features)
        if plan is None and process_group is not None:
            raise ValueError("process_group is given but plan is None: pass plan='auto' (or a dict) to shard")
        if plan is None:
            self.group = None
            self.plan = ExecutionPlan(tables, draw_seeds(tables), device=device)
            self.executor = LocalExecutor(self.plan)
        else:
            self.group = _sharding_group(process_group, timeout)
            world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            shardings = resolve_plan(tables, world, None if plan == "auto" else _check_plan_spec(plan))
            check_agreement(_signature(tables, features, world, shardings), self.group,
                            "EmbeddingCollection config")
            seeds = draw_seeds(tables, agree=self._agree_on_seeds)
            self.plan = ExecutionPlan(tables, seeds, shardings=shardings, rank=rank, world=world, device=device)
            self.executor = ShardedExecutor(self.plan, self.group)
        self._combined: Optional[CombinedOptimizer] = None  # made on first use (see optimizer)
        self._staged: dict = {}  # batches whose stateless stages run ahead (expect)
        self.staged_hits = 0  # forwards that took staged stages (a pipeline's check)

    @property
    def optimizer(self) -> CombinedOptimizer:
        """The tables' sparse optimizers as one (``step``, ``zero_grad``, ``state_dict``). Made on first use: a
        torch optimizer's first one imports ``torch._dynamo`` (about 2 s), which a model that only scores (``dynemb
        predict``) never needs."""
        if self._combined is None:
            self._combined = CombinedOptimizer(self.plan.optimizers())
        return self._combined

    # ------------------------------------------------------------------ what the user configured
    def extra_repr(self) -> str:
        # what ``print(model)`` shows: the user's tables and features (never the layout: groups, shards, ranks)
        tables = ", ".join(f"{t.name}(dim={t.dim}" + (f", vocabulary_size={t.vocabulary_size}" if t.vocabulary_size
                                                       else "") + ")" for t in self.table_configs.values())
        features = ", ".join(f"{f.name}->{f.table_name}" for f in self.feature_configs.values())
        return f"tables=[{tables}], features=[{features}]"

    @property
    def embeddings(self) -> Mapping[str, nn.Module]:
        """Each table's module on this rank by table name (read-only; absent: held by another rank)."""
        return MappingProxyType(self.plan.modules())

    def logical_tables(self) -> dict[str, TableShard]:
        """Every table's part on this rank, by the user's table name (used by checkpoints and exports)."""
        return dict(self.plan.shards)

    @property
    def sharded(self) -> bool:
        return self.plan.sharded

    @property
    def world(self) -> int:
        return self.plan.world

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def comm_stats(self) -> dict:
        """Bytes, calls and seconds of this rank's collectives (sharded collections)."""
        return getattr(self.executor, "comm_stats", {})

    def dynemb_tables(self) -> list:
        """The physical tables on this rank (for optimizers)."""
        return [m.table for m in self.plan.modules().values()]

    def table_totals(self) -> dict:
        """``{"rows", "evicted", "table_bytes"}`` of the user's tables, all ranks together: rows and evictions as
        one process holding the tables would count them (a replica or a column shard's keys once), bytes as every
        rank holds them. A collective when sharded (every rank calls it: one all-gather of a few integers); this
        rank's tables alone gave a result that depended on the world size (rank 0 of 2 reported about half the
        rows).

        Example:
            >>> ec = EmbeddingCollection([TableConfig(name="t", dim=4)], [FeatureConfig(name="f", table="t")])
            >>> _ = ec({"f": torch.tensor([3, 5, 3])})
            >>> ec.table_totals()["rows"], ec.table_totals()["evicted"]
            (2, 0)
        """
        shards = list(self.plan)
        here = torch.zeros(2 * len(shards) + 1, dtype=torch.int64)
        for i, shard in enumerate(shards):
            table = shard.table if shard.module is not None else None
            if table is None:
                continue
            here[-1] += table.nbytes()
            if shard.strategy is None or shard.strategy.writes(self.rank):  # a replica's copy counted once
                here[2 * i], here[2 * i + 1] = table.size(), getattr(table, "evicted", 0)
        if not self.sharded:
            every = here.view(1, -1)
        else:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" \
                else torch.device("cpu")
            parts = [torch.empty_like(here, device=device) for _ in range(self.world)]
            all_gather(parts, here.to(device), self.group, "all-gather of table sizes")
            every = torch.stack(parts).cpu()
        rows = evicted = 0
        for i, shard in enumerate(shards):
            count = shard.strategy.logical_rows if shard.strategy is not None else (lambda parts: int(sum(parts)))
            rows += count(every[:, 2 * i].tolist())
            evicted += count(every[:, 2 * i + 1].tolist())
        return {"rows": rows, "evicted": evicted, "table_bytes": int(every[:, -1].sum())}

    @property
    def tiered(self) -> bool:
        """Whether any table has a slow tier (``TableConfig.tiers``): only then does :meth:`prefetch` do work."""
        return any(cfg.tiers is not None for cfg in self.table_configs.values())

    # ------------------------------------------------------------------ lookups
    def forward(self, features, weights: Optional[dict] = None) -> dict:
        """Look up every feature given: ``features`` is ``{feature name: input}`` or a TorchRec
        ``KeyedJaggedTensor``; each input is ids ``[B]`` (one per sample), dense ``[B, M]``, sparse COO,
        ``(ids, offsets)``, ``(ids, offsets, weights)``, :class:`Bags` (offsets or lengths) or a ``JaggedTensor``.
        ``weights`` optionally maps feature names to per-id weights. See the class docstring for shapes.

        Every feature is validated before any table changes. Tables insert only in training mode with grad mode
        on; under ``eval()`` or ``torch.no_grad()`` they are read-only. Sharded: a collective call that every
        rank makes."""
        features = as_feature_dict(features)
        staged = self._staged.pop(_identity(features), None) if weights is None and self._staged else None
        exchange = None
        if staged is not None:  # its stateless stages ran ahead (dynemb.train.Pipeline)
            prepared, exchange = staged.result()
            self.staged_hits += 1
        else:
            prepared = self._prepare(features, weights)
        if self.training and torch.is_grad_enabled():  # what training looks up, for the planner (no device sync)
            for name, parts in prepared.items():
                seen = self.plan[name].observed
                seen["accesses"] += sum(p.ids.numel() for p in parts)
            for shard in self.plan:
                shard.observed["steps"] += 1
        out = self.executor.forward(prepared, self.training, exchange) if exchange is not None else \
            self.executor.forward(prepared, self.training)
        return {name: out[name] for name in features}

    def _prepare(self, features: dict, weights: Optional[dict]) -> dict:
        check = self.validate if self.validate is not None else self._device.type == "cpu"
        return prepare_features(features, weights or {}, self.feature_configs, self.table_configs, self._device,
                                check_ranges=check)

    def stage(self, features, group=None):
        """The stages of :meth:`forward` that change no state, for a batch that a later forward will look up:
        validation, the copy to the device, and (sharded) deduplication and the key all-to-all over ``group`` (a
        process group of the caller's, so that it can run on another thread while the current batch computes).
        Returns ``(prepared, key exchange)``; :meth:`expect` hands it to the forward of the same ``features``.
        Sharded: a collective on ``group``, in the same batch order on every rank."""
        features = as_feature_dict(features)
        prepared = self._prepare(features, None)
        return prepared, (self.executor.input_dist(prepared, group) if self.sharded else None)

    def expect(self, features, staged) -> None:
        """The forward of ``features`` (the same tensors) takes ``staged`` (a future of :meth:`stage`'s result)
        instead of running those stages itself."""
        features = as_feature_dict(features)
        self._staged[_identity(features)] = _Staged(features, staged)

    def forget(self, features) -> None:
        """Drop what :meth:`expect` registered for ``features`` (a batch that was never looked up)."""
        self._staged.pop(_identity(as_feature_dict(features)), None)

    def prefetch(self, features) -> None:
        """Bring the rows that ``features`` (the next batch, in any form :meth:`forward` takes) will read into the
        fast tier of every tiered table (``TableConfig.tiers``) on this rank, so that the forward that reads them
        finds them there. Other tables ignore it. Nothing is inserted and no result changes. Sharded: each rank
        prefetches the ids of its own batch that it owns (not a collective).

        Example:
            >>> from dynemb.table import Tiers
            >>> ec = EmbeddingCollection([TableConfig(name="t", dim=2, tiers=Tiers(fast_capacity=8))],
            ...                          [FeatureConfig(name="f", table="t")])
            >>> ec.prefetch({"f": torch.tensor([[1, 2]])})
        """
        if not self.tiered:  # every row of an untiered table is in place
            return
        prepared = prepare_features(as_feature_dict(features), {}, self.feature_configs, self.table_configs,
                                    self._device, check_ranges=False)
        for name, parts in prepared.items():
            shard = self.plan[name]
            if shard.module is not None and shard.config.tiers is not None:
                keys = torch.cat([p.ids for p in parts])
                shard.table.prefetch(shard.shard_keys(keys[shard.owned(keys)]))

    def export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [N], values [N, D])`` of ``table`` on this rank, in the user's keys."""
        shard = self._shard(table)
        if shard.module is None:
            cfg = shard.config
            return torch.empty(0, dtype=cfg.key_dtype), torch.empty(0, cfg.dim, dtype=cfg.dtype)
        rows = shard.table.export()
        return shard.user_keys(rows.keys), rows.values

    def gather_export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's rows of ``table``, concatenated (a collective when sharded; a replica is one copy)."""
        keys, values = self.export(table)
        if not self.sharded:
            return keys, values
        return self.executor.gather(self._shard(table), keys, values)

    def _shard(self, table: str) -> TableShard:
        if table not in self.plan.shards:
            raise KeyError(f"no table {table!r}; tables: {list(self.plan.shards)}")
        return self.plan[table]

    # ------------------------------------------------------------------ sharding set-up
    def _agree_on_seeds(self, seeds: dict) -> dict:
        """Rank 0's seeds win, so seed=None tables initialize identically on every rank."""
        names = sorted(seeds)
        values = torch.tensor([seeds[n] for n in names], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            values = values.cuda()
        dist.broadcast(values, src=dist.get_global_rank(self.group, 0), group=self.group)
        return dict(zip(names, values.tolist()))

    # ------------------------------------------------------------------ nn.Module plumbing
    def to(self, *args, **kwargs):
        check_move(args, kwargs)  # a device this process cannot use: a ValueError before any table moves
        return super().to(*args, **kwargs)

    def cuda(self, device=None):
        check_cuda(device)
        return super().cuda(device)

    def _apply(self, fn, recurse=True):
        for module in self.plan.modules().values():  # .to(device) moves the tables; .half() etc. convert their rows
            module._apply(fn, recurse)
        for shard in self.plan:  # also where this rank holds none of the table: its outputs take the same dtype
            shard.cast_dtype = fn(torch.empty(0, dtype=shard.dtype)).dtype
        self._device = fn(torch.empty(0, device=self._device)).device
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, shard in self.plan.shards.items():
            if shard.module is None:
                continue
            shard.module._save_to_state_dict(destination, f"{prefix}{_TABLES}{name}.", keep_vars)
            if shard.optimizer is not None:
                destination[f"{prefix}{_TABLES}{name}.optimizer"] = shard.optimizer.state_dict()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        expected = set()
        for name, shard in self.plan.shards.items():
            if shard.module is None:
                continue
            table_prefix = f"{prefix}{_TABLES}{name}."
            names = _state_names(shard)
            expected.update(table_prefix + n for n in names)
            before = len(missing_keys) + len(error_msgs)
            shard.module._load_from_state_dict(state_dict, table_prefix, local_metadata, strict, missing_keys,
                                               [], error_msgs)
            if shard.optimizer is not None and len(missing_keys) + len(error_msgs) == before:
                state = state_dict.get(table_prefix + "optimizer")
                if state is None:
                    missing_keys.append(table_prefix + "optimizer")
                else:
                    try:
                        shard.optimizer.load_state_dict(state)
                    except (TypeError, ValueError, KeyError) as e:
                        error_msgs.append(f"table {name!r}: optimizer state: {e}")
        own = {k: v for k, v in state_dict.items() if not k.startswith(prefix + _TABLES)}
        super()._load_from_state_dict(own, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix + _TABLES) and k not in expected)


def _state_names(shard: TableShard) -> list[str]:
    """The state_dict entries of one table (relative to ``tables.<name>.``)."""
    table = shard.table
    names = ["values"] + ["slot." + s for s in table.slot_names]
    if isinstance(shard.module, DynamicEmbedding):
        names += ["keys", "scores", "_extra_state"]
    if shard.optimizer is not None:
        names.append("optimizer")
    return names


class _Staged:
    """A batch's staged stages: holds its features (so that their tensors' ids stay theirs) and the future."""

    def __init__(self, features: dict, future) -> None:
        self.features, self.future = features, future

    def result(self):
        return self.future.result()


def _identity(features: dict) -> tuple:
    """A batch's identity: its features' names and where their tensors lie (kept alive by :class:`_Staged`)."""
    def ids(value):
        if isinstance(value, torch.Tensor):  # (a view made again of the same memory is the same input)
            return value.data_ptr(), tuple(value.shape), value.stride(), value.dtype, value.device
        if isinstance(value, (tuple, list)):
            return tuple(ids(v) for v in value)
        return id(value)
    return tuple((name, ids(value)) for name, value in features.items())


def _index_configs(tables: list[TableConfig], features: list[FeatureConfig]):
    if not isinstance(tables, (list, tuple)) or not all(isinstance(t, TableConfig) for t in tables):
        raise TypeError(f"tables must be a list of TableConfig, got {tables!r}")
    if not isinstance(features, (list, tuple)) or not all(isinstance(f, FeatureConfig) for f in features):
        raise TypeError(f"features must be a list of FeatureConfig, got {features!r}")
    table_configs = {t.name: t for t in tables}
    if len(table_configs) != len(tables):
        raise ValueError(f"table names must be unique, got {[t.name for t in tables]}")
    feature_configs = {f.name: f for f in features}
    if len(feature_configs) != len(features):
        raise ValueError(f"feature names must be unique, got {[f.name for f in features]}")
    for f in features:
        if f.table_name not in table_configs:
            raise ValueError(f"feature {f.name!r} uses table {f.table_name!r}, which is not in tables "
                             f"{sorted(table_configs)}")
        if not isinstance(f.table, str) and f.table != table_configs[f.table_name]:
            raise ValueError(f"feature {f.name!r} names table {f.table_name!r} with a TableConfig that differs "
                             "from the one in tables")
    return table_configs, feature_configs


def _check_plan_spec(plan) -> dict:
    if isinstance(getattr(plan, "shardings", None), Mapping):  # a TablePlan (plan_tables): its shardings
        return dict(plan.shardings)
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be None, 'auto', a dict {{table: sharding}} or a plan_tables() plan, got "
                        f"{plan!r}")
    return dict(plan)


def _check_timeout(timeout) -> None:
    """``timeout`` is seconds > 0: 0 made every collective fail at once (a bare ``DistStoreError: wait timeout after
    0ms`` on every rank), a negative or infinite one failed inside ``timedelta`` or the process group."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise ValueError(f"timeout must be a finite number of seconds > 0 (a collective's limit before it gives up "
                         f"with DistributedError; default 300), got {timeout!r}")


def _sharding_group(process_group, timeout: float):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("a sharded EmbeddingCollection (plan given) needs torch.distributed: call "
                           "dist.init_process_group first (or launch with torchrun)")
    backend = dist.get_backend(process_group)
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    return dist.new_group(ranks=ranks, backend=backend, timeout=timedelta(seconds=timeout))


def _signature(tables, features, world: int, shardings: dict) -> dict:
    def table(cfg):
        d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "seed"}
        return {k: (repr(v) if not isinstance(v, (int, float, str, type(None))) else v) for k, v in d.items()}

    return {"world": world, "tables": [table(t) for t in tables], "features": [repr(f) for f in features],
            "plan": {k: v.describe() for k, v in shardings.items()}}
