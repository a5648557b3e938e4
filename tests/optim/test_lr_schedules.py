"""torch LR schedulers drive the sparse optimizers: ten scheduled steps equal torch.optim (or a reference) under the
same schedule, and the schedule survives a state_dict round trip."""

import json

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, StepLR
from test_equivalence import (D, KEYS, STEPS, TORCH_CASES, V, batches, initial_rows, ref_ftrl, ref_rowwise_adagrad,
                              rel_err)

import dynemb
from dynemb import optim

SCHEDULES = {
    "step": lambda opt: StepLR(opt, step_size=3, gamma=0.5),
    "lambda": lambda opt: LambdaLR(opt, lambda epoch: 1.0 / (1 + epoch)),
    "cosine": lambda opt: CosineAnnealingLR(opt, T_max=STEPS),
}


def _scheduled_run(make_opt, schedule, cover_all, fused):
    emb = dynemb.DynamicEmbedding(D, seed=11)
    opt = make_opt(emb, fused)
    sched = SCHEDULES[schedule](opt)
    for idx, r in batches(cover_all):
        (emb(KEYS[idx]) * r).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return emb.find(KEYS)


def _torch_scheduled_run(make_torch_opt, schedule, cover_all, sparse):
    ref = torch.nn.Embedding(V, D, sparse=sparse)
    with torch.no_grad():
        ref.weight.copy_(initial_rows())
    opt = make_torch_opt(ref.parameters())
    sched = SCHEDULES[schedule](opt)
    for idx, r in batches(cover_all):
        (ref(idx) * r).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return ref.weight.detach()


def _lrs(schedule, lr):
    """The lr of each step under ``schedule``."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    sched, out = SCHEDULES[schedule](opt), []
    for _ in range(STEPS):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert len(set(out)) > 2  # the schedule changes the lr
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("case", ["sgd", "momentum", "adagrad_decay", "adam", "wrap_adagrad", "wrap_adam"])
def test_scheduled_lr_matches_torch_optim(case, schedule, fused):
    make_opt, make_torch, cover_all, sparse = TORCH_CASES[case]
    got = _scheduled_run(make_opt, schedule, cover_all, fused)
    want = _torch_scheduled_run(make_torch, schedule, cover_all, sparse)
    unscheduled = _torch_scheduled_run(make_torch, "lambda", cover_all, sparse) if schedule != "lambda" else None
    assert unscheduled is None or not torch.allclose(want, unscheduled)  # the schedules differ
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_scheduled_rowwise_adagrad_and_ftrl_match_references(schedule, fused):
    lrs = _lrs(schedule, 0.1)
    got = _scheduled_run(lambda e, f: optim.RowWiseAdagrad([e], lr=0.1, fused=f), schedule, False, fused)
    w, state = initial_rows().double(), torch.zeros(V, dtype=torch.float64)
    for lr, (idx, r) in zip(lrs, batches(False)):
        ref_rowwise_adagrad(w, state, idx, r, lr, 1e-10)
    assert rel_err(got.double(), w) <= 1e-6
    got = _scheduled_run(lambda e, f: optim.FTRL([e], lr=0.1, l1=0.001, fused=f), schedule, False, fused)
    w = initial_rows().double()
    acc, lin = torch.full((V, D), 0.1, dtype=torch.float64), torch.zeros(V, D, dtype=torch.float64)
    for lr, (idx, r) in zip(lrs, batches(False)):
        ref_ftrl(w, acc, lin, idx, r, lr, 0.001, 0.0)
    assert rel_err(got.double(), w) <= 1e-6


def test_one_param_group_per_table_each_with_its_own_lr():
    a, b = dynemb.DynamicEmbedding(D, seed=1), dynemb.DynamicEmbedding(D, seed=2)
    opt = optim.Adagrad([a, b], lr=0.1)
    assert isinstance(opt, torch.optim.Optimizer) and opt.defaults["lr"] == 0.1
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.1] and all(g["params"] == [] for g in opt.param_groups)
    sched = LambdaLR(opt, [lambda epoch: 1.0, lambda epoch: 0.5**epoch])  # one schedule per table
    alone = [dynemb.DynamicEmbedding(D, seed=s) for s in (1, 2)]
    alone_opts = [optim.Adagrad([alone[0]], lr=0.1), optim.Adagrad([alone[1]], lr=0.1)]
    for step, (idx, r) in enumerate(batches(False)):
        (a(KEYS[idx]) * r).sum().backward()
        (b(KEYS[idx]) * r).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        for emb, o, lr in zip(alone, alone_opts, (0.1, 0.1 * 0.5**step)):
            o.param_groups[0]["lr"] = lr
            (emb(KEYS[idx]) * r).sum().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(a.find(KEYS), alone[0].find(KEYS)) and torch.equal(b.find(KEYS), alone[1].find(KEYS))


@pytest.mark.parametrize("make", [lambda e: optim.Adam([e], lr=0.1), lambda e: optim.FTRL([e], lr=0.1),
                                  lambda e: dynemb.OptimizerWrapper(torch.optim.Adagrad, [e], lr=0.1)],
                         ids=["adam", "ftrl", "wrap_adagrad"])
def test_state_dict_round_trip_keeps_the_schedule(make):
    def run(emb, opt, sched, steps):
        for idx, r in steps:
            (emb(KEYS[idx]) * r).sum().backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    emb = dynemb.DynamicEmbedding(D, seed=3)
    opt = make(emb)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    all_steps = list(batches(False))
    run(emb, opt, sched, all_steps[:5])
    saved = json.loads(json.dumps(opt.state_dict()))  # checkpoint manifests keep it as JSON
    saved_sched, saved_rows = sched.state_dict(), emb.state_dict()
    assert opt.param_groups[0]["lr"] == 0.025 and saved["param_groups"][0]["initial_lr"] == 0.1

    resumed = dynemb.DynamicEmbedding(D, seed=4)
    resumed_opt = make(resumed)
    resumed_sched = StepLR(resumed_opt, step_size=2, gamma=0.5)  # as torch: build the scheduler, then load
    resumed.load_state_dict(saved_rows)
    resumed_opt.load_state_dict(saved)
    resumed_sched.load_state_dict(saved_sched)
    assert resumed_opt.param_groups == opt.param_groups and resumed_opt.state_dict() == opt.state_dict()
    run(emb, opt, sched, all_steps[5:])
    run(resumed, resumed_opt, resumed_sched, all_steps[5:])
    assert torch.equal(emb.find(KEYS), resumed.find(KEYS))
    assert resumed_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.1 * 0.5**5


def test_combined_optimizer_schedules_sparse_and_dense_groups():
    from dynemb import EmbeddingCollection, FeatureConfig, TableConfig

    tables = [TableConfig(name=n, dim=D, optimizer=optim.SGD(lr=0.2), seed=i) for i, n in enumerate("ab")]
    ec = EmbeddingCollection(tables, [FeatureConfig(name=n, table=n) for n in "ab"])
    mlp = torch.nn.Linear(D, 1)
    opt = optim.CombinedOptimizer({"sparse": ec.optimizer, "dense": torch.optim.SGD(mlp.parameters(), lr=0.2)})
    assert isinstance(ec.optimizer, torch.optim.Optimizer) and isinstance(opt, torch.optim.Optimizer)
    assert len(ec.optimizer.param_groups) == 2 and len(opt.param_groups) == 3
    sched = StepLR(opt, step_size=1, gamma=0.5)
    ids = torch.tensor([[1, 2]])
    before = ec.export("a")[1].clone()
    for _ in range(2):
        out = ec({"a": ids, "b": ids})
        mlp(out["a"] + out["b"]).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.05] * 3
    assert [g["lr"] for g in ec.optimizer.optimizers["a"].param_groups] == [0.05]  # the tables' own optimizers
    assert not torch.equal(ec.export("a")[1], before)
    saved = opt.state_dict()
    assert saved["optimizers"]["sparse"]["optimizers"]["b"]["param_groups"][0]["lr"] == 0.05


def test_combined_optimizer_still_steps_a_fused_optimizer_with_step_hooks():
    """A fused table optimizer's step does nothing, so a combined optimizer skips it, unless a step hook (its own or
    torch's global one) would see it."""
    from dynemb import EmbeddingCollection, FeatureConfig, TableConfig

    tables = [TableConfig(name=n, dim=D, optimizer=optim.Adagrad(lr=0.2, fused=True), seed=i)
              for i, n in enumerate("ab")]
    ec = EmbeddingCollection(tables, [FeatureConfig(name=n, table=n) for n in "ab"])
    seen = []
    ec.optimizer.optimizers["a"].register_step_post_hook(lambda opt, args, kwargs: seen.append("a"))
    ec.optimizer.step()
    assert seen == ["a"]
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append(opt))
    try:
        ec.optimizer.step()
    finally:
        handle.remove()
    assert seen[1:] == [ec.optimizer, ec.optimizer.optimizers["a"], "a", ec.optimizer.optimizers["b"]]


