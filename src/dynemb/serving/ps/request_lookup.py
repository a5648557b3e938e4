"""A request's lookup in a fixed number of calls: every table of a request together, not table by table.

A request is one int64 tensor of ids, the ids of each of its tables one run after the other (a table may have
several runs: two features of one table). What does not change from one request to the next is worked out once,
in a :class:`RequestPlan` the parameter server keeps per model and list of tables (until the model is loaded
again): the tables' group caches (:mod:`.group_cache`, one per row shape), their salts and seeds and, per run
length pattern, the table and cache salt of every position. A request then costs, per group cache, one pass over
the cache for the ids of all its tables; the misses of every table made unique as ``(table, key)`` pairs in one
call; one call per lower tier for all of them (:meth:`Store.get_concat`); default rows for the ids found nowhere
only, in one call per initializer (tables that differ only in their seed share it: the rows are a function of
``key ^ mix64(seed)``); the statistics of every table from one count; the rows the stores answered for the cold
tables (hit rate under the threshold) into the group cache in one insert. What stays per table is a few Python
operations on numbers: the counts added to its statistics, a deferred write-back.

The common case, every table of the request in one cache on the CPU, takes the fused path (:func:`lookup_fused`),
whatever the rows' dtype (float32, float16, bfloat16 or an 8-bit export's packed rows, decoded to float32 as they
are written, bit for bit as :meth:`~.cache.TableState.answer` decodes them): two numba calls
(:func:`~dynemb.kernels.numba_find_many.probe_request`, :func:`~dynemb.kernels.numba_find_many.finish_request`)
probe the cache, read the misses from the in-process store, compute default rows and write every row straight to
its place in the output (a model's ``[B, F, D]`` input, for :meth:`~dynemb.serving.ParameterServer.lookup_stacked`);
Redis and persistent tiers are one call each in between (Redis:
:meth:`~dynemb.serving.stores.RedisStore.get_concat_into`, its reply parsed by numba straight into the misses' rows,
no tensor made), and initializers without a kernel (normal, truncated normal) compute their rows in torch as above
(as do the uniform default rows of 16-bit tables: the kernel computes float32 rows and quantizes 8-bit ones). A
request whose tables are in several caches (tables of several dtypes, 8-bit kinds or widths) takes the grouped
path's calls instead; so does :meth:`~dynemb.serving.ParameterServer.lookup_concat` of float16 or
bfloat16 tables (it answers rows of their dtype, the fused path float32 ones).

It answers exactly as the per-table path (:mod:`.table_lookup`) does, row for row (``tests/serving/test_ps.py``).
While a background write-back inserts into a group cache (a table's batch of rows, 1/16 of its share of the cache at
most) a request waits for the insert: reading every id of the request from the stores instead, as the per-table path
does, took 10-20x a request's time with the demo model.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional, Sequence

import numpy as np
import torch

from ...kernels.dispatch import numba_available
from ...table.hashing import mix64
from ...table.policy import EvictionPolicy
from ...table.initializers import Initializer, Normal, TruncatedNormal, Uniform, initial_rows
from .cache import TableState
from .group_cache import GroupCache
from .tiers import StoreTiers

__all__ = ["RequestPlan", "lookup_request", "lookup_fused", "concat_answers", "split_answers", "settle_stats"]

_SOURCES = ("volatile", "persistent", "default")  # codes 1, 2, 3 of _Part.source; 0: not found yet
_SEEDED = (Uniform, Normal, TruncatedNormal)  # rows a function of (key ^ mix64(seed)) alone: see _default_rows
_MIX0 = mix64(torch.zeros((), dtype=torch.int64))
_LAYOUTS = 64  # run-length patterns a plan keeps (a server sees few: its batch sizes)
_NUMPY_VIEW = {torch.bfloat16: torch.int16}  # rows numpy has no dtype for, seen as words of their width


@dataclasses.dataclass
class _GroupPlan:
    """The tables of a request that share a group cache (in the order they first appear in the request)."""

    group: GroupCache
    tables: list  # [TableState]
    members: list  # index in RequestPlan.tables of each
    names: list  # their names in the stores
    salts: torch.Tensor  # [T] each table's cache salt, on the CPU
    seeds: torch.Tensor  # [T] int64 mix64(seed) ^ mix64(0) of each table (see _default_rows)
    shared_default: bool  # every table's default is the same constant or seeded initializer (one call for all)
    stats_lock: Optional[threading.Lock] = None  # the one stats_lock of all the tables (the loader gives a group's
    # tables one), taken once a request for all their counts; None: each table's own
    kinds: Optional[torch.Tensor] = None  # [T] int64, params [T, 2] float64, salts [T] int64: each table's default
    params: Optional[torch.Tensor] = None  # as numba_find_many.finish_request computes it (None: not fused)
    default_salts: Optional[torch.Tensor] = None
    kernel_defaults: bool = False  # every table's default rows come from finish_request (else from torch first)
    arrays: Optional[tuple] = None  # the fused path's numpy views of the cache, kept (_cache_arrays)
    kernel_arrays: Optional[tuple] = None  # kinds, params and default_salts as numpy arrays (fused path)
    cache_rows: Optional[np.ndarray] = None  # each table's row in its group's pending_stats (fused path)
    row_kind: int = 0  # how the cache's rows decode to float32 (numba_find_many.ROW_FLOAT32, ...; fused path)
    lut: Optional[np.ndarray] = None  # float32 [256] each 8-bit code's value (row_codec._lut), or zeros
    fixed: Optional[np.ndarray] = None  # [T, W] the words of each CONSTANT table's default row as stored


@dataclasses.dataclass
class _RunLayout:
    """Where the ids of one run-length pattern go: per group cache, ``(positions [N_g] in the request or None for
    all of them in order, table [N_g] in the group's list, cache salt [N_g] of each position, ids of each table)``.
    """

    parts: list
    arrays: Optional[tuple] = None  # (tid, ids of each table) as numpy arrays, for the fused path


class RequestPlan:
    """What the lookups of a model's list of tables reuse from request to request (module docstring).

    ``tables``: the request's list of tables (a table may come more than once); a request's ids are their runs, in
    that order. Built by :meth:`ParameterServer.lookup_concat`, which keeps it until the model's tables are loaded
    again (:attr:`source`: the table dict it was built from).
    """

    def __init__(self, tables: Sequence[TableState], source: Optional[dict] = None) -> None:
        self.source = source
        distinct = {id(t): t for t in tables}  # in order of first appearance
        self.tables: list[TableState] = list(distinct.values())
        where = {key: i for i, key in enumerate(distinct)}
        self.slot_of = [where[id(t)] for t in tables]  # each run's table, in self.tables
        groups: dict[int, list] = {}
        for i, t in enumerate(self.tables):
            groups.setdefault(id(t.cache.group), []).append(i)
        self.groups = [self._group_plan(members) for members in groups.values()]
        self.group_of = [0] * len(self.tables)  # each table's group, and its index there
        self.local = [0] * len(self.tables)
        for g, gp in enumerate(self.groups):
            for k, i in enumerate(gp.members):
                self.group_of[i], self.local[i] = g, k
        self.run_groups = [self.group_of[i] for i in self.slot_of]  # each run's group
        self.one_width = len({t.row_dim for t in self.tables}) == 1
        self.int32_keys = any(t.key_dtype == torch.int32 for t in self.tables)
        self._layouts: dict[tuple, _RunLayout] = {}
        # The fused path (lookup_fused): one cache on the CPU holds every table of the request (rows of any dtype,
        # decoded to float32 by the kernels); `answers_float32`: the rows the tables answer are float32 (float32 or
        # 8-bit rows), so lookup_request's answer may come from it too.
        group = self.groups[0].group if len(self.groups) == 1 else None
        self.fused = group is not None and group.device.type == "cpu" and \
            group.dtype in (torch.float32, torch.float16, torch.bfloat16) and numba_available()
        self.answers_float32 = all(t.codec or t.dtype == torch.float32 for t in self.tables)
        if self.fused:
            _kernel_defaults(self.groups[0])
            gp = self.groups[0]
            if gp.stats_lock is None:  # counts folded under one lock for the group's tables (_account_fused)
                self.fused = False
            else:
                gp.group.ensure_pending_stats()
                gp.cache_rows = np.asarray([t.cache.index for t in gp.tables], dtype=np.int64)

    def _group_plan(self, members: list) -> _GroupPlan:
        tables = [self.tables[i] for i in members]
        group = tables[0].cache.group
        first = tables[0].default
        shared = all(t.default == first for t in tables) and isinstance(first, (float, int, *_SEEDED))
        lock = tables[0].stats_lock
        return _GroupPlan(group, tables, members, [t.store_name for t in tables],
                          group.salts[torch.tensor([t.cache.index for t in tables])].cpu(),
                          mix64(torch.tensor([t.seed for t in tables], dtype=torch.int64)) ^ _MIX0, shared,
                          lock if all(t.stats_lock is lock for t in tables) else None)

    def layout(self, sizes: tuple) -> _RunLayout:
        """The layout of a request whose run ``i`` has ``sizes[i]`` ids."""
        kept = self._layouts.get(sizes)
        if kept is None:
            if len(self._layouts) >= _LAYOUTS:
                self._layouts.clear()
            kept = self._layouts[sizes] = self._new_layout(sizes)
        return kept

    def _new_layout(self, sizes: tuple) -> _RunLayout:
        counts = torch.tensor(sizes, dtype=torch.int64)
        n = int(counts.sum())
        group = torch.tensor(self.run_groups, dtype=torch.int64)
        local = torch.tensor([self.local[i] for i in self.slot_of], dtype=torch.int64)
        parts = []
        for g, gp in enumerate(self.groups):
            mine = group == g
            runs = mine.repeat_interleave(counts, output_size=n)
            positions = None if len(self.groups) == 1 else runs.nonzero().squeeze(1)
            tid = local[mine].repeat_interleave(counts[mine])
            per_table = torch.bincount(tid, minlength=len(gp.tables)).tolist()
            device = gp.group.device
            parts.append((positions, tid.to(device), gp.salts.index_select(0, tid).to(device), per_table))
        return _RunLayout(parts)


@dataclasses.dataclass
class _Part:
    """The ids of one request that share a group cache, and their misses."""

    group: GroupCache
    tables: list  # [TableState]
    slots: list  # unused (kept for callers that build parts by hand)
    sizes: list  # ids of each table
    values: torch.Tensor  # [N, D] the answer, on the cache's device
    epochs: list
    missed: list  # misses (with repeats) of each table
    miss_at: torch.Tensor = None  # [K] positions of `values` missed
    utid: torch.Tensor = None  # [M] table (index in `tables`) of each unique missed (table, key), sorted by table
    ukey: torch.Tensor = None  # [M] its key
    inverse: torch.Tensor = None  # [K] index in the unique pairs of each missed position
    counts: torch.Tensor = None  # [M] times each pair was asked for
    rows: torch.Tensor = None  # [M, D] rows of the pairs, as tiers fill them in
    source: torch.Tensor = None  # [M] int64 code of the tier that answered (see _SOURCES)
    salts: torch.Tensor = None  # [T] the cache salt of each table, on the CPU
    plan: _GroupPlan = None


def _kernel_defaults(gp: _GroupPlan) -> None:
    """Each table's default as :func:`~dynemb.kernels.numba_find_many.finish_request` takes it, and how the
    group's rows decode (:attr:`_GroupPlan.row_kind`)."""
    from ...checkpoint.row_codec import _lut
    from ...kernels import numba_find_many as k

    one = gp.tables[0]  # the tables of a group share dim, dtype and 8-bit kind
    if one.codec:
        gp.row_kind = {"int8": k.ROW_INT8, "float8_e4m3fn": k.ROW_FLOAT8_E4M3,
                       "float8_e5m2": k.ROW_FLOAT8_E5M2}[one.codec]
        gp.lut = _lut(one.codec).numpy()
    else:
        gp.row_kind = {torch.float32: k.ROW_FLOAT32, torch.float16: k.ROW_FLOAT16,
                       torch.bfloat16: k.ROW_BFLOAT16}[gp.group.dtype]
        gp.lut = np.zeros(256, np.float32)
    kinds, params, fixed = [], [], []
    for t in gp.tables:
        spec = t.default.kernel_spec() if isinstance(t.default, Initializer) else ("constant", (float(t.default),))
        row = torch.zeros(1, gp.group.dim, dtype=gp.group.dtype)
        if spec is not None and spec[0] == "uniform" and gp.row_kind not in (k.ROW_FLOAT16, k.ROW_BFLOAT16):
            low, high = spec[1]
            kinds.append(k.UNIFORM)
            params.append((float(low), float(high) - float(low)))  # rounded to float32 there, as numba_init does
        elif spec is not None and spec[0] == "constant":
            kinds.append(k.CONSTANT)
            params.append((float(spec[1][0]), 0.0))
            # the row as TableState.default_rows stores it (8-bit rows: quantized)
            value = torch.full((1, t.row_dim), float(spec[1][0]), dtype=torch.float32 if t.codec else t.dtype)
            row = t.encode(value).to(gp.group.dtype)
        else:  # normal and truncated normal, and uniform rows of 16 bits: computed in torch
            kinds.append(k.IN_PYTHON)
            params.append((0.0, 0.0))
        fixed.append(row)
    gp.kinds = torch.tensor(kinds, dtype=torch.int64)
    gp.params = torch.tensor(params, dtype=torch.float64)
    gp.fixed = k.row_views(torch.cat(fixed))[0]
    gp.default_salts = mix64(torch.tensor([t.seed for t in gp.tables], dtype=torch.int64))
    gp.kernel_defaults = k.IN_PYTHON not in kinds


def _from_cache(gp: _GroupPlan, ids: torch.Tensor, tid: torch.Tensor, salt: torch.Tensor, sizes: list) -> _Part:
    """Look the ids ``[N]`` of a group's tables (table ``tid [N]``, cache salt ``salt [N]``) up in its cache."""
    group, tables = gp.group, gp.tables
    ids = ids.to(group.device)
    with group.lock:
        values, found = group.find(ids ^ salt, ids)
        epochs = [t.epoch for t in tables]
    if group.device.type == "cpu" and numba_available():  # the misses' pairs in one numba pass
        from ...kernels.numba_find_many import miss_pairs

        miss_at, utid, ukey, inverse, counts, missed = miss_pairs(found, ids, tid, gp.salts, len(tables))
        part = _Part(group, tables, [], sizes, values, epochs, [0] * len(tables), miss_at, plan=gp)
        if miss_at.numel():
            part.missed = missed.tolist()
            part.utid, part.ukey, part.inverse, part.counts = utid, ukey, inverse, counts
    else:
        miss_at = (~found).nonzero().squeeze(1)
        part = _Part(group, tables, [], sizes, values, epochs, [0] * len(tables), miss_at, plan=gp)
        if miss_at.numel():
            mt, mk = tid.index_select(0, miss_at).cpu(), ids.index_select(0, miss_at).cpu()
            part.missed = torch.bincount(mt, minlength=len(tables)).tolist()
            part.utid, part.ukey, part.inverse, part.counts = _unique_pairs(mt, mk, gp.salts)
    if miss_at.numel():
        part.salts = gp.salts
        part.rows = torch.empty(part.ukey.numel(), group.dim, dtype=group.dtype)
        part.source = torch.zeros(part.ukey.numel(), dtype=torch.int64)
    return part


def _unique_pairs(tid: torch.Tensor, keys: torch.Tensor, salts: torch.Tensor) -> tuple:
    """``(table [M], key [M], inverse [K], counts [M])`` of the distinct ``(tid, keys)`` pairs ``[K]``, sorted by
    table. A pair's cache key ``key ^ salt[table]`` names it but for the rare keys of two tables that meet there
    (see :mod:`.group_cache`): a 1-d unique of those (a fraction of the time of a unique over pairs), checked."""
    ckeys = keys ^ salts.index_select(0, tid)
    unique, inverse, counts = torch.unique(ckeys, return_inverse=True, return_counts=True)
    utid = torch.empty_like(unique).index_copy_(0, inverse, tid)
    if not bool((utid.index_select(0, inverse) == tid).all()):  # two tables' keys met: unique over the pairs
        pairs, inverse, counts = torch.unique(torch.stack([tid, keys], 1), dim=0, return_inverse=True,
                                              return_counts=True)
        return pairs[:, 0].contiguous(), pairs[:, 1].contiguous(), inverse, counts
    order = torch.argsort(utid, stable=True)
    rank = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel()))
    utid = utid.index_select(0, order)
    return utid, unique.index_select(0, order) ^ salts.index_select(0, utid), rank.index_select(0, inverse), \
        counts.index_select(0, order)


