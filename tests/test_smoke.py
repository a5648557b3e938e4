import torch

import dynemb


def test_import_and_roundtrip():
    emb = dynemb.DynamicEmbedding(8, seed=1)
    out = emb(torch.tensor([1, 2, 1]))
    assert out.shape == (3, 8)
    assert torch.equal(out[0], out[2])
    assert len(emb) == 2
