"""Initializers: statistics over 2**17 new keys, per-key reproducibility, constants, callables and errors."""

from __future__ import annotations

import json
import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from dynemb.table import Constant, KeyValueTable, TruncatedNormal, Uniform, resolve_initializer

N_KEYS = 2**17
DIM = 8
PHI_2 = 0.5 * math.erfc(2.0 / math.sqrt(2.0))  # P(Z < -2)
# Variance of N(0, 1) truncated to [-2, 2]: 1 - 2 * 2 * pdf(2) / (1 - 2 * PHI_2).
TRUNC_STD = math.sqrt(1 - 4 * math.exp(-2) / math.sqrt(2 * math.pi) / (1 - 2 * PHI_2))


def _new_rows(initializer, key_dtype, device, seed=0) -> torch.Tensor:
    t = KeyValueTable(DIM, key_dtype=key_dtype, device=device, initializer=initializer, seed=seed, init_capacity=N_KEYS)
    # Spread-out keys of both signs, not a run of small integers.
    keys = (torch.arange(N_KEYS, dtype=torch.int64) * 2654435761 - 2**40).to(key_dtype)
    rows, found = t.find_or_insert(keys.to(device))
    assert not found.any() and t.size() == N_KEYS
    return t.values[rows].cpu()


@pytest.mark.parametrize(
    "name,std,low,high",
    [
        pytest.param("uniform", 0.1 / math.sqrt(12), -0.05, 0.05, id="uniform"),
        pytest.param("normal", 0.05, -math.inf, math.inf, id="normal"),
        pytest.param("truncated_normal", 0.05 * TRUNC_STD, -0.1, 0.1, id="truncated_normal"),
    ],
)
def test_statistics_of_new_rows(name, std, low, high, key_dtype, device):
    values = _new_rows(name, key_dtype, device)
    n = values.numel()
    assert abs(values.mean().item()) < 6 * std / math.sqrt(n)
    assert abs(values.std().item() / std - 1) < 0.01
    assert values.min().item() >= low and values.max().item() <= high
    for column in values.T:  # every column is centred and equally spread
        assert abs(column.mean().item()) < 6 * std / math.sqrt(N_KEYS)
        assert abs(column.std().item() / std - 1) < 0.03
    if name == "normal":
        assert values.abs().max().item() > 4 * std  # tails are there
    assert abs(torch.corrcoef(values[:, :2].T)[0, 1].item()) < 0.02


@pytest.mark.parametrize("name", ["uniform", "normal", "truncated_normal"])
def test_low_precision_rows_are_the_rounded_float32_rows(name, value_dtype, key_dtype, device):
    keys = torch.arange(-500, 500, dtype=key_dtype, device=device)
    full = KeyValueTable(DIM, key_dtype=key_dtype, device=device, initializer=name).find(keys)[0]
    low = KeyValueTable(DIM, key_dtype=key_dtype, dtype=value_dtype, device=device, initializer=name)
    rows, _ = low.find_or_insert(keys)
    assert low.values.dtype == value_dtype
    assert torch.equal(low.values[rows], full.to(value_dtype))


def test_truncated_normal_stays_within_two_std(key_dtype, device):
    values = _new_rows(TruncatedNormal(mean=1.0, std=0.5), key_dtype, device)
    assert values.min().item() >= 0.0 and values.max().item() <= 2.0
    assert values.min().item() < 0.01 and values.max().item() > 1.99  # and reaches the bounds


def test_uniform_bounds(key_dtype, device):
    values = _new_rows(Uniform(low=2.0, high=3.0), key_dtype, device)
    assert values.min().item() > 2.0 and values.max().item() < 3.0
    assert abs(values.mean().item() - 2.5) < 1e-3