def _open(part: _Part) -> tuple[torch.Tensor, list]:
    """``(positions [P] of the pairs no tier has answered, sorted by table; how many of them each table has)``."""
    at = (part.source == 0).nonzero().squeeze(1)
    return at, torch.bincount(part.utid.index_select(0, at), minlength=len(part.tables)).tolist()


def _read_tier(tiers: StoreTiers, tier, parts: list[_Part]) -> bool:
    """Ask ``tier`` once for the open pairs of every part (one group's: :meth:`Store.get_concat`); rows found there
    go up into the volatile tier when ``tier`` is the persistent one. Returns whether the tier answered (False: it
    failed)."""
    asked = []
    for part in parts:
        if part.rows is not None:
            at, per_table = _open(part)
            if at.numel():
                asked.append((part, at, per_table))
    if not asked:
        return True
    if len(asked) == 1 and tier is tiers.volatile and asked[0][1].numel() == asked[0][0].ukey.numel() and \
            getattr(tier.store, "reads_into", False):
        # Redis, every pair open: its reply parsed straight into the part's rows (as stored: 8-bit rows as 16-bit words)
        part = asked[0][0]
        rows = part.rows.view(_NUMPY_VIEW.get(part.rows.dtype, part.rows.dtype)).numpy()
        found = tier.call(tier.store.get_concat_into, tuple(part.plan.names), part.ukey.numpy(), part.utid.numpy(),
                          rows)
        if found is not None:
            part.source.numpy()[found] = 1 + _SOURCES.index(tier.name)
        return found is not None
    if len(asked) == 1:
        part, at, per_table = asked[0]
        names = [name for name, n in zip(part.plan.names, per_table) if n]
        answer = tier.call(tier.store.get_concat, names, part.ukey.index_select(0, at), [n for n in per_table if n])
        answers = None if answer is None else [answer]
    else:
        request = {}
        for part, at, per_table in asked:
            for name, keys in zip(part.plan.names, part.ukey.index_select(0, at).split(per_table)):
                if keys.numel():
                    request[name] = keys
        got = tier.call(tier.store.get_many, request)
        answers = None if got is None else [
            tuple(torch.cat(cols) for cols in zip(*(got[name] for name, n in zip(part.plan.names, per_table) if n)))
            for part, _, per_table in asked]
    if answers is None:  # the tier is unavailable: the next one answers
        return False
    code = 1 + _SOURCES.index(tier.name)
    for (part, at, _), (values, found) in zip(asked, answers):
        hit = at[found]
        if not hit.numel():
            continue
        part.rows.index_copy_(0, hit, values[found].to(part.group.dtype))
        part.source.index_fill_(0, hit, code)
        if tier is tiers.persistent and tiers.volatile.available:
            tid = part.utid.index_select(0, hit)
            for k in torch.unique(tid).tolist():
                mine = hit[tid == k]
                tiers.volatile.call(tiers.volatile.store.put, part.tables[k].store_name,
                                    part.ukey.index_select(0, mine), part.rows.index_select(0, mine))
    return True


