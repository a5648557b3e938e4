"""OptimizerWrapper with optimizers that take sparse gradients only (torch.optim.SparseAdam)."""

import pytest
import torch

import dynemb
from dynemb.functional import embedding_lookup_sparse

V, D, STEPS = 30, 6, 8
KEYS = torch.tensor([2**62, -7, 0, -(2**63)] + list(range(1000, 1000 + V - 4)), dtype=torch.int64)


def _bags(step):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, V // 2, (24,), generator=g)  # repeated ids, half the rows untouched (lazy updates)
    return ids, torch.tensor([0, 5, 5, 12, 20]), torch.randn(5, D, generator=g)


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
@pytest.mark.parametrize("given", ["class", "instance"])
def test_wrapped_sparse_adam_equals_embedding_bag_with_sparse_adam(given, fused):
    emb = dynemb.DynamicEmbedding(D, seed=5)
    if given == "class":
        opt = dynemb.OptimizerWrapper(torch.optim.SparseAdam, [emb], lr=0.05, betas=(0.8, 0.99), fused=fused)
    else:
        instance = torch.optim.SparseAdam([torch.zeros(1, requires_grad=True)], lr=0.05, betas=(0.8, 0.99))
        opt = dynemb.OptimizerWrapper(instance, [emb], fused=fused)
    initial = emb.find(KEYS)
    ref = torch.nn.EmbeddingBag(V, D, mode="mean", sparse=True)
    with torch.no_grad():
        ref.weight.copy_(initial)
    ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.05, betas=(0.8, 0.99))
    for step in range(STEPS):
        ids, offsets, r = _bags(step)
        (embedding_lookup_sparse(emb, KEYS[ids], offsets, combiner="mean") * r).sum().backward()
        opt.step()
        opt.zero_grad()
        (ref(ids, offsets) * r).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    want = ref.weight.detach()
    assert not torch.equal(want[: V // 2], initial[: V // 2])
    assert torch.equal(emb.find(KEYS[V // 2 :]), initial[V // 2 :])  # rows no bag touched did not move
    assert float((emb.find(KEYS) - want).norm() / want.norm()) <= 1e-6
    assert emb.table.slot_names == ["wrap_sparseadam.exp_avg", "wrap_sparseadam.exp_avg_sq"]


def test_wrapper_takes_an_instance_with_torch_fused_in_its_defaults():
    emb = dynemb.DynamicEmbedding(D, seed=5)
    opt = dynemb.OptimizerWrapper(torch.optim.Adam([torch.zeros(1, requires_grad=True)], lr=0.1), [emb])
    assert opt.param_groups[0]["lr"] == 0.1 and opt.fused is False
    emb(torch.tensor([1])).sum().backward()
    opt.step()
