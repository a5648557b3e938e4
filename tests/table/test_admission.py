import pytest
import torch

import dynemb
from dynemb.table import FrequencyAdmission, KeyValueTable


@pytest.mark.parametrize("threshold", [1, 2, 3, 5])
def test_key_is_stored_exactly_at_threshold(threshold):
    emb = dynemb.DynamicEmbedding(4, seed=0, admission=threshold)
    opt = dynemb.optim.SGD([emb], lr=1.0)
    key = torch.tensor([-(2**63)])
    for seen in range(1, threshold + 2):
        before = emb.find(key)
        emb(key).sum().backward()
        opt.step()
        opt.zero_grad()
        stored = bool(emb.contains(key))
        assert stored == (seen >= threshold)
        after = emb.find(key)
        if seen < threshold:
            assert torch.equal(after, before)  # reads the initializer row; gradient dropped
        else:
            assert torch.allclose(after, before - 1.0 if seen > threshold else emb.table.initial_rows(key) - 1.0)


def test_duplicates_in_one_batch_count():
    t = KeyValueTable(2, admission=FrequencyAdmission(3))
    rows, _ = t.find_or_insert(torch.tensor([9, 9, 9, 8, 8]))
    assert t.contains(torch.tensor([9, 8])).tolist() == [True, False]
    assert (rows[:3] >= 0).all() and (rows[3:] == -1).all()
    assert t.inserted == 1 and t.size() == 1


def test_counting_is_bounded_and_never_admits_early():
    adm = FrequencyAdmission(2, max_tracked=4)
    t = KeyValueTable(2, admission=adm)
    t.find_or_insert(torch.arange(100))  # 100 candidates, 4 tracked
    assert adm.counter.size() <= 4
    t.find_or_insert(torch.arange(100))
    assert t.size() <= 4  # the forgotten ones start over instead of being admitted


def test_bad_threshold():
    with pytest.raises(ValueError, match="threshold"):
        FrequencyAdmission(0)
    with pytest.raises(TypeError, match="admission"):
        KeyValueTable(2, admission="often")


def test_counts_stand_for_occurrences_in_lfu_and_admission():
    t = KeyValueTable(2, eviction="lfu", admission=FrequencyAdmission(3))
    t.find_or_insert(torch.tensor([4, 5]), counts=torch.tensor([3, 2]))
    assert t.contains(torch.tensor([4, 5])).tolist() == [True, False]
    rows = t.find_rows(torch.tensor([4]))
    assert int(t.scores[rows]) == 3
    with pytest.raises(TypeError, match="counts must be an int64 tensor"):
        t.find_or_insert(torch.tensor([4]), counts=torch.tensor([1.0]))
    before = t.export()
    for bad in (0, -1):  # found by review: a negative count gave decayed scores that differed by backend
        with pytest.raises(ValueError, match=f"counts must be >= 1.*got {bad}"):
            t.find_or_insert(torch.tensor([4, 9]), counts=torch.tensor([2, bad]))
    after = t.export()
    assert torch.equal(before.keys, after.keys) and torch.equal(before.scores, after.scores)  # left unchanged


def test_the_owning_table_builds_the_counter(device):
    adm = FrequencyAdmission(2, max_tracked=16)
    t = KeyValueTable(2, key_dtype=torch.int32, device=device, admission=adm)
    t.find_or_insert(torch.tensor([7, 8, 8], dtype=torch.int32, device=device))
    assert adm.counter.key_dtype == torch.int32 and adm.counter.device == t.device
    assert adm.counter.max_capacity == 16 and adm.counter.policy.value == "lfu"
    with pytest.raises(RuntimeError, match="until a table owns it"):
        FrequencyAdmission(2).admit(torch.tensor([1]), torch.tensor([1]))