def _default_rows(part: _Part) -> None:
    at, per_table = _open(part)
    if not at.numel():
        return
    one = part.tables[0]  # the tables of a group share dim, dtype and 8-bit kind
    first = one.default
    dtype = torch.float32 if one.codec else one.dtype
    if part.plan.shared_default:
        if isinstance(first, (float, int)):
            rows = one.encode(torch.full((at.numel(), one.row_dim), float(first), dtype=dtype))
        else:
            # The seeded initializers' row of key k under seed s is f(mix64(k ^ mix64(s))) (initializers'
            # _unit_uniform): under seed 0 the key k ^ mix64(s) ^ mix64(0) gets the same row, so one call serves
            # every table, bit for bit.
            keys = part.ukey.index_select(0, at) ^ part.plan.seeds.index_select(0, part.utid.index_select(0, at))
            rows = one.encode(initial_rows(first, keys, one.row_dim, dtype, 0))
    else:
        tables = [t for t, n in zip(part.tables, per_table) if n]
        rows = torch.cat([t.default_rows(keys) for t, keys in
                          zip(tables, [k for k in part.ukey.index_select(0, at).split(per_table) if k.numel()])])
    part.rows.index_copy_(0, at, rows.to(part.group.dtype))
    part.source.index_fill_(0, at, 1 + _SOURCES.index("default"))


