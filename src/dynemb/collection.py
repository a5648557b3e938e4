"""TableConfig, FeatureConfig and EmbeddingCollection: many features over shared, optionally stacked tables.

Each physical table is looked up once per forward with the ids of all its features concatenated, so a step costs
one dedup, one find/insert, one gather and one (fused) optimizer update per physical table.

Stacking (``table_stacking="auto"``) stores compatible tables in one physical table:
- static tables of the same dim, dtype and optimizer are concatenated row-wise (id ``i`` of table ``t`` is row
  ``offset_t + i``);
- dynamic int32-keyed tables of the same dim, dtype, optimizer and policy share one int64-keyed table, with key
  ``t << 32 | (id & 0xFFFFFFFF)``, which is injective.
Dynamic int64-keyed tables are never stacked: a 64-bit id plus a table id does not fit one 64-bit key without
collisions. Each logical table keeps its own initializer and seed, so results are identical with and without
stacking.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from torch import nn

from .embedding import DynamicEmbedding, StaticEmbedding
from .functional import COMBINERS, pool, pool_many, pooled_lookup, to_bags, unique_rows
from .optim.base import SparseOptimizer
from .optim.combined import CombinedOptimizer
from .table.checks import KEY_DTYPES, VALUE_DTYPES
from .table.initializers import Initializer, InitializerSpec, resolve_initializer

__all__ = ["TableConfig", "FeatureConfig", "EmbeddingCollection", "Jagged"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig:
    """One embedding table.

    Attributes:
        name: unique table name.
        dim: embedding width.
        vocabulary_size: ``None`` for a dynamic (hash) table; an int for a static dense table of ids ``[0, V)``.
        initializer: as for :class:`DynamicEmbedding`.
        optimizer: an unbound sparse optimizer spec, e.g. ``dynemb.optim.Adagrad(lr=0.1)``; bound per table.
        combiner: default pooling of the table's features: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
        dtype: value dtype.
        key_dtype: id dtype (dynamic tables); int32 tables can be stacked.
        max_capacity, eviction, admission: dynamic tables only; see :class:`DynamicEmbedding`.
        init_capacity: rows allocated up front (dynamic tables).
        seed: initializer seed; ``None`` draws one from torch's RNG when the collection is built.
    """

    name: str
    dim: int
    vocabulary_size: Optional[int] = None
    initializer: InitializerSpec = "uniform"
    optimizer: Optional[SparseOptimizer] = None
    combiner: str = "mean"
    dtype: torch.dtype = torch.float32
    key_dtype: torch.dtype = torch.int64
    max_capacity: Optional[int] = None
    eviction: Optional[str] = None
    admission: Optional[int] = None
    init_capacity: int = 8192
    seed: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableConfig.name must be a non-empty str, got {self.name!r}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"TableConfig({self.name!r}).dim must be an int >= 1, got {self.dim!r}")
        if self.vocabulary_size is not None and (isinstance(self.vocabulary_size, bool)
                                                 or not isinstance(self.vocabulary_size, int)
                                                 or self.vocabulary_size < 1):
            raise ValueError(f"TableConfig({self.name!r}).vocabulary_size must be None or an int >= 1, "
                             f"got {self.vocabulary_size!r}")
        if self.combiner not in COMBINERS:
            raise ValueError(f"TableConfig({self.name!r}).combiner must be one of {COMBINERS}, got {self.combiner!r}")
        if self.dtype not in VALUE_DTYPES:
            raise TypeError(f"TableConfig({self.name!r}).dtype must be one of {VALUE_DTYPES}, got {self.dtype!r}")
        if self.key_dtype not in KEY_DTYPES:
            raise TypeError(f"TableConfig({self.name!r}).key_dtype must be int32 or int64, got {self.key_dtype!r}")
        if self.optimizer is not None and not isinstance(self.optimizer, SparseOptimizer):
            raise TypeError(f"TableConfig({self.name!r}).optimizer must be a dynemb.optim optimizer spec, "
                            f"got {self.optimizer!r}")
        if self.optimizer is not None and self.optimizer.tables:
            raise ValueError(f"TableConfig({self.name!r}).optimizer must be unbound (built without tables)")
        if self.vocabulary_size is not None and (self.max_capacity, self.eviction, self.admission) != (None,) * 3:
            raise ValueError(f"TableConfig({self.name!r}): max_capacity/eviction/admission apply to dynamic tables "
                             "only (vocabulary_size=None)")
        resolve_initializer(self.initializer, f"TableConfig({self.name!r}).initializer")

    @property
    def is_static(self) -> bool:
        return self.vocabulary_size is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig:
    """One input feature looked up in ``table`` (a table name or its TableConfig).

    Attributes:
        name: the feature's key in the input dict.
        table: the table it reads.
        combiner: ``None`` pools with the table's combiner; ``"sum"``/``"mean"``/``"sqrtn"`` override it;
            ``"none"`` returns the sequence of rows without pooling.
        padding_value: for dense ``[B, M]`` inputs, entries equal to it are skipped.
        max_norm: clip each row's L2 norm before combining.
    """

    name: str
    table: Union[str, TableConfig]
    combiner: Optional[str] = None
    padding_value: Optional[int] = None
    max_norm: Optional[float] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FeatureConfig.name must be a non-empty str, got {self.name!r}")
        if self.combiner is not None and self.combiner not in COMBINERS + ("none",):
            raise ValueError(f"FeatureConfig({self.name!r}).combiner must be None, 'none' or one of {COMBINERS}, "
                             f"got {self.combiner!r}")

    @property
    def table_name(self) -> str:
        return self.table if isinstance(self.table, str) else self.table.name


class Jagged(tuple):
    """Sequence output for ``(ids, offsets)`` inputs: ``(values [N, D], offsets [B])``."""

    def __new__(cls, values, offsets):
        return super().__new__(cls, (values, offsets))

    values = property(lambda self: self[0])
    offsets = property(lambda self: self[1])


class _StackedInit(Initializer):
    """Initializes packed keys ``t << 32 | id`` with logical table ``t``'s own initializer and seed."""

    def __init__(self, parts: list[tuple[Initializer, int]]) -> None:
        self.parts = parts

    def __call__(self, keys, dim, dtype, seed):
        tags, ids = keys >> 32, (keys & 0xFFFFFFFF).to(torch.int32)
        out = torch.empty(keys.numel(), dim, dtype=dtype, device=keys.device)
        for tag, (init, part_seed) in enumerate(self.parts):  # a loop over tables, not keys
            sel = (tags == tag).nonzero().squeeze(1)
            if sel.numel():
                out[sel] = init(ids.index_select(0, sel), dim, dtype, part_seed)
        return out

    def describe(self) -> dict:
        return {"type": "stacked", "parts": [[init.describe(), seed] for init, seed in self.parts]}


