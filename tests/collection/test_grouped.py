"""Grouped execution of a collection's training lookups (one call of each ``group`` family operation for a group of
tables) against the per-table path (grouping switched off, torch backend: the reference): every optimizer, mixed
dims, both key dtypes, combiners, weights, multi-hot bags; tables that leave the group for a call (a bound they would
pass, rows moved between forward and backward) or never join it (frozen, step mode, lfu, admission, static); and a
table trains the same alone as in a group.

Each runs on the three backends' grouped paths: torch (the family's torch reference,
:mod:`dynemb.table.group_reference`), numba, and Triton (without a GPU under Triton's interpreter on CPU tensors: the
repository's conftest.py sets it up). A spy on the family's module says that the grouped path ran.

Tolerances: against the per-table path ``rtol=1e-5, atol=1e-6`` (float32 rounding: torch's per-table update fuses
some multiply-adds, the numba and Triton kernels sum and fuse in their own order); a table alone against the same
table in a group, on one backend, bit-identical."""

from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.functional import grouped
from dynemb.kernels import use_backend
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True),
    "sgd_plain": lambda: dynemb.optim.SGD(lr=0.1, fused=True),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.01, fused=True),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1, weight_decay=0.01, fused=True),
    "adam": lambda: dynemb.optim.Adam(lr=0.05, fused=True),
    "ftrl": lambda: dynemb.optim.FTRL(lr=0.05, l1=0.001, l2=0.01, fused=True),
}


def _collection(opt: str, names=("a", "b", "c", "d"), **extra) -> EmbeddingCollection:
    spec = OPTIMIZERS[opt]
    tables = {"a": TableConfig(name="a", dim=4, optimizer=spec(), seed=1, init_capacity=16),
              "b": TableConfig(name="b", dim=8, optimizer=spec(), seed=2, key_dtype=torch.int32, combiner="sqrtn"),
              "c": TableConfig(name="c", dim=3, optimizer=spec(), seed=3, initializer=0.25, combiner="mean"),
              "d": TableConfig(name="d", dim=4, optimizer=spec(), seed=4, init_capacity=16)}
    tables.update(extra)
    features = {"a": [FeatureConfig(name="a1", table="a"), FeatureConfig(name="a2", table="a", combiner="mean")],
                "b": [FeatureConfig(name="b1", table="b")], "c": [FeatureConfig(name="c1", table="c")],
                "d": [FeatureConfig(name="d1", table="d")]}
    picked = [tables[n] for n in names]
    return EmbeddingCollection(picked, [f for n in names for f in features.get(n, [FeatureConfig(name=f"{n}1",
                                                                                                table=n)])],
                               device=DEVICE)


def _batch(step: int, names) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(step)
    ids = {"a1": torch.randint(0, 60, (5,), generator=g),
           "a2": torch.randint(-(2**62), 2**62, (5, 3), generator=g),
           "b1": (torch.randint(-(2**31), 2**31 - 1, (9,), generator=g, dtype=torch.int32),
                  torch.tensor([0, 2, 2, 5, 6]), torch.rand(9, generator=g)),
           "c1": torch.randint(0, 40, (5, 2), generator=g),
           "d1": torch.randint(0, 10 + 20 * step, (5,), generator=g)}
    batch = {f: v for f, v in ids.items() if f[0] in names or f[:-1] in names}
    return {f: tuple(x.to(DEVICE) for x in v) if isinstance(v, tuple) else v.to(DEVICE) for f, v in batch.items()}, \
        {f: 1.0 + i for i, f in enumerate(ids) if f in batch}  # each feature's own loss weight


def _train(ec: EmbeddingCollection, steps, names) -> None:
    for step in steps:
        batch, scale = _batch(step, names)
        out = ec(batch)
        sum((o * scale[f]).square().sum() for f, o in out.items()).backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()


def _state(ec: EmbeddingCollection, name: str) -> dict:
    rows = ec.embeddings[name].table.export()
    return {"keys": rows.keys, "values": rows.values, "scores": rows.scores, **rows.slots}


def _close(a: dict, b: dict, exact: bool = False) -> None:
    assert torch.equal(a["keys"], b["keys"]) and torch.equal(a["scores"], b["scores"])  # rows in the same order
    for col in a:
        if exact:
            assert torch.equal(a[col], b[col]), col
        else:
            torch.testing.assert_close(a[col], b[col], rtol=1e-5, atol=1e-6)