def _finish(part: _Part, threshold: float, writeback) -> None:
    """The misses' rows into the answer, each table's statistics, and the write-back of rows found in a store."""
    served = torch.zeros(len(part.tables), 1 + len(_SOURCES), dtype=torch.int64)
    if part.rows is not None:
        part.values.index_copy_(0, part.miss_at, part.rows.index_select(0, part.inverse).to(part.values.device))
        served.index_put_((part.utid, part.source), part.counts, accumulate=True)
    _account(part, served.tolist(), threshold, writeback)


def _account(part: _Part, served: list, threshold: float, writeback) -> None:
    """Each table's statistics (``served[t][code]``: its ids each source answered) and the write-back of the rows
    found in a store."""
    counts = zip(part.tables, part.sizes, part.missed, served)
    lock = part.plan.stats_lock if part.plan is not None else None
    if lock is not None:  # one lock for the group's tables: taken once for all their counts
        with lock:
            for t, n, missed, row in counts:
                if n:
                    _count(t.stats, n, missed, row)
    else:
        for t, n, missed, row in counts:
            if n:
                with t.stats_lock:
                    _count(t.stats, n, missed, row)
    if part.rows is None:
        return
    fetched = ((part.source == 1) | (part.source == 2)).nonzero().squeeze(1)
    if not fetched.numel():
        return
    per_table = torch.bincount(part.utid.index_select(0, fetched), minlength=len(part.tables)).tolist()
    # the fetched pairs' keys and rows gathered once, each table's a view of them (pairs are sorted by table)
    keys = part.ukey.index_select(0, fetched).split(per_table)
    rows = part.rows.index_select(0, fetched).split(per_table)
    cold = []
    for k, at in enumerate(fetched.split(per_table)):
        if not at.numel():
            continue
        if part.sizes[k] - part.missed[k] < threshold * part.sizes[k]:  # cold: into the cache now
            cold.append((k, at))
        else:
            writeback.defer(part.tables[k], keys[k], rows[k], part.epochs[k])
    if cold:
        _insert_cold(part, cold)