@dataclasses.dataclass(frozen=True)
class _Route:
    physical: str
    tag: int  # row offset (static) or key tag (dynamic int32); -1 when not stacked
    static: bool


def _stack_group(cfg: TableConfig):
    if cfg.is_static:
        return ("static", cfg.dim, cfg.dtype, cfg.optimizer)
    if cfg.key_dtype == torch.int32 and cfg.max_capacity is None and cfg.admission is None:
        return ("dynamic32", cfg.dim, cfg.dtype, cfg.optimizer, cfg.eviction)
    return None


class EmbeddingCollection(nn.Module):
    """Embeddings for many features over shared tables.

    Args:
        tables: the TableConfigs (names unique).
        features: the FeatureConfigs; several may share a table.
        table_stacking: ``"auto"`` stacks compatible tables (see module docs); ``None`` keeps them apart.
        device: where the tables live.

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
    """

    def __init__(self, tables: list[TableConfig], features: list[FeatureConfig], *,
                 table_stacking: Optional[str] = "auto", device=None) -> None:
        super().__init__()
        if table_stacking not in ("auto", None):
            raise ValueError(f"table_stacking must be 'auto' or None, got {table_stacking!r}")
        self._validate(tables, features)
        seeds = {t.name: t.seed if t.seed is not None else int(torch.randint(0, 2**31, (1,)).item()) for t in tables}
        self.embeddings = nn.ModuleDict()
        self.routes: dict[str, _Route] = {}
        groups: dict = {}
        for cfg in tables:
            key = _stack_group(cfg) if table_stacking == "auto" else None
            groups.setdefault(key if key is not None else ("alone", cfg.name), []).append(cfg)
        for members in groups.values():
            self._build(members, seeds, device)
        self.optimizer = CombinedOptimizer({name: self._physical_optimizer[name].bind([module])
                                            for name, module in self.embeddings.items()
                                            if self._physical_optimizer[name] is not None})

    def _validate(self, tables: list[TableConfig], features: list[FeatureConfig]) -> None:
        self.table_configs = {t.name: t for t in tables}
        if len(self.table_configs) != len(tables):
            raise ValueError(f"table names must be unique, got {[t.name for t in tables]}")
        self.feature_configs = {f.name: f for f in features}
        if len(self.feature_configs) != len(features):
            raise ValueError(f"feature names must be unique, got {[f.name for f in features]}")
        for f in features:
            if f.table_name not in self.table_configs:
                raise ValueError(f"feature {f.name!r} uses table {f.table_name!r}, which is not in tables "
                                 f"{sorted(self.table_configs)}")

    @staticmethod
    def _check_static_range(fname: str, tcfg: TableConfig, ids: torch.Tensor) -> None:
        if tcfg.is_static and ids.numel():
            limit = tcfg.vocabulary_size
            if int(ids.min()) < 0 or int(ids.max()) >= limit:
                raise ValueError(f"ids of feature {fname!r} must be in [0, {limit}) for static table {tcfg.name!r}")

    def _build(self, members: list[TableConfig], seeds: dict, device) -> None:
        if not hasattr(self, "_physical_optimizer"):
            self._physical_optimizer = {}
        first = members[0]
        name = first.name if len(members) == 1 else "stack:" + "+".join(m.name for m in members)
        self._physical_optimizer[name] = first.optimizer
        if first.is_static:
            total = sum(m.vocabulary_size for m in members)
            module = StaticEmbedding(total, first.dim, dtype=first.dtype, device=device, initializer="zeros")
            offset = 0
            for m in members:
                ids = torch.arange(m.vocabulary_size, dtype=torch.int64, device=module.table.device)
                init = resolve_initializer(m.initializer)
                module.table.values[offset: offset + m.vocabulary_size] = init(ids, m.dim, m.dtype, seeds[m.name])
                self.routes[m.name] = _Route(name, offset if len(members) > 1 else -1, True)
                offset += m.vocabulary_size
        elif len(members) == 1:
            module = DynamicEmbedding(first.dim, key_dtype=first.key_dtype, dtype=first.dtype,
                                      initializer=first.initializer, device=device,
                                      init_capacity=first.init_capacity, max_capacity=first.max_capacity,
                                      eviction=first.eviction, admission=first.admission, seed=seeds[first.name])
            self.routes[first.name] = _Route(name, -1, False)
        else:
            init = _StackedInit([(resolve_initializer(m.initializer), seeds[m.name]) for m in members])
            module = DynamicEmbedding(first.dim, key_dtype=torch.int64, dtype=first.dtype, initializer=init,
                                      device=device, init_capacity=sum(m.init_capacity for m in members),
                                      eviction=first.eviction, seed=0)
            for tag, m in enumerate(members):
                self.routes[m.name] = _Route(name, tag, False)
        self.embeddings[name] = module

    def dynemb_tables(self):
        return [m.table for m in self.embeddings.values()]

    def _physical_ids(self, route: _Route, ids: torch.Tensor, table) -> torch.Tensor:
        if route.tag < 0:
            return ids
        if route.static:
            return ids.to(torch.int64) + route.tag  # the logical range was checked in forward
        if ids.dtype != torch.int32:
            raise TypeError(f"ids of an int32 table must be int32, got {ids.dtype}")
        return (ids.to(torch.int64) & 0xFFFFFFFF) | (route.tag << 32)

    def forward(self, features: dict, weights: Optional[dict] = None) -> dict:
        """Look up every feature given; see the class docstring for shapes."""
        by_table: dict[str, list] = {}
        for table, parts in self._prepare_all(features, weights or {}).items():
            route = self.routes[table]
            module = self.embeddings[route.physical]
            for prepared in parts:
                prepared["ids"] = self._physical_ids(route, prepared["ids"], module.table)
            by_table.setdefault(route.physical, []).extend(parts)
        out = {}
        for physical, parts in by_table.items():
            out.update(self._lookup(self.embeddings[physical], parts))
        return {name: out[name] for name in features}

    def _prepare_all(self, features: dict, weights: dict) -> dict:
        """Validated, normalized features grouped by (logical) table name."""
        unknown = set(features) - set(self.feature_configs)
        if unknown:
            raise ValueError(f"features {sorted(unknown)} are not configured; known: {sorted(self.feature_configs)}")
        by_table: dict[str, list] = {}
        for fname, value in features.items():
            fcfg = self.feature_configs[fname]
            tcfg = self.table_configs[fcfg.table_name]
            prepared = self._prepare(fname, fcfg, tcfg, value, weights.get(fname))
            self._check_static_range(fname, tcfg, prepared["ids"])
            by_table.setdefault(tcfg.name, []).append(prepared)
        return by_table

    def _lookup(self, module, parts: list[dict]) -> dict:
        """Outputs of the features ``parts`` of one physical table: one dedup, one find and one pooling op for all
        plain pooled features (no ``max_norm``), which pool straight from the table when they are all there is."""
        ids = torch.cat([p["ids"] for p in parts])
        plain = [p for p in parts if p["seq"] is None and p["max_norm"] is None]
        bag_sets = [(p["ids"].numel(), p["offsets"], p["weights"], p["bags"], p["combiner"]) for p in plain]
        if len(plain) == len(parts):
            return {p["name"]: pooled for p, pooled in zip(parts, pooled_lookup(module, ids, bag_sets))}
        values, inverse = unique_rows(module, ids)
        inverses = dict(zip([p["name"] for p in parts], inverse.split([p["ids"].numel() for p in parts])))
        plain_inverse = torch.cat([inverses[p["name"]] for p in plain]) if plain else inverse[:0]
        out = {p["name"]: pooled for p, pooled in zip(plain, pool_many(values, plain_inverse, bag_sets))}
        for p in parts:
            if p["name"] not in out:
                out[p["name"]] = self._finish(p, values, inverses[p["name"]])
        return out

    def _prepare(self, fname, fcfg: FeatureConfig, tcfg: TableConfig, value, weight) -> dict:
        combiner = fcfg.combiner or tcfg.combiner
        if combiner == "none":
            if isinstance(value, (tuple, list)):
                ids, offsets = value
                return {"name": fname, "ids": ids.reshape(-1), "seq": "jagged", "offsets": offsets,
                        "max_norm": fcfg.max_norm}
            return {"name": fname, "ids": value.reshape(-1), "seq": tuple(value.shape), "max_norm": fcfg.max_norm}
        if isinstance(value, (tuple, list)):
            ids, offsets = value
        elif isinstance(value, torch.Tensor) and not value.is_sparse and value.dim() == 1:
            ids, offsets = value, torch.arange(value.numel(), device=value.device)  # one id per sample
        else:
            ids, offsets = value, None
        flat, offsets, w, num_bags = to_bags(ids, offsets, weight, padding_value=fcfg.padding_value)
        return {"name": fname, "ids": flat, "offsets": offsets, "weights": w, "bags": num_bags,
                "combiner": combiner, "max_norm": fcfg.max_norm, "seq": None}

    def _finish(self, p: dict, values, inverse):
        from .functional import _clip

        if p["max_norm"] is not None:
            used, local = torch.unique(inverse, return_inverse=True)
            values, inverse = _clip(values.index_select(0, used), p["max_norm"]), local
        if p["seq"] is None:
            return pool(values, inverse, p["offsets"], p["weights"], p["bags"], p["combiner"])
        rows = torch.nn.functional.embedding(inverse, values)
        if p["seq"] == "jagged":
            return Jagged(rows, p["offsets"])
        return rows.view(*p["seq"], values.shape[1])

    def export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, values)`` of one logical table, unstacked."""
        route = self.routes[table]
        keys, values = self.embeddings[route.physical].export()
        if route.tag < 0:
            return keys, values
        cfg = self.table_configs[table]
        if route.static:
            sel = (keys >= route.tag) & (keys < route.tag + cfg.vocabulary_size)
            return keys[sel] - route.tag, values[sel]
        sel = (keys >> 32) == route.tag
        return (keys[sel] & 0xFFFFFFFF).to(torch.int32), values[sel]