@pytest.mark.parametrize("name", ["uniform", "normal", "truncated_normal"])
def test_same_key_same_row_across_tables_orders_and_batches(name, key_dtype, device):
    keys = torch.tensor([5, -1, 0, torch.iinfo(key_dtype).max, torch.iinfo(key_dtype).min], dtype=key_dtype)
    keys = keys.to(device)
    a = KeyValueTable(4, key_dtype=key_dtype, device=device, initializer=name, seed=3)
    b = KeyValueTable(4, key_dtype=key_dtype, device=device, initializer=name, seed=3)
    a.find_or_insert(keys)
    b.find_or_insert(torch.tensor([77, 78], dtype=key_dtype, device=device))  # other keys first
    for key in keys.flip(0):
        b.find_or_insert(key.view(1))
    c = KeyValueTable(4, key_dtype=key_dtype, device=device, initializer=name, seed=3)
    unseen = c.find(keys)[0]  # a read of a missing key returns the row it would get
    assert torch.equal(a.find(keys)[0], b.find(keys)[0])
    assert torch.equal(a.find(keys)[0], unseen)
    assert torch.unique(a.find(keys)[0], dim=0).shape[0] == keys.numel()


@pytest.mark.parametrize("name", ["uniform", "normal", "truncated_normal"])
def test_different_seeds_differ(name, key_dtype, device):
    keys = torch.arange(64, dtype=key_dtype, device=device)
    tables = [KeyValueTable(4, key_dtype=key_dtype, device=device, initializer=name, seed=s) for s in (0, 1)]
    rows = [t.find(keys)[0] for t in tables]
    assert not torch.isclose(rows[0], rows[1]).any()


def test_int32_and_int64_keys_of_equal_value_get_equal_rows(device):
    keys = torch.tensor([-5, 0, 7, 2**31 - 1], device=device)
    tables = {d: KeyValueTable(4, key_dtype=d, device=device, seed=9) for d in (torch.int32, torch.int64)}
    rows = [t.find(keys.to(d))[0] for d, t in tables.items()]
    assert torch.equal(rows[0], rows[1])


@pytest.mark.parametrize("spec,value", [("zeros", 0.0), (0.25, 0.25), (3, 3.0), ("13", 13.0), (Constant(-2.0), -2.0)])
def test_constants(spec, value, key_dtype, value_dtype, device):
    t = KeyValueTable(3, key_dtype=key_dtype, dtype=value_dtype, device=device, initializer=spec)
    rows, _ = t.find_or_insert(torch.tensor([1, -1], dtype=key_dtype, device=device))
    assert t.values[rows].dtype == value_dtype
    assert t.values[rows].float().eq(value).all()


def test_describe_is_json():
    for spec in ["uniform", "normal", "truncated_normal", "zeros", 0.5, lambda n, d: torch.zeros(n, d)]:
        json.dumps(resolve_initializer(spec).describe())
    assert resolve_initializer("normal").describe() == {"type": "normal", "mean": 0.0, "std": 0.05}
    assert resolve_initializer(_randn).describe() == {"type": "callable", "name": "_randn"}


# ----------------------------------------------------------------------------------------------------------- callables
def _randn(n, dim):
    return torch.randn(n, dim)


def _ones(n, dim):
    return torch.ones(n, dim, dtype=torch.float64)  # the table casts to its dtype


def test_callable_is_reproducible_under_the_seed(key_dtype, device):
    def run(seed):
        t = KeyValueTable(4, key_dtype=key_dtype, device=device, initializer=_randn, seed=seed)
        t.find_or_insert(torch.tensor([1, 2, 3], dtype=key_dtype, device=device))
        t.find_or_insert(torch.tensor([4, 2], dtype=key_dtype, device=device))
        return t.find(torch.tensor([1, 2, 3, 4], dtype=key_dtype, device=device))[0]

    assert torch.equal(run(1), run(1))
    assert not torch.equal(run(1), run(2))
    first = run(1)
    assert not torch.equal(first[0], first[3])  # successive calls draw fresh numbers


def test_callable_leaves_global_rng_alone(device):
    torch.manual_seed(0)
    state = torch.get_rng_state()
    t = KeyValueTable(4, device=device, initializer=_randn, seed=1)
    t.find_or_insert(torch.arange(10, device=device))
    assert torch.equal(torch.get_rng_state(), state)


def test_callable_output_is_cast_to_the_table(key_dtype, value_dtype, device):
    t = KeyValueTable(2, key_dtype=key_dtype, dtype=value_dtype, device=device, initializer=_ones)
    rows, _ = t.find_or_insert(torch.tensor([8, 9], dtype=key_dtype, device=device))
    assert t.values[rows].dtype == value_dtype and t.values[rows].eq(1).all()


