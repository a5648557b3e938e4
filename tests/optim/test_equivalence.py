"""Ten training steps on a dynamic table equal the same steps on nn.Embedding with torch.optim (or a reference)."""

import math

import pytest
import torch

import dynemb
from dynemb import optim

V, D, STEPS = 24, 8, 10
KEYS = torch.tensor([0, -1, 2**63 - 1, -(2**63), 7, 2**40] + list(range(100, 100 + V - 6)), dtype=torch.int64)


def batches(cover_all: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        idx = torch.randint(0, V, (40,), generator=g)  # repeated ids within a batch
        if cover_all:
            idx = torch.cat([torch.randperm(V, generator=g), idx])
        yield idx, torch.randn(idx.numel(), D, generator=g)


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------- references
def ref_rowwise_adagrad(w, state, idx, g, lr, eps):
    rows, inv = idx.unique(return_inverse=True)
    grad = torch.zeros(rows.numel(), D, dtype=torch.float64).index_add_(0, inv, g.double())
    state[rows] += grad.pow(2).mean(1)
    w[rows] -= lr * grad / (state[rows].sqrt().unsqueeze(1) + eps)


def ref_ftrl(w, acc, lin, idx, g, lr, l1, l2, power=-0.5):
    rows, inv = idx.unique(return_inverse=True)
    grad = torch.zeros(rows.numel(), D, dtype=torch.float64).index_add_(0, inv, g.double())
    a_old, a_new = acc[rows], acc[rows] + grad**2
    sigma = (a_new ** (-power) - a_old ** (-power)) / lr
    lin[rows] += grad - sigma * w[rows]
    quad = a_new ** (-power) / lr + 2 * l2
    z = lin[rows]
    w[rows] = torch.where(z.abs() > l1, (torch.sign(z) * l1 - z) / quad, torch.zeros_like(z))
    acc[rows] = a_new


# ------------------------------------------------------------------------------------------- harness
def dynamic_run(make_opt, cover_all, fused):
    emb = dynemb.DynamicEmbedding(D, seed=11)
    opt = make_opt(emb, fused)
    for idx, r in batches(cover_all):
        (emb(KEYS[idx]) * r).sum().backward()
        opt.step()
        opt.zero_grad()
    return emb.find(KEYS)


def initial_rows():
    return dynemb.DynamicEmbedding(D, seed=11).find(KEYS)


def torch_run(make_torch_opt, cover_all, sparse=False):
    ref = torch.nn.Embedding(V, D, sparse=sparse)
    with torch.no_grad():
        ref.weight.copy_(initial_rows())
    opt = make_torch_opt(ref.parameters())
    for idx, r in batches(cover_all):
        (ref(idx) * r).sum().backward()
        opt.step()
        opt.zero_grad()
    return ref.weight.detach()


TORCH_CASES = {
    "sgd": (lambda e, f: optim.SGD([e], lr=0.3, fused=f), lambda p: torch.optim.SGD(p, lr=0.3), False, False),
    "sgd_wd": (lambda e, f: optim.SGD([e], lr=0.3, weight_decay=0.1, fused=f),
               lambda p: torch.optim.SGD(p, lr=0.3, weight_decay=0.1), True, False),
    "momentum": (lambda e, f: optim.SGD([e], lr=0.1, momentum=0.9, fused=f),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True, False),
    "nesterov": (lambda e, f: optim.SGD([e], lr=0.1, momentum=0.9, nesterov=True, fused=f),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), True, False),
    "adagrad": (lambda e, f: optim.Adagrad([e], lr=0.1, fused=f), lambda p: torch.optim.Adagrad(p, lr=0.1),
                False, False),
    "adagrad_decay": (lambda e, f: optim.Adagrad([e], lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1,
                                                 fused=f),
                      lambda p: torch.optim.Adagrad(p, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
                      False, False),
    "adam": (lambda e, f: optim.Adam([e], lr=0.01, fused=f), lambda p: torch.optim.SparseAdam(list(p), lr=0.01),
             False, True),
    "wrap_sgd": (lambda e, f: dynemb.OptimizerWrapper(torch.optim.SGD, [e], lr=0.3, fused=f),
                 lambda p: torch.optim.SGD(p, lr=0.3), False, False),
    "wrap_momentum": (lambda e, f: dynemb.OptimizerWrapper(torch.optim.SGD, [e], lr=0.1, momentum=0.9, fused=f),
                      lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), True, False),
    "wrap_adagrad": (lambda e, f: dynemb.OptimizerWrapper(torch.optim.Adagrad, [e], lr=0.1, fused=f),
                     lambda p: torch.optim.Adagrad(p, lr=0.1), False, False),
    # torch.optim.Adam adds eps after the bias correction (SparseAdam before it): compare with Adam itself, on
    # batches touching every row so that dense Adam and lazy Adam coincide.
    "wrap_adam": (lambda e, f: dynemb.OptimizerWrapper(torch.optim.Adam, [e], lr=0.01, fused=f),
                  lambda p: torch.optim.Adam(p, lr=0.01), True, False),
    "wrap_rmsprop": (lambda e, f: dynemb.OptimizerWrapper(torch.optim.RMSprop(
                         [torch.zeros(1)], lr=0.01, momentum=0.5), [e], fused=f),
                     lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5), True, False),
}


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_matches_torch_optim(case, fused):
    make_opt, make_torch, cover_all, sparse = TORCH_CASES[case]
    got = dynamic_run(make_opt, cover_all, fused)
    want = torch_run(make_torch, cover_all, sparse)
    assert not torch.equal(want, initial_rows())  # training moved the rows
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
def test_rowwise_adagrad_matches_reference(fused):
    got = dynamic_run(lambda e, f: optim.RowWiseAdagrad([e], lr=0.1, fused=f), False, fused)
    w, state = initial_rows().double(), torch.zeros(V, dtype=torch.float64)
    for idx, r in batches(False):
        ref_rowwise_adagrad(w, state, idx, r, 0.1, 1e-10)
    assert rel_err(got.double(), w) <= 1e-6


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
@pytest.mark.parametrize("l1,l2", [(0.0, 0.0), (0.001, 0.01)])
def test_ftrl_matches_reference(fused, l1, l2):
    got = dynamic_run(lambda e, f: optim.FTRL([e], lr=0.1, l1=l1, l2=l2, fused=f), False, fused)
    w = initial_rows().double()
    acc, lin = torch.full((V, D), 0.1, dtype=torch.float64), torch.zeros(V, D, dtype=torch.float64)
    for idx, r in batches(False):
        ref_ftrl(w, acc, lin, idx, r, 0.1, l1, l2)
    assert rel_err(got.double(), w) <= 1e-6


