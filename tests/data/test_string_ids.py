import numpy as np
import pyarrow as pa
import pytest
import torch
import xxhash

from dynemb.data import hash_strings, null_key


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
