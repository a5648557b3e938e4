import pytest
import torch

from dynemb.data import Batch
from dynemb.data.batch import concat_batches, slice_rows, take_rows
from dynemb.data.stream import held_out, rebatch, shuffled, split


def numbered(first: int, n: int, multi_hot: bool = True) -> Batch:
    """Rows ``first .. first + n - 1``: row r has label r % 2, dense [r], id r and (multi-hot) the bag of r % 3
    ids ``[r, r, ...]``."""
    rows = torch.arange(first, first + n)
    sparse, offsets = {"id": rows.clone()}, {}
    if multi_hot:
        lengths = rows % 3
        sparse["bag"] = rows.repeat_interleave(lengths)
        offsets["bag"] = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return Batch(rows.float().unsqueeze(1), sparse, (rows % 2).float(), offsets)


def check_rows(batch: Batch) -> list[int]:
    """The row numbers of ``batch``, after checking that every field still belongs to the same row."""
    rows = batch.sparse["id"]
    assert torch.equal(batch.dense[:, 0], rows.float()) and torch.equal(batch.labels, (rows % 2).float())
    if "bag" in batch.sparse:
        assert torch.equal(batch.sparse["bag"], rows.repeat_interleave(rows % 3))
        assert torch.equal(batch.offsets["bag"].diff(), rows % 3)
    return rows.tolist()


def test_row_operations_keep_bags_whole():
    a, b = numbered(0, 5), numbered(5, 4)
    both = concat_batches([a, b])
    assert check_rows(both) == list(range(9))
    assert check_rows(slice_rows(both, 2, 7)) == [2, 3, 4, 5, 6]
    assert check_rows(take_rows(both, torch.tensor([8, 0, 4, 4]))) == [8, 0, 4, 4]
    assert check_rows(take_rows(both, torch.tensor([], dtype=torch.int64))) == []


def test_held_out_is_a_seeded_function_of_the_row_number():
    rows = torch.arange(200_000)
    mask = held_out(rows, 0.05, seed=0)
    assert abs(mask.float().mean().item() - 0.05) < 0.003
    assert torch.equal(held_out(rows[1000:2000], 0.05, 0), mask[1000:2000])  # any chunking agrees
    assert not torch.equal(held_out(rows, 0.05, seed=1), mask)
    assert not held_out(rows, 0.0, 0).any() and held_out(rows, 1.0, 0).all()


def test_split_is_a_partition_whatever_the_chunks():
    chunks = [(0, numbered(0, 700)), (700, numbered(700, 300)), (1000, numbered(1000, 1))]
    train = sum((check_rows(b) for b in split(chunks, 0.3, 7, "train")), [])
    held = sum((check_rows(b) for b in split(chunks, 0.3, 7, "eval")), [])
    assert sorted(train + held) == list(range(1001)) and not set(train) & set(held)
    assert held == held_out(torch.arange(1001), 0.3, 7).nonzero().squeeze(1).tolist()
    assert 200 < len(held) < 400
    assert sum((check_rows(b) for b in split(chunks, 0.0, 7, "train")), []) == list(range(1001))
    with pytest.raises(ValueError, match="part must be 'train' or 'eval', got 'test'"):
        list(split(chunks, 0.3, 7, "test"))


@pytest.mark.parametrize("buffer_rows", [10, 64, 10_000])
def test_shuffle_visits_every_row_once_in_a_seeded_order(buffer_rows):
    chunks = [numbered(i * 50, 50) for i in range(10)]
    first = sum((check_rows(b) for b in shuffled(chunks, buffer_rows, seed=3, epoch=0)), [])
    assert sorted(first) == list(range(500)) and first != list(range(500))
    assert first == sum((check_rows(b) for b in shuffled(chunks, buffer_rows, seed=3, epoch=0)), [])
    assert first != sum((check_rows(b) for b in shuffled(chunks, buffer_rows, seed=3, epoch=1)), [])


def test_shuffle_holds_a_bounded_number_of_rows():
    consumed, outstanding = [0], []

    def chunks():
        for i in range(100):
            consumed[0] += 10
            yield numbered(i * 10, 10, multi_hot=False)

    emitted = 0
    for batch in shuffled(chunks(), 40, seed=0):
        outstanding.append(consumed[0] - emitted)  # rows read but not yet sent out when this batch leaves
        emitted += len(batch)
    assert emitted == 1000 and max(outstanding) <= 2 * 40


def test_rebatch_cuts_any_chunks_into_full_batches():
    chunks = [numbered(0, 3), numbered(3, 10), numbered(13, 0), numbered(13, 2)]
    sizes = [len(b) for b in rebatch(chunks, 4)]
    assert sizes == [4, 4, 4, 3]
    assert sum((check_rows(b) for b in rebatch(chunks, 4)), []) == list(range(15))
    assert [len(b) for b in rebatch(chunks, 4, drop_last=True)] == [4, 4, 4]