def _count(stats: dict, n: int, missed: int, served: list) -> None:
    """Add a request's ``n`` lookups of one table to its ``stats`` (under its ``stats_lock``)."""
    stats["lookups"] += n
    stats["cache"] += n - missed
    stats["volatile"] += served[1]
    stats["persistent"] += served[2]
    stats["default"] += served[3]


def _insert_cold(part: _Part, cold: list) -> None:
    """The rows of the cold tables (``[(index in part.tables, positions of its fetched pairs)]``) into the group
    cache in one insert (one pass over the cache's index and one eviction scan for the request, not one a table), but
    a table's only when no update came since they were read (they may be stale then), as
    :meth:`~.cache.TableState.insert_if_current` does. Two tables' keys that meet on one cache key: the later
    table's row wins, as it would inserted table by table."""
    group = part.group
    with group.lock:
        cold = [(k, at) for k, at in cold if part.epochs[k] == part.tables[k].epoch]
        if not cold:
            return
        at = torch.cat([a for _, a in cold]) if len(cold) > 1 else cold[0][1]
        keys = part.ukey.index_select(0, at)
        cache_keys = keys ^ part.salts.index_select(0, part.utid.index_select(0, at))
        rows = group.with_keys(keys, part.rows.index_select(0, at))
        group.kv.insert_or_assign(cache_keys.to(group.device), rows.to(group.device))


