import pytest
import torch

from dynemb.data import Batch


def _batch(**overrides):
    fields = dict(
        dense=torch.zeros(3, 2),
        sparse={"a": torch.tensor([1, -1, 2**63 - 1]), "b": torch.tensor([5, 6, 7, 8])},
        labels=torch.tensor([0.0, 1.0, 0.0]),
        offsets={"b": torch.tensor([0, 1, 1, 4])},
    )
    fields.update(overrides)
    return Batch(**fields)


def test_valid_batch_and_to():
    b = _batch()
    assert len(b) == 3
    moved = b.to("cpu")
    assert torch.equal(moved.sparse["b"], b.sparse["b"]) and torch.equal(moved.offsets["b"], b.offsets["b"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"labels": torch.tensor([0, 1, 0])}, "labels must be a torch.float32"),
        ({"dense": torch.zeros(2, 2)}, r"dense must be a torch.float32 tensor of shape \(3, '\*'\)"),
        ({"dense": torch.zeros(3, 2, dtype=torch.float64)}, "dense must be"),
        ({"sparse": {"a": torch.tensor([1, 2]), "b": torch.tensor([1])}}, r"sparse\['a'\]"),
        ({"sparse": {"a": torch.tensor([1, 2, 3], dtype=torch.int32), "b": torch.tensor([1])}}, r"sparse\['a'\]"),
        ({"offsets": {"b": torch.tensor([0, 4])}}, r"offsets\['b'\]"),
        ({"offsets": {"zz": torch.tensor([0, 1, 2, 3])}}, "unknown"),
        ({"sparse": {"a": [1, 2, 3], "b": torch.tensor([1])}}, "got list"),
    ],
)
def test_bad_fields_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        _batch(**overrides)
