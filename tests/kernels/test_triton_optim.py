"""The fused backward + optimizer kernel (``sparse_update``) and the whole Triton backend in a training loop:
three steps of pooled and plain lookups under backend "triton" equal the same steps under "torch" (values and
optimizer slots), for every optimizer, fused and in step mode (interpreter on CPU without a GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import dynemb  # noqa: E402
from dynemb import optim  # noqa: E402
from dynemb.functional import embedding_lookup_sparse  # noqa: E402
from dynemb.kernels import triton_index, triton_init, triton_optim, triton_pool, use_backend  # noqa: E402

pytestmark = pytest.mark.triton
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DIM = 6
OPTIMIZERS = {
    "sgd": lambda e, f: optim.SGD([e], lr=0.1, fused=f),
    "sgd_nesterov": lambda e, f: optim.SGD([e], lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, fused=f),
    "adagrad": lambda e, f: optim.Adagrad([e], lr=0.1, lr_decay=0.01, weight_decay=0.02, fused=f),
    "rowwise_adagrad": lambda e, f: optim.RowWiseAdagrad([e], lr=0.1, weight_decay=0.01, fused=f),
    "adam": lambda e, f: optim.Adam([e], lr=0.05, fused=f),
    "ftrl": lambda e, f: optim.FTRL([e], lr=0.1, l1=0.001, l2=0.01, fused=f),
}
KEYS = torch.tensor([0, -1, 2**63 - 1, -(2**63), 7, 2**40, 3, 11, 12, 13], dtype=torch.int64)


def _batches(dim: int = DIM):
    g = torch.Generator().manual_seed(0)
    for step, combiner in enumerate(["sum", "mean", "sqrtn"]):
        ids = KEYS[torch.randint(0, KEYS.numel(), (30,), generator=g)]  # repeated ids within and across bags
        offsets = torch.tensor([0, 4, 4, 12, 20, 29])  # an empty bag and one of a single id
        weights = torch.rand(30, generator=g) if step else None
        yield ids, offsets, weights, combiner, torch.randn(offsets.numel(), dim, generator=g)


def _train(backend: str, make_opt, fused: bool, dim: int = DIM) -> dict:
    with use_backend(backend):
        emb = dynemb.DynamicEmbedding(dim, seed=3, device=DEVICE)
        opt = make_opt(emb, fused)
        for ids, offsets, weights, combiner, target in _batches(dim):
            def to(t):
                return None if t is None else t.to(DEVICE)

            out = embedding_lookup_sparse(emb, ids.to(DEVICE), to(offsets), to(weights), combiner)
            loss = (out * target.to(DEVICE)).sum()
            if not fused:  # step mode also gets a plain (unpooled) lookup: a [U, D] gradient, order None
                loss = loss + emb(ids[:7].to(DEVICE)).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
        table = emb.table
        rows = table.find_rows(KEYS.to(DEVICE))
        unseen = torch.tensor([123456789, -5], device=DEVICE)  # eval reads of absent keys: initializer rows
        return {"values": emb.find(KEYS.to(DEVICE)), "initial": emb.find(unseen),
                **{name: table.slot(name)[rows] for name in table.slot_names}}


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_training_under_triton_equals_torch(name, fused, monkeypatch):
    calls = set()
    for module, fn in ((triton_optim, "sparse_update"), (triton_pool, "pool"), (triton_pool, "dedup"),
                       (triton_index, "probe"), (triton_index, "find_or_insert"), (triton_init, "initial_rows")):
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _real=real, _fn=fn, **k: calls.add(_fn) or _real(*a, **k))
    want = _train("torch", OPTIMIZERS[name], fused)
    assert not calls
    got = _train("triton", OPTIMIZERS[name], fused)
    assert calls == {"sparse_update", "pool", "dedup", "probe", "find_or_insert", "initial_rows"}, "a kernel never ran"
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=2e-5, atol=2e-6, msg=f"{name} {key}")
    assert torch.equal(got["initial"], want["initial"])  # new rows from the kernel, bit for bit


@pytest.mark.parametrize("name", ["rowwise_adagrad", "adam"])
def test_wide_rows_in_one_tile(name):
    """dim 130: a non-power-of-two row wider than 128 (masked columns, 4 warps), RowWiseAdagrad's row sum."""
    want = _train("torch", OPTIMIZERS[name], True, dim=130)
    got = _train("triton", OPTIMIZERS[name], True, dim=130)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=2e-5, atol=2e-6, msg=f"{name} {key}")


def test_sparse_update_checks_its_arguments():
    values, rows, grad = torch.zeros(4, 2), torch.tensor([1]), torch.ones(1, 2)
    with pytest.raises(ValueError, match="kind must be one of"):
        triton_optim.sparse_update("lamb", (0.1,), values, (), rows, grad, None, None, None, None)
    with pytest.raises(ValueError, match="hparams for 'adam' must be 4 floats"):
        triton_optim.sparse_update("adam", (0.1,), values, (), rows, grad, None, None, None, None)
    with pytest.raises(ValueError, match="slots for 'adagrad'"):
        triton_optim.sparse_update("adagrad", (0.1, 0.0, 1e-10), values, (), rows, grad, None, None, None, None)
