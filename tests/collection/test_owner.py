"""owner_lookup (the owner side of a sharded lookup) runs an execution group's tables grouped, with the rows and
updates of the per-table path: received keys that repeat (several requesters), tables that count occurrences, a
table this rank does not hold, read-only lookups, every optimizer."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import dynemb
from dynemb.functional.grouped import GroupedLookup
from dynemb.functional.owner import owner_lookup
from dynemb.kernels import use_backend

#: every backend runs groups (torch: the group family's torch reference)
GROUPED = ["torch", "numba", pytest.param("triton", marks=[pytest.mark.triton, pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed")])]
OPTIMIZERS = {
    "sgd": lambda m: dynemb.optim.SGD(m, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True),
    "adagrad": lambda m: dynemb.optim.Adagrad(m, lr=0.1, fused=True),
    "rowwise_adagrad": lambda m: dynemb.optim.RowWiseAdagrad(m, lr=0.1, fused=True),
    "adam": lambda m: dynemb.optim.Adam(m, lr=0.05, fused=True),
    "ftrl": lambda m: dynemb.optim.FTRL(m, lr=0.05, l1=0.001, fused=True),
}


def _tables(opt: str):
    mods = [dynemb.DynamicEmbedding(d, seed=i) for i, d in enumerate((4, 3, 4))]
    mods.append(dynemb.DynamicEmbedding(4, seed=9, eviction="lfu", max_capacity=64))  # counts occurrences: apart
    for m in mods:
        OPTIMIZERS[opt]([m])
    return [m.table for m in mods]


def _keys(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return [torch.randint(0, 30 + 10 * step, (n,), generator=g) for n in (12, 7, 0, 9)]


def _run(tables, grouped: bool, steps=4):
    groups = [GroupedLookup(tables[:3])] if grouped else []
    seen = []
    for step in range(steps):
        keys = _keys(step)
        counts = [None, None, None, torch.ones(9, dtype=torch.int64)]
        got = owner_lookup(tables + [None], keys + [torch.empty(0, dtype=torch.int64)],
                           insert=[True, True, True, True, False], counts=counts + [None], groups=groups)
        assert got.values[4] is None
        seen.append([v.clone() for v in got.values[:4]])
        got.backward([(v * (i + 1)).square() for i, v in enumerate(got.values[:4])] + [None])
    return seen


@pytest.mark.parametrize("backend", GROUPED)
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_the_owner_runs_a_group_as_its_tables_alone(opt, backend, monkeypatch):
    calls = []
    real = GroupedLookup.forward
    monkeypatch.setattr(GroupedLookup, "forward", staticmethod(lambda call: calls.append(1) or real(call)))
    with use_backend(backend):
        ref, grouped = _tables(opt), _tables(opt)
        want, got = _run(ref, False), _run(grouped, True)
    assert len(calls) == 4  # one grouped call a step
    for w, g in zip(want, got):
        for a, b in zip(w, g):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(ref, grouped):
        ea, eb = a.export(), b.export()
        assert torch.equal(ea.keys, eb.keys)
        torch.testing.assert_close(ea.values, eb.values, rtol=1e-5, atol=1e-6)
        for s in ea.slots:
            torch.testing.assert_close(ea.slots[s], eb.slots[s], rtol=1e-5, atol=1e-6)


def test_a_read_only_owner_lookup_inserts_nothing():
    with use_backend("numba"):
        tables = _tables("sgd")
        got = owner_lookup(tables[:2], [torch.tensor([1, 2, 1]), torch.tensor([5])], insert=[False, False],
                           groups=[GroupedLookup(tables[:2])])
    assert [len(t) for t in tables[:2]] == [0, 0]
    assert torch.equal(got.values[0][0], got.values[0][2]) and got.values[1].shape == (1, 3)


def test_owner_lookup_checks_its_arguments():
    tables = _tables("sgd")
    with pytest.raises(ValueError, match="one entry for each of the 2 tables"):
        owner_lookup(tables[:2], [torch.tensor([1])], insert=[True, True])
    got = owner_lookup(tables[:1], [torch.tensor([1])], insert=[True])
    got.backward([torch.ones(1, 4)])
    with pytest.raises(RuntimeError, match="already applied"):
        got.backward([torch.ones(1, 4)])