def test_slots_move_with_rows_on_eviction_and_export():
    emb = dynemb.DynamicEmbedding(D, seed=1, max_capacity=4)
    opt = optim.Adam([emb], lr=0.1)
    emb(torch.tensor([1, 2, 3, 4])).sum().backward()
    opt.step()
    rows = emb.table.export()
    assert set(rows.slots) == {"adam.exp_avg", "adam.exp_avg_sq"}
    assert bool((rows.slots["adam.exp_avg"] != 0).all())
    opt.zero_grad()
    emb(torch.tensor([5])).sum().backward()  # evicts one key; the new key's slots start at zero
    opt.step()
    new = emb.table.export()
    pos = (new.keys == 5).nonzero().item()
    assert math.isclose(float(new.slots["adam.exp_avg"][pos, 0]), 0.1, rel_tol=1e-6)  # (1 - beta1) * grad 1.0
    assert emb.table.evicted == 1


def test_dense_params_keep_torch_optim():
    model = torch.nn.ModuleDict({"emb": dynemb.DynamicEmbedding(D, seed=0), "mlp": torch.nn.Linear(D, 1)})
    sparse, dense = optim.Adagrad([model["emb"]], lr=0.1), torch.optim.SGD(model["mlp"].parameters(), lr=0.1)
    before = model["mlp"].weight.detach().clone()
    model["mlp"](model["emb"](torch.tensor([3, 4]))).sum().backward()
    sparse.step()
    dense.step()
    assert not torch.equal(before, model["mlp"].weight)
    assert list(model["emb"].parameters()) == []


def test_bad_hyperparameters_name_the_argument():
    with pytest.raises(ValueError, match="lr"):
        optim.SGD(lr=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        optim.SGD(momentum=-0.5)
    with pytest.raises(ValueError, match="betas"):
        optim.Adam(betas=(1.5, 0.9))
    with pytest.raises(TypeError, match="optimizer"):
        dynemb.OptimizerWrapper("adam")
