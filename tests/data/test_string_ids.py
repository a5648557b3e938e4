import hypothesis.strategies as st
import numpy as np
import pyarrow as pa
import pytest
import torch
import xxhash
from hypothesis import given, settings

from dynemb.data import hash_strings, null_key
from dynemb.kernels.numba_hash import split_length_prefixed, xxh64_many


def _reference(values):
    out = []
    for v in values:
        h = xxhash.xxh64_intdigest(v.encode("utf-8") if isinstance(v, str) else v)
        out.append(h - 2**64 if h >= 2**63 else h)
    return out


def test_known_value_of_the_spec():
    # XXH64 of the empty input with seed 0 is 0xEF46DB3751D8E999 (the xxHash test vector), read as signed.
    assert hash_strings([""]).tolist() == [0xEF46DB3751D8E999 - 2**64]


def test_matches_xxh64_of_utf8_and_spans_both_signs():
    values = [f"item-{i}" for i in range(200)] + ["é", "日本", "item-7"]
    got = hash_strings(values)
    assert got.dtype == torch.int64 and got.tolist() == _reference(values)
    assert (got < 0).any() and (got > 0).any()


def test_input_forms_agree():
    values = ["a", "b", "a", "ccc"]
    expected = hash_strings(values)
    forms = [
        np.array(values),
        np.array(values, dtype=object),
        [v.encode() for v in values],
        pa.array(values),
        pa.array(values, pa.large_string()),
        pa.chunked_array([pa.array(values[:1]), pa.array(values[1:])]),
        pa.array(values).dictionary_encode(),
        pa.array([v.encode() for v in values], pa.binary()),
    ]
    for form in forms:
        assert torch.equal(hash_strings(form), expected), form


def test_empty():
    assert hash_strings([]).shape == (0,)


def test_nulls_and_non_strings_are_rejected():
    with pytest.raises(ValueError, match="nulls.*position 1"):
        hash_strings(["a", None])
    with pytest.raises(TypeError, match="strings or bytes"):
        hash_strings([1, 2])
    with pytest.raises(TypeError, match="strings or bytes"):
        hash_strings(["a", 1])


@pytest.mark.parametrize("single", ["user_1", b"user_1", ""])
def test_a_single_string_is_rejected(single):
    # A str is a sequence of characters: hashing it would give one key per character, silently.
    with pytest.raises(TypeError, match=r"a list of strings.*\[values\]"):
        hash_strings(single)


def test_null_key_per_column():
    h = xxhash.xxh64_intdigest(b"C1", seed=1)
    assert null_key("C1") == (h - 2**64 if h >= 2**63 else h)
    assert null_key("C1") != null_key("C2")
    assert null_key("C1") != hash_strings(["C1"]).item()
    with pytest.raises(TypeError, match="column must be a str"):
        null_key(3)


# ------------------------------------------------------------------ the numba XXH64 against the xxhash binding


def _reference(values) -> list:
    return [(h - 2**64 if h >= 2**63 else h)
            for h in (xxhash.xxh64_intdigest(v.encode("utf-8") if isinstance(v, str) else v) for v in values)]


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.binary(min_size=0, max_size=100), min_size=0, max_size=40), cut=st.integers(0, 40))
def test_kernel_equals_the_binding_on_any_bytes(values, cut):
    """Every length from 0 across the 4-, 8- and 32-byte boundaries; plain, large, sliced and chunked arrays."""
    want = _reference(values)
    for array in (pa.array(values, pa.binary()), pa.array(values, pa.large_binary())):
        assert hash_strings(array).tolist() == want
        assert hash_strings(array.slice(min(cut, len(values)))).tolist() == want[cut:]
    if values:
        chunked = pa.chunked_array([values[:cut], values[cut:]], pa.binary())
        assert hash_strings(chunked).tolist() == want


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.text(max_size=40), min_size=1, max_size=30), seed=st.sampled_from([0, 1, 2**64 - 1]))
def test_kernel_equals_the_binding_on_text_and_seeds(values, seed):
    assert hash_strings(values).tolist() == _reference(values)
    assert hash_strings(pa.array(values).dictionary_encode()).tolist() == _reference(values)
    data = np.frombuffer(b"".join(v.encode() for v in values), np.uint8)
    offsets = np.concatenate([[0], np.cumsum([len(v.encode()) for v in values])]).astype(np.int64)
    got = xxh64_many(data, offsets, 0, len(values), seed=seed)
    assert got.tolist() == [xxhash.xxh64_intdigest(v.encode(), seed=seed) for v in values]


@settings(max_examples=80, deadline=None)
@given(values=st.lists(st.binary(max_size=60), max_size=20), cut=st.integers(0, 2000))
def test_length_prefixed_elements_split_into_arrow_layout(values, cut):
    raw = b"".join(len(v).to_bytes(4, "little") + v for v in values)
    offsets, data = split_length_prefixed(np.frombuffer(raw, np.uint8))
    assert [data[a:b].tobytes() for a, b in zip(offsets[:-1], offsets[1:])] == values
    if cut < len(raw):  # cut inside an element: the offset where the truncated element starts
        starts = np.concatenate([[0], np.cumsum([4 + len(v) for v in values])])
        truncated = split_length_prefixed(np.frombuffer(raw[:cut], np.uint8))
        if cut in starts:
            assert isinstance(truncated, tuple)
        else:
            assert truncated == starts[np.searchsorted(starts, cut, side="right") - 1]
