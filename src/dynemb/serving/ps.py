"""ParameterServer: hierarchical embedding lookups for inference.

Lookup order for each table: unique keys -> device cache (a bounded LRU :class:`KeyValueTable`) -> volatile store
(in-process memory or Redis) -> persistent store (RocksDB or LMDB) -> the default row. Rows found below the cache
are written back up: synchronously while the cache's hit rate is under ``hit_rate_threshold``, by a background
thread above it. A tier that fails (Redis went away) is skipped for a back-off period that doubles on each failure
(up to 30 s) and retried after; its errors are counted, and lookups keep answering from the other tiers.

Thread safety: any number of threads may call :meth:`lookup`. Reads and writes of a model's cache take that
model's lock, and :meth:`apply_update` replaces each row under it, so no reader sees half of an old row and half of
a new one. The stores are row-atomic themselves (one value per key in Redis, transactions in LMDB/RocksDB).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from ..checkpoint.manifest import SERVING_FORMAT, file_record, read_manifest, resolve
from ..checkpoint.tensorfile import read_tensors
from ..table import KeyValueTable
from ..table.checks import check_keys
from ..table.initializers import Constant, Initializer, Normal, TruncatedNormal, Uniform
from .config import ModelConfig, ServerConfig
from .stores import RowStore, StoreError, make_store

__all__ = ["ParameterServer", "read_export"]

_FLUSH = object()
_SMALL_TABLE_ROWS = 4096
_INITIALIZERS = {"Uniform": Uniform, "Normal": Normal, "TruncatedNormal": TruncatedNormal, "Constant": Constant}


def read_export(path) -> tuple[dict, dict]:
    """Read a serving export (its ``latest`` version, or the version directory given) with checksums verified.

    Returns ``(manifest, {table: {"keys": [N], "values": [N, D], "deleted_keys": [K] (deltas)}})``.
    """
    directory = resolve(path)
    manifest = read_manifest(directory, SERVING_FORMAT)
    tables = {}
    for name, entry in manifest["tables"].items():
        tensors, _ = read_tensors(directory / entry["file"], file_record(manifest, directory, entry["file"]))
        tables[name] = tensors
    manifest["path"] = str(directory)
    return manifest, tables


class _Tier:
    """A store with failure accounting and exponential back-off."""

    def __init__(self, name: str, store: Optional[RowStore]) -> None:
        self.name, self.store = name, store
        self.errors, self._down_until, self._backoff = 0, 0.0, 0.5

    @property
    def available(self) -> bool:
        return self.store is not None and time.monotonic() >= self._down_until

    def call(self, fn, *args):
        """Run ``fn(*args)``; on a store failure count it, back off, and return None."""
        try:
            result = fn(*args)
        except StoreError:
            self.errors += 1
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, 30.0)
            return None
        self._backoff = 0.5
        return result


@dataclasses.dataclass
class _Table:
    name: str
    dim: int
    dtype: torch.dtype
    store_name: str
    cache: KeyValueTable
    default: Union[float, Initializer]
    seed: int
    stats: dict = dataclasses.field(default_factory=lambda: {"lookups": 0, "cache": 0, "volatile": 0,
                                                             "persistent": 0, "default": 0})

    def default_rows(self, keys: torch.Tensor) -> torch.Tensor:
        if isinstance(self.default, Initializer):
            return self.default(keys, self.dim, self.dtype, self.seed)
        return torch.full((keys.numel(), self.dim), float(self.default), dtype=self.dtype)

    @property
    def hit_rate(self) -> float:
        return self.stats["cache"] / max(self.stats["lookups"], 1)


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
        self.volatile = _Tier("volatile", make_store(config.volatile_db, name="volatile_db"))
        persistent = make_store(config.persistent_db, name="persistent_db") if config.persistent_db else None
        self.persistent = _Tier("persistent", persistent)
        self._tables: dict[str, dict[str, _Table]] = {}
        self._locks = {name: threading.RLock() for name in self.models}
        self.versions: dict[str, dict] = {}
        self._writeback: queue.Queue = queue.Queue(maxsize=256)
        self.writeback_errors = 0
        self._worker = threading.Thread(target=self._drain, name="dynemb-ps-writeback", daemon=True)
        self._worker.start()

    @classmethod
    def from_config(cls, source: Union[str, Path, Mapping]) -> "ParameterServer":
        """Build from a JSON file or a dict (see :class:`ServerConfig` and :class:`ModelConfig`)."""
        return cls(ServerConfig.load(source))

    # ------------------------------------------------------------------ loading
    def load(self, model: str, progress: bool = True) -> None:
        """Load ``model``'s tables from its serving exports into the stores, and size its caches."""
        cfg = self._model(model)
        tables: dict[str, _Table] = {}
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
            table = self._new_table(cfg, i, name, dim, dtype, entry, len(payload[name]["keys"]))
            self._write_stores(table, payload[name]["keys"].to(torch.int64), payload[name]["values"].to(dtype))
            tables[name] = table
            bar.update(1)
        bar.close()
        with self._locks[model]:
            self._tables[model] = tables
            self.versions[model] = {"version": max(m["version"] for m, _ in exports.values()),
                                    "loaded_unix": time.time()}

    def _new_table(self, cfg: ModelConfig, i: int, name: str, dim: int, dtype, entry: dict, rows: int) -> _Table:
        default = cfg.default_for(i)
        if default == "initializer":
            spec = dict(entry["initializer"])
            kind = spec.pop("type")
            if kind not in _INITIALIZERS:
                raise ValueError(f"table {name!r}: its initializer {kind!r} cannot be rebuilt for default rows")
            default = _INITIALIZERS[kind](**spec)
        # Small tables are cached whole: a fraction of a 10-row table would only cost misses.
        capacity = max(1, int(rows * cfg.cache_fraction), min(rows, _SMALL_TABLE_ROWS))
        cache = KeyValueTable(dim, dtype=dtype, device=cfg.device, max_capacity=capacity,
                              init_capacity=min(capacity, 1 << 16), eviction="lru", initializer="zeros")
        store_name = f"{cfg.model}.{name}"
        for tier in (self.volatile, self.persistent):
            if tier.store is not None and not getattr(tier.store, "read_only", False):
                tier.store.create_table(store_name, dim, dtype)
        return _Table(name, dim, dtype, store_name, cache, default, int(entry.get("seed") or 0))

    def _write_stores(self, table: _Table, keys: torch.Tensor, values: torch.Tensor) -> None:
        for tier in (self.persistent, self.volatile):
            if tier.store is not None and not getattr(tier.store, "read_only", False):
                for start in range(0, keys.numel(), 1 << 18):
                    tier.call(tier.store.put, table.store_name, keys[start: start + (1 << 18)],
                              values[start: start + (1 << 18)])

    # ------------------------------------------------------------------ lookups
    def lookup(self, model: str, table: str, keys: torch.Tensor) -> torch.Tensor:
        """Rows of ``keys`` (int64, any shape ``S``) as ``S + (D,)`` on the model's device."""
        t = self._table(model, table)
        cfg = self.models[model]
        flat = check_keys(keys, torch.int64, keys.device).to("cpu")
        if flat.numel() > cfg.max_batch_size:
            raise ValueError(f"keys has {flat.numel()} entries, more than models[{model!r}].max_batch_size "
                             f"({cfg.max_batch_size})")
        unique, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        rows = self._lookup_unique(model, t, unique, counts)
        return rows.index_select(0, inverse.to(rows.device)).view(*keys.shape, t.dim)

    def _lookup_unique(self, model: str, t: _Table, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Statistics count every requested id (a key asked for 5 times in a batch is 5 lookups), as a cache's
        # hit rate is usually meant: the share of traffic it absorbs.
        with self._locks[model]:
            values, found = t.cache.find(keys.to(t.cache.device), update_scores=True)
            t.stats["lookups"] += int(counts.sum())
            t.stats["cache"] += int(counts[found.cpu()].sum())
            hit_rate = t.hit_rate
        missing = (~found).nonzero().squeeze(1).cpu()
        if missing.numel() == 0:
            return values
        fetched_keys, fetched_rows = [], []
        for tier in (self.volatile, self.persistent):
            if missing.numel() == 0 or not tier.available:
                continue
            got = tier.call(tier.store.get, t.store_name, keys.index_select(0, missing))
            if got is None:
                continue
            rows, hit = got
            t.stats[tier.name] += int(counts.index_select(0, missing)[hit].sum())
            where = missing[hit]
            values.index_copy_(0, where.to(values.device), rows[hit].to(values.device, t.dtype))
            fetched_keys.append(keys.index_select(0, where))
            fetched_rows.append(rows[hit].to(t.dtype))
            if tier is self.persistent and self.volatile.available:
                self.volatile.call(self.volatile.store.put, t.store_name, fetched_keys[-1], fetched_rows[-1])
            missing = missing[~hit]
        if missing.numel():
            t.stats["default"] += int(counts.index_select(0, missing).sum())
            values.index_copy_(0, missing.to(values.device), t.default_rows(keys.index_select(0, missing))
                               .to(values.device))
        if fetched_keys:
            job = (model, t, torch.cat(fetched_keys), torch.cat(fetched_rows))
            if hit_rate < self.models[model].hit_rate_threshold:
                self._fill_cache(*job)
            else:
                try:
                    self._writeback.put_nowait(job)
                except queue.Full:  # the cache is warm; dropping a write-back only costs a later miss
                    pass
        return values

    def _fill_cache(self, model: str, t: _Table, keys: torch.Tensor, rows: torch.Tensor) -> None:
        with self._locks[model]:
            fresh = ~t.cache.contains(keys.to(t.cache.device))  # never overwrite a row an update just wrote
            if bool(fresh.any()):
                t.cache.insert_or_assign(keys[fresh.cpu()].to(t.cache.device), rows[fresh.cpu()].to(t.cache.device))

    def _drain(self) -> None:
        while True:
            job = self._writeback.get()
            if job is None:
                return
            if job[0] is _FLUSH:
                job[1].set()
                continue
            try:
                self._fill_cache(*job)
            except Exception:  # a failed write-back only costs a later cache miss; keep the worker alive
                self.writeback_errors += 1

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
                    for tier in (self.volatile, self.persistent):
                        if tier.store is not None and not getattr(tier.store, "read_only", False):
                            tier.call(tier.store.delete, t.store_name, deleted.to(torch.int64))
                self._write_stores(t, keys, values)
                with self._locks[model]:
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
                         "cache_capacity": t.cache.max_capacity}
                  for name, t in self._model_tables(model).items()}
        return {"tables": tables, "errors": {"volatile": self.volatile.errors, "persistent": self.persistent.errors},
                **self.versions.get(model, {})}

    def reset_stats(self, model: str) -> None:
        for t in self._model_tables(model).values():
            for k in t.stats:
                t.stats[k] = 0

    def flush(self) -> None:
        """Wait until background cache write-backs are done."""
        done = threading.Event()
        self._writeback.put((_FLUSH, done))
        done.wait(timeout=30)

    def close(self) -> None:
        self._writeback.put(None)
        self._worker.join(timeout=5)
        for tier in (self.volatile, self.persistent):
            if tier.store is not None:
                tier.store.close()

    def _model(self, model: str) -> ModelConfig:
        if model not in self.models:
            raise ValueError(f"model {model!r} is not configured; configured models: {sorted(self.models)}")
        return self.models[model]

    def _model_tables(self, model: str) -> dict:
        self._model(model)
        if model not in self._tables:
            raise ValueError(f"model {model!r} is not loaded; call ps.load({model!r}) first")
        return self._tables[model]

    def _table(self, model: str, table: str) -> _Table:
        tables = self._model_tables(model)
        if table not in tables:
            raise ValueError(f"table {table!r} is not served by model {model!r}; tables: {sorted(tables)}")
        return tables[table]
