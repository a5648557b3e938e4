"""Tables of 0, 1 and 2 rows for the property tests of every path that writes or reads rows (checkpoints, serving
exports, the parameter server, tiered tables).

A :class:`TableSpec` is a table's config and content; :func:`table_specs` draws them with row counts from
``st.integers(0, max_rows)`` (hypothesis shrinks toward 0, and 0, 1 and 2 come up often), keys among the values
other libraries reserve (the dtype's min and max, -1, 0) or anywhere in the dtype, every eviction policy, value
dtypes float32/bfloat16/float16, optimizer slots, and admission candidates pending. :func:`edge_spec` gives a fixed
table of ``n`` rows for ``@example``. :func:`change_lists` draws operations that then grow, shrink or rewrite a
table (for deltas). Comparisons are bitwise (``-0.0`` and ``0.0`` differ, as the files would).
"""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import torch

import dynemb

POLICIES = ("lru", "lfu", "epoch_lru", "epoch_lfu", "decayed_lfu", "custom")
VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KEY_DTYPES = (torch.int64, torch.int32)
#: optimizer slots a table may carry: (name, dim (None: the table's), dtype, init)
SLOTS = (("m", None, torch.float32, 0.0), ("v", 1, torch.bfloat16, 0.5))
COUNTERS = ("clock", "save_ticks", "epoch", "inserted", "removed", "evicted", "_init_calls")


def edge_keys(key_dtype: torch.dtype) -> list[int]:
    """Keys that other libraries reserve as sentinels, which must work as any other key here."""
    info = torch.iinfo(key_dtype)
    return [info.min, info.max, -1, 0, 1, info.min + 1, info.max - 1]


def keys_of(key_dtype: torch.dtype) -> st.SearchStrategy[int]:
    """Any key of ``key_dtype``, the :func:`edge_keys` often."""
    info = torch.iinfo(key_dtype)
    return st.one_of(st.sampled_from(edge_keys(key_dtype)), st.integers(info.min, info.max))


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """A dynamic table's config and rows. ``keys`` are stored with values drawn from ``seed`` (and ``scores`` under
    the custom policy), ``touched`` are read again (scores differ), ``pending`` are seen once by a table with
    admission (candidates, not stored). ``eviction`` applies to a bounded or tiered table; an unbounded one is
    built with the default policy."""

    keys: tuple = ()
    key_dtype: torch.dtype = torch.int64
    dtype: torch.dtype = torch.float32
    eviction: str = "lru"
    dim: int = 2
    slots: tuple = ("m",)
    max_capacity: int | None = None
    admission: int | None = None
    scores: tuple = ()
    touched: tuple = ()
    pending: tuple = ()
    init_capacity: int = 1
    seed: int = 0

    @property
    def rows(self) -> int:
        return len(self.keys)

    def build(self, seed: int = 0, tiers=None) -> dynemb.DynamicEmbedding:
        """An empty table of this config (``seed``: its initializer's, which a load replaces)."""
        # a policy is for a table that evicts or moves rows down: bounded or tiered (else the default lru)
        bounded = tiers is not None or self.max_capacity is not None
        emb = dynemb.DynamicEmbedding(self.dim, key_dtype=self.key_dtype, dtype=self.dtype,
                                      eviction=self.eviction if bounded else None,
                                      max_capacity=None if tiers else self.max_capacity, admission=self.admission,
                                      init_capacity=self.init_capacity, seed=seed, tiers=tiers)
        for name, dim, dtype, init in SLOTS:
            if name in self.slots:
                emb.table.add_slot(name, dim or self.dim, init, dtype)
        return emb

    def filled(self, tiers=None) -> dynemb.DynamicEmbedding:
        """A table holding this spec's rows."""
        emb = self.build(seed=self.seed % 1000, tiers=tiers)
        t = emb.table
        g = torch.Generator().manual_seed(self.seed)
        keys = self.tensor(self.keys)
        scores = torch.tensor(self.scores, dtype=torch.int64) if self.eviction == "custom" else None
        t.insert_or_assign(keys, torch.randn(keys.numel(), self.dim, generator=g).to(self.dtype), scores)
        write_slots(t, keys, g)
        if self.touched and self.eviction != "custom":
            t.find(self.tensor(self.touched), update_scores=True)
        if self.pending:
            t.find_or_insert(self.tensor(self.pending))  # seen once: below the admission threshold
        return emb

    def tensor(self, keys) -> torch.Tensor:
        return torch.tensor(list(keys), dtype=self.key_dtype)


def write_slots(t, keys: torch.Tensor, g: torch.Generator) -> None:
    """Random slot rows for ``keys`` (all stored), stamped as written, as an optimizer does."""
    if not keys.numel():
        return
    rows = t.find_rows(keys)  # a tiered table's rows: valid until its next call
    for name in t.slot_names:
        slot = t.slot(name)
        slot[rows] = torch.randn(rows.numel(), slot.shape[1], generator=g).to(slot.dtype)
    t.mark_updated(rows)


