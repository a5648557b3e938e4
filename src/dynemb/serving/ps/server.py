"""ParameterServer: the config, loading, lookups, online updates and lifecycle of the parameter server."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import torch

from ...checks import KEY_DTYPES, check_keys, check_positive_int
from ...serialization import parse_dtype
from ..server_config import ModelConfig, ServerConfig
from ...checkpoint.export_format import read_chain, read_export, version_name
from ...checkpoint.manifest import MANIFEST, SERVING_FORMAT, complete
from ...checkpoint.row_codec import packed_width, quantized_kind
from . import updates
from .cache import TableState, cache_capacity, namespace, new_table, store_name
from .group_cache import GroupCache, TableCache
from .lineage import Lineage, summary
from .request_lookup import RequestPlan, concat_answers, lookup_fused, lookup_request, settle_stats, split_answers
from .table_lookup import Lookup, read_tiers
from .tiers import StoreTier, StoreTiers, TierUnavailableError
from .writeback import WriteBack

__all__ = ["ParameterServer", "TierUnavailableError"]


def row_format(dtype: str, table: str) -> tuple[Optional[str], torch.dtype]:
    """``(8-bit kind or None, the dtype rows are held in)`` of an export's table of ``dtype``: 8-bit rows stay packed
    in every tier and cache, as 16-bit words (their bytes unchanged)."""
    kind = quantized_kind(dtype)
    return kind, torch.float16 if kind else parse_dtype(dtype, f"table {table!r}: dtype")


def _reformats(manifest: dict, targets: dict[str, dict]) -> bool:
    """Whether full export ``manifest`` brings rows of another format (dtype, 8-bit kind) than the ones served in a
    table it updates (``targets``): a server loading that version would hold them in its format, so it is installed
    as a load installs it (every model it updates), not converted to the format served."""
    return manifest["kind"] == "full" and any(row_format(manifest["tables"][name]["dtype"], name) != (t.codec, t.dtype)
                                              for tables in targets.values() for name, t in tables.items())


class ParameterServer:
    """Serves the tables of one or more models from a hierarchy of stores.

    Args:
        config: the models and their stores: a :class:`ServerConfig`, or what :meth:`ServerConfig.load` reads (a
            dict, or the path of a JSON file).
        seed: seeds this server's random generator, which draws the sizes of its background write-backs (see
            :class:`~dynemb.serving.ps.writeback.PendingRows`). Each server has its own generator, so servers in one
            process do not change each other's draws.

    Raises:
        ValueError: ``seed`` is not an int >= 0, or a bad config (the message names the field).
        TypeError: ``config`` is none of these.

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
        >>> torch.equal(ps.lookup("m", "embedding", torch.tensor([3, 1])), emb.find(torch.tensor([3, 1])))
        True
        >>> ps.close()
    """

    def __init__(self, config: Union[ServerConfig, Mapping, str, Path], *, seed: int = 0) -> None:
        self._jitter = random.Random(check_positive_int(seed, "seed", minimum=0))
        config = config if isinstance(config, ServerConfig) else ServerConfig.load(config)
        self.config = config
        self.models = {m.model: m for m in config.models}
        self.tiers = StoreTiers(config)
        self._tables: dict[str, dict[str, TableState]] = {}
        self._locks = {name: threading.RLock() for name in self.models}
        self.versions: dict[str, dict] = {}
        self._writeback = WriteBack()
        self.grouped = True  # lookups take every table of a request together (.request_lookup); False: table by table
        self.fused = True  # grouped lookups of one CPU cache in two numba calls (lookup_fused); False: not
        self._plans: dict[tuple, RequestPlan] = {}  # (model, tables) -> the plan of their requests
        self._roots: dict[str, dict] = {}  # model -> {namespace: its export root}: what a lost tier is restored from
        self.tiers.check_evicting()
        self.tiers.start_monitor(self._restore)

    @classmethod
    def from_config(cls, source: Union[str, Path, Mapping], *, seed: int = 0) -> "ParameterServer":
        """Build from a JSON file or a dict (see :class:`ServerConfig` and :class:`ModelConfig`) and ``seed``: the
        same as ``ParameterServer(source, seed=seed)``."""
        return cls(source, seed=seed)

    @property
    def volatile(self) -> StoreTier:
        """The volatile tier (memory or Redis)."""
        return self.tiers.volatile

    @property
    def persistent(self) -> StoreTier:
        """The persistent tier (RocksDB or LMDB, or none)."""
        return self.tiers.persistent

    @property
    def writeback_errors(self) -> int:
        """Background write-backs that failed (each only costs later cache misses)."""
        return self._writeback.errors

    # ------------------------------------------------------------------ loading
    def load(self, model: str, progress: bool = True) -> None:
        """Load ``model``'s tables from its serving exports into the stores, and size its caches.

        Each export root's ``latest`` version is loaded; when it is a delta, its chain (the last full export and
        every delta after it) is replayed, so a restarted server serves what the newest export holds. The stores
        then hold exactly those rows: keys they held beyond them (from an earlier run) are deleted.

        Raises:
            ValueError: an export root is missing or holds no export, a table is not in its export, or has
                another dim. CheckpointError: an export of the
                chain is missing or does not match its checksums.
        """
        cfg = self._model(model)
        for root in cfg.export_roots():
            if not root.is_dir() or not ((root / "latest").is_file() or (root / MANIFEST).is_file()):
                what = "no such directory" if not root.is_dir() else "no serving export there (no 'latest' version)"
                raise ValueError(f"models[{model!r}].sparse_files: export root {root}: {what}; write one with "
                                 "`dynemb export` or export_for_serving")
        chains = {root: read_chain(root) for root in cfg.export_roots()}
        self._install(cfg, chains, progress)

    def ready(self, model: Optional[str] = None) -> tuple[bool, str]:
        """``(whether lookups of ``model`` — or of every model — answer correctly now, why not)``: the tier
        holding every row is up, its rows are there and of the version served (:mod:`.tiers`). While it is not,
        lookups whose misses need it raise :class:`TierUnavailableError`."""
        if model is not None:
            self._model(model)
        return self.tiers.ready()

    def _restore(self, tier: StoreTier) -> None:
        """Write the rows of every loaded model's version served into ``tier`` again (its store lost them), then
        the markers: on the tiers' monitor thread, under each model's lock (no update meanwhile). With a
        persistent tier holding every row, only the markers: the misses read the rows from there."""
        if tier is self.tiers.volatile and self.tiers.complete is not tier:
            self.tiers.rewrite_markers()
            return
        for model in list(self._tables):
            with self._locks[model]:
                roots = self._roots.get(model, {})
                by_space: dict[str, list] = {}
                for t in self._tables[model].values():
                    by_space.setdefault(t.namespace, []).append(t)
                for space, members in by_space.items():
                    lineage = members[0].lineage
                    chain = read_chain(roots[space] / version_name(lineage.version))
                    for t in members:
                        keys, values = updates.replay(chain, t.name)
                        kind = quantized_kind(chain[-1][0]["tables"][t.name]["dtype"])
                        tier.store.create_table(t.store_name, t.dim, t.dtype)
                        for start in range(0, keys.numel(), 1 << 18):
                            tier.store.put(t.store_name, keys[start:start + (1 << 18)],
                                           t.stored(values[start:start + (1 << 18)], kind))
        self.tiers.rewrite_markers()

    def rollback(self, model: str, version: int, progress: bool = False) -> None:
        """Serve the full export ``version`` of ``model``'s export roots again, in place of what is served.

        Later updates then apply on top of ``version``: a delta written after it is a gap and is refused.

        Raises:
            ValueError: ``version`` is not kept in an export root of the model (the message lists the versions
                kept), or it is a delta export (the message lists the full versions kept).
        """
        cfg = self._model(model)
        check_positive_int(version, "version")
        chains = {}
        for root in cfg.export_roots():
            kept = {m["version"]: m["kind"] for m in complete(root, SERVING_FORMAT).values()}
            full = sorted(v for v, kind in kept.items() if kind == "full")
            if version not in kept:
                raise ValueError(f"cannot roll model {model!r} back to version {version}: {root} does not keep it "
                                 f"(it keeps versions {sorted(kept)}, full ones {full})")
            if kept[version] != "full":
                raise ValueError(f"cannot roll model {model!r} back to version {version}: in {root} it is a delta "
                                 f"export; roll back to a full one (kept: {full})")
            chains[root] = [read_export(root / version_name(version))]
        self._install(cfg, chains, progress, rolling_back=True)

    def _install(self, cfg: ModelConfig, chains: Mapping[Path, list], progress: bool,
                 rolling_back: bool = False) -> None:
        """Serve the tables of ``cfg`` as of the last export of each root's chain, with new caches."""
        from tqdm.auto import tqdm

        tables: dict[str, TableState] = {}
        spaces: dict[str, tuple] = {}  # namespace -> (export root, manifest, store names)
        names = cfg.embedding_table_names
        with self._locks[cfg.model], tqdm(total=len(names), desc=f"loading {cfg.model}", unit="table",
                                          disable=not progress) as bar:
            loaded = []
            for i, (name, dim) in enumerate(zip(names, cfg.embedding_vecsize_per_table)):
                chain = chains[cfg.export_root(i)]
                manifest = chain[-1][0]
                entry = self._entry(cfg, i, manifest)
                space = namespace(cfg.model, manifest.get("model"))
                if space not in spaces:  # a shared store holding a newer version of it refuses the load
                    self.tiers.claim(space, manifest["version"], force=rolling_back)
                    spaces[space] = (cfg.export_root(i), manifest, [])
                keys, values = updates.replay(chain, name)
                kind, dtype = row_format(entry["dtype"], name)
                width = packed_width(kind, dim) // 2 if kind else dim
                store = store_name(cfg.model, name, manifest.get("model"))
                spaces[space][2].append(store)
                # every row is replaced: a table an earlier version left with rows of another dtype is dropped
                self.tiers.create_table(store, width, dtype, replace=True)
                self.tiers.replace(store, keys, values.view(dtype) if kind else values.to(dtype))
                loaded.append((i, name, (width, dtype, kind, dim), entry, keys.numel(), manifest))
                del keys, values
                bar.update(1)
            # One cache per row shape (stored width, dtype, 8-bit kind): a request reads all the tables of a group
            # in one pass.
            groups: dict[tuple, list] = {}
            for item in loaded:
                groups.setdefault(item[2], []).append(item)
            for (width, dtype, kind, dim), members in groups.items():
                capacities = [cache_capacity(cfg, item[4]) for item in members]
                group = GroupCache(width, dtype, cfg.device, sum(capacities), len(members))
                # One stats_lock for the group's tables: a request counts all of them under it at once (no code
                # holds two tables' stats locks, so sharing one cannot deadlock).
                stats_lock = threading.Lock()
                for k, ((i, name, _, entry, _, manifest), capacity) in enumerate(zip(members, capacities)):
                    table = new_table(cfg, i, name, width, dtype, entry, TableCache(group, k, capacity),
                                      self._jitter, manifest.get("model"))
                    table.codec, table.row_dim = kind, dim
                    table.stats_lock = stats_lock
                    table.lineage = Lineage.of(manifest)
                    tables[name] = table
            tables = {name: tables[name] for name in names}
            for space, (_, manifest, stores) in spaces.items():  # the rows are written: the markers say so
                self.tiers.mark(space, stores, manifest["version"], manifest.get("digest"))
            self._roots[cfg.model] = {space: root for space, (root, _, _) in spaces.items()}
            self._tables[cfg.model] = tables
            self._plans = {key: plan for key, plan in self._plans.items() if key[0] != cfg.model}
            self.versions[cfg.model] = {**summary(tables), "loaded_unix": time.time()}

    @staticmethod
    def _entry(cfg: ModelConfig, i: int, manifest: dict) -> dict:
        """The manifest entry of table ``i`` of ``cfg``, checked against the config."""
        name, dim = cfg.embedding_table_names[i], cfg.embedding_vecsize_per_table[i]
        if name not in manifest["tables"]:
            raise ValueError(f"models[{cfg.model!r}]: table {name!r} is not in the export {manifest['path']} "
                             f"(it has {sorted(manifest['tables'])})")
        entry = manifest["tables"][name]
        if entry["dim"] != dim:
            raise ValueError(f"models[{cfg.model!r}].embedding_vecsize_per_table[{i}] is {dim} but table {name!r} "
                             f"in {manifest['path']} has dim {entry['dim']}")
        return entry

    # ------------------------------------------------------------------ lookups
    def lookup(self, model: str, table: str, keys: torch.Tensor) -> torch.Tensor:
        """Rows of ``keys`` (int64 or int32, any shape ``S``) as ``S + (D,)`` on the model's device."""
        return self.lookup_many(model, {table: keys})[table]

    def lookup_many(self, model: str, keys_per_table: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Rows from several tables of ``model`` in one call, as HPS looks up every table of a request at once.

        The tables of one row shape share a cache, read in one pass for all of them; each lower tier answers the
        cache misses of all the tables in one call (one round trip to Redis per request instead of one per table),
        and default rows are computed only for the ids missing everywhere (:mod:`.request_lookup`).

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
        batches = {name: (t := self._table(model, name), self._check_batch(cfg, t, keys))
                   for name, keys in keys_per_table.items()}
        if self.grouped and batches:
            plan = self._plan(model, tuple(batches))
            sizes = tuple(flat.numel() for _, flat in batches.values())
            flats = [flat for _, flat in batches.values()]
            answers = lookup_request(self.tiers, self._writeback, cfg.hit_rate_threshold, plan, self.fused,
                                     flats[0] if len(flats) == 1 else torch.cat(flats), sizes)
            return {name: r.view(*keys_per_table[name].shape, batches[name][0].row_dim)
                    for name, r in zip(batches, split_answers(plan, sizes, answers))}
        rows = self._per_table(cfg, [(t, flat) for t, flat in batches.values()])
        return {name: r.view(*keys_per_table[name].shape, batches[name][0].row_dim) for name, r in zip(batches, rows)}

    def lookup_concat(self, model: str, tables: Sequence[str], ids: torch.Tensor,
                      sizes: Sequence[int]) -> torch.Tensor:
        """Rows of a request given as one tensor: ``ids [N]`` is the runs of ids of ``tables`` (run ``i``:
        ``sizes[i]`` ids of ``tables[i]``; a table may have several runs), as a model's features come. The same
        rows as :meth:`lookup_many`, without a dict of tensors in or out: what the model's list of tables needs
        from request to request is worked out once and kept (:class:`~.request_lookup.RequestPlan`), until the
        model is loaded again.

        Args:
            model: a loaded model.
            tables: its tables, one per run, all of one row width ``D``.
            ids: int64 ``[N]``.
            sizes: ints >= 0 summing to ``N``, each at most ``max_batch_size``.

        Returns:
            ``[N, D]`` rows on the model's device, row ``j`` the row of ``ids[j]``.

        Raises:
            TypeError/ValueError: an unknown model or table, tables of several widths, or bad ids or sizes;
            nothing is looked up then.

        Example:
            >>> import tempfile, torch, dynemb
            >>> from dynemb.checkpoint import export_for_serving
            >>> tables = torch.nn.ModuleDict({"user": dynemb.DynamicEmbedding(4), "item": dynemb.DynamicEmbedding(4)})
            >>> _ = tables["user"](torch.tensor([1, 2])), tables["item"](torch.tensor([7]))
            >>> root = tempfile.mkdtemp()
            >>> _ = export_for_serving(root, tables)
            >>> ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [root],
            ...     "embedding_table_names": ["user", "item"], "embedding_vecsize_per_table": [4, 4]}]})
            >>> ps.load("m", progress=False)
            >>> rows = ps.lookup_concat("m", ["user", "item"], torch.tensor([2, 1, 7]), [2, 1])
            >>> torch.equal(rows[2], ps.lookup("m", "item", torch.tensor(7)))
            True
            >>> ps.close()
        """
        cfg, plan, tables, sizes = self._concat_request(model, tables, ids, sizes)
        if not ids.numel():
            t = plan.tables[0]
            return torch.empty(0, t.row_dim, dtype=t.answer(torch.empty(0, t.dim, dtype=t.dtype)).dtype,
                               device=t.cache.device)
        if self.grouped:
            answers = lookup_request(self.tiers, self._writeback, cfg.hit_rate_threshold, plan, self.fused, ids, sizes)
            return concat_answers(plan, sizes, answers)
        # table by table: each table's runs together (a table looked up twice in one call would count its misses
        # as one)
        runs = ids.split(sizes)
        mine: dict[str, list] = {}
        for i, t in enumerate(tables):
            mine.setdefault(t, []).append(i)
        found = self._per_table(cfg, [(self._tables[model][t], torch.cat([runs[i] for i in at]))
                                      for t, at in mine.items()])
        out: list = [None] * len(runs)
        for at, rows in zip(mine.values(), found):
            for i, part in zip(at, rows.split([sizes[i] for i in at])):
                out[i] = part
        return out[0] if len(out) == 1 else torch.cat(out)

    def lookup_stacked(self, model: str, tables: Sequence[str], ids: torch.Tensor, rows: int,
                       out: Optional[torch.Tensor] = None, out_array=None) -> torch.Tensor:
        """A request of ``F`` features of one id a row, as the ``[B, F, D]`` input of a model's interaction: what
        :meth:`lookup_concat` answers for ``F`` runs of ``B = rows`` ids, each row as a bag of that one id pools to
        by sum (``0.0 + row``: a ``-0.0`` becomes ``+0.0``, as ``embedding_bag`` gives it; a mean or sqrtn of one id
        is the same). With one cache on the CPU for every table, the rows are looked up and written to
        their places in two numba calls (:func:`~.request_lookup.lookup_fused`), with no ``[F * B, D]`` in between;
        float16, bfloat16 and 8-bit rows too, decoded as they are written, into a float32 ``out``.

        Args:
            model: a loaded model.
            tables: each feature's table, ``F`` of them, all of one row width ``D``.
            ids: int64 ``[F * rows]``: feature ``f``'s ids are ``ids[f * rows:(f + 1) * rows]``.
            rows: ``B``, an int in ``[0, max_batch_size]``.
            out: a ``[B, F, D]`` tensor to write into (a model's buffer, reused from request to request), contiguous
                or ``buffer[:, k:k + F]`` of a contiguous ``[B, S, D]`` (the DLRM's interaction input, its first
                slot left to the bottom MLP); default a new one of the rows' dtype (float32 for 8-bit rows).
            out_array: ``out.numpy()``, when the caller keeps it with ``out`` (no conversion a request).

        Returns:
            ``out``: ``out[b, f]`` is the row of ``ids[f * rows + b]``.

        Raises:
            TypeError/ValueError: as :meth:`lookup_concat`, or ``out`` is not a ``[B, F, D]`` tensor as above.

        Example:
            >>> import tempfile, torch, dynemb
            >>> from dynemb.checkpoint import export_for_serving
            >>> tables = torch.nn.ModuleDict({"user": dynemb.DynamicEmbedding(4), "item": dynemb.DynamicEmbedding(4)})
            >>> _ = tables["user"](torch.tensor([1, 2])), tables["item"](torch.tensor([7]))
            >>> root = tempfile.mkdtemp()
            >>> _ = export_for_serving(root, tables)
            >>> ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [root],
            ...     "embedding_table_names": ["user", "item"], "embedding_vecsize_per_table": [4, 4]}]})
            >>> ps.load("m", progress=False)
            >>> stacked = ps.lookup_stacked("m", ["user", "item"], torch.tensor([2, 1, 7, 7]), 2)
            >>> stacked.shape, torch.equal(stacked[1, 1], ps.lookup("m", "item", torch.tensor(7)))
            (torch.Size([2, 2, 4]), True)
            >>> ps.close()
        """
        cfg, tables = self._model(model), tuple(tables)
        if not isinstance(rows, int) or isinstance(rows, bool) or not 0 <= rows <= cfg.max_batch_size:
            raise ValueError(f"rows must be an int in [0, models[{model!r}].max_batch_size={cfg.max_batch_size}], "
                             f"got {rows!r}")
        cfg, plan, tables, sizes = self._concat_request(model, tables, ids, (rows,) * len(tables), True)
        t = plan.tables[0]
        shape = (rows, len(tables), t.row_dim)
        if out is None:
            dtype = t.answer(torch.empty(0, t.dim, dtype=t.dtype)).dtype  # the rows' dtype (float32: 8-bit rows)
            out = torch.empty(shape, dtype=dtype, device=t.cache.device)
        elif not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or not _rows_of_rows(out):
            got = f"{'a contiguous' if out.is_contiguous() else 'a strided'} tensor of shape {tuple(out.shape)}" \
                if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"out must be a tensor of shape {list(shape)} (rows, features, dim) whose rows of "
                             f"features are contiguous (contiguous, or a slice of a [rows, more, dim] one's second "
                             f"dimension), got {got}")
        if not ids.numel():
            return out
        if self.grouped and self.fused and plan.fused and out.dtype == torch.float32 and out.device.type == "cpu":
            lookup_fused(self.tiers, self._writeback, cfg.hit_rate_threshold, plan, ids, sizes, out, True,
                         out_array)
            return out
        flat = self.lookup_concat(model, tables, ids, sizes)
        return torch.add(flat.view(len(tables), rows, shape[2]).transpose(0, 1), 0.0, out=out)

    def _concat_request(self, model: str, tables: Sequence[str], ids, sizes: Sequence,
                        sizes_checked: bool = False) -> tuple:
        """``(config, plan, tables, sizes)`` of a :meth:`lookup_concat` request, checked."""
        cfg = self._model(model)
        tables = tuple(tables)
        sizes = tuple(sizes)
        plan = self._plan(model, tables)
        if not plan.one_width:
            raise ValueError(f"tables must share one row width for lookup_concat, got "
                             f"{ {t.name: t.row_dim for t in plan.tables} }; use lookup_many")
        if sizes_checked:  # lookup_stacked's (rows,) * F, rows checked
            pass
        elif len(sizes) != len(tables) or not all(isinstance(n, int) and 0 <= n <= cfg.max_batch_size
                                                  for n in sizes):
            raise ValueError(f"sizes must give the ids of each of the {len(tables)} runs, ints in [0, "
                             f"models[{model!r}].max_batch_size={cfg.max_batch_size}], got {list(sizes)}")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            got = f"{ids.dtype} tensor of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else \
                type(ids).__name__
            raise TypeError(f"ids must be a 1-D int64 tensor, got {got}")
        if sum(sizes) != ids.numel():
            raise ValueError(f"sizes sum to {sum(sizes)}, but ids has {ids.numel()} entries")
        if plan.int32_keys:  # an int32 table's ids must fit int32
            for t, run in zip(tables, ids.split(sizes)):
                self._check_batch(cfg, self._tables[model][t], run)
        return cfg, plan, tables, sizes

    def _plan(self, model: str, tables: tuple) -> RequestPlan:
        """The kept plan of ``model``'s requests of ``tables`` (made now if none is, or the model was loaded again
        since). Raises ValueError for an unknown model or table."""
        served = self._model_tables(model)
        plan = self._plans.get((model, tables))
        if plan is None or plan.source is not served:
            if not tables:
                raise ValueError("tables must name at least one table")
            plan = RequestPlan([self._table(model, name) for name in tables], source=served)
            if len(self._plans) > 256:
                self._plans.clear()
            self._plans[(model, tables)] = plan
        return plan

    def _per_table(self, cfg: ModelConfig, batches: list) -> list[torch.Tensor]:
        """Rows ``[N_t, D_t]`` of each ``(table, flat keys)``, looked up table by table (:mod:`.table_lookup`)."""
        lookups = [Lookup.from_cache(t, flat) for t, flat in batches]
        read_tiers(self.tiers, lookups)
        for lookup in lookups:
            self._write_back(cfg, lookup, lookup.finish())
        return [lookup.t.answer(lookup.values) for lookup in lookups]

    @staticmethod
    def _check_batch(cfg: ModelConfig, table: TableState, keys) -> torch.Tensor:
        # Any table takes int32 and int64 ids (HPS habit); stores and caches key by the int64 value. An int32
        # table only ever trained int32-range ids: a larger one is refused, as training refuses it.
        if not isinstance(keys, torch.Tensor) or keys.dtype not in KEY_DTYPES:
            got = f"{keys.dtype} tensor" if isinstance(keys, torch.Tensor) else type(keys).__name__
            raise TypeError(f"keys of table {table.name!r} must be an int64 or int32 tensor (the table's key dtype "
                            f"is {table.key_dtype}), got {got}")
        flat = check_keys(keys, keys.dtype, keys.device).to(torch.int64)
        if flat.numel() > cfg.max_batch_size:
            raise ValueError(f"keys has {flat.numel()} entries, more than models[{cfg.model!r}].max_batch_size "
                             f"({cfg.max_batch_size})")
        if table.key_dtype == torch.int32 and keys.dtype == torch.int64 and flat.numel():
            info = torch.iinfo(torch.int32)
            if int(flat.min()) < info.min or int(flat.max()) > info.max:
                bad = flat[(flat < info.min) | (flat > info.max)][0]
                raise ValueError(f"keys of table {table.name!r}: {int(bad)} is outside the int32 range "
                                 f"[{info.min}, {info.max}] of the table's keys (key_dtype torch.int32)")
        return flat

    def _write_back(self, cfg: ModelConfig, m: Lookup, fetched: Optional[tuple]) -> None:
        """Rows ``fetched`` from the stores into the cache: now while it is cold, else in the background."""
        if fetched is None:
            return
        if m.served["cache"] < cfg.hit_rate_threshold * m.served["lookups"]:
            m.t.insert_if_current(*fetched, m.epoch)
        else:
            self._writeback.defer(m.t, *fetched, m.epoch)

    # ------------------------------------------------------------------ online updates
    def apply_update(self, export_dir, export: Optional[tuple] = None) -> dict:
        """Apply a serving export (a delta, or a full one) to every loaded model that serves its tables.

        It goes only onto tables holding an export of its own model, and only forward (see :mod:`.lineage`):
        a full export newer than the version served replaces the tables (the keys it lacks leave every tier); a
        delta of the version served deletes its deleted keys from every tier, then upserts its rows. Rows are
        replaced in the caches under each table's cache lock (no torn rows; see :mod:`.updates`).

        Args:
            export_dir: an export root (its ``latest`` version) or a version directory.
            export: ``read_export(export_dir)`` read beforehand (the caller then holds no lock while reading).

        Returns:
            ``{model: {"version", "model_id", "digest", "updated_unix", ...}}`` for the models updated.

        Raises:
            LineageError: another model's export, a version not newer than the one served, or a delta whose
                parent is not the version served (a gap); the message names both versions and model ids.
            ValueError: a table has another dim than the one served. Nothing changes on any error.
        """
        manifest, payload = export if export is not None else read_export(export_dir)
        with contextlib.ExitStack() as stack:
            for name in sorted(self._locks):
                stack.enter_context(self._locks[name])
            targets = updates.checked_targets(manifest, self._tables)  # nothing changes when it raises
            if _reformats(manifest, targets):  # rows of another dtype: installed as a load installs them
                for model in targets:
                    self._install_full(self.models[model], manifest, payload)
                    self.versions[model]["updated_unix"] = time.time()
                return {model: dict(self.versions[model]) for model in targets}
            touched = updates.apply_update(manifest, payload, targets, self.tiers)
            for model in touched:
                self.versions[model] = {**self.versions[model], **summary(self._tables[model]),
                                        "updated_unix": time.time()}
            return {model: dict(self.versions[model]) for model in touched}

    def _install_full(self, cfg: ModelConfig, manifest: dict, payload: dict) -> None:
        """Serve full export ``manifest`` in place of what ``cfg``'s export root of it serves, with new stores and
        caches (:meth:`_install`); the model's other export roots keep their versions served."""
        root = Path(manifest["path"]).parent.resolve()
        served = {cfg.export_root(i).resolve(): t.lineage.version
                  for i, t in enumerate(self._tables[cfg.model].values())}
        chains = {r: [(manifest, payload)] if r.resolve() == root else read_chain(r / version_name(served[r.resolve()]))
                  for r in cfg.export_roots()}
        self._install(cfg, chains, progress=False)

    # ------------------------------------------------------------------ stats and lifecycle
    def stats(self, model: str) -> dict:
        """Per-table counts of keys served by each tier, cache hit rate and size, and tier error counts."""
        settle_stats(self._model_tables(model).values())
        tables = {name: {**t.stats, "hit_rate": t.hit_rate, "cache_rows": t.cache.size(),
                         "cache_capacity": t.cache.max_capacity, "cache_bytes": t.cache.nbytes()}
                  for name, t in self._model_tables(model).items()}
        return {"tables": tables, "errors": self.tiers.errors, "tiers": self.tiers.state(),
                **self.versions.get(model, {})}

    def reset_stats(self, model: str) -> None:
        settle_stats(self._model_tables(model).values())
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


def _rows_of_rows(out: torch.Tensor) -> bool:
    """``out [B, F, D]`` is contiguous but for its first stride (``>= F * D``): a slice of a contiguous buffer's
    second dimension."""
    b, f, d = out.shape
    stride = out.stride()
    return (d <= 1 or stride[2] == 1) and (f <= 1 or stride[1] == d) and (b <= 1 or stride[0] >= f * d)
