"""Trace replay through a real bounded table, Belady's optimum (checked against exhaustive search), and the
drifting traces they run on."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynemb.data import replay as replay_module
from dynemb.data.replay import belady, compare, replay, unique_accesses
from dynemb.data.traces import DriftingTrace
from dynemb.table.hashing import mix64

POLICIES = ["lru", "lfu", "epoch_lru", "epoch_lfu", "decayed_lfu"]
batches_st = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1, max_size=7)


def _optimum(accesses, capacity: int) -> int:
    """Most hits any cache of ``capacity`` keys can get, by trying every choice at every miss."""
    seq = tuple(int(k) for keys, _ in accesses for k in keys)

    @functools.lru_cache(maxsize=None)
    def best(i: int, stored: frozenset) -> int:
        if i == len(seq):
            return 0
        key = seq[i]
        if key in stored:
            return 1 + best(i + 1, stored)
        options = [best(i + 1, stored)]  # do not store it
        if len(stored) < capacity:
            options.append(best(i + 1, stored | {key}))
        else:
            options += [best(i + 1, (stored - {out}) | {key}) for out in stored]
        return max(options)

    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(batches=batches_st, capacity=st.integers(1, 3))
def test_belady_is_the_optimum(batches, capacity):
    accesses = unique_accesses([torch.tensor(b) for b in batches])
    assert belady(accesses, capacity)["hits"] == _optimum(accesses, capacity)


@settings(max_examples=30, deadline=None)
@given(batches=batches_st, capacity=st.integers(1, 4), policy=st.sampled_from(POLICIES))
def test_no_policy_beats_belady(batches, capacity, policy):
    accesses = unique_accesses([torch.tensor(b) for b in batches])
    kw = {"half_life": 2} if policy == "decayed_lfu" else {}
    assert replay(accesses, capacity, policy, **kw)["hits"] <= belady(accesses, capacity)["hits"]


def test_python_and_compiled_belady_agree():
    pytest.importorskip("numba")
    trace = DriftingTrace(num_slots=3000, batch_size=512, num_batches=30, lifetime=10)
    accesses = unique_accesses(trace.batches())
    ids = np.unique(torch.cat([k for k, _ in accesses]).numpy(), return_inverse=True)[1].reshape(-1)
    nxt = replay_module._next_use(ids)
    got = [np.zeros(ids.size, np.bool_) for _ in range(2)]
    replay_module._belady_python(ids, nxt, 400, got[0])
    replay_module._kernel()(ids, nxt, 400, got[1])
    assert np.array_equal(*got) and 0 < got[0].sum() < ids.size


def test_drifting_trace_ceiling_and_policies():
    """On a real trace every policy stays under Belady, decayed_lfu beats lfu (its churn), and the counters add up."""
    trace = DriftingTrace(num_slots=5000, batch_size=256, num_batches=100, lifetime=30)
    accesses = unique_accesses(trace.batches())
    cap = 600
    ceiling = belady(accesses, cap, warmup=5)
    got = {p: replay(accesses, cap, p, warmup=5) for p in POLICIES}
    for p, r in got.items():
        assert r["accesses"] == ceiling["accesses"] and 0 < r["hit_rate"] < ceiling["hit_rate"], p
        assert r["evicted_per_row"] == r["evicted"] / cap
    assert got["decayed_lfu"]["hit_rate"] > got["lfu"]["hit_rate"] + 0.03  # measured 0.439 vs 0.390


def test_replay_without_pressure_misses_each_key_once():
    batches = [torch.tensor([1, 2, 2]), torch.tensor([2, 3]), torch.tensor([-1, 1, 3])]
    r = replay(unique_accesses(batches), 10, "lfu")
    assert (r["hits"], r["accesses"], r["evicted"]) == (3, 7, 0)
    assert belady(unique_accesses(batches), 10)["hits"] == 3


# ---------------------------------------------------------------------------------------------------------- traces
def test_trace_is_reproducible_and_turns_over():
    trace = DriftingTrace(num_slots=1000, batch_size=4096, num_batches=100, lifetime=5, stable=0.0)
    assert torch.equal(trace.batch(7), DriftingTrace(**trace.describe()).batch(7))
    first, late = set(trace.batch(0).tolist()), set(trace.batch(60).tolist())
    assert len(first & late) < 0.1 * len(first)  # lifetimes are at most 4 x 5 batches
    still = DriftingTrace(num_slots=1000, batch_size=4096, num_batches=100, lifetime=5, stable=1.0)
    assert set(still.batch(60).tolist()) <= set(mix64(torch.arange(1000)).tolist())  # generation 0 forever


def test_trace_follows_the_power_law():
    trace = DriftingTrace(num_slots=100, batch_size=50_000, lifetime=1e9, alpha=1.0)
    _, counts = torch.unique(trace.batch(0), return_counts=True)
    top = counts.sort(descending=True).values.double()
    assert 1.6 < float(top[0] / top[1]) < 2.4  # P(rank r) ~ 1 / (r + 1): the top id twice the second


@pytest.mark.parametrize("bad,match", [({"num_slots": 0}, "num_slots"), ({"lifetime": 0.5}, "lifetime must be"),
                                       ({"stable": 2}, "stable must be"), ({"alpha": -1}, "alpha must be")])
def test_trace_rejects_bad_arguments(bad, match):
    with pytest.raises(ValueError, match=match):
        DriftingTrace(**bad)


def test_replay_mistakes_are_named_errors():
    batches = [torch.randint(0, 50, (32,), dtype=torch.int32) for _ in range(3)]
    accesses = unique_accesses(batches)  # int32 batches and lists of ints are fine
    assert accesses[0][0].dtype == torch.int64 and unique_accesses([[1, 2, 2]])[0][1].tolist() == [1, 2]
    with pytest.raises(TypeError, match="unique_accesses"):
        replay(batches, 10, "lfu")
    with pytest.raises(ValueError, match="max_capacity must be an int >= 1, got 0"):
        replay(accesses, 0, "lfu")
    with pytest.raises(ValueError, match="custom"):
        replay(accesses, 10, "custom")
    with pytest.raises(ValueError, match=r"fractions must be numbers in \(0, 1\]"):
        compare(accesses, fractions=(2.0,))