def _spied(monkeypatch) -> list:
    """Calls of the grouped path (a table count a call)."""
    calls = []
    real = grouped.GroupedLookup.pooled

    def spy(self, lookups):
        got = real(self, lookups)
        calls.append(len(got))
        return got
    monkeypatch.setattr(grouped.GroupedLookup, "pooled", spy)
    return calls


_TRITON = [pytest.mark.triton, pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                                  reason="triton is not installed")]
#: every backend runs groups: torch through the family's torch reference, numba and Triton through their kernels
GROUPED = ["torch", "numba", pytest.param("triton", marks=_TRITON)]
#: the same, Triton's interpreter marked slow (> 5 s a test on CPU)
GROUPED_SLOW = ["torch", "numba", pytest.param("triton", marks=[*_TRITON, pytest.mark.slow])]
#: the module implementing the ``group`` family on each backend
FAMILY = {"torch": "dynemb.table.group_reference", "numba": "dynemb.kernels.numba_group",
          "triton": "dynemb.kernels.triton_group"}
OPS = ("find_or_insert", "pool", "sparse_update")


def _family_calls(monkeypatch, backend: str) -> collections.Counter:
    """Calls of the ``group`` family's operations on ``backend`` (its module's functions, which the group reads at
    each call): proof that the grouped path ran, on that backend's implementation."""
    module = importlib.import_module(FAMILY[backend])
    calls = collections.Counter()
    for name in OPS:
        def spy(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    return calls


@contextlib.contextmanager
def _per_table():
    """Grouping off: every table runs its own lookup and update, the path a group is held to."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grouped.GroupedLookup, "start", lambda self, lookups: None)
        yield


def _reference(make, train):
    """The per-table path on the torch backend: ``make()`` trained by ``train``."""
    with _per_table(), use_backend("torch"):
        ec = make()
        train(ec)
    return ec


@pytest.mark.parametrize("backend", GROUPED)
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_grouped_training_is_the_per_table_path(monkeypatch, opt, backend):
    reference = _reference(lambda: _collection(opt), lambda ec: _train(ec, range(5), "abcd"))
    calls, family = _spied(monkeypatch), _family_calls(monkeypatch, backend)
    with use_backend(backend):
        ec = _collection(opt)
        _train(ec, range(5), "abcd")
    # every table, every step, in its group (int32 "b" in one of its own): each operation once a group a step
    assert ec.plan.describe_groups() == [["a", "c", "d"], ["b"]] and sum(calls) == 20
    assert family == {op: 10 for op in OPS}
    for name in "abcd":
        _close(_state(reference, name), _state(ec, name))
        assert reference.embeddings[name].table.clock == ec.embeddings[name].table.clock
    assert reference.optimizer.state_dict() == ec.optimizer.state_dict()


@pytest.mark.parametrize("backend", GROUPED_SLOW)
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_a_table_trains_the_same_alone_or_in_a_group(opt, backend, monkeypatch):
    family = _family_calls(monkeypatch, backend)
    with use_backend(backend):
        together = _collection(opt)
        _train(together, range(5), "abcd")
        assert family["sparse_update"] == 10  # two groups, five steps
        for name in "abcd":
            alone = _collection(opt, (name,))
            _train(alone, range(5), name)
            _close(_state(alone, name), _state(together, name), exact=True)
            assert alone.optimizer.state_dict()["optimizers"][name] == \
                together.optimizer.state_dict()["optimizers"][name]
    assert family == {op: 30 for op in OPS}  # alone, each table is a group of one


MIXED = {  # one update kind, each table its own hyper-parameters
    "sgd": {"a": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01), "c": dict(lr=0.05, momentum=0.5),
            "d": dict(lr=0.2, momentum=0.9)},
    "adam": {"a": dict(lr=0.05), "c": dict(lr=0.01, betas=(0.8, 0.99)), "d": dict(lr=0.1, eps=1e-6)},
}


@pytest.mark.parametrize("backend", GROUPED)
@pytest.mark.parametrize("opt", sorted(MIXED))
def test_each_table_keeps_its_own_hyper_parameters_and_step_count(monkeypatch, opt, backend):
    make = {"sgd": dynemb.optim.SGD, "adam": dynemb.optim.Adam}[opt]

    def collection():
        tables = [TableConfig(name=n, dim=d, seed=i, optimizer=make(fused=True, **MIXED[opt][n]))
                  for i, (n, d) in enumerate((("a", 4), ("c", 3), ("d", 4)))]
        features = [FeatureConfig(name=f"{n}1", table=n) for n in "acd"]
        return EmbeddingCollection(tables, [*features, FeatureConfig(name="a2", table="a", combiner="mean")],
                                   device=DEVICE)

    def train(ec):
        for step in range(5):
            batch, _ = _batch(step, "acd")
            if step % 2:
                del batch["d1"]  # "d" steps less often: its own step count (Adam's bias correction)
            sum(o.square().sum() for o in ec(batch).values()).backward()

    reference = _reference(collection, train)
    family = _family_calls(monkeypatch, backend)
    with use_backend(backend):
        ec = collection()
        train(ec)
    assert ec.plan.describe_groups() == [["a", "c", "d"]] and family["sparse_update"] == 5
    for name in "acd":
        _close(_state(reference, name), _state(ec, name))
    assert reference.optimizer.state_dict() == ec.optimizer.state_dict()


@pytest.mark.parametrize("backend", GROUPED_SLOW)
def test_tables_outside_the_group_run_beside_it(monkeypatch, backend):
    extra = {"lfu": TableConfig(name="lfu", dim=4, optimizer=OPTIMIZERS["adagrad"](), eviction="lfu", max_capacity=30,
                                seed=5),
             "adm": TableConfig(name="adm", dim=4, optimizer=OPTIMIZERS["adagrad"](), admission=2, seed=6),
             "stat": TableConfig(name="stat", dim=4, vocabulary_size=60, optimizer=OPTIMIZERS["adagrad"](), seed=7),
             "step": TableConfig(name="step", dim=4, optimizer=dynemb.optim.Adagrad(lr=0.1), seed=8),
             "bound": TableConfig(name="bound", dim=4, optimizer=OPTIMIZERS["adagrad"](), max_capacity=40, seed=9,
                                  eviction="lru")}
    names = ("a", "d", *extra)

    def train(ec):
        ec.embeddings["d"].requires_grad_(False)  # frozen: read-only, its own lookups
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            batch = {f"{n}1": torch.randint(0, 60, (6, 2), generator=g).to(DEVICE) for n in extra}
            batch.update({"a1": torch.randint(0, 60, (6,), generator=g).to(DEVICE),
                          "d1": torch.randint(0, 60, (6,), generator=g).to(DEVICE)})
            sum(o.square().sum() for o in ec(batch).values()).backward()
            ec.optimizer.step()
            ec.optimizer.zero_grad()

    reference = _reference(lambda: _collection("adagrad", names, **extra), train)
    calls, family = _spied(monkeypatch), _family_calls(monkeypatch, backend)
    with use_backend(backend):
        ec = _collection("adagrad", names, **extra)
        assert ec.plan.describe_groups() == [["a", "d", "bound"]]
        train(ec)
    assert calls and calls[-1] == 1  # the bound table passed its bound's room: only "a" ran grouped at the end
    assert family["sparse_update"] == 6
    for name in names:
        _close(_state(reference, name), _state(ec, name))
    assert ec.embeddings["bound"].table.evicted > 0


@pytest.mark.parametrize("backend", GROUPED)
def test_rows_moved_between_forward_and_backward_are_found_again(backend, monkeypatch):
    def train(ec):
        _train(ec, range(3), "ad")
        batch, _ = _batch(3, "ad")
        out = ec(batch)
        ec.embeddings["a"].table.erase(batch["a1"][:2])  # compaction moves other rows of "a"
        sum(o.square().sum() for o in out.values()).backward()

    reference = _reference(lambda: _collection("adagrad", ("a", "d")), train)
    family = _family_calls(monkeypatch, backend)
    with use_backend(backend):
        ec = _collection("adagrad", ("a", "d"))
        train(ec)
    assert family["sparse_update"] == 4
    for name in "ad":
        _close(_state(reference, name), _state(ec, name))


@pytest.mark.parametrize("backend", GROUPED)
def test_sizes_counters_and_checkpoints_after_grouped_steps(tmp_path, backend, monkeypatch):
    family = _family_calls(monkeypatch, backend)
    with use_backend(backend):
        ec = _collection("adam")
        _train(ec, range(4), "abcd")
        sizes = {n: len(ec.embeddings[n]) for n in "abcd"}
        dynemb.checkpoint.save(tmp_path, ec, step=4)
        again = _collection("adam")
        dynemb.checkpoint.load(tmp_path, again)
        _train(ec, range(4, 7), "abcd")
        _train(again, range(4, 7), "abcd")
    for name in "abcd":
        table = ec.embeddings[name].table
        assert table.size() == table.inserted - table.removed - table.evicted >= sizes[name] > 0
        _close(_state(ec, name), _state(again, name), exact=True)
    assert family["find_or_insert"] == 20  # 7 + 3 steps of two groups


#: every kind of table, each beside a grouped neighbour: tables the group takes (plain, bounded lru) and those that
#: run their own lookups, the documented fallback (tiered, admission, lfu, static, step-mode), with pooled,
#: sequence (unpooled), weighted and max_norm features
KINDS = {
    "plain": dict(dim=4),
    "mixed": dict(dim=3),  # a table the group takes, whose sequence and max_norm features make it run its own
    "bounded": dict(dim=4, max_capacity=40, eviction="lru"),
    "tiered": dict(dim=4, tiers=dynemb.table.Tiers(fast_capacity=12)),
    "admission": dict(dim=4, admission=2),
    "lfu": dict(dim=4, eviction="lfu", max_capacity=30),
    "static": dict(dim=4, vocabulary_size=80),
}
FEATURES = {"pooled": {}, "sequence": {"combiner": "none"}, "max_norm": {"max_norm": 0.5}, "weighted": {}}
#: the features of each table (the rest get all four)
PLAIN = {"plain": ("pooled", "weighted"), "bounded": ("pooled", "weighted")}


def _kinds_collection(opt: str, names) -> EmbeddingCollection:
    tables = [TableConfig(name=n, optimizer=OPTIMIZERS[opt](), seed=i + 1, **KINDS[n])
              for i, n in enumerate(KINDS) if n in names]
    features = [FeatureConfig(name=f"{n}_{f}", table=n, **FEATURES[f]) for n in KINDS if n in names
                for f in PLAIN.get(n, FEATURES)]
    return EmbeddingCollection(tables, features, device=DEVICE)


def _kinds_train(ec: EmbeddingCollection, names, steps=6) -> None:
    for step in steps if not isinstance(steps, int) else range(steps):
        g = torch.Generator().manual_seed(step)
        batch = {}
        for n in KINDS:
            ids = {f: torch.randint(0, 25 + 8 * step, (6, 2), generator=g) for f in FEATURES}
            weights = torch.rand(12, generator=g)
            if n in names:
                batch.update({f"{n}_{f}": ids[f].to(DEVICE) for f in ("pooled", "sequence", "max_norm")
                              if f in PLAIN.get(n, FEATURES)})
                batch[f"{n}_weighted"] = (ids["weighted"].reshape(-1).to(DEVICE), torch.arange(0, 12, 2).to(DEVICE),
                                          weights.to(DEVICE))
        out = ec(batch)
        scale = {f"{n}_{f}": 1 + i for i, (n, f) in enumerate((n, f) for n in KINDS for f in FEATURES)}
        sum(o.square().sum() * scale[f] for f, o in out.items()).backward()  # each feature's own weight
        ec.optimizer.step()
        ec.optimizer.zero_grad()


#: Triton's interpreter takes about a minute an optimizer here; its per-optimizer arithmetic is held to the
#: per-table path by the alone-vs-together test above, so this one runs it with the two kinds of slots (one
#: row-wise, two element-wise)
KIND_CASES = [(opt, backend) for opt in sorted(OPTIMIZERS) for backend in GROUPED_SLOW
              if getattr(backend, "values", (backend,))[0] != "triton" or opt in ("rowwise_adagrad", "adam")]


@pytest.mark.parametrize("opt, backend", [pytest.param(o, b.values[0], marks=b.marks) if hasattr(b, "values")
                                          else (o, b) for o, b in KIND_CASES])
def test_every_kind_of_table_trains_the_same_alone_or_beside_a_group(opt, backend, monkeypatch):
    calls, family = _spied(monkeypatch), _family_calls(monkeypatch, backend)
    with use_backend(backend):
        together = _kinds_collection(opt, KINDS)
        _kinds_train(together, KINDS)
        assert together.plan.describe_groups() == [["plain", "mixed", "bounded"]]
        assert calls[0] == 2  # "mixed" runs its own lookups; "bounded" too once it may have to evict
        assert family["sparse_update"] == 6  # one grouped update a step
        for name in KINDS:
            alone = _kinds_collection(opt, (name,))
            _kinds_train(alone, (name,))
            want, got = alone.state_dict(), together.state_dict()
            mine = [k for k in want if k.split(".")[1] == name]
            assert mine
            for key in mine:
                a, b = want[key], got[key]
                assert torch.equal(a, b) if torch.is_tensor(a) else a == b, key
