"""DistributedEmbeddingCollection: the EmbeddingCollection interface, with tables sharded over ranks.

One step, for all row/table-sharded tables together (input_dist -> compute -> output_dist):

1. each table's ids are deduplicated locally and sorted by owner rank;
2. one all-to-all of the per-(rank, table) counts, then one all-to-all of the keys;
3. each owner runs find_or_insert (admission and eviction happen at the owner) and gathers the rows;
4. one all-to-all returns the rows, which are pooled locally exactly as in :class:`EmbeddingCollection`;
5. backward: one all-to-all carries the per-unique-key gradients to the owners, which hand them to their sparse
   optimizer (applied at once when fused, else on ``step()``).

Replicated (``data``) tables all-gather each step's unique keys so every replica inserts the same keys, and
all-gather the gradients so every replica applies the same update. Only unique keys and their rows cross the wire.
Initial rows depend only on (seed, key), so a key gets the same row whichever rank owns it, and N-rank training
equals 1-rank training.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..collection import EmbeddingCollection, FeatureConfig, TableConfig
from ..optim.combined import CombinedOptimizer
from ..embedding import DynamicEmbedding, StaticEmbedding
from ..functional import _deliver, _read_rows, counts_occurrences
from .comm import all_gather_varsize, all_to_all_known, check_agreement
from .plan import Sharding, resolve_plan

__all__ = ["DistributedEmbeddingCollection"]


@dataclasses.dataclass
class _Shard:
    cfg: TableConfig
    sharding: Sharding
    module: Optional[nn.Module]  # None on ranks that own none of the table
    world: int

    def local_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Global int64 keys -> this shard's keys (its key dtype; static row shards use ``key // world``)."""
        if self.cfg.is_static and self.sharding.kind == "row":
            keys = torch.div(keys, self.world, rounding_mode="floor")
        return keys.to(self.cfg.key_dtype)

    def global_keys(self, keys: torch.Tensor, rank: int) -> torch.Tensor:
        if self.cfg.is_static and self.sharding.kind == "row":
            return keys.to(torch.int64) * self.world + rank
        return keys


def _counts_occurrences(cfg: TableConfig) -> bool:
    """The config-level twin of ``functional.counts_occurrences`` (identical on every rank)."""
    return not cfg.is_static and (cfg.admission is not None or (cfg.eviction or "lru").endswith("lfu"))


