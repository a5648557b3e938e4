"""``backend="torch"`` means torch: on a table, or as the process default, no numba or Triton module is even asked
for, whatever the other tables and the process default use."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.functional import BagSet, embedding_lookup_sparse
from dynemb.functional.grouped import GroupedLookup
from dynemb.kernels import FAMILIES, dispatch, numba_available, use_backend
from dynemb.table import KeyValueTable, TieredTable, Tiers, group_reference
from dynemb.table.static import StaticTable


@pytest.fixture
def no_kernels(monkeypatch):
    """Every kernel module refused: a call that reaches for one fails the test (the backend objects' cached
    families are dropped first, so that a module loaded earlier is asked for again)."""
    asked = []

    def refuse(name):
        asked.append(name)
        raise AssertionError(f"kernel module {name} asked for under backend torch")

    monkeypatch.setattr(dispatch, "_module", refuse)
    for kernels in dispatch._KERNELS.values():
        monkeypatch.setattr(kernels, "_families", {})
    yield asked
    assert not asked


def _exercise_table(table, n: int = 20_000) -> None:
    """Every table operation, on batches past each kernel threshold (stamps, victims, row moves)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(-(2**40), 2**40, (n,), generator=g)
    table.find_or_insert(keys)
    table.find_or_insert(torch.cat([keys[: n // 2], keys[: n // 2] + 1]))  # evicts under a bound
    table.find(keys, update_scores=True)
    table.insert_or_assign(keys[:300], torch.ones(300, table.dim))
    table.erase(keys[::3])
    table.evict(table.size() // 4)
    table.export()


@pytest.mark.parametrize("eviction", ["lru", "lfu", "decayed_lfu", "epoch_lfu"])
def test_a_torch_table_runs_no_kernel_beside_a_numba_default(no_kernels, eviction):
    table = KeyValueTable(8, backend="torch", max_capacity=30_000, eviction=eviction, init_capacity=64)
    _exercise_table(table)
    assert table.size() > 0


def test_torch_tables_look_up_and_train_without_kernels(no_kernels):
    dynamic = KeyValueTable(4, backend="torch")
    static = StaticTable(50, 4, backend="torch")
    tiered = TieredTable(4, tiers=Tiers(fast_capacity=16), backend="torch")
    admitted = KeyValueTable(4, backend="torch", admission=2)
    fused = dynemb.optim.Adam([dynamic, static], lr=0.1, fused=True)
    stepped = dynemb.optim.Adagrad([tiered, admitted], lr=0.1)
    ids = torch.tensor([3, 7, 7, 1, 9, 3, 40])
    offsets = torch.tensor([0, 2, 5])
    for _ in range(3):
        loss = sum(embedding_lookup_sparse(t, ids, offsets, combiner=c).square().sum()
                   for t, c in ((dynamic, "mean"), (static, "sqrtn"), (tiered, "sum"), (admitted, "mean")))
        loss.backward()
        fused.step()
        stepped.step()
        stepped.zero_grad()
    assert dynamic.size() == tiered.size() == admitted.size() == 5  # admitted from the second sighting


@pytest.mark.skipif(not numba_available(), reason="without numba the process default is torch anyway")
def test_the_process_default_torch_runs_no_kernel(no_kernels):
    tables = [TableConfig(name="a", dim=4, max_capacity=40, eviction="lfu", optimizer=dynemb.optim.SGD(lr=0.1)),
              TableConfig(name="s", dim=4, vocabulary_size=30, optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1)),
              TableConfig(name="t", dim=4, tiers=Tiers(fast_capacity=8), optimizer=dynemb.optim.Adam(lr=0.1)),
              TableConfig(name="m", dim=4, admission=2, optimizer=dynemb.optim.Adagrad(lr=0.1, fused=True))]
    features = [FeatureConfig(name=t.name, table=t.name) for t in tables]
    features.append(FeatureConfig(name="seq", table="a", combiner="none"))
    g = torch.Generator().manual_seed(1)
    with use_backend("torch"):
        ec = EmbeddingCollection(tables, features)
        for _ in range(4):
            batch = {f.name: torch.randint(0, 30 if f.name == "s" else 100, (6, 3), generator=g) for f in features}
            sum(o.sum() for o in ec(batch).values()).backward()
            ec.optimizer.step()
            ec.optimizer.zero_grad()
    assert len(ec.embeddings["a"]) == 40 and ec.embeddings["a"].table.evicted > 0


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a_torch_collection_runs_its_groups_without_kernels(no_kernels, monkeypatch, opt):
    """The grouped path on ``backend="torch"``: each group's operations run once a step, by the group family's torch
    reference, and no kernel module is asked for (``no_kernels``)."""
    calls = []
    for name in ("find_or_insert", "pool", "sparse_update"):
        real = getattr(group_reference, name)
        monkeypatch.setattr(group_reference, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    make = {"sgd": lambda: dynemb.optim.SGD(lr=0.1, momentum=0.9, fused=True),
            "adam": lambda: dynemb.optim.Adam(lr=0.1, fused=True)}[opt]
    tables = [TableConfig(name="a", dim=4, optimizer=make()), TableConfig(name="b", dim=8, optimizer=make()),
              TableConfig(name="c", dim=4, max_capacity=64, eviction="lru", optimizer=make())]
    features = [FeatureConfig(name=t.name, table=t.name) for t in tables]
    g = torch.Generator().manual_seed(2)
    with use_backend("torch"):
        ec = EmbeddingCollection(tables, features)
        for _ in range(3):
            batch = {f.name: torch.randint(0, 40, (6, 2), generator=g) for f in features}
            sum(o.square().sum() for o in ec(batch).values()).backward()
    assert ec.plan.describe_groups() == [["a", "b", "c"]]
    assert calls == ["find_or_insert", "pool", "sparse_update"] * 3  # one group: each operation once a step
    assert len(ec.embeddings["b"]) > 0


def test_torch_tables_run_a_group_without_kernels_beside_any_default(no_kernels):
    """Tables set to ``backend="torch"`` group through the torch reference, whatever the process default is."""
    tables = [KeyValueTable(d, backend="torch", seed=i) for i, d in enumerate((4, 3))]
    dynemb.optim.Adam(tables, lr=0.1, fused=True)
    lookup = GroupedLookup(tables)
    ids = torch.tensor([3, 7, 7, 1])
    bags = [BagSet(4, torch.tensor([0, 2]), None, 2, "mean")]
    for _ in range(2):
        out = lookup.pooled([(0, ids, bags), (1, ids + 1, bags)])
        sum(o[0].square().sum() for o in out.values()).backward()
    assert sorted(out) == [0, 1] and [len(t) for t in tables] == [3, 3]
    assert lookup._group().kernels.module is group_reference


def test_each_kernel_module_implements_its_declared_family():
    for (family, backend), name in dispatch._MODULES.items():
        if backend is dispatch.Backend.NUMBA and not numba_available():
            continue
        if backend is dispatch.Backend.TRITON and not dispatch.triton_available():
            continue
        _implements(dispatch._module(name), family, name)
    _implements(group_reference, "group", "group_reference")  # the group family's torch reference


def _implements(module, family: str, name: str) -> None:
    spec = FAMILIES[family]
    assert all(callable(getattr(module, f, None)) for f in spec.required), (name, spec.required)
    assert all(getattr(module, f, None) is None or callable(getattr(module, f)) for f in spec.optional)
    public = set(getattr(module, "__all__", ()))
    assert public <= set(spec.names) | _HELPERS.get(name, set()), (name, public - set(spec.names))


# module-level names a family module exports beyond its family (constants and helpers for other kernels)
_HELPERS = {"numba_optim": {"KINDS"}, "triton_optim": {"KINDS"}, "numba_init": {"KINDS", "uniform_salted"},
            "triton_group": {"KINDS"}, "numba_group": {"KINDS"}, "group_reference": {"KINDS"},
            "numba_pool": {"block_width", "grouped_bags", "sum_rows", "sum_terms"}}


def test_a_family_names_only_what_it_declares():
    pool = dispatch.kernels_for("torch").pool
    assert pool.spread is None and not pool
    with pytest.raises(AttributeError, match="declares no function 'sprad'"):
        pool.sprad  # noqa: B018