def lookup_request(tiers: StoreTiers, writeback, threshold: float, plan: RequestPlan, fused: bool, ids: torch.Tensor,
                   sizes: tuple) -> list[torch.Tensor]:
    """Rows (as answered: 8-bit rows dequantized) of the flat int64 ``ids [N]`` of a request whose run ``i``
    (``sizes[i]`` ids) belongs to the ``i``-th table of ``plan`` (module docstring): ``[N, D]`` rows for each
    group cache of the plan, of the ids of its tables in request order (:meth:`RequestPlan.layout` says which).
    ``fused``: take :func:`lookup_fused` where the plan allows it."""
    if fused and plan.fused and plan.answers_float32:
        dim = plan.tables[0].row_dim
        out = torch.empty(ids.numel(), dim, dtype=torch.float32)
        lookup_fused(tiers, writeback, threshold, plan, ids, sizes, out.view(ids.numel(), 1, dim), False)
        return [out]
    layout = plan.layout(sizes)
    parts = []
    for gp, (positions, tid, salt, per_table) in zip(plan.groups, layout.parts):
        parts.append(_from_cache(gp, ids if positions is None else ids.index_select(0, positions), tid, salt,
                                 per_table))
    answered = False  # the tier holding every row answered the misses (else a miss left is no unknown id)
    for tier in (tiers.volatile, tiers.persistent):
        if tier.available and _read_tier(tiers, tier, parts):
            answered = answered or tier is tiers.complete
    if not answered and any(bool((part.source == 0).any()) for part in parts if part.rows is not None):
        tiers.unanswered(False)
    answers = []
    for part in parts:
        if part.rows is not None:
            _default_rows(part)
        _finish(part, threshold, writeback)
        answers.append(part.tables[0].answer(part.values))  # 8-bit rows dequantized once for the whole part
    return answers


_NO_META = np.zeros((0, 7), np.int64)
_NO_SERVED = np.zeros((0, 4), np.int64)
_NO_STAMPS = np.zeros(0, np.int64)


def _cache_arrays(gp: _GroupPlan) -> tuple:
    """The numpy views :func:`~dynemb.kernels.numba_find_many.probe_request_arrays` takes of ``gp``'s group cache
    (index, overflow flags, rows as words, float32 and bytes: ``row_views``) and of the tables' salts, kept on the
    plan while the cache's storage and index stay where they are (the signature
    :class:`~dynemb.serving.stores.memory.MemoryStore` checks for its own kept pointers): a request converts no
    tensor."""
    from ...kernels.numba_find_many import row_views

    kv = gp.group.kv
    signature = (kv.storage_generation, id(kv.index), kv.index.generation)
    kept = gp.arrays
    if kept is None or kept[0] != signature:
        table, key_cols, overflow, _, shift = kv.index._kernel_args(None)
        cols = kv._cols
        kept = gp.arrays = (signature, table.numpy(), key_cols, overflow.numpy(), shift, *row_views(kv.values),
                            gp.salts.numpy(), cols["score"].numpy(), cols["version"].numpy())
    return kept


