import dataclasses
import time

import pytest
import torch

from dynemb.data import Batch, SyntheticClickLog, auc


def _assert_same(a: Batch, b: Batch) -> None:
    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert a.sparse.keys() == b.sparse.keys() and a.offsets.keys() == b.offsets.keys()
    assert all(torch.equal(a.sparse[k], b.sparse[k]) for k in a.sparse)
    assert all(torch.equal(a.offsets[k], b.offsets[k]) for k in a.offsets)


@pytest.fixture(scope="module")
def log():
    return SyntheticClickLog(batch_size=4096, seed=3)


def test_batch_shapes_and_names(log):
    b = log.batch(0)
    assert b.dense.shape == (4096, 13) and b.dense.dtype == torch.float32
    assert b.labels.shape == (4096,) and b.labels.dtype == torch.float32
    assert list(b.sparse) == [f"C{i}" for i in range(1, 27)] == list(log.categorical_names)
    assert log.dense_names == tuple(f"I{i}" for i in range(1, 14))
    assert all(ids.shape == (4096,) and ids.dtype == torch.int64 for ids in b.sparse.values())
    assert b.offsets == {}


def test_deterministic_under_seed(log):
    _assert_same(SyntheticClickLog(batch_size=4096, seed=3).batch(5), log.batch(5))
    _assert_same(next(log.batches(start=5)), log.batch(5))
    other = SyntheticClickLog(batch_size=4096, seed=4).batch(5)
    assert not torch.equal(other.sparse["C3"], log.batch(5).sparse["C3"])


def test_batches_resume_and_shard(log):
    small = dataclasses.replace(log, batch_size=8)
    got = list(small.batches(num_batches=3, start=2, step=4))
    assert len(got) == 3
    for batch, index in zip(got, (2, 6, 10)):
        _assert_same(batch, small.batch(index))
    assert list(small.batches(num_batches=0)) == []


def test_eval_split_is_a_different_stream_of_the_same_model(log):
    train, held_out = log.batch(0), log.batch(0, "eval")
    assert not torch.equal(train.dense, held_out.dense)
    assert log.logits(held_out).shape == (4096,)
    # The hidden model does not depend on the batch size or the stream: another generator scores alike.
    twin = dataclasses.replace(log, batch_size=7)
    assert torch.equal(twin.logits(held_out), log.logits(held_out))


def test_ground_truth_auc_and_label_balance(log):
    held_out = log.batch(1, "eval")
    ceiling = auc(log.logits(held_out), held_out.labels)
    assert 0.7 < ceiling < 1.0
    assert abs(held_out.labels.mean().item() - 0.25) < 0.03
    rare = dataclasses.replace(log, ctr=0.05).batch(0)
    assert abs(rare.labels.mean().item() - 0.05) < 0.015


def test_ids_span_the_int64_range_and_features_do_not_share_ids(log):
    ids = log.batch(0).sparse["C3"]  # ~10M vocabulary
    assert ids.min() < -(2**62) and ids.max() > 2**62
    assert 0.4 < (ids < 0).float().mean().item() < 0.6
    assert torch.isin(ids, log.batch(0).sparse["C4"]).sum() == 0
    assert log.batch(0).sparse["C9"].unique().numel() <= 3  # Criteo's C9 has 3 values


def test_power_law_head_covers_most_traffic():
    def head_share(alpha: float) -> float:
        log = SyntheticClickLog(num_categorical=1, vocab_sizes=100_000, alpha=alpha, batch_size=50_000, seed=1)
        _, counts = log.batch(0).sparse["C1"].unique(return_counts=True)
        return counts.sort(descending=True).values[:1000].sum().item() / 50_000  # top 1% of the vocabulary

    assert head_share(1.05) > 0.5
    assert head_share(0.0) < 0.1  # alpha 0 is uniform


def test_rank_zero_is_the_most_frequent_id():
    log = SyntheticClickLog(num_categorical=1, vocab_sizes=1000, alpha=1.2, batch_size=20_000, seed=2)
    ids, counts = log.batch(0).sparse["C1"].unique(return_counts=True)
    assert counts.max() > 5 * counts.float().median()
    assert ids.numel() <= 1000


def test_multi_hot_offsets():
    log = SyntheticClickLog(batch_size=64, ids_per_feature=4, seed=5)
    b = log.batch(0)
    for name in log.categorical_names:
        offsets, lengths = b.offsets[name], b.offsets[name].diff()
        assert offsets.shape == (65,) and offsets[0] == 0 and offsets[-1] == b.sparse[name].numel()
        assert lengths.min() >= 1 and lengths.max() <= 4
    assert torch.isfinite(log.logits(b)).all()
    _assert_same(dataclasses.replace(log).batch(0), b)
    held_out = list(log.batches("eval", num_batches=64))
    logits, labels = torch.cat([log.logits(b) for b in held_out]), torch.cat([b.labels for b in held_out])
    assert auc(logits, labels) > 0.7


def test_throughput_one_core():
    # Idle, one core makes ~600k samples/s (26 features). This machine is shared and noisy, so the floor only
    # catches a lost vectorization (a Python loop over ids runs ~100x slower), not a few percent.
    log = SyntheticClickLog(batch_size=4096, seed=0)
    assert torch.get_num_threads() == 1  # set by conftest
    best = float("inf")
    for i in range(5):
        start = time.perf_counter()
        log.batch(i)
        best = min(best, time.perf_counter() - start)
    assert 4096 / best > 50_000


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"vocab_sizes": (10, 20)}, "vocab_sizes"),
        ({"vocab_sizes": 0}, "vocab_sizes"),
        ({"vocab_sizes": 2**40 + 1}, "vocab_sizes"),
        ({"alpha": -0.5}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"ctr": 1.0}, "ctr"),
        ({"signal": -1.0}, "signal"),
        ({"dense_share": 1.5}, "dense_share"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"batch_size": 0}, "batch_size"),
        ({"ids_per_feature": 0}, "ids_per_feature"),
        ({"num_categorical": 0}, "num_categorical"),
        ({"num_dense": -1}, "num_dense"),
    ],
)
def test_bad_config_names_the_argument(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        SyntheticClickLog(**kwargs)


def test_bad_stream_arguments(log):
    with pytest.raises(ValueError, match="split must be one of"):
        log.batch(0, "test")
    with pytest.raises(ValueError, match="index"):
        log.batch(-1)
    with pytest.raises(ValueError, match="step"):
        log.batches(step=0)
    with pytest.raises(ValueError, match="num_batches"):
        log.batches(num_batches=-1)


def test_logits_rejects_a_batch_of_other_features(log):
    b = SyntheticClickLog(num_categorical=3, num_dense=2, vocab_sizes=10, batch_size=4).batch(0)
    with pytest.raises(ValueError, match="batch must have sparse features"):
        log.logits(b)


def test_no_dense_features():
    b = SyntheticClickLog(num_dense=0, dense_share=0.0, batch_size=16).batch(0)
    assert b.dense.shape == (16, 0)
