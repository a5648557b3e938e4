"""A row's logit does not depend on the rows scored beside it: the DLRM's CPU scoring passes (no autograd) pad to a
multiple of ``SCORING_ROWS``, so any batch size (from 0), any cut and any offset give the bits of one 1,024-row
pass, through ``forward`` (pooled as a dict, as one tensor, or looked up by the collection) and
``forward_stacked``. Training passes (autograd) are not padded and keep their batch."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from dynemb.collection import EmbeddingCollection
from dynemb.data.batch import Batch
from dynemb.models import DLRM, dlrm_tables
from dynemb.models.dlrm import SCORING_ROWS

ROWS, FEATURES, DIM, DENSE = 1024, 6, 16, 5


def _model() -> DLRM:
    torch.manual_seed(0)
    tables, features = dlrm_tables([f"f{i}" for i in range(FEATURES)], dim=DIM)
    return DLRM(DENSE, EmbeddingCollection(tables, features), dim=DIM)


MODEL = _model()
G = torch.Generator().manual_seed(1)
DENSE_X = torch.randn(ROWS, DENSE, generator=G)
POOLED = torch.randn(ROWS, FEATURES, DIM, generator=G)
IDS = {f: torch.randint(0, 100, (ROWS,), generator=G) for f in MODEL.features}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _batch(lo: int, hi: int) -> Batch:
    return Batch(DENSE_X[lo:hi], {f: v[lo:hi] for f, v in IDS.items()}, torch.zeros(hi - lo))


def _stacked(lo: int, hi: int) -> torch.Tensor:
    whole = torch.empty(hi - lo, FEATURES + 1, DIM)
    whole[:, 1:] = POOLED[lo:hi]
    return whole


with torch.no_grad():
    WHOLE = MODEL(_batch(0, ROWS), pooled=POOLED)
    LOOKED_UP = MODEL.eval()(_batch(0, ROWS))


@settings(max_examples=80, deadline=None)
@given(lo=st.integers(0, ROWS), size=st.integers(0, 70))
def test_any_cut_scores_as_one_pass(lo, size):
    hi = min(ROWS, lo + size)
    with torch.no_grad():
        as_tensor = MODEL(_batch(lo, hi), pooled=POOLED[lo:hi])
        as_dict = MODEL(_batch(lo, hi), pooled={f: POOLED[lo:hi, k] for k, f in enumerate(MODEL.features)})
        stacked = MODEL.forward_stacked(DENSE_X[lo:hi], _stacked(lo, hi))
        looked_up = MODEL(_batch(lo, hi))
    for got in (as_tensor, as_dict, stacked):
        assert got.shape == (hi - lo,)
        assert torch.equal(_bits(got), _bits(WHOLE[lo:hi]))
    assert torch.equal(_bits(looked_up), _bits(LOOKED_UP[lo:hi]))


def test_one_row_at_a_time_and_training_passes():
    with torch.no_grad():
        rows = torch.cat([MODEL(_batch(i, i + 1), pooled=POOLED[i:i + 1]) for i in range(40)])
    assert torch.equal(_bits(rows), _bits(WHOLE[:40]))
    # with autograd nothing is padded: the logits have the batch's rows and a gradient flows
    logits = MODEL(_batch(0, SCORING_ROWS + 3), pooled=POOLED[:SCORING_ROWS + 3].clone().requires_grad_())
    assert logits.shape == (SCORING_ROWS + 3,) and logits.requires_grad
    torch.testing.assert_close(logits.detach(), WHOLE[:SCORING_ROWS + 3], rtol=1e-5, atol=1e-6)
