"""The sharded executor: tables spread over ranks, one step as input_dist -> compute -> output_dist.

For all row/table-sharded tables together:

1. each table's ids are deduplicated locally and sorted by owner rank;
2. one all-to-all of the per-(rank, table) counts, then one all-to-all of the keys (and, for tables that count
   occurrences, one of the per-key counts);
3. each owner runs find_or_insert (admission and eviction happen at the owner) and gathers the rows;
4. one all-to-all returns the rows, which are pooled locally exactly as by the local executor;
5. backward: one all-to-all carries the per-unique-key gradients to the owners, which hand them to their
   optimizer (applied at once when fused, else on ``step()``).

Replicated (``data``) tables all-gather each step's unique keys so every replica inserts the same keys, and
all-gather the gradients so every replica applies the same update. Initial rows depend only on (seed, key), so a
key gets the same row whichever rank owns it, and N-rank training equals 1-rank training.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ..distributed.comm import all_gather_varsize, all_to_all_known
from ..distributed.sharding import ShardingKind
from ..functional import deliver_gradient, read_rows
from ..functional.lookup import find_ids, trains
from .features import PreparedFeature, finish
from .plan import ExecutionPlan, TableShard

__all__ = ["ShardedExecutor"]


class ShardedExecutor:
    """Runs lookups of prepared features against tables sharded over ``group``; every rank must call
    :meth:`forward` (and backward) each step, with possibly different or empty batches."""

    def __init__(self, plan: ExecutionPlan, group) -> None:
        self.plan, self.group = plan, group
        self.world, self.rank = plan.world, plan.rank
        self.comm_stats = {"bytes_sent": 0, "seconds": 0.0, "calls": 0, "keys_received": 0}
        self.training = True
        self.inserting: dict[str, bool] = {}

    def forward(self, prepared: dict[str, list[PreparedFeature]], training: bool) -> dict:
        # Tables insert, evict and count only when training with grad mode on; otherwise they are read-only.
        # (Every rank must be in the same mode: the exchange below depends on it.)
        training = self.training = training and torch.is_grad_enabled()
        # which tables insert and train (the rule of functional.lookup.trains), decided here: the owner side runs
        # inside an autograd node's forward, where grad mode is off
        self.inserting = {s.name: s.table is not None and trains(s.table, training) for s in self.plan}
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
        if training:
            values = _ShardedLookup.apply(torch.empty(0, requires_grad=True), self, keys, counts)
        else:
            values, _ = self._exchange(keys, counts)
        out = {}
        for name, vals, inverse in zip(names, values, inverses):
            start = 0
            for p in prepared.get(name, []):
                n = p.ids.numel()
                out[p.name] = finish(p, vals, inverse[start: start + n])
                start += n
        return out

    # ------------------------------------------------------------------ exchange
    def _a2a(self, send: torch.Tensor, send_counts: list, recv_counts: list, what: str) -> torch.Tensor:
        """all-to-all with accounting: bytes this rank hands to the collective, and seconds spent in it."""
        start = time.perf_counter()
        out = send if self.world == 1 else all_to_all_known(send, send_counts, recv_counts, self.group, what)
        stats = self.comm_stats
        stats["bytes_sent"] += send.numel() * send.element_size()
        stats["seconds"] += time.perf_counter() - start
        stats["calls"] += 1
        return out

    def _exchange(self, keys: list[torch.Tensor], counts: list[torch.Tensor]):
        """Rows for each table's unique keys (``counts``: their occurrences); returns ``(values per table, saved
        state for backward)``."""
        shards = list(self.plan)
        row = [i for i, s in enumerate(shards) if s.sharding.kind != ShardingKind.DATA]
        data = [i for i, s in enumerate(shards) if s.sharding.kind == ShardingKind.DATA]
        values: list = [None] * len(shards)
        saved = {"row": self._row_forward([shards[i] for i in row], [keys[i] for i in row],
                                          [counts[i] for i in row]), "data": []}
        for i, v in zip(row, saved["row"]["values"]):
            values[i] = v
        for i in data:
            values[i], state = self._data_forward(shards[i], keys[i], counts[i])
            saved["data"].append(state)
        saved["row_index"], saved["data_index"] = row, data
        return values, saved

    def _owner_lookup(self, shard: TableShard, keys: torch.Tensor, counts: Optional[torch.Tensor]):
        """Owner side: the one lookup of :func:`~dynemb.functional.lookup.find_ids` (dedup, find or insert with the
        requesters' occurrence counts when given), then the rows read. Returns (unique shard keys, rows, inverse,
        rows per key received)."""
        table = shard.table
        # a frozen table is read-only, as under no_grad (the rule of functional.lookup.trains)
        found = find_ids(table, shard.shard_keys(keys), insert=self.inserting[shard.name], counts=counts,
                         inverse=True)
        unique, rows, inverse = found.ids.unique, found.rows, found.ids.inverse
        return unique, rows, inverse, read_rows(table, unique, rows).float().index_select(0, inverse)

    def _row_forward(self, shards: list[TableShard], keys: list[torch.Tensor], counts: list[torch.Tensor]) -> dict:
        world, tables = self.world, len(shards)
        if tables == 0:
            return {"values": []}
        device = keys[0].device
        dims = [s.config.dim for s in shards]
        owners = [s.sharding.owners(k, world) for s, k in zip(shards, keys)]
        sizes = [k.numel() for k in keys]
        table_id = torch.repeat_interleave(torch.arange(tables, device=device), torch.tensor(sizes, device=device))
        sort_key = torch.cat(owners) * tables + table_id
        perm = torch.sort(sort_key, stable=True).indices
        sent = torch.bincount(sort_key, minlength=world * tables).view(world, tables)
        recv = self._a2a(sent, [1] * world, [1] * world, "all-to-all of key counts")
        recv_keys = self._a2a(torch.cat(keys).index_select(0, perm), sent.sum(1).tolist(), recv.sum(1).tolist(),
                              "all-to-all of keys")
        self.comm_stats["keys_received"] += recv_keys.numel()
        recv_counts = None
        if any(s.config.counts_occurrences for s in shards):  # from configs: every rank agrees
            # lfu/admission tables count occurrences: the counts travel with the keys (8 more bytes per key)
            recv_counts = self._a2a(torch.cat(counts).index_select(0, perm), sent.sum(1).tolist(),
                                    recv.sum(1).tolist(), "all-to-all of key counts per key")
        recv_table = torch.repeat_interleave(torch.arange(tables, device=device).repeat(world), recv.reshape(-1))
        owned, blocks = [], []
        for t, shard in enumerate(shards):
            mine = recv_keys[recv_table == t]
            if shard.module is None:
                owned.append(None)
                blocks.append(torch.empty(0, dims[t], device=device))
                continue
            mine_counts = recv_counts[recv_table == t] if recv_counts is not None and \
                shard.config.counts_occurrences else None
            unique, rows, inverse, vals = self._owner_lookup(shard, mine, mine_counts)
            owned.append((unique, rows, inverse))
            blocks.append(vals)
        send_rows = _interleave(blocks, recv)
        dims_t = torch.tensor(dims, device=device)
        got = self._a2a(send_rows, (recv * dims_t).sum(1).tolist(), (sent * dims_t).sum(1).tolist(),
                        "all-to-all of rows")
        per_table = _deinterleave(got, sent, dims)
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        values, order = [], []
        perm_table = table_id.index_select(0, perm)
        for t, shard in enumerate(shards):
            idx = perm[perm_table == t] - offsets[t]
            out = torch.empty(sizes[t], dims[t], device=device)
            out[idx] = per_table[t]
            values.append(out.to(shard.dtype))
            order.append(idx)
        return {"values": values, "shards": shards, "sent": sent, "recv": recv, "order": order, "owned": owned,
                "dims": dims}

    def _row_backward(self, state: dict, grads: list) -> None:
        if not state.get("shards"):
            return
        shards, sent, recv, dims = state["shards"], state["sent"], state["recv"], state["dims"]
        dims_t = torch.tensor(dims, device=sent.device)
        blocks = [g.float().index_select(0, idx) for g, idx in zip(grads, state["order"])]
        got = self._a2a(_interleave(blocks, sent), (sent * dims_t).sum(1).tolist(), (recv * dims_t).sum(1).tolist(),
                        "all-to-all of gradients")
        for shard, owned, dim, grad in zip(shards, state["owned"], dims, _deinterleave(got, recv, dims)):
            if owned is None:
                continue
            unique, rows, inverse = owned
            total = torch.zeros(unique.numel(), dim, device=grad.device).index_add_(0, inverse, grad)
            deliver_gradient(shard.table, unique, rows, total)

    def _data_forward(self, shard: TableShard, keys: torch.Tensor, counts: torch.Tensor):
        parts = all_gather_varsize(keys, self.group, f"all-gather of keys of {shard.name!r}")
        table = shard.table
        inserts = self.inserting[shard.name]
        every_count = None
        if inserts and shard.config.counts_occurrences:
            every_count = torch.cat(all_gather_varsize(counts, self.group, f"all-gather of counts of {shard.name!r}"))
        # every replica finds or inserts the union of the ranks' keys, with their counts: the same rows everywhere
        found = find_ids(table, shard.shard_keys(torch.cat(parts)), insert=inserts, counts=every_count, inverse=True)
        local, rows, where = found.ids.unique, found.rows, found.ids.inverse
        values = read_rows(table, local, rows)
        start = sum(p.numel() for p in parts[: self.rank])
        mine = where[start: start + keys.numel()]
        return values.index_select(0, mine), {"shard": shard, "where": where, "local": local, "rows": rows}

    def _data_backward(self, state: dict, grad: torch.Tensor) -> None:
        shard = state["shard"]
        grads = all_gather_varsize(grad.float(), self.group, f"all-gather of gradients of {shard.name!r}")
        total = torch.zeros(state["local"].numel(), grad.shape[1], device=grad.device)
        total.index_add_(0, state["where"], torch.cat(grads))
        deliver_gradient(shard.table, state["local"], state["rows"], total)

    def gather(self, shard: TableShard, keys: torch.Tensor, values: torch.Tensor):
        """Every rank's ``(keys, values)`` of a table, concatenated (a collective; a replica is one copy)."""
        if shard.sharding.kind == ShardingKind.DATA:
            return keys, values
        all_keys = all_gather_varsize(keys.to(torch.int64), self.group, f"all-gather of {shard.name!r} keys")
        all_values = all_gather_varsize(values.float(), self.group, f"all-gather of {shard.name!r} values")
        return torch.cat(all_keys).to(keys.dtype), torch.cat(all_values).to(values.dtype)