class DistributedEmbeddingCollection(EmbeddingCollection):
    """Sharded twin of :class:`EmbeddingCollection` (same constructor arguments plus ``plan``).

    Args:
        tables, features: as for EmbeddingCollection. ``max_capacity`` is per rank for row-sharded tables.
        plan: explicit shardings by table name (see :mod:`dynemb.distributed.plan`); the rest is automatic.
        process_group: the group to shard over (default: the world).
        timeout: seconds before a collective gives up with :class:`DistributedError` (a dead or stuck rank).
        device: where this rank's shards live (``cuda`` for NCCL).

    Every rank must call ``forward`` (and ``backward``) each step, with the same feature names; batches may
    differ in size and a rank may have no ids at all.
    """

    def __init__(self, tables: list[TableConfig], features: list[FeatureConfig], *, plan: Optional[dict] = None,
                 process_group=None, timeout: float = 300.0, device=None) -> None:
        nn.Module.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first "
                               "(or launch with torchrun)")
        backend = dist.get_backend(process_group)
        self.group = dist.new_group(ranks=dist.get_process_group_ranks(process_group) if process_group else None,
                                    backend=backend, timeout=timedelta(seconds=timeout))
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        EmbeddingCollection._validate(self, tables, features)
        self.plan = resolve_plan(tables, self.world, plan)
        check_agreement(self._signature(tables, features), self.group, "DistributedEmbeddingCollection config")
        seeds = {t.name: t.seed if t.seed is not None else int(torch.randint(0, 2**31, (1,)).item()) for t in tables}
        seeds = self._agree_on_seeds(seeds)
        self.embeddings = nn.ModuleDict()
        self.shards: dict[str, _Shard] = {}
        optimizers = {}
        for cfg in tables:
            module = self._build_shard(cfg, self.plan[cfg.name], seeds[cfg.name], device)
            if module is not None:
                self.embeddings[cfg.name] = module
                if cfg.optimizer is not None:
                    optimizers[cfg.name] = cfg.optimizer.bind([module])
            self.shards[cfg.name] = _Shard(cfg, self.plan[cfg.name], module, self.world)
        self.optimizer = CombinedOptimizer(optimizers)
        self.comm_stats = {"bytes_sent": 0, "seconds": 0.0, "calls": 0, "keys_received": 0}

    # ------------------------------------------------------------------ construction
    def _signature(self, tables, features) -> dict:
        def table(cfg):
            d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in ("seed",)}
            return {k: (repr(v) if not isinstance(v, (int, float, str, type(None))) else v) for k, v in d.items()}

        return {"world": self.world, "tables": [table(t) for t in tables],
                "features": [repr(f) for f in features], "plan": {k: v.describe() for k, v in self.plan.items()}}

    def _agree_on_seeds(self, seeds: dict) -> dict:
        """Rank 0's seeds win, so seed=None tables initialize identically on every rank."""
        names = sorted(seeds)
        values = torch.tensor([seeds[n] for n in names], dtype=torch.int64)
        if dist.get_backend(self.group) == "nccl":
            values = values.cuda()
        dist.broadcast(values, src=dist.get_global_rank(self.group, 0), group=self.group)
        return dict(zip(names, values.tolist()))

    def _build_shard(self, cfg: TableConfig, sharding: Sharding, seed: int, device) -> Optional[nn.Module]:
        if sharding.kind == "table" and sharding.owner != self.rank:
            return None
        if cfg.is_static:
            rows = cfg.vocabulary_size
            if sharding.kind == "row":  # this rank owns ids r, r + W, r + 2W, ...
                rows = max(1, (cfg.vocabulary_size - self.rank + self.world - 1) // self.world)
            module = StaticEmbedding(rows, cfg.dim, dtype=cfg.dtype, device=device, initializer="zeros", seed=seed)
            ids = torch.arange(rows, dtype=torch.int64, device=module.table.device)
            if sharding.kind == "row":
                ids = ids * self.world + self.rank
            from ..table.initializers import resolve_initializer

            module.table.values.copy_(resolve_initializer(cfg.initializer)(ids, cfg.dim, cfg.dtype, seed))
            return module
        capacity = cfg.max_capacity
        return DynamicEmbedding(cfg.dim, key_dtype=cfg.key_dtype, dtype=cfg.dtype, initializer=cfg.initializer,
                                device=device, init_capacity=cfg.init_capacity, max_capacity=capacity,
                                eviction=cfg.eviction, admission=cfg.admission, seed=seed)

    def train(self, mode: bool = True):
        super().train(mode)
        return self

    # ------------------------------------------------------------------ forward
    def forward(self, features: dict, weights: Optional[dict] = None) -> dict:
        """As :meth:`EmbeddingCollection.forward`; a collective call: every rank must make it."""
        prepared = self._prepare_all(features, weights or {})
        names = list(self.shards)
        device = next((p["ids"].device for parts in prepared.values() for p in parts), None)
        keys, inverses, counts = [], [], []
        for name in names:
            cfg = self.shards[name].cfg
            parts = prepared.get(name, [])
            flat = torch.cat([p["ids"] for p in parts]) if parts else torch.empty(0, dtype=cfg.key_dtype,
                                                                                   device=device)
            unique, inverse, count = torch.unique(flat.to(torch.int64), return_inverse=True, return_counts=True)
            keys.append(unique)
            inverses.append(inverse)
            counts.append(count)
        if self.training and torch.is_grad_enabled():
            values = _ShardedLookup.apply(torch.empty(0, requires_grad=True), self, keys, counts)
        else:
            values, _ = self._exchange(keys, counts)
        out = {}
        for name, vals, inverse in zip(names, values, inverses):
            start = 0
            for p in prepared.get(name, []):
                n = p["ids"].numel()
                out[p["name"]] = self._finish(p, vals, inverse[start: start + n])
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
        names = list(self.shards)
        row = [i for i, n in enumerate(names) if self.shards[n].sharding.kind != "data"]
        data = [i for i, n in enumerate(names) if self.shards[n].sharding.kind == "data"]
        values: list = [None] * len(names)
        saved = {"row": self._row_forward([names[i] for i in row], [keys[i] for i in row], [counts[i] for i in row]),
                 "data": []}
        for i, v in zip(row, saved["row"]["values"]):
            values[i] = v
        for i in data:
            values[i], state = self._data_forward(names[i], keys[i], counts[i])
            saved["data"].append(state)
        saved["row_index"], saved["data_index"] = row, data
        return values, saved

    def _insert(self, table, unique: torch.Tensor, inverse: torch.Tensor, counts: Optional[torch.Tensor]):
        """find_or_insert of ``unique``, with occurrence counts summed from every requester when the table uses them."""
        if counts is None or not counts_occurrences(table):
            return table.find_or_insert(unique)[0]
        total = torch.zeros(unique.numel(), dtype=torch.int64, device=unique.device).index_add_(0, inverse, counts)
        return table.find_or_insert(unique, counts=total)[0]

    def _lookup(self, shard: _Shard, keys: torch.Tensor, counts: Optional[torch.Tensor]):
        """Owner side: unique, find/insert, read. Returns (unique local keys, rows, inverse, rows per key)."""
        local = shard.local_keys(keys)
        unique, inverse = torch.unique(local, return_inverse=True)
        table = shard.module.table
        if self.training:
            rows = self._insert(table, unique, inverse, counts)
        else:
            rows = table.find_rows(unique)
        return unique, rows, inverse, _read_rows(table, unique, rows).float().index_select(0, inverse)

    def _row_forward(self, names: list[str], keys: list[torch.Tensor], counts: list[torch.Tensor]) -> dict:
        world, tables = self.world, len(names)
        device = keys[0].device if keys else torch.device("cpu")
        dims = [self.shards[n].cfg.dim for n in names]
        if tables == 0:
            return {"values": []}
        owners = [self.shards[n].sharding.owners(k, world) for n, k in zip(names, keys)]
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
        if any(_counts_occurrences(self.shards[n].cfg) for n in names):  # from configs: every rank agrees
            # lfu/admission tables count occurrences: the counts travel with the keys (8 more bytes per key)
            recv_counts = self._a2a(torch.cat(counts).index_select(0, perm), sent.sum(1).tolist(),
                                    recv.sum(1).tolist(), "all-to-all of key counts per key")
        recv_table = torch.repeat_interleave(torch.arange(tables, device=device).repeat(world), recv.reshape(-1))
        owned, blocks = [], []
        for t, name in enumerate(names):
            mine = recv_keys[recv_table == t]
            shard = self.shards[name]
            if shard.module is None:
                owned.append(None)
                blocks.append(torch.empty(0, dims[t], device=device))
                continue
            mine_counts = recv_counts[recv_table == t] if recv_counts is not None else None
            unique, rows, inverse, vals = self._lookup(shard, mine, mine_counts)
            owned.append((unique, rows, inverse))
            blocks.append(vals)
        send_rows = _interleave(blocks, recv, dims)
        got = self._a2a(send_rows, (recv * torch.tensor(dims, device=device)).sum(1).tolist(),
                        (sent * torch.tensor(dims, device=device)).sum(1).tolist(), "all-to-all of rows")
        per_table = _deinterleave(got, sent, dims)
        offsets = [0]
        for s in sizes:
            offsets.append(offsets[-1] + s)
        values, order = [], []
        perm_table = table_id.index_select(0, perm)
        for t, name in enumerate(names):
            idx = perm[perm_table == t] - offsets[t]
            out = torch.empty(sizes[t], dims[t], device=device)
            out[idx] = per_table[t]
            values.append(out.to(self.shards[name].cfg.dtype))
            order.append(idx)
        return {"values": values, "names": names, "sent": sent, "recv": recv, "order": order, "owned": owned,
                "dims": dims}

    def _row_backward(self, state: dict, grads: list) -> None:
        if not state.get("names"):
            return
        names, sent, recv, dims = state["names"], state["sent"], state["recv"], state["dims"]
        device = sent.device
        blocks = [g.float().index_select(0, idx) for g, idx in zip(grads, state["order"])]
        send = _interleave(blocks, sent, dims)
        got = self._a2a(send, (sent * torch.tensor(dims, device=device)).sum(1).tolist(),
                        (recv * torch.tensor(dims, device=device)).sum(1).tolist(), "all-to-all of gradients")
        for t, (name, grad) in enumerate(zip(names, _deinterleave(got, recv, dims))):
            if state["owned"][t] is None:
                continue
            unique, rows, inverse = state["owned"][t]
            total = torch.zeros(unique.numel(), dims[t], device=device).index_add_(0, inverse, grad)
            _deliver(self.shards[name].module.table, unique, rows, total)

    def _data_forward(self, name: str, keys: torch.Tensor, counts: torch.Tensor):
        shard = self.shards[name]
        parts = all_gather_varsize(keys, self.group, f"all-gather of keys of {name!r}")
        union, where = torch.unique(torch.cat(parts), return_inverse=True)
        table = shard.module.table
        local = shard.local_keys(union)
        every_count = None
        if self.training and _counts_occurrences(shard.cfg):
            every_count = torch.cat(all_gather_varsize(counts, self.group, f"all-gather of counts of {name!r}"))
        rows = self._insert(table, local, where, every_count) if self.training else table.find_rows(local)
        values = _read_rows(table, local, rows)
        pos = torch.searchsorted(union, keys)
        return values.index_select(0, pos), {"name": name, "union": union, "local": local, "rows": rows,
                                             "parts": parts}

    def _data_backward(self, state: dict, grad: torch.Tensor) -> None:
        grads = all_gather_varsize(grad.float(), self.group, f"all-gather of gradients of {state['name']!r}")
        pos = torch.searchsorted(state["union"], torch.cat(state["parts"]))
        total = torch.zeros(state["union"].numel(), grad.shape[1], device=grad.device)
        total.index_add_(0, pos, torch.cat(grads))
        _deliver(self.shards[state["name"]].module.table, state["local"], state["rows"], total)

    # ------------------------------------------------------------------ export
    def export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(keys, values)`` of ``table`` (global keys)."""
        shard = self.shards[table]
        if shard.module is None:
            return torch.empty(0, dtype=shard.cfg.key_dtype), torch.empty(0, shard.cfg.dim, dtype=shard.cfg.dtype)
        keys, values = shard.module.export()
        return shard.global_keys(keys, self.rank), values

    def gather_export(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's rows of ``table``, concatenated (a collective; replicated tables return one copy)."""
        keys, values = self.export(table)
        if self.shards[table].sharding.kind == "data":
            return keys, values
        all_keys = all_gather_varsize(keys.to(torch.int64), self.group, f"all-gather of {table!r} keys")
        all_values = all_gather_varsize(values.float(), self.group, f"all-gather of {table!r} values")
        return torch.cat(all_keys).to(keys.dtype), torch.cat(all_values).to(values.dtype)


class _ShardedLookup(torch.autograd.Function):
    """All tables' exchanges as one autograd node, so backward runs its collectives in one fixed order."""

    @staticmethod
    def forward(ctx, anchor, collection, keys, counts):
        values, saved = collection._exchange(keys, counts)
        ctx.collection, ctx.saved = collection, saved
        ctx.shapes = [(v.shape, v.dtype, v.device) for v in values]
        return tuple(values)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                 for g, (shape, dtype, device) in zip(grads, ctx.shapes)]
        saved, collection = ctx.saved, ctx.collection
        collection._row_backward(saved["row"], [grads[i] for i in saved["row_index"]])
        for i, state in zip(saved["data_index"], saved["data"]):
            collection._data_backward(state, grads[i])
        return None, None, None, None


def _interleave(blocks: list[torch.Tensor], counts: torch.Tensor, dims: list[int]) -> torch.Tensor:
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