@pytest.mark.parametrize(
    "bad",
    [lambda n, d: torch.zeros(n, d + 1), lambda n, d: torch.zeros(n), lambda n, d: [0.0] * n],
    ids=["wide", "flat", "list"],
)
def test_callable_with_wrong_output_fails_cleanly(bad, key_dtype, device, fails_cleanly):
    # A full bounded table: the insert would evict, so a late failure would lose rows.
    t = KeyValueTable(2, key_dtype=key_dtype, device=device, max_capacity=3, initializer=bad, seed=0)
    t.insert_or_assign(torch.tensor([1, 2, 3], dtype=key_dtype, device=device), torch.ones(3, 2, device=device))
    keys = torch.tensor([1, 4, 5], dtype=key_dtype, device=device)
    with fails_cleanly(t, ValueError, r"initializer callable must return a Tensor of shape \(2, 2\)", clock=False):
        t.find_or_insert(keys)
    with fails_cleanly(t, ValueError, r"initializer callable must return a Tensor of shape \(2, 2\)"):
        t.find(keys)


def test_a_failed_initializer_kernel_leaves_the_table_as_it_was(monkeypatch, fails_cleanly):
    # New rows that all follow size get the initializer kernel's values written straight into the table, after the
    # index insert: a failure there (a kernel's first compile, an interrupt) must take the keys out of the index again.
    pytest.importorskip("numba")
    from dynemb.kernels import numba_init

    t = KeyValueTable(DIM, seed=0, backend="numba")
    t.find_or_insert(torch.tensor([1, 2]))
    real = numba_init.initial_rows

    def failing(*args, **kwargs):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(numba_init, "initial_rows", failing)
    with fails_cleanly(t, RuntimeError, "kernel failed", clock=False):
        t.find_or_insert(torch.tensor([3, 4]))
    assert t.find_rows(torch.tensor([3, 4])).tolist() == [-1, -1]
    monkeypatch.setattr(numba_init, "initial_rows", real)
    rows, found = t.find_or_insert(torch.tensor([5, 6, 3]))
    assert not found.any() and sorted(rows.tolist()) == [2, 3, 4]  # three new rows, none shared with 1 and 2
    assert torch.equal(t.find(torch.tensor([5, 6, 3]))[0], KeyValueTable(DIM, seed=0).find(torch.tensor([5, 6, 3]))[0])


@pytest.mark.parametrize(
    "spec,exc,match",
    [
        ("gaussian", ValueError, "initializer must be one of .*got 'gaussian'"),
        (True, TypeError, "initializer .*got bool"),
        (object(), TypeError, "initializer .*got object"),
        (None, TypeError, "initializer .*got NoneType"),
    ],
)
def test_bad_specs(spec, exc, match):
    with pytest.raises(exc, match=match):
        resolve_initializer(spec)


def _spec_unit_uniform(key: int, column: int, seed: int) -> float:
    """The counter-based uniform as the docs state it, in Python integers: splitmix64 of the row, then a 32-bit
    hash (a Weyl step and lowbias32) of each value."""
    m64, m32 = (1 << 64) - 1, (1 << 32) - 1

    def mix64(x: int) -> int:
        x &= m64
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & m64
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & m64
        return x ^ (x >> 31)

    row = mix64((key & m64) ^ mix64(seed))
    x = ((row & m32) + (column + 1) * 0x9E3779B9 & m32) ^ (row >> 32)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m32
    x ^= x >> 15
    x = (x * 0x846CA68B) & m32
    x ^= x >> 16
    return float(torch.tensor((x >> 8) + 0.5, dtype=torch.float32) * 2.0**-24)


@settings(max_examples=40, deadline=None)
@given(keys=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=6), seed=st.integers(0, 2**63 - 1),
       dim=st.integers(1, 40))
def test_uniform_values_follow_the_stated_hash(keys, seed, dim):
    """Every backend is held to the torch rows elsewhere; these are held to the definition, computed without torch's
    integer ops."""
    got = Uniform(0.0, 1.0)(torch.tensor(keys), dim, torch.float32, seed)
    want = [[_spec_unit_uniform(k, c, seed) for c in range(dim)] for k in keys]
    assert got.tolist() == want
