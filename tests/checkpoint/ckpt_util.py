"""Helpers of the checkpoint tests: a small two-table model, deterministic training steps, exact comparisons."""

from __future__ import annotations

import torch
from torch import nn

import dynemb

COUNTERS = ("clock", "epoch", "inserted", "removed", "evicted", "_init_calls")


class TwoTables(nn.Module):
    """``user``: int64 keys, lru, bounded (evicts); ``item``: int32 keys, lfu, bfloat16; a dense layer and a buffer.

    Both tables carry two Adam-like slots. ``seed`` changes every initializer seed, so a freshly built model
    differs from the trained one until a checkpoint is loaded into it.
    """

    def __init__(self, seed: int = 0, slots: bool = True) -> None:
        super().__init__()
        self.user = dynemb.DynamicEmbedding(8, seed=seed, max_capacity=120, init_capacity=16)
        self.item = dynemb.DynamicEmbedding(4, key_dtype=torch.int32, dtype=torch.bfloat16, eviction="lfu",
                                            max_capacity=1 << 16, seed=seed + 1)
        self.dense = nn.Linear(12, 1)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        if slots:
            for t in (self.user.table, self.item.table):
                t.add_slot("m", t.dim)
                t.add_slot("v", t.dim)


def train_step(model: TwoTables, i: int) -> None:
    """One deterministic step: lookups (inserts, evictions), Adam-like slot and value updates stamped with
    ``mark_updated``, an ``accum``, an ``upsert``, and now and then an erase or a ``restrict``."""
    g = torch.Generator().manual_seed(1000 + i)
    user_ids = torch.randint(-100, 200, (24,), generator=g)
    info = torch.iinfo(torch.int32)
    item_ids = torch.cat([torch.randint(-40, 40, (16,), generator=g), torch.tensor([info.min, info.max, -1, 0])])
    item_ids = item_ids.to(torch.int32)
    model.user(user_ids)
    model.item(item_ids)
    with torch.no_grad():
        for emb, ids in ((model.user, user_ids), (model.item, item_ids)):
            t = emb.table
            rows = t.find_rows(torch.unique(ids))
            rows = rows[rows >= 0]
            grad = torch.randn(rows.numel(), t.dim, generator=g)
            m = t.slot("m")[rows] * 0.9 + grad
            v = t.slot("v")[rows] + grad * grad
            t.slot("m")[rows], t.slot("v")[rows] = m, v
            t.values[rows] -= (0.1 * m / (v.sqrt() + 1)).to(t.dtype)
            t.mark_updated(rows)
        keys = torch.unique(user_ids)[:5]
        old, exists = model.user.find(keys, return_exists=True)
        model.user.accum(keys, old, old + 0.5, exists)
        model.item.insert_or_assign(item_ids[:3], torch.full((3, 4), float(i), dtype=torch.bfloat16))
        if i % 3 == 2:
            model.user.erase(torch.unique(user_ids)[-4:])
        if i % 4 == 3:
            model.item.restrict(30)
        model.dense.weight.mul_(0.99).add_(float(model.user.table.values[:5].sum()))
        model.steps += 1


def table_state(emb) -> dict:
    """Every column of the live rows in row order, the counters and the seed."""
    rows = emb.table.export()
    state = {"keys": rows.keys, "values": rows.values, "scores": rows.scores}
    state.update({f"slot.{k}": v for k, v in rows.slots.items()})
    state.update({k: getattr(emb.table, k) for k in COUNTERS})
    state["seed"] = emb.table.seed
    return state


def assert_same_tables(a, b) -> None:
    """Bit-exact equality of two embeddings (row order included)."""
    sa, sb = table_state(a), table_state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        if isinstance(sa[name], torch.Tensor):
            assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
        else:
            assert sa[name] == sb[name], name


def assert_same_models(a: nn.Module, b: nn.Module) -> None:
    ta = {n: m for n, m in a.named_modules() if isinstance(m, dynemb.DynamicEmbedding)}
    tb = {n: m for n, m in b.named_modules() if isinstance(m, dynemb.DynamicEmbedding)}
    assert ta.keys() == tb.keys()
    for name in ta:
        assert_same_tables(ta[name], tb[name])
    for (na, pa), (nb, pb) in zip(a.dense.state_dict().items(), b.dense.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    assert torch.equal(a.steps, b.steps)


def trained_model(steps: int = 6) -> TwoTables:
    """A TwoTables model after ``steps`` training steps."""
    model = TwoTables()
    for i in range(steps):
        train_step(model, i)
    return model
