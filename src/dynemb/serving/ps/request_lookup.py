"""A request's lookup in a few calls: every table of a request together, not table by table.

For each group cache (the tables of one row shape, :mod:`.group_cache`) one pass reads the ids of all its tables;
the misses of every table are made unique as ``(table, key)`` pairs in one call; each lower tier is asked once for
all of them (:meth:`Store.get_many`); default rows are computed for the ids found nowhere only, in one call per
initializer (tables that differ only in their seed share it: the rows are a function of ``key ^ mix64(seed)``);
the statistics of every table come from one count; the rows the stores answered for the cold tables (hit rate under
the threshold) go into the group cache in one insert (one eviction scan a request, not one a table). What stays per
table is a few Python operations: the dict of keys for a store, the counts added to its statistics, a deferred
write-back.

It answers exactly as the per-table path (:mod:`.table_lookup`) does, row for row (``tests/serving/test_ps.py``),
which still serves a request while a background write-back fills a group's cache (the stores are read then).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ...table.hashing import mix64
from ...table.initializers import Normal, TruncatedNormal, Uniform
from .cache import TableState
from .group_cache import GroupCache
from .tiers import StoreTiers

__all__ = ["lookup_request"]

_SOURCES = ("volatile", "persistent", "default")  # codes 1, 2, 3 of _Part.source; 0: not found yet
_SEEDED = (Uniform, Normal, TruncatedNormal)  # rows a function of (key ^ mix64(seed)) alone: see _default_rows
_MIX0 = mix64(torch.zeros((), dtype=torch.int64))


@dataclasses.dataclass
class _Part:
    """The tables of one request that share a group cache, and their misses."""

    group: GroupCache
    tables: list  # [TableState]
    slots: list  # index into the caller's list of each table
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


def _from_cache(group: GroupCache, tables: list, slots: list, flats: list) -> _Part:
    sizes = [f.numel() for f in flats]
    device = group.device
    ids = (flats[0] if len(flats) == 1 else torch.cat(flats)).to(device)
    tid = torch.repeat_interleave(torch.arange(len(tables), device=device), torch.tensor(sizes, device=device))
    salts = group.salts[torch.tensor([t.cache.index for t in tables], device=device)]
    with group.lock:
        raw, found = group.find(ids ^ salts.index_select(0, tid), ids)
        epochs = [t.epoch for t in tables]
    values = raw[:, :group.dim].contiguous()
    miss_at = (~found).nonzero().squeeze(1)
    part = _Part(group, tables, slots, sizes, values, epochs, [0] * len(tables), miss_at)
    if miss_at.numel():
        mt, mk = tid.index_select(0, miss_at).cpu(), ids.index_select(0, miss_at).cpu()
        part.missed = torch.bincount(mt, minlength=len(tables)).tolist()
        part.salts = salts.cpu()
        part.utid, part.ukey, part.inverse, part.counts = _unique_pairs(mt, mk, part.salts)
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


def _read_tier(tiers: StoreTiers, tier, parts: list[_Part]) -> None:
    """Ask ``tier`` once for the open pairs of every part; rows found there go up into the volatile tier when
    ``tier`` is the persistent one."""
    request, asked = {}, []
    for part in parts:
        if part.rows is None:
            continue
        at, per_table = _open(part)
        if not at.numel():
            continue
        keys = part.ukey.index_select(0, at).split(per_table)
        for k, n in enumerate(per_table):
            if n:
                request[part.tables[k].store_name] = keys[k]
        asked.append((part, at, per_table))
    if not request:
        return
    got = tier.call(tier.store.get_many, request)
    if got is None:  # the tier is unavailable: the next one answers
        return
    code = 1 + _SOURCES.index(tier.name)
    for part, at, per_table in asked:
        names = [part.tables[k].store_name for k, n in enumerate(per_table) if n]
        values = torch.cat([got[name][0] for name in names]) if len(names) > 1 else got[names[0]][0]
        found = torch.cat([got[name][1] for name in names]) if len(names) > 1 else got[names[0]][1]
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


def _default_rows(part: _Part) -> None:
    at, per_table = _open(part)
    if not at.numel():
        return
    tables = [part.tables[k] for k, n in enumerate(per_table) if n]
    first = tables[0].default
    one = tables[0]  # the tables of a group share dim, dtype and 8-bit kind
    dtype = torch.float32 if one.codec else one.dtype
    if all(t.default == first for t in tables) and isinstance(first, (float, int, *_SEEDED)):
        if isinstance(first, (float, int)):
            rows = one.encode(torch.full((at.numel(), one.row_dim), float(first), dtype=dtype))
        else:
            # The seeded initializers' row of key k under seed s is f(mix64(k ^ mix64(s))) (initializers'
            # _unit_uniform): under seed 0 the key k ^ mix64(s) ^ mix64(0) gets the same row, so one call serves
            # every table, bit for bit.
            seeds = torch.tensor([t.seed for t in part.tables], dtype=torch.int64)
            keys = part.ukey.index_select(0, at) ^ mix64(seeds.index_select(0, part.utid.index_select(0, at))) ^ _MIX0
            rows = one.encode(first(keys, one.row_dim, dtype, 0))
    else:
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
    counts = served.tolist()
    for k, t in enumerate(part.tables):
        with t.stats_lock:
            t.stats["lookups"] += part.sizes[k]
            t.stats["cache"] += part.sizes[k] - part.missed[k]
            for j, tier in enumerate(_SOURCES):
                t.stats[tier] += counts[k][j + 1]
    if part.rows is None:
        return
    fetched = ((part.source == 1) | (part.source == 2)).nonzero().squeeze(1)
    if not fetched.numel():
        return
    per_table = torch.bincount(part.utid.index_select(0, fetched), minlength=len(part.tables)).tolist()
    cold = []
    for k, at in enumerate(fetched.split(per_table)):
        if not at.numel():
            continue
        if part.sizes[k] - part.missed[k] < threshold * part.sizes[k]:  # cold: into the cache now
            cold.append((k, at))
        else:
            t, keys, rows = part.tables[k], part.ukey.index_select(0, at), part.rows.index_select(0, at)
            writeback.defer(t, keys, rows, part.epochs[k])
    if cold:
        _insert_cold(part, cold)


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


def lookup_request(tiers: StoreTiers, writeback, threshold: float,
                   batches: list[tuple[TableState, torch.Tensor]]) -> Optional[list[torch.Tensor]]:
    """Rows ``[N_t, D_t]`` (as answered: 8-bit rows dequantized) of each ``(table, flat int64 keys [N_t])`` of a
    request (module docstring); None when a group cache is being filled by a write-back (the per-table path, which
    reads around it, answers then)."""
    by_group: dict[int, tuple] = {}
    for slot, (t, flat) in enumerate(batches):
        entry = by_group.setdefault(id(t.cache.group), (t.cache.group, [], [], []))
        entry[1].append(t), entry[2].append(slot), entry[3].append(flat)
    if any(group.filling for group, *_ in by_group.values()):
        return None
    parts = [_from_cache(*entry) for entry in by_group.values()]
    for tier in (tiers.volatile, tiers.persistent):
        if tier.available:
            _read_tier(tiers, tier, parts)
    out: list = [None] * len(batches)
    for part in parts:
        if part.rows is not None:
            _default_rows(part)
        _finish(part, threshold, writeback)
        # 8-bit rows are dequantized once for the whole part (its tables share their kind and dim)
        for slot, rows in zip(part.slots, part.tables[0].answer(part.values).split(part.sizes)):
            out[slot] = rows
    return out
