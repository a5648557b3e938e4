"""StepGraph's choice between a CUDA-graph replay and an eager step, made on CPU: which collections never replay,
which steps of a replaying one run eagerly (warm-up, other shapes, a table that must grow or may evict, storage
that moved), and that the host's part of a replayed grouped call is what an eager call does on the host. The
capture itself runs on a GPU only (the last test)."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.collection.step_graph import StepGraph, _shapes
from dynemb.kernels import use_backend


def _collection(**extra) -> EmbeddingCollection:
    tables = [TableConfig(name=n, dim=4, optimizer=dynemb.optim.Adagrad(lr=0.1, fused=True), seed=i,
                          init_capacity=64, **extra.get(n, {})) for i, n in enumerate("ab")]
    return EmbeddingCollection(tables, [FeatureConfig(name=f"{n}1", table=n) for n in "ab"])


def _batch(step: int, n: int = 8) -> dict:
    g = torch.Generator().manual_seed(step)
    return {f"{t}1": torch.randint(0, 12 + step, (n,), generator=g) for t in "ab"}


def _stepper(ec):
    def step(batch):
        loss = sum(o.square().sum() for o in ec(batch).values())
        loss.backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()
        return loss
    return step


def test_on_cpu_every_step_is_eager_and_the_same():
    with use_backend("numba"):
        plain, graphed = _collection(), _collection()
        sg = StepGraph(_stepper(graphed), graphed, warmup=1)
        for step in range(4):
            assert torch.equal(_stepper(plain)(_batch(step)), sg(_batch(step)))
        assert sg.replays == 0 and sg.eager_steps == 4 and "CUDA device" in sg.last_reason
    for name in "ab":
        assert torch.equal(plain.embeddings[name].table.export().values, graphed.embeddings[name].table.export().values)


@pytest.mark.parametrize("extra, feature, why", [
    ({"b": {"admission": 2}}, None, "'b' runs outside the execution groups"),
    ({"b": {"tiers": dynemb.table.Tiers(fast_capacity=8)}}, None, "'b' runs outside"),
    ({"b": {"eviction": "lfu", "max_capacity": 50}}, None, "'b' runs outside"),
    ({}, {"combiner": "none"}, "sequence"),
    ({}, {"max_norm": 1.0}, "sequence or clips rows"),
])
def test_collections_that_never_replay(extra, feature, why):
    with use_backend("numba"):
        ec = _collection(**extra)
        if feature is not None:
            features = [FeatureConfig(name="a1", table="a", **feature), FeatureConfig(name="b1", table="b")]
            ec = EmbeddingCollection(list(ec.table_configs.values()), features)
        reason = StepGraph(_stepper(ec), ec).tables_reason()
    assert why in reason


def test_a_torch_backend_collection_never_replays():
    with use_backend("torch"):
        ec = _collection()
        assert ec.plan.describe_groups() == [["a", "b"]]  # grouped, through the group family's torch reference
        assert "backend 'torch'" in StepGraph(_stepper(ec), ec).tables_reason()


def test_which_steps_of_a_replaying_collection_run_eagerly():
    with use_backend("numba"):
        ec = _collection(b={"max_capacity": 40, "eviction": "lru"})
        step = _stepper(ec)
        sg = StepGraph(step, ec, warmup=2)
        assert sg.tables_reason() is None
        sg.never_reason = lambda: None  # as on a CUDA device
        assert sg.eager_reason(_batch(0)) == "warming up before the capture"
        for s in range(2):
            sg(_batch(s))
        assert sg.eager_reason(_batch(2)) is None  # the capture comes next
        # as after a capture of an 8-id step: one grouped call of both tables
        lookup = ec.plan.groups[0].lookup
        sg.graph, sg.shapes, sg.generations = object(), _shapes(_batch(2)), sg._generations()
        sg.calls = [(lookup, [{"counts": {0: 8, 1: 8}}])]
        assert sg.eager_reason(_batch(3)) is None
        assert "shapes differ" in sg.eager_reason(_batch(3, n=5))
        sg.calls = [(lookup, [{"counts": {0: 8, 1: 39}}])]  # "b" could pass its bound of 40 rows
        assert "grow, read its size back or may evict" in sg.eager_reason(_batch(3))
        sg.calls = [(lookup, [{"counts": {0: 8, 1: 8}}])]
        ec.embeddings["a"].table._reserve(1000)  # "a" grows: its storage moves, the graph would read the old
        assert "storage moved" in sg.eager_reason(_batch(3))


def test_a_replays_host_part_is_an_eager_calls():
    with use_backend("numba"):
        eager, replayed = _collection(), _collection()
        for ec in (eager, replayed):
            _stepper(ec)(_batch(0))
        _stepper(eager)(_batch(1))  # one more eager grouped call
        lookup = replayed.plan.groups[0].lookup
        group = lookup._group()
        staged = {}
        group.staging.kept = {name: (torch.zeros(shape, dtype=dtype), None) for name, shape, dtype in
                              (("stamps", (2, 2), torch.int64), ("hparams", (2, 8), torch.float64),
                               ("versions", (2,), torch.int64))}
        group.staging.fill = lambda name, values: staged.__setitem__(name, values)
        bound = list(group._bound)
        lookup.replayed([{"counts": {0: 8, 1: 8}}])
    for name in "ab":
        a, b = eager.embeddings[name].table, replayed.embeddings[name].table
        assert a.clock == b.clock
        assert eager.optimizer.state_dict()["optimizers"][name] == replayed.optimizer.state_dict()["optimizers"][name]
    assert group._bound == [bound[0] + 8, bound[1] + 8] and group.pending
    assert [v for _, v in staged["stamps"]] == [eager.embeddings[n].table.clock for n in "ab"]
    assert staged["versions"] == [-1, -1] and all(row[7] == 1.0 for row in staged["hparams"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replayed_step_trains_as_an_eager_one():
    with use_backend("triton"):
        eager, graphed = _collection().cuda(), _collection().cuda()
        sg = StepGraph(_stepper(graphed), graphed, warmup=2)
        for step in range(8):
            batch = {k: v.cuda() for k, v in _batch(step % 3).items()}  # old ids only after the first steps
            want = _stepper(eager)(batch)
            got = sg(batch)
            torch.testing.assert_close(want, got)
        assert sg.replays > 0, sg.last_reason
    for name in "ab":
        torch.testing.assert_close(eager.embeddings[name].table.export().values,
                                   graphed.embeddings[name].table.export().values)