def lookup_fused(tiers: StoreTiers, writeback, threshold: float, plan: RequestPlan, ids: torch.Tensor, sizes: tuple,
                 out: torch.Tensor, pool: bool, out_array: Optional[np.ndarray] = None) -> None:
    """:func:`lookup_request` of a plan with ``fused`` set, in two numba calls and the tiers' calls between them
    (module docstring): the row of ``ids[f * B + b]`` written to ``out[b, f]``, decoded to float32 (``out [B, F, D]``
    float32, last
    dimension contiguous, any other strides: a view of a model's ``[B, F + 1, D]`` input; ``[N, 1, D]`` writes
    ``out[j, 0]``), as ``0.0 + row`` when ``pool`` (a bag of one id summed). ``out_array``: ``out.numpy()`` when the
    caller keeps it. The same rows, statistics and write-backs as :func:`lookup_request`."""
    from ...kernels.numba_find_many import finish_request_arrays, probe_request_arrays, row_views

    gp = plan.groups[0]
    layout = plan.layout(sizes)
    _, tid, _, per_table = layout.parts[0]
    if layout.arrays is None:
        layout.arrays = (tid.numpy(), np.asarray(per_table, dtype=np.int64))
    tid_np, sizes_np = layout.arrays
    ids_np = (ids if ids.is_contiguous() else ids.contiguous()).numpy()
    out_np = out.numpy() if out_array is None else out_array
    group = gp.group
    kv = group.kv
    touched = np.empty(ids_np.shape[0], np.int64)
    with group.lock:
        _, table, key_cols, overflow, shift, words, values, raw, salts, scores, versions = _cache_arrays(gp)
        # What kv.find(update_scores=True) stamps on every row the index found (an LRU cache: fill_score's access
        # clock and the clock), written by the probe itself. The stamps kv may have deferred are written first
        # (kv._cols settles them), so every row ends as kv._touch would leave it once settled: its version the
        # clock, which no version is above (a settle keeps the larger one; kv stamps at once when the clock is
        # below its high).
        direct = kv.policy is EvictionPolicy.LRU
        if direct:
            kv._cols  # noqa: B018  (the property writes deferred stamps)
        kv.clock += 1
        t, miss_at, utid, ukey, inverse, counts, missed = probe_request_arrays(
            table, key_cols, overflow, shift, words, values, ids_np, tid_np, salts, out_np, pool, touched,
            scores if direct else _NO_STAMPS, versions if direct else _NO_STAMPS, kv.access_clock, kv.clock, raw,
            gp.row_kind, gp.lut)
        if not direct:
            kv._touch(torch.from_numpy(touched[:t]))
        epochs = [t.epoch for t in gp.tables]
    if not miss_at.shape[0]:
        _account_fused(gp, sizes_np, missed, None)
        return
    rows_t = torch.empty(ukey.shape[0], group.dim, dtype=group.dtype)  # the misses' rows as stored
    rows_np, rows_f32, rows_raw = row_views(rows_t)
    source_np = np.zeros(ukey.shape[0], np.int64)
    served = np.zeros((len(gp.tables), 4), np.int64)
    if gp.kernel_arrays is None:
        gp.kernel_arrays = (gp.kinds.numpy(), gp.params.numpy(), gp.default_salts.numpy())
    kinds, params, seeds = gp.kernel_arrays

    def finish(meta, read_only: bool = False) -> bool:
        finish_request_arrays(meta if isinstance(meta, np.ndarray) else meta.numpy(), utid, ukey, counts, rows_np,
                              rows_f32, rows_raw, source_np, kinds, params, gp.fixed, seeds, miss_at, inverse, out_np,
                              pool, served, gp.row_kind, gp.lut, read_only)
        return True

    def torch_part() -> _Part:
        """The request's misses as the tiers' code and the write-back take them (torch views of the arrays)."""
        to_torch = torch.from_numpy
        part = _Part(group, gp.tables, [], per_table, out, epochs, missed.tolist(), to_torch(miss_at), plan=gp)
        part.utid, part.ukey, part.inverse, part.counts, part.salts = (to_torch(utid), to_torch(ukey),
                                                                       to_torch(inverse), to_torch(counts), gp.salts)
        part.rows, part.source = rows_t, to_torch(source_np)
        return part

    part = done = None
    volatile = tiers.volatile
    answered = False  # the tier holding every row answered the misses (lookup_request)
    in_kernel = volatile.available and getattr(volatile.store, "fused_reads", False)  # the memory store
    if in_kernel and gp.kernel_defaults and not tiers.persistent.available:
        done = volatile.call(volatile.store.with_meta, tuple(gp.names), finish)  # one call: store, defaults
    if done is None:
        asked = [tiers.volatile, tiers.persistent]
        if in_kernel:  # the memory store's rows read by the kernel; the persistent tier and torch's defaults next
            if volatile.call(volatile.store.with_meta, tuple(gp.names), lambda meta: finish(meta, True)) is not None:
                asked = asked[1:]
                answered = volatile is tiers.complete
        elif volatile.available and getattr(volatile.store, "reads_into", False):
            # Redis: the reply parsed into rows_t by numba, no tensor made (None: it failed, and backs off)
            found = volatile.call(volatile.store.get_concat_into, tuple(gp.names), ukey, utid, rows_np)
            if found is not None:
                source_np[found] = 1
                asked = asked[1:]
                answered = volatile is tiers.complete
        asked = [tier for tier in asked if tier.available]
        if (asked or not gp.kernel_defaults) and not source_np.all():
            part = torch_part()
            for tier in asked:
                if _read_tier(tiers, tier, [part]):
                    answered = answered or tier is tiers.complete
        if not answered and not source_np.all():
            tiers.unanswered(False)  # raises: no default rows for ids the failed tier may hold
        if part is not None and not gp.kernel_defaults:
            _default_rows(part)
        finish(_NO_META)
    _account_fused(gp, sizes_np, missed, served)
    fetched = np.flatnonzero((source_np == 1) | (source_np == 2))
    if fetched.shape[0]:
        _write_back_fetched(part or torch_part(), threshold, writeback, fetched, utid)


