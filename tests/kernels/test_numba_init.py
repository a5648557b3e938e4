"""The numba initializer kernel writes exactly (bit for bit) the rows of the torch initializers, so a table's new
rows do not depend on the backend."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from dynemb.kernels import init_kernels, use_backend
from dynemb.table import KeyValueTable
from dynemb.table.initializers import Constant, Normal, Uniform

pytest.importorskip("numba")

KEYS = st.lists(st.integers(-(2**63), 2**63 - 1), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None)
@given(keys=KEYS, seed=st.integers(0, 2**62), dim=st.one_of(st.integers(1, 33), st.sampled_from([64, 100, 256])),
       bounds=st.tuples(st.floats(-10, 10, width=32), st.floats(0, 10, width=32)),
       key_dtype=st.sampled_from([torch.int64, torch.int32]))
def test_uniform_and_constant_rows_are_bit_identical(keys, seed, dim, bounds, key_dtype):
    info = torch.iinfo(key_dtype)
    k = torch.tensor([min(max(x, info.min), info.max) for x in keys] + [info.min, info.max, -1, 0], dtype=key_dtype)
    low, width = bounds
    for init in (Uniform(low, low + width), Constant(low)):
        out = torch.empty(k.numel(), dim)
        init_kernels("numba", "cpu").initial_rows(*init.kernel_spec(), k, seed, out)
        assert torch.equal(out, init(k, dim, torch.float32, seed))


def test_find_or_insert_writes_the_same_rows_under_both_backends():
    keys = torch.cat([torch.tensor([-(2**63), 2**63 - 1, -1, 0]), torch.randint(-(2**62), 2**62, (5000,))])
    rows = {}
    for backend in ("numba", "torch"):
        table = KeyValueTable(16, seed=9, backend=backend)
        table.find_or_insert(keys)
        rows[backend] = table.find(keys)[0]
    assert torch.equal(rows["numba"], rows["torch"])
    assert torch.equal(rows["torch"], Uniform()(keys, 16, torch.float32, 9))


def test_initializers_without_a_kernel_run_in_torch():
    assert Normal().kernel_spec() is None
    with use_backend("numba"):
        table = KeyValueTable(4, initializer="normal", seed=2)
        table.find_or_insert(torch.tensor([3, 4]))
        assert torch.equal(table.find(torch.tensor([3, 4]))[0], Normal()(torch.tensor([3, 4]), 4, torch.float32, 2))
    with pytest.raises(ValueError, match="kind must be one of"):
        init_kernels("numba", "cpu").initial_rows("normal", (), torch.tensor([1]), 0, torch.empty(1, 4))