class _ShardedLookup(torch.autograd.Function):
    """All tables' exchanges as one autograd node, so backward runs its collectives in one fixed order."""

    @staticmethod
    def forward(ctx, anchor, executor, keys, counts):
        values, saved = executor._exchange(keys, counts)
        ctx.executor, ctx.saved = executor, saved
        ctx.shapes = [(v.shape, v.dtype, v.device) for v in values]
        return tuple(values)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip(grads, ctx.shapes)]
        saved, executor = ctx.saved, ctx.executor
        executor._row_backward(saved["row"], [grads[i] for i in saved["row_index"]])
        for i, state in zip(saved["data_index"], saved["data"]):
            executor._data_backward(state, grads[i])
        return None, None, None, None


def _interleave(blocks: list[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
    """Flatten per-table row blocks into one buffer ordered by (rank, table). ``counts``: ``[W, T]`` rows."""
    pieces = [b.split(counts[:, t].tolist()) for t, b in enumerate(blocks)]
    world = counts.shape[0]
    flat = [pieces[t][r].reshape(-1) for r in range(world) for t in range(len(blocks))]
    return torch.cat(flat) if flat else torch.empty(0)


def _deinterleave(flat: torch.Tensor, counts: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    """Inverse of :func:`_interleave`: per-table ``[rows, dim]`` tensors, ranks in order."""
    world, tables = counts.shape
    sizes = (counts * torch.tensor(dims, device=counts.device)).reshape(-1).tolist()
    chunks = flat.split(sizes)
    return [torch.cat([chunks[r * tables + t].view(-1, dims[t]) for r in range(world)]) for t in range(tables)]
