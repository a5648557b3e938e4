import pytest
import torch

from dynemb.data import auc


def _pairwise_auc(scores, labels):
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).double() + 0.5 * (diff == 0).double()).mean().item()


@pytest.mark.parametrize("seed", range(3))
def test_matches_pairwise_definition_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 20, (500,), generator=g).float()  # many ties
    labels = (torch.rand(500, generator=g) < 0.3).long()
    assert auc(scores, labels) == pytest.approx(_pairwise_auc(scores, labels), abs=1e-12)


def test_extremes():
    y = torch.tensor([0, 0, 1, 1])
    assert auc(torch.tensor([1.0, 2.0, 3.0, 4.0]), y) == 1.0
    assert auc(torch.tensor([4.0, 3.0, 2.0, 1.0]), y) == 0.0
    assert auc(torch.zeros(4), y.bool()) == 0.5


@pytest.mark.parametrize(
    "scores, labels, error, message",
    [
        (torch.zeros(3), torch.tensor([1, 1, 1]), ValueError, "both classes"),
        (torch.zeros(3), torch.tensor([0, 1]), ValueError, "same shape"),
        (torch.zeros(2), torch.tensor([0, 2]), ValueError, "0/1"),
        ([0.1, 0.2], torch.tensor([0, 1]), TypeError, "scores must be a torch.Tensor"),
    ],
)
def test_errors(scores, labels, error, message):
    with pytest.raises(error, match=message):
        auc(scores, labels)