def test_a_scheduler_of_one_fused_tables_optimizer_sees_it_stepped():
    import warnings

    from dynemb import EmbeddingCollection, FeatureConfig, TableConfig

    ec = EmbeddingCollection([TableConfig(name="a", dim=D, optimizer=optim.Adagrad(lr=0.2, fused=True))],
                             [FeatureConfig(name="a", table="a")])
    sched = StepLR(ec.optimizer.optimizers["a"], step_size=1, gamma=0.5)
    ec({"a": torch.tensor([1, 2])})["a"].sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" if the step were skipped
        ec.optimizer.step()
        sched.step()
    assert ec.optimizer.optimizers["a"].param_groups[0]["lr"] == 0.1


def test_unbound_spec_has_no_groups_and_binding_gives_one():
    spec = optim.Adam(lr=0.01)
    assert spec.param_groups == [] and spec.defaults["lr"] == 0.01
    emb = dynemb.DynamicEmbedding(D, seed=0)
    bound = spec.bind([emb])
    assert spec.param_groups == [] and [g["lr"] for g in bound.param_groups] == [0.01]
    assert bound == spec and hash(bound) == hash(spec)
    bound.param_groups[0]["lr"] = 0.5  # a group is the table's own: the spec keeps its defaults
    assert spec.defaults["lr"] == 0.01 and optim.Adam(lr=0.01).bind([dynemb.DynamicEmbedding(D)]) == spec


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
def test_a_tensor_lr_changed_in_place_reaches_every_update(fused):
    # Schedulers may keep the lr as a tensor and change it in place (fill_): each update must read its value then,
    # not a value remembered by identity (a cache keyed on the settings once kept the first lr).
    emb = dynemb.DynamicEmbedding(1, initializer=0.0)
    opt = optim.SGD([emb], lr=1.0, fused=fused)
    lr = torch.tensor(1.0)
    opt.param_groups[0]["lr"] = lr
    for value in (1.0, 0.5, 0.25):
        lr.fill_(value)
        emb(torch.tensor([7])).sum().backward()
        opt.step()
        opt.zero_grad()
    assert emb.find(torch.tensor([7])).item() == -1.75
