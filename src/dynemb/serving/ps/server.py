"""ParameterServer: the config, loading, lookups, online updates and lifecycle of the parameter server."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from ...table.checks import check_keys
from ..config import ModelConfig, ServerConfig
from ..export_reader import read_export
from .cache import TableState, new_table
from .tiers import Tier, Tiers
from .writeback import WriteBack

__all__ = ["ParameterServer"]

_JITTER = random.Random(0)  # draws the batch sizes of write-backs (see PendingRows)


@dataclasses.dataclass
class _Lookup:
    """One table's part of a lookup: the cache's answer, and its misses as the lower tiers fill them in."""

    t: TableState
    values: torch.Tensor  # [N, D] on the cache's device: the answer
    at: torch.Tensor  # [K] positions in `values` that the cache missed
    keys: torch.Tensor  # [M] the missed keys, unique, on the CPU
    inverse: torch.Tensor  # [K] index in `keys` of each missed position
    weights: torch.Tensor  # [M] times each missed key was requested
    epoch: int
    served: dict  # ids served per tier, counted per request (the statistics)
    cache_skipped: bool  # the cache was busy with a write-back: the stores were asked first
    rows: Optional[torch.Tensor] = None  # [M, D] rows of `keys`, allocated when a second source fills them
    todo: torch.Tensor = None  # indices in `keys` that no tier has answered yet
    fetched: list = dataclasses.field(default_factory=list)  # indices in `keys` found in a store

    def __post_init__(self) -> None:
        self.todo = torch.arange(self.keys.numel())

    def take(self, tier: str, values: torch.Tensor, found: torch.Tensor) -> torch.Tensor:
        """Keep the rows a tier found for ``keys[todo]``; returns their indices in ``keys``."""
        values = values.to(self.t.dtype)
        if bool(found.all()):  # the usual case: the tier has every row it was asked for
            where, self.todo = self.todo, self.todo[:0]
        else:
            hit = found.nonzero().squeeze(1)
            where, values, self.todo = self.todo.index_select(0, hit), values.index_select(0, hit), self.todo[~found]
        self.served[tier] = int(self.put(where, values, self.weights))
        if where.numel():
            self.fetched.append(where)
        return where

    def put(self, where: torch.Tensor, values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Rows ``values`` for ``keys[where]``; returns how often they were requested (``weights[where]``)."""
        if where.numel() == self.keys.numel():  # one source answers every key: its rows are the rows, no copy
            self.rows = values
            return weights.sum()
        if self.rows is None:
            self.rows = torch.empty(self.keys.numel(), self.t.dim, dtype=self.t.dtype)
        self.rows.index_copy_(0, where, values)
        return weights.index_select(0, where).sum()

    def picked(self, where: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys[where], rows[where])``."""
        if where.numel() == self.keys.numel():
            return self.keys, self.rows
        return self.keys.index_select(0, where), self.rows.index_select(0, where)


class ParameterServer:
    """Serves the tables of one or more models from a hierarchy of stores.

    Example:
        >>> import tempfile, torch, dynemb
        >>> from dynemb.checkpoint import export_for_serving
        >>> emb = dynemb.DynamicEmbedding(4, seed=0)
        >>> _ = emb(torch.tensor([1, 2, 3]))
        >>> root = tempfile.mkdtemp()
        >>> _ = export_for_serving(root, emb)
        >>> ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [root],
        ...     "embedding_table_names": ["embedding"], "embedding_vecsize_per_table": [4]}]})
        >>> ps.load("m", progress=False)
        >>> torch.equal(ps.lookup("m", "embedding", torch.tensor([3, 1])), emb.lookup(torch.tensor([3, 1])))
        True
        >>> ps.close()
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.models = {m.model: m for m in config.models}
        self.tiers = Tiers(config)
        self._tables: dict[str, dict[str, TableState]] = {}
        self._locks = {name: threading.RLock() for name in self.models}
        self.versions: dict[str, dict] = {}
        self._writeback = WriteBack()

    @classmethod
    def from_config(cls, source: Union[str, Path, Mapping]) -> "ParameterServer":
        """Build from a JSON file or a dict (see :class:`ServerConfig` and :class:`ModelConfig`)."""
        return cls(ServerConfig.load(source))

    @property
    def volatile(self) -> Tier:
        """The volatile tier (memory or Redis)."""
        return self.tiers.volatile

    @property
    def persistent(self) -> Tier:
        """The persistent tier (RocksDB or LMDB, or none)."""
        return self.tiers.persistent

    @property
    def writeback_errors(self) -> int:
        """Background write-backs that failed (each only costs later cache misses)."""
        return self._writeback.errors

    # ------------------------------------------------------------------ loading
    def load(self, model: str, progress: bool = True) -> None:
        """Load ``model``'s tables from its serving exports into the stores, and size its caches."""
        cfg = self._model(model)
        tables: dict[str, TableState] = {}
        exports: dict[Path, tuple] = {}
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cfg.embedding_table_names), desc=f"loading {model}", unit="table", disable=not progress)
        for i, (name, dim) in enumerate(zip(cfg.embedding_table_names, cfg.embedding_vecsize_per_table)):
            root = cfg.export_root(i)
            if root not in exports:
                exports[root] = read_export(root)
            manifest, payload = exports[root]
            if name not in manifest["tables"]:
                raise ValueError(f"models[{model!r}]: table {name!r} is not in the export {manifest['path']} "
                                 f"(it has {sorted(manifest['tables'])})")
            entry = manifest["tables"][name]
            if entry["dim"] != dim:
                raise ValueError(f"models[{model!r}].embedding_vecsize_per_table[{i}] is {dim} but table {name!r} "
                                 f"in {manifest['path']} has dim {entry['dim']}")
            if manifest.get("kind") != "full":
                raise ValueError(f"{manifest['path']} is a delta export; load a full export and apply deltas "
                                 "with apply_update")
            dtype = getattr(torch, entry["dtype"].replace("torch.", ""))
            table = new_table(cfg, i, name, dim, dtype, entry, len(payload[name]["keys"]), _JITTER)
            self.tiers.create_table(table.store_name, dim, dtype)
            keys, values = payload[name]["keys"].to(torch.int64), payload[name]["values"].to(dtype)
            self.tiers.put(table.store_name, keys, values)
            tables[name] = table
            bar.update(1)
        bar.close()
        with self._locks[model]:
            self._tables[model] = tables
            self.versions[model] = {"version": max(m["version"] for m, _ in exports.values()),
                                    "loaded_unix": time.time()}

    # ------------------------------------------------------------------ lookups
    def lookup(self, model: str, table: str, keys: torch.Tensor) -> torch.Tensor:
        """Rows of ``keys`` (int64, any shape ``S``) as ``S + (D,)`` on the model's device."""
        return self.lookup_many(model, {table: keys})[table]

    def lookup_many(self, model: str, keys_per_table: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows from several tables of ``model`` in one call, as HPS looks up every table of a request at once.

        Each lower tier answers the cache misses of all the tables in one call: one round trip to Redis per
        request instead of one per table.

        Args:
            model: a loaded model.
            keys_per_table: ``{table: keys}``, keys int64 of any shape ``S`` with at most ``max_batch_size``
                entries.

        Returns:
            ``{table: rows}``, rows ``S + (D,)`` on the model's device.

        Raises:
            TypeError/ValueError: an unknown model or table, or bad keys; nothing is looked up then.

        Example:
            >>> import tempfile, torch, dynemb
            >>> from dynemb.checkpoint import export_for_serving
            >>> tables = torch.nn.ModuleDict({"user": dynemb.DynamicEmbedding(4), "item": dynemb.DynamicEmbedding(8)})
            >>> _ = tables["user"](torch.tensor([1, 2])), tables["item"](torch.tensor([7]))
            >>> root = tempfile.mkdtemp()
            >>> _ = export_for_serving(root, tables)
            >>> ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [root],
            ...     "embedding_table_names": ["user", "item"], "embedding_vecsize_per_table": [4, 8]}]})
            >>> ps.load("m", progress=False)
            >>> rows = ps.lookup_many("m", {"user": torch.tensor([[2, 1]]), "item": torch.tensor([7, 7, 7])})
            >>> rows["user"].shape, rows["item"].shape
            (torch.Size([1, 2, 4]), torch.Size([3, 8]))
            >>> ps.close()
        """
        cfg = self._model(model)
        if not isinstance(keys_per_table, Mapping):
            raise TypeError(f"keys_per_table must be a dict {{table: keys}}, got {type(keys_per_table).__name__}")
        batches = {name: (self._table(model, name), self._check_batch(cfg, keys))
                   for name, keys in keys_per_table.items()}
        lookups = [self._read_cache(t, flat) for t, flat in batches.values()]
        for tier in (self.tiers.volatile, self.tiers.persistent):
            self._read_tier(tier, lookups)
        for lookup in lookups:
            self._finish(cfg, lookup)
        return {name: lookup.values.view(*keys_per_table[name].shape, lookup.t.dim)
                for name, lookup in zip(batches, lookups)}

    @staticmethod
    def _check_batch(cfg: ModelConfig, keys) -> torch.Tensor:
        flat = check_keys(keys, torch.int64, getattr(keys, "device", None))
        if flat.numel() > cfg.max_batch_size:
            raise ValueError(f"keys has {flat.numel()} entries, more than models[{cfg.model!r}].max_batch_size "
                             f"({cfg.max_batch_size})")
        return flat

    @staticmethod
    def _read_cache(t: TableState, flat: torch.Tensor) -> _Lookup:
        # The cache reads the batch as it is: de-duplicating first costs a sort and a second gather, and under
        # power-law traffic the duplicates are hot rows that hit anyway. Only the misses are de-duplicated.
        ids = flat.to(t.cache.device)
        busy = t.filling  # a background insert holds the cache for milliseconds: read the lower tiers meanwhile
        if busy:
            values = torch.empty(ids.numel(), t.dim, dtype=t.dtype, device=ids.device)
            found, epoch = torch.zeros_like(ids, dtype=torch.bool), t.epoch
        else:
            with t.cache_lock:
                values, found = t.cache.find(ids, update_scores=True)
                epoch = t.epoch
        at = (~found).nonzero().squeeze(1)
        keys, inverse, weights = torch.unique(ids.index_select(0, at).cpu(), return_inverse=True, return_counts=True)
        # Statistics count every requested id (a key asked for 5 times in a batch is 5 lookups), as a cache's
        # hit rate is usually meant: the share of traffic it absorbs.
        served = {"lookups": ids.numel(), "cache": ids.numel() - at.numel()}
        return _Lookup(t, values, at, keys, inverse, weights, epoch, served, cache_skipped=busy)

    def _read_tier(self, tier: Tier, lookups: list) -> None:
        waiting = [lookup for lookup in lookups if lookup.todo.numel()]
        if not waiting or not tier.available:
            return
        got = tier.call(tier.store.get_many, {m.t.store_name: m.keys.index_select(0, m.todo) for m in waiting})
        if got is None:
            return
        for m in waiting:
            where = m.take(tier.name, *got[m.t.store_name])
            volatile = self.tiers.volatile
            if tier is self.tiers.persistent and where.numel() and volatile.available:
                volatile.call(volatile.store.put, m.t.store_name, *m.picked(where))

    def _finish(self, cfg: ModelConfig, m: _Lookup) -> None:
        """Default rows for keys no tier has, the misses' rows into the answer, statistics and write-back."""
        t = m.t
        if m.todo.numel() and m.cache_skipped:  # keys the stores lack (Redis restarted empty) may be cached
            with t.cache_lock:
                values, found = t.cache.find(m.keys.index_select(0, m.todo).to(t.cache.device), update_scores=True)
            m.take("cache", values.cpu(), found.cpu())
        if m.todo.numel():
            m.served["default"] = int(m.put(m.todo, t.default_rows(m.keys.index_select(0, m.todo)), m.weights))
        if m.at.numel():
            m.values.index_copy_(0, m.at, m.rows.index_select(0, m.inverse).to(m.values.device))
        with t.stats_lock:
            for tier, n in m.served.items():
                t.stats[tier] += n
        if m.fetched and not m.cache_skipped:  # after a skipped cache, most of these rows are in it already
            where = m.fetched[0] if len(m.fetched) == 1 else torch.cat(m.fetched)
            cold = m.served["cache"] < cfg.hit_rate_threshold * m.served["lookups"]
            keys, rows = m.picked(where)
            if cold:
                t.insert_if_current(keys, rows, m.epoch)
            else:
                self._writeback.defer(t, keys, rows, m.epoch)

    # ------------------------------------------------------------------ online updates
    def apply_update(self, export_dir) -> dict:
        """Apply a serving export (a delta, or a full one) to every loaded model that serves its tables.

        Deleted keys leave every tier first, then rows are written to the stores and replaced in the caches, each
        under the model's lock (no torn rows). Returns ``{model: {"version", "updated_unix"}}``.
        """
        manifest, payload = read_export(export_dir)
        touched = {}
        for model, tables in self._tables.items():
            for name, t in tables.items():
                if name not in payload:
                    continue
                cols = payload[name]
                deleted = cols.get("deleted_keys")
                keys, values = cols["keys"].to(torch.int64), cols["values"].to(t.dtype)
                if values.shape[1:] != (t.dim,):
                    raise ValueError(f"{manifest['path']}: table {name!r} has dim {values.shape[1]}, served as {t.dim}")
                if deleted is not None and deleted.numel():
                    self.tiers.delete(t.store_name, deleted.to(torch.int64))
                self.tiers.put(t.store_name, keys, values)
                with t.cache_lock:
                    with t.stats_lock:
                        t.epoch += 1
                        t.pending.clear()
                    if deleted is not None and deleted.numel():
                        t.cache.erase(deleted.to(torch.int64).to(t.cache.device))
                    present = t.cache.contains(keys.to(t.cache.device)).cpu()
                    if bool(present.any()):
                        t.cache.insert_or_assign(keys[present].to(t.cache.device), values[present].to(t.cache.device))
                touched[model] = {"version": manifest["version"], "updated_unix": time.time()}
        for model, info in touched.items():
            self.versions[model] = info
        return touched

    # ------------------------------------------------------------------ stats and lifecycle
    def stats(self, model: str) -> dict:
        """Per-table counts of keys served by each tier, cache hit rate and size, and tier error counts."""
        tables = {name: {**t.stats, "hit_rate": t.hit_rate, "cache_rows": t.cache.size(),
                         "cache_capacity": t.cache.max_capacity, "cache_bytes": t.cache.nbytes()}
                  for name, t in self._model_tables(model).items()}
        return {"tables": tables, "errors": self.tiers.errors,
                **self.versions.get(model, {})}

    def reset_stats(self, model: str) -> None:
        for t in self._model_tables(model).values():
            for k in t.stats:
                t.stats[k] = 0

    def flush(self) -> None:
        """Write every pending write-back to the caches and wait until that is done."""
        self._writeback.flush([t for tables in list(self._tables.values()) for t in tables.values()])

    def close(self) -> None:
        self._writeback.close()
        self.tiers.close()

    def _model(self, model: str) -> ModelConfig:
        if model not in self.models:
            raise ValueError(f"model {model!r} is not configured; configured models: {sorted(self.models)}")
        return self.models[model]

    def _model_tables(self, model: str) -> dict:
        self._model(model)
        if model not in self._tables:
            raise ValueError(f"model {model!r} is not loaded; call ps.load({model!r}) first")
        return self._tables[model]

    def _table(self, model: str, table: str) -> TableState:
        tables = self._model_tables(model)
        if table not in tables:
            raise ValueError(f"table {table!r} is not served by model {model!r}; tables: {sorted(tables)}")
        return tables[table]