def edge_spec(n: int, key_dtype: torch.dtype = torch.int64, **fields) -> TableSpec:
    """A table of ``n`` rows whose keys are the dtype's min, max and -1 (for ``@example``)."""
    info = torch.iinfo(key_dtype)
    keys = (info.min, info.max, -1)[:n]
    return TableSpec(keys=keys, key_dtype=key_dtype, scores=tuple(range(n)), touched=keys[-1:], **fields)


@st.composite
def table_specs(draw, max_rows: int = 2) -> TableSpec:
    """A :class:`TableSpec` of ``0 .. max_rows`` rows (a tiered table built from it drops ``max_capacity``)."""
    key_dtype = draw(st.sampled_from(KEY_DTYPES))
    n = draw(st.integers(0, max_rows))
    keys = draw(st.lists(keys_of(key_dtype), min_size=n, max_size=n, unique=True))
    eviction = draw(st.sampled_from(POLICIES))
    admission = draw(st.sampled_from([None, 2]))
    pending = draw(st.lists(keys_of(key_dtype).filter(lambda k: k not in keys), max_size=2, unique=True)) \
        if admission else []
    bounded = eviction != "lru" or draw(st.booleans())  # another policy needs a bound (or tiers) to mean anything
    return TableSpec(
        keys=tuple(keys), key_dtype=key_dtype, dtype=draw(st.sampled_from(VALUE_DTYPES)), eviction=eviction,
        dim=draw(st.integers(1, 3)), slots=tuple(draw(st.sets(st.sampled_from([s[0] for s in SLOTS])))),
        max_capacity=draw(st.integers(max(1, n), n + 1)) if bounded else None, admission=admission,
        scores=tuple(draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=n, max_size=n))),
        touched=tuple(draw(st.lists(st.sampled_from(keys), max_size=n, unique=True))) if n else (),
        pending=tuple(pending), init_capacity=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**31)))


# ------------------------------------------------------------------------------------------------------ changes
def change_lists(key_dtype: torch.dtype) -> st.SearchStrategy[list]:
    """Up to three operations on a table: ``("erase", which)``, ``("insert", keys)``, ``("update", which)``,
    ``("touch", which)``, ``("evict", n)``, ``("clear",)``; ``which`` picks stored keys by position."""
    which = st.lists(st.integers(0, 3), max_size=2)
    op = st.one_of(st.tuples(st.just("erase"), which), st.tuples(st.just("update"), which),
                   st.tuples(st.just("touch"), which), st.tuples(st.just("evict"), st.integers(0, 2)),
                   st.tuples(st.just("insert"), st.lists(keys_of(key_dtype), max_size=2, unique=True)),
                   st.just(("clear",)))
    return st.lists(op, max_size=3)


def apply_changes(emb: dynemb.DynamicEmbedding, changes: list, seed: int = 1) -> None:
    """Apply ``changes`` (see :func:`change_lists`) to ``emb``."""
    t = emb.table
    g = torch.Generator().manual_seed(seed)
    for op, *arg in changes:
        stored = t.export().keys
        picked = stored[[i for i in arg[0] if i < stored.numel()]].unique() if op in ("erase", "update", "touch") \
            else None
        if op == "erase":
            t.erase(picked)
        elif op == "update" and picked.numel():
            scores = torch.full((picked.numel(),), 7, dtype=torch.int64) if t.policy.value == "custom" else None
            t.insert_or_assign(picked, torch.randn(picked.numel(), t.dim, generator=g).to(t.dtype), scores)
            write_slots(t, picked, g)
        elif op == "touch" and picked.numel():
            t.find(picked, update_scores=True)
        elif op == "evict":
            t.evict(arg[0])
        elif op == "insert":
            keys = torch.tensor(arg[0], dtype=t.key_dtype)
            scores = torch.arange(keys.numel(), dtype=torch.int64) - 5 if t.policy.value == "custom" else None
            t.find_or_insert(keys, scores)
        elif op == "clear":
            t.clear()


# ------------------------------------------------------------------------------------------------- comparisons
def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as integers of its width, so that equality is bitwise."""
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def table_state(emb, *, by_key: bool = False) -> dict:
    """Every column of the live rows (row order, or sorted by key with ``by_key``), the counters, the seed and the
    admission candidates."""
    t = emb.table
    rows = t.export()
    order = rows.keys.argsort() if by_key else torch.arange(rows.keys.numel())
    state = {"keys": rows.keys[order], "values": rows.values[order], "scores": rows.scores[order]}
    state.update({f"slot.{k}": v[order] for k, v in rows.slots.items()})
    state.update({k: getattr(t, k) for k in COUNTERS if hasattr(t, k)})
    state["seed"] = t.seed
    if t.admission is not None:  # a filter that never counted a key has no counter yet: the same as an empty one
        counter = t.admission.counter
        keys = counter.export().keys if counter is not None else torch.empty(0, dtype=t.key_dtype)
        counts = counter.export().scores if counter is not None else torch.empty(0, dtype=torch.int64)
        at = keys.argsort() if by_key else torch.arange(keys.numel())
        state.update({"admission.keys": keys[at], "admission.counts": counts[at]})
    return state


def assert_same_state(a: dict, b: dict) -> None:
    """Two :func:`table_state` results are equal, tensors bitwise."""
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y)), (name, x, y)
        else:
            assert x == y, (name, x, y)
