"""KeyValueTable on the triton backend (its one-launch ``find_gather``, ``find_or_insert`` and ``erase``, and the
torch fallback where they do not apply) against the same table on the torch backend: operation sequences over
extreme keys, keys sharing a bucket, duplicates in a batch, growth and rehash across calls, bounded tables that
evict; and a training step through EmbeddingCollection.

Without a GPU they run under Triton's interpreter on CPU tensors (the repository's conftest.py sets it up)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from dynemb import EmbeddingCollection, FeatureConfig, TableConfig, optim  # noqa: E402
from dynemb.kernels import triton_index, use_backend  # noqa: E402
from dynemb.table import KeyValueTable, fused  # noqa: E402
from dynemb.table.hashing import key_hash  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def spied(monkeypatch):
    """Names of the one-launch kernels that ran."""
    calls: set = set()
    for fn in ("find_or_insert", "find_gather", "erase"):
        real = getattr(triton_index, fn)
        monkeypatch.setattr(triton_index, fn, lambda *a, _real=real, _fn=fn, **k: calls.add(_fn) or _real(*a, **k))
    return calls


def _pair(key_dtype, **kwargs):
    """The same table on the torch and the triton backend, with a slot, a deletion log and an eviction log."""
    tables, evicted = [], []
    for backend in ("torch", "triton"):
        log: list = []
        t = KeyValueTable(3, key_dtype=key_dtype, device=DEVICE, seed=7, backend=backend,
                          on_evict=lambda k, v, s, _log=log: _log.append((k.clone(), v.clone(), s.clone())), **kwargs)
        t.add_slot("m", 2, init=0.5)
        t.track_deletions()
        tables.append(t)
        evicted.append(log)
    return tables, evicted


def _same(a, b) -> None:
    """Tensors, tuples of them or Python values, equal exactly."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


def _state(t: KeyValueTable) -> tuple:
    """Everything observable but the index's layout: within a bucket run, which key spilled may differ (the
    kernel places a batch in lane order, the torch path in hash order), so after erases the overflow flags, and
    with them the moment of a rehash (``index_load``, ``bytes``), may too; ``test_rehash_rule_as_torch`` checks
    the rule on a seeded run."""
    rows = t.export()
    stats = {k: v for k, v in t.stats().items() if k not in ("index_load", "bytes")}
    return (rows.keys, rows.values, rows.scores, rows.slots["m"], t.find_rows(rows.keys), t.changes_since(0),
            stats, t.clock)


_OP = st.tuples(st.sampled_from(["find_or_insert", "find", "find_scored", "erase", "assign", "accum"]),
                st.lists(st.integers(0, 255), min_size=0, max_size=14))


def _run(tables, evicted, pool: torch.Tensor, ops) -> None:
    pool = pool.to(DEVICE)
    for step, (op, picks) in enumerate(ops):
        keys = pool[torch.tensor(picks, dtype=torch.int64) % pool.numel()]
        values = torch.arange(keys.numel() * 3, dtype=torch.float32).view(-1, 3).to(DEVICE) + step
        results = []
        for t in tables:
            if op == "find_or_insert":
                results.append(t.find_or_insert(keys))
            elif op in ("find", "find_scored"):
                results.append(t.find(keys, update_scores=op == "find_scored"))
            elif op == "erase":
                results.append(t.erase(keys))
            elif op == "assign":
                results.append(t.insert_or_assign(keys, values))
            else:
                old, exists = t.find(keys)
                results.append(t.accum(keys, old, old + values, exists))
        _same(results[0], results[1])
        _same(_state(tables[0]), _state(tables[1]))
        _same(evicted[0], evicted[1])


@SETTINGS
@given(ops=st.lists(_OP, min_size=1, max_size=8), key64=st.booleans(), bounded=st.booleans())
@pytest.mark.slow
def test_operation_sequences_equal_torch(pools, ops, key64, bounded):
    """Rows, ``found``, values (stored and initializer rows), scores, slots, version stamps, the deletion log,
    counters and evicted rows all equal the torch table's after every call; a small start grows and rehashes."""
    key_dtype = torch.int64 if key64 else torch.int32
    tables, evicted = _pair(key_dtype, init_capacity=4, max_capacity=20 if bounded else None)
    _run(tables, evicted, pools[key_dtype], ops)