def _account_fused(gp: _GroupPlan, sizes: np.ndarray, missed: np.ndarray, served: Optional[np.ndarray]) -> None:
    """A fused request's counts added to its group cache's pending statistics in one numba call (no loop over the
    tables in Python): :meth:`~.server.ParameterServer.stats` folds them into each table's ``stats`` when it reads
    them."""
    from ...kernels.numba_find_many import add_counts

    with gp.stats_lock:
        add_counts(gp.group.pending_stats, gp.cache_rows, sizes, missed, _NO_SERVED if served is None else served)


def _write_back_fetched(part: _Part, threshold: float, writeback, fetched: np.ndarray, utid: np.ndarray) -> None:
    """The write-back of the rows a fused request read from a store (positions ``fetched`` of its pairs), as
    :func:`_account` does it, with the pairs found in numpy on the kernels' arrays."""
    per_table = np.bincount(utid[fetched], minlength=len(part.tables))
    fetched_t = torch.from_numpy(fetched)
    keys = part.ukey.index_select(0, fetched_t)
    rows = part.rows.index_select(0, fetched_t)
    cold = []
    bounds = np.concatenate([[0], np.cumsum(per_table)]).tolist()
    for k in np.flatnonzero(per_table).tolist():
        lo, hi = bounds[k], bounds[k + 1]
        if part.sizes[k] - part.missed[k] < threshold * part.sizes[k]:  # cold: into the cache now
            cold.append((k, fetched_t[lo:hi]))
        else:
            writeback.defer(part.tables[k], keys[lo:hi], rows[lo:hi], part.epochs[k])
    if cold:
        _insert_cold(part, cold)


def settle_stats(tables) -> None:
    """Fold the counts fused requests left with their group caches (:func:`_account_fused`) into each of
    ``tables``' ``stats`` (a :class:`TableState` iterable), under each table's ``stats_lock``."""
    for t in tables:
        pending = t.cache.group.pending_stats
        if pending is None:
            continue
        with t.stats_lock:
            row = pending[t.cache.index]
            if row.any():
                for name, n in zip(("lookups", "cache", "volatile", "persistent", "default"), row.tolist()):
                    t.stats[name] += n
                row[:] = 0


def concat_answers(plan: RequestPlan, sizes: tuple, answers: list[torch.Tensor]) -> torch.Tensor:
    """The rows of every id of the request in request order, ``[N, D]``, from :func:`lookup_request`'s answers
    (one group cache: its answer as it is)."""
    if len(answers) == 1:
        return answers[0]
    dtypes = {a.dtype for a in answers}
    if len(dtypes) > 1:
        raise ValueError(f"the tables answer rows of several dtypes {sorted(map(str, dtypes))}: look them up with "
                         "lookup_many")
    layout = plan.layout(sizes)
    out = torch.empty(sum(a.shape[0] for a in answers), answers[0].shape[1], dtype=answers[0].dtype,
                      device=answers[0].device)
    for (positions, *_), rows in zip(layout.parts, answers):
        out.index_copy_(0, positions.to(out.device), rows)
    return out


def split_answers(plan: RequestPlan, sizes: tuple, answers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The rows of each run of the request, ``[sizes[i], D_i]``, from :func:`lookup_request`'s answers."""
    if len(answers) == 1:
        return list(answers[0].split(list(sizes)))
    pieces = [iter(a.split([n for n, g in zip(sizes, plan.run_groups) if g == k])) for k, a in enumerate(answers)]
    return [next(pieces[g]) for g in plan.run_groups]
