"""The sharded executor: drives each table's sharding strategy, one step as input_dist -> lookup -> output_dist.

For all tables of keyed kinds (row, table, table_row, column) together:

1. each table's ids are deduplicated locally; its strategy routes each unique key to one or more ranks
   (:meth:`~dynemb.distributed.strategy.ShardingStrategy.route`), and the copies are sorted by rank;
2. one all-to-all of the per-(rank, table) counts, then one all-to-all of the keys (and, for tables that count
   occurrences, one of the per-key counts);
3. each owner runs the collection's owner-side lookup (:meth:`ShardedExecutor.owner_lookup`, which is
   :func:`~dynemb.functional.owner.owner_lookup` over all its tables: an execution group's tables as one grouped
   call; find_or_insert with the requesters' counts, so admission and eviction happen at the owner) and reads its
   columns of the rows;
4. one all-to-all returns them, and each table's strategy puts its rows together
   (:meth:`~dynemb.distributed.strategy.ShardingStrategy.assemble`); they are pooled locally exactly as by the
   local executor;
5. backward: each strategy splits the per-unique-key gradients (:meth:`~.ShardingStrategy.split`), one
   all-to-all carries them to the owners, an owner shares what its strategy must share before the update (a
   column shard's part of a row statistic, one more all-to-all when any table needs it), and hands them to the
   table's optimizer (applied at once when fused, else on ``step()``).

Replicated (``data``) tables exchange by all-gathers (:mod:`dynemb.distributed.shard_data`). Initial rows depend
only on (seed, key), so a key gets the same row whichever rank owns it, and N-rank training equals 1-rank
training. The exchange records kept between forward and backward are typed
(:class:`~dynemb.distributed.strategy.KeyedRecord`, :class:`~dynemb.distributed.strategy.ReplicatedRecord`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from ..distributed.comm import all_gather_varsize, all_to_all_known
from ..distributed.strategy import KeyedRecord
from ..functional.find import trains
from ..functional.owner import OwnerRows, owner_lookup
from .features import PreparedFeature, finish
from .plan import ExecutionPlan, TableShard

__all__ = ["ShardedExecutor"]


class ShardedExecutor:
    """Runs lookups of prepared features against tables sharded over ``group``; every rank must call
    :meth:`forward` (and backward) each step, with possibly different or empty batches."""

    def __init__(self, plan: ExecutionPlan, group) -> None:
        self.plan, self.group = plan, group
        self.world, self.rank = plan.world, plan.rank
        self.comm_stats = {"bytes_sent": 0, "bytes_remote": 0, "seconds": 0.0, "calls": 0, "keys_received": 0}
        self.training = True
        self.inserting: dict[str, bool] = {}
        self._width_cache: dict = {}

    def input_dist(self, prepared: dict[str, list[PreparedFeature]], group=None) -> "KeyDist":
        """The stages of a step that change no state: each table's ids deduplicated, routed, and the keys (with
        their counts) exchanged with their owners, over ``group`` (default: the collection's). A collective on
        ``group``; :class:`~dynemb.train.Pipeline` runs it for the next batch, over a group of its own, while this
        batch computes, and hands the result to :meth:`forward`."""
        names = list(self.plan.shards)
        device = next((p.ids.device for parts in prepared.values() for p in parts), None)
        keys, inverses, counts = [], [], []
        for name in names:
            cfg = self.plan[name].config
            parts = prepared.get(name, [])
            flat = torch.cat([p.ids for p in parts]) if parts else torch.empty(0, dtype=cfg.key_dtype, device=device)
            unique, inverse, count = torch.unique(flat.to(torch.int64), return_inverse=True, return_counts=True)
            keys.append(unique)
            inverses.append(inverse)
            counts.append(count)
        shards = list(self.plan)
        keyed = [i for i, s in enumerate(shards) if not s.strategy.replicated]
        sent = self._keyed_input([shards[i] for i in keyed], [keys[i] for i in keyed], [counts[i] for i in keyed],
                                 self.group if group is None else group)
        return KeyDist(keys, inverses, counts, sent)

    def forward(self, prepared: dict[str, list[PreparedFeature]], training: bool,
                dist: Optional["KeyDist"] = None) -> dict:
        """Rows of ``prepared``'s features; ``dist``: their :meth:`input_dist`, done already (else done here)."""
        # Tables insert, evict and count only when training with grad mode on; otherwise they are read-only.
        # (Every rank must be in the same mode: the exchange below depends on it.)
        training = self.training = training and torch.is_grad_enabled()
        # which tables insert and train (the rule of functional.lookup.trains), decided here: the owner side runs
        # inside an autograd node's forward, where grad mode is off
        self.inserting = {s.name: s.table is not None and trains(s.table, training) for s in self.plan}
        names = list(self.plan.shards)
        if dist is None:
            dist = self.input_dist(prepared)
        keys, inverses, counts = dist.keys, dist.inverses, dist.counts
        if training:
            for name, unique in zip(names, keys):
                self.plan[name].observed["unique_accesses"] += unique.numel()
        if training:
            values = _ShardedLookup.apply(torch.empty(0, requires_grad=True), self, keys, counts, dist.sent)
        else:
            values, _ = self._exchange(keys, counts, dist.sent)
        out = {}
        for name, vals, inverse in zip(names, values, inverses):
            start = 0
            for p in prepared.get(name, []):
                n = p.ids.numel()
                out[p.name] = finish(p, vals, inverse[start: start + n])
                start += n
        return out

    # ------------------------------------------------------------------ exchange
    def _a2a(self, send: torch.Tensor, send_counts: list, recv_counts: list, what: str, group=None) -> torch.Tensor:
        """all-to-all (over ``group``, default the collection's) with accounting: bytes this rank hands to the
        collective (``bytes_remote``: those for other ranks, what crosses the wire), and seconds spent in it."""
        start = time.perf_counter()
        group = self.group if group is None else group
        out = send if self.world == 1 else all_to_all_known(send, send_counts, recv_counts, group, what)
        stats = self.comm_stats
        total = send.numel() * send.element_size()
        stats["bytes_sent"] += total
        units = sum(send_counts)
        stats["bytes_remote"] += total - (total // units * send_counts[self.rank] if units else 0)
        stats["seconds"] += time.perf_counter() - start
        stats["calls"] += 1
        return out

    def _exchange(self, keys: list[torch.Tensor], counts: list[torch.Tensor], sent: Optional["KeysSent"]):
        """Rows for each table's unique keys (``counts``: their occurrences); returns ``(values per table, saved
        records for backward)``."""
        shards = list(self.plan)
        keyed = [i for i, s in enumerate(shards) if not s.strategy.replicated]
        replicated = [i for i, s in enumerate(shards) if s.strategy.replicated]
        values: list = [None] * len(shards)
        record = self._keyed_forward([shards[i] for i in keyed], [keys[i] for i in keyed], sent)
        for i, v in zip(keyed, record.values if record is not None else []):
            values[i] = v
        saved = {"keyed": record, "keyed_index": keyed, "replicated": [], "replicated_index": replicated}
        for i in replicated:
            shard = shards[i]
            values[i], state = shard.strategy.forward(shard, keys[i], counts[i], self.owner_lookup,
                                                      self.inserting[shard.name], self.group)
            saved["replicated"].append(state)
        return values, saved

    def owner_lookup(self, shards: list[TableShard], keys: list[torch.Tensor],
                     counts: list[Optional[torch.Tensor]]) -> OwnerRows:
        """The collection's owner-side lookup, which every strategy calls: the received ``keys[t]`` (the user's) of
        ``shards[t]`` found or inserted (with the requesters' occurrence ``counts[t]`` where given) by
        :func:`~dynemb.functional.owner.owner_lookup`, an execution group's tables as one grouped call."""
        return owner_lookup([s.table for s in shards], [s.shard_keys(k) for s, k in zip(shards, keys)],
                            insert=[s.table is not None and self.inserting[s.name] for s in shards],
                            counts=counts, groups=[g.lookup for g in self.plan.groups])

    def _widths(self, strategies: list) -> torch.Tensor:
        """``[W, T]``: the columns each rank holds of each table (fixed by the plan: computed once)."""
        key = tuple(id(s) for s in strategies)
        if self._width_cache.get("key") != key:
            self._width_cache = {"key": key, "widths": torch.tensor(
                [[hi - lo for lo, hi in (s.column_range(r) for s in strategies)] for r in range(self.world)],
                dtype=torch.int64).reshape(self.world, len(strategies))}
        return self._width_cache["widths"]

    def _keyed_input(self, shards: list[TableShard], keys: list[torch.Tensor], counts: list[torch.Tensor],
                     group) -> Optional["KeysSent"]:
        """input_dist of the keyed tables: route each unique key, then the all-to-alls of the counts, the keys and
        (for tables that count occurrences) the per-key counts, over ``group``. Changes no state."""
        world, tables = self.world, len(shards)
        if tables == 0:
            return None
        device = keys[0].device
        strategies = [s.strategy for s in shards]
        routes = [st.route(k) for st, k in zip(strategies, keys)]
        sizes = [r.dest.numel() for r in routes]
        table_id = torch.repeat_interleave(torch.arange(tables, device=device), torch.tensor(sizes, device=device))
        sort_key = torch.cat([r.dest for r in routes]) * tables + table_id
        perm = torch.sort(sort_key, stable=True).indices
        sent = torch.bincount(sort_key, minlength=world * tables).view(world, tables)
        recv = self._a2a(sent, [1] * world, [1] * world, "all-to-all of key counts", group)
        copies_all = torch.cat([k.index_select(0, r.index) for k, r in zip(keys, routes)])
        recv_keys = self._a2a(copies_all.index_select(0, perm), sent.sum(1).tolist(), recv.sum(1).tolist(),
                              "all-to-all of keys", group)
        recv_counts = None
        if any(s.config.counts_occurrences for s in shards):  # from configs: every rank agrees
            # lfu/admission tables count occurrences: the counts travel with the keys (8 more bytes per key)
            all_counts = torch.cat([c.index_select(0, r.index) for c, r in zip(counts, routes)])
            recv_counts = self._a2a(all_counts.index_select(0, perm), sent.sum(1).tolist(), recv.sum(1).tolist(),
                                    "all-to-all of key counts per key", group)
        return KeysSent(routes, sizes, table_id, perm, sent, recv, recv_keys, recv_counts)

    def _keyed_forward(self, shards: list[TableShard], keys: list[torch.Tensor],
                       kin: Optional["KeysSent"]) -> Optional[KeyedRecord]:
        world, tables = self.world, len(shards)
        if tables == 0:
            return None
        device = keys[0].device
        strategies = [s.strategy for s in shards]
        widths = self._widths(strategies).to(device)
        routes, sizes, table_id, perm = kin.routes, kin.sizes, kin.table_id, kin.perm
        sent, recv, recv_keys, recv_counts = kin.sent, kin.recv, kin.recv_keys, kin.recv_counts
        self.comm_stats["keys_received"] += recv_keys.numel()
        recv_table = torch.repeat_interleave(torch.arange(tables, device=device).repeat(world), recv.reshape(-1))
        mine = [recv_keys[recv_table == t] for t in range(tables)]
        mine_counts = [recv_counts[recv_table == t] if recv_counts is not None and s.config.counts_occurrences
                       else None for t, s in enumerate(shards)]
        # the owner side: one call for all of this rank's tables
        owner = self.owner_lookup(shards, mine, mine_counts)
        blocks = [v if v is not None else torch.empty(0, int(widths[self.rank, t]), device=device)
                  for t, v in enumerate(owner.values)]
        send_rows = _interleave([list(b.split(recv[:, t].tolist())) for t, b in enumerate(blocks)])
        got = self._a2a(send_rows, (recv * widths[self.rank]).sum(1).tolist(), (sent * widths).sum(1).tolist(),
                        "all-to-all of rows")
        pieces = _deinterleave(got, sent, widths)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        values, copies = [], []
        perm_table = table_id.index_select(0, perm)
        for t, (shard, route) in enumerate(zip(shards, routes)):
            order = route.index.index_select(0, perm[perm_table == t] - offsets[t])  # unique-key positions
            values.append(shard.strategy.assemble(keys[t].numel(), order, pieces[t], shard.dtype))
            copies.append(order)
        received = [s.shard_keys(k) for s, k in zip(shards, mine)]
        return KeyedRecord(strategies, shards, sent, recv, widths, copies, received, owner, values)

    def _keyed_backward(self, record: Optional[KeyedRecord], grads: list) -> None:
        if record is None:
            return
        sent, recv, widths = record.sent, record.recv, record.widths
        pieces = [st.split(g, order, sent[:, t].tolist())
                  for t, (st, g, order) in enumerate(zip(record.strategies, grads, record.copies))]
        got = self._a2a(_interleave(pieces), (sent * widths).sum(1).tolist(),
                        (recv * widths[self.rank]).sum(1).tolist(), "all-to-all of gradients")
        mine = [torch.cat(p) for p in _deinterleave(got, recv, widths[self.rank].expand_as(recv))]
        self._share(record, mine)
        record.owner.backward([g if v is not None else None for g, v in zip(mine, record.owner.values)])

    def _share(self, record: KeyedRecord, grads: list) -> None:
        """What each owner shares with the table's other owners before its update (a column shard's part of each
        row's statistic), summed over the others and handed to the strategy: one all-to-all for every table that
        needs it. Which tables share is fixed by the plan, the same on every rank (all join the collective), and a
        shard's unique keys are the same on every rank of its group (the same keys arrive in the same order), so
        the sizes are known on both sides."""
        sharing = [t for t, st in enumerate(record.strategies) if st.shares_row_statistic]
        if not sharing:
            return
        parts = {t: record.strategies[t].before_delivery(record.shards[t], record.received[t],
                                                         record.owner.values[t], grads[t])
                 for t in sharing if record.owner.values[t] is not None}
        parts = {t: p for t, p in parts.items() if p is not None}
        send, counts = [], [0] * self.world
        for r in range(self.world):
            for t, (_, part) in parts.items():
                if r != self.rank and record.strategies[t].holds(r):
                    send.append(part)
                    counts[r] += part.numel()
        device = record.sent.device
        got = self._a2a(torch.cat(send) if send else torch.empty(0, device=device), counts, counts,
                        "all-to-all of row statistics")
        shared = {t: torch.zeros_like(part) for t, (_, part) in parts.items()}
        start = 0
        for r in range(self.world):
            for t, (_, part) in parts.items():
                if r != self.rank and record.strategies[t].holds(r):
                    shared[t] += got[start: start + part.numel()]
                    start += part.numel()
        for t, (unique, _) in parts.items():
            record.strategies[t].deliver(record.shards[t], unique, shared[t])

    def gather(self, shard: TableShard, keys: torch.Tensor, values: torch.Tensor):
        """Every rank's ``(keys, values)`` of a table put together by its strategy (a collective; a replica is one
        copy, column shards are joined)."""
        if shard.strategy.replicated:
            return keys, values
        all_keys = all_gather_varsize(keys.to(torch.int64), self.group, f"all-gather of {shard.name!r} keys")
        # flat: column shards' widths differ by rank
        all_values = all_gather_varsize(values.float().reshape(-1), self.group, f"all-gather of {shard.name!r} values")
        widths = [hi - lo for lo, hi in (shard.strategy.column_range(r) for r in range(self.world))]
        parts = {r: {"keys": k, "values": v.view(k.numel(), widths[r])}
                 for r, (k, v) in enumerate(zip(all_keys, all_values)) if shard.strategy.writes(r)}
        whole = shard.strategy.join(parts, {"values"})
        return whole["keys"].to(keys.dtype), whole["values"].to(values.dtype)


@dataclass
class KeysSent:
    """The keyed tables' input_dist of one batch: each unique key's route, the per-(rank, table) counts sent and
    received (``[W, T]``), and the keys (and per-key counts) this rank received as an owner."""

    routes: list
    sizes: list
    table_id: torch.Tensor
    perm: torch.Tensor
    sent: torch.Tensor
    recv: torch.Tensor
    recv_keys: torch.Tensor
    recv_counts: Optional[torch.Tensor]


@dataclass
class KeyDist:
    """One batch's :meth:`ShardedExecutor.input_dist`: per table (plan order) its unique keys, each id's position
    among them, their occurrences, and the keyed tables' exchange (None without keyed tables)."""

    keys: list
    inverses: list
    counts: list
    sent: Optional[KeysSent]


class _ShardedLookup(torch.autograd.Function):
    """All tables' exchanges as one autograd node, so backward runs its collectives in one fixed order."""

    @staticmethod
    def forward(ctx, anchor, executor, keys, counts, sent):
        values, saved = executor._exchange(keys, counts, sent)
        ctx.executor, ctx.saved = executor, saved
        ctx.shapes = [(v.shape, v.dtype, v.device) for v in values]
        return tuple(values)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip(grads, ctx.shapes)]
        saved, executor = ctx.saved, ctx.executor
        executor._keyed_backward(saved["keyed"], [grads[i] for i in saved["keyed_index"]])
        for i, record in zip(saved["replicated_index"], saved["replicated"]):
            record.shard.strategy.backward(record, grads[i], executor.group)
        return None, None, None, None, None


def _interleave(pieces: list) -> torch.Tensor:
    """Flatten ``pieces[t][r]`` (table ``t``'s rows for rank ``r``) into one buffer ordered by (rank, table)."""
    world = len(pieces[0]) if pieces else 0
    flat = [pieces[t][r].reshape(-1) for r in range(world) for t in range(len(pieces))]
    return torch.cat(flat) if flat else torch.empty(0)


def _deinterleave(flat: torch.Tensor, counts: torch.Tensor, widths: torch.Tensor) -> list:
    """Inverse of :func:`_interleave`: ``pieces[t][r]`` of ``counts[r, t]`` rows of ``widths[r, t]`` columns."""
    world, tables = counts.shape
    chunks = flat.split((counts * widths).reshape(-1).tolist())
    widths = widths.tolist()
    return [[chunks[r * tables + t].view(-1, widths[r][t]) if widths[r][t] else flat.new_empty(0)
             for r in range(world)] for t in range(tables)]