@pytest.mark.parametrize("initializer", ["zeros", "normal"])
def test_other_initializers_and_lfu(pools, initializer):
    """A constant initializer runs in the kernels; ``normal`` has no kernel spec: ``find`` falls back."""
    ops = [("find_or_insert", list(range(0, 40, 3)) * 2), ("find", list(range(45))), ("erase", list(range(0, 30, 2))),
           ("find_or_insert", list(range(20, 50))), ("find_scored", list(range(10)))]
    tables, evicted = _pair(torch.int64, init_capacity=64, initializer=initializer, eviction="lfu")
    _run(tables, evicted, pools[torch.int64], ops)


def test_one_launch_paths_run_and_fall_back(pools, spied):
    """With headroom, find_or_insert is one launch; past it (growth) the table falls back, then comes back."""
    (plain, tri), evicted = _pair(torch.int64, init_capacity=16)
    pool = pools[torch.int64]
    ops = [("find_or_insert", [0, 1, 1, 2, 3, 0]), ("find_or_insert", list(range(30))),
           ("find_or_insert", [5, 40]), ("find", [0, 44, 45]), ("erase", [0, 0, 1, 44])]
    _run((plain, tri), evicted, pool, ops[:1])
    assert spied == {"find_or_insert"}
    spied.clear()
    _run((plain, tri), evicted, pool, ops[1:2])  # 30 keys > capacity 16: the torch path grows the table
    assert "find_or_insert" not in spied and tri.capacity >= 30
    _run((plain, tri), evicted, pool, ops[2:])
    assert spied == {"find_or_insert", "find_gather", "erase"}


@pytest.mark.slow
def test_rehash_rule_as_torch(monkeypatch):
    """Keys crowded into an eighth of the buckets, inserted and erased: stale overflow flags pile up and the
    one-launch path rehashes when the torch path does (same bucket count, same flags after the rebuild)."""
    plain, tri = (KeyValueTable(2, init_capacity=256, backend=b, device=DEVICE) for b in ("torch", "triton"))
    g = torch.Generator().manual_seed(0)
    cand = torch.randint(-(2**62), 2**62, (1 << 16,), generator=g)
    pool = cand[plain.index._home(key_hash(cand)) % 8 == 0].to(DEVICE)
    rebuilt, in_one_launch = [], []
    real_rehash, real_one_launch = tri.index.rehash, fused.find_or_insert
    monkeypatch.setattr(tri.index, "rehash", lambda *a: rebuilt.append(1) or real_rehash(*a))

    def one_launch(*args):
        before = len(rebuilt)
        out = real_one_launch(*args)
        in_one_launch.append(out is not None and len(rebuilt) > before)
        return out

    monkeypatch.setattr(fused, "find_or_insert", one_launch)
    for _ in range(20):
        keys = pool[torch.randint(0, pool.numel(), (30,), generator=g)]
        for t in (plain, tri):
            t.find_or_insert(keys)
        gone = torch.cat([keys[:14], plain.export().keys[:4]])
        for t in (plain, tri):
            t.erase(gone)
        assert plain.stats() == tri.stats()
        assert torch.equal(plain.find_rows(keys), tri.find_rows(keys))
    assert sum(in_one_launch) >= 2


def test_full_bounded_table_evicts_through_the_fallback(pools, spied):
    (plain, tri), evicted = _pair(torch.int32, init_capacity=8, max_capacity=8, eviction="lru")
    ops = [("find_or_insert", list(range(8))), ("find_or_insert", [1, 2, 9, 10, 11]), ("find", [9, 30])]
    _run((plain, tri), evicted, pools[torch.int32], ops)
    assert len(evicted[1]) == 1 and evicted[1][0][0].numel() == 3
    assert "find_gather" in spied


def test_custom_scores_and_counts(pools):
    keys = pools[torch.int64][:10].repeat(2).to(DEVICE)
    for eviction, kwargs in (("custom", {"scores": torch.arange(20, device=DEVICE)}),
                             ("lfu", {"counts": torch.arange(1, 21, device=DEVICE)})):
        (plain, tri), _ = _pair(torch.int64, init_capacity=64, eviction=eviction)
        _same(plain.find_or_insert(keys, **kwargs), tri.find_or_insert(keys, **kwargs))
        _same(_state(plain), _state(tri))


def test_find_into_out(pools):
    (plain, tri), _ = _pair(torch.int32, init_capacity=64)
    keys = pools[torch.int32][:12].to(DEVICE)
    plain.find_or_insert(keys[::2])
    tri.find_or_insert(keys[::2])
    for out in (torch.empty(12, 3, device=DEVICE), torch.empty(3, 12, device=DEVICE).t()):  # contiguous or not
        want = plain.find(keys)
        got = tri.find(keys, out=out)
        _same(want, got)
        assert torch.equal(out, want[0])


def _train(backend: str) -> dict:
    with use_backend(backend):
        tables = [TableConfig(name="t", dim=4, seed=3, optimizer=optim.RowWiseAdagrad(lr=0.1), combiner="sum"),
                  TableConfig(name="u", dim=2, seed=4, optimizer=optim.RowWiseAdagrad(lr=0.1), key_dtype=torch.int32,
                              initializer="zeros")]
        features = [FeatureConfig(name="f", table="t"), FeatureConfig(name="g", table="t", combiner="mean"),
                    FeatureConfig(name="h", table="u")]
        ec = EmbeddingCollection(tables, features, device=DEVICE)
        extremes = torch.tensor([-(2**63), 2**63 - 1, -1, 0], device=DEVICE)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 60, (24,), generator=gen).to(DEVICE) * 7919
            ids[:4] = extremes
            offsets = torch.tensor([0, 4, 4, 11, 20, 22], device=DEVICE)  # 6 bags, one empty
            out = ec({"f": (ids, offsets), "g": ids.view(6, 4), "h": ids[4:16].view(6, 2).to(torch.int32)})
            (out["f"].square().sum() + out["g"].sum() + out["h"].sum()).backward()
            ec.optimizer.step()
            ec.optimizer.zero_grad()
        return {name: ec.export(name) for name in ("t", "u")}


@pytest.mark.slow
def test_training_step_through_embedding_collection_equals_torch(spied):
    want = _train("torch")
    assert not spied
    got = _train("triton")
    assert "find_or_insert" in spied
    for name in want:
        assert torch.equal(got[name][0], want[name][0]), name  # the same keys in the same row order
        torch.testing.assert_close(got[name][1], want[name][1], rtol=2e-5, atol=2e-6, msg=name)


class _SyncCounter(TorchDispatchMode):
    """Counts the ops that read a device value on the host (a sync on CUDA): scalar reads, ``nonzero``, boolean
    indexing; ``tolist`` does not dispatch, so the test counts it apart."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        masks = args[1] if name == "index" else ()
        if name in ("_local_scalar_dense", "nonzero", "masked_select") or any(
                isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks):
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def test_host_syncs_of_the_one_launch_paths(monkeypatch):
    """Steady state on the triton backend: find_or_insert reads the device once (hits and new keys alike), find
    never; the torch glue they replace read it 2 (hits) to 8 (new keys) times, 2 for find."""
    counter, tolist = _SyncCounter(), torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: counter.syncs.append("tolist") or tolist(self))
    table = KeyValueTable(8, init_capacity=4096, backend="triton", device=DEVICE)
    table.find_or_insert(torch.arange(1000, device=DEVICE))
    calls = {"hits": lambda: table.find_or_insert(torch.arange(0, 1000, 3, device=DEVICE)),
             "new keys": lambda: table.find_or_insert(torch.arange(995, 1010, device=DEVICE)),
             "find": lambda: table.find(torch.arange(990, 1020, device=DEVICE))}
    want = {"hits": ["tolist"], "new keys": ["tolist"], "find": []}
    for name, call in calls.items():
        counter.syncs = []
        with counter:
            call()
        assert counter.syncs == want[name], name
