"""Stable hashing of string ids to int64 keys.

The hash of a string is **XXH64** (xxHash 64-bit, seed 0) of its UTF-8 bytes, read as an unsigned 64-bit integer
and reinterpreted as a two's-complement int64 (values ``>= 2**63`` become negative). Byte strings are hashed as
they are. The mapping is the same on every platform and in every xxHash implementation, so keys can be recomputed
in any language at serving time; in plain Python: ``h = xxhash.xxh64_intdigest(s.encode("utf-8"))`` then
``key = h - 2**64 if h >= 2**63 else h``.

:func:`hash_strings` hashes every value of an Arrow array in one numba call over its offsets and data buffers
(:mod:`dynemb.kernels.numba_hash`, tested equal to the ``xxhash`` binding); a dictionary-encoded column hashes its
distinct values once and gathers. (The binding hashes one value per Python call: a column of distinct user ids
would cost a Python call a row.)
"""

from __future__ import annotations

try:
    import numpy as np
    import pyarrow as pa
    import xxhash
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"dynemb.data.string_ids needs pyarrow and xxhash: pip install 'dynemb[data]' ({exc})") from exc
import torch

__all__ = ["hash_strings", "null_key", "NULL_SEED"]

NULL_SEED = 1
"""The xxHash seed of :func:`null_key`; seed 0 is for ids, so a null cannot share the hash of any string id."""


def _to_signed(hashes: np.ndarray) -> np.ndarray:
    return hashes.astype(np.uint64).view(np.int64)


def _as_binary_array(values) -> pa.Array:
    """``values`` as a binary or dictionary-of-binary Arrow array, checked for nulls."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if not isinstance(values, pa.Array):
        try:
            values = pa.array(values)
        except (pa.ArrowException, TypeError) as exc:
            raise TypeError(f"values must be strings or bytes, got {type(values).__name__} ({exc})") from None
    kind = values.type.value_type if pa.types.is_dictionary(values.type) else values.type
    if not (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind)
        or pa.types.is_large_binary(kind)
        or pa.types.is_null(kind)
    ):
        raise TypeError(f"values must be strings or bytes, got Arrow type {values.type}")
    if values.null_count:
        first = values.is_null().to_numpy(zero_copy_only=False).argmax()
        raise ValueError(f"values must not contain nulls, got {values.null_count} (the first at position {first})")
    return values


def hash_strings(values) -> torch.Tensor:
    """Hash string (or bytes) ids to int64 keys: XXH64, seed 0, of the UTF-8 bytes, as signed int64.

    Args:
        values: a sequence or numpy array of ``str`` or ``bytes``, or an Arrow (chunked, dictionary) array of
            strings or binary. No nulls.

    Returns:
        A new int64 tensor of the keys; equal strings get equal keys in every call and on every platform.

    Raises:
        TypeError: ``values`` are not strings or bytes, or are one ``str``/``bytes`` (which would otherwise be
            hashed character by character): pass ``[value]``.
        ValueError: ``values`` contains a null (the message gives its position).

    Shape:
        ``[N]`` values -> ``[N]``.

    Example:
        >>> hash_strings(["user_42", "user_42", "", "é"]).tolist()
        [4815382341779711111, 4815382341779711111, -1205034819632174695, 1717938401253289848]
    """
    if isinstance(values, (str, bytes)):
        raise TypeError(f"values must be a list of strings or bytes, got a single {type(values).__name__} "
                        f"{values[:40]!r}; pass [values] to hash one id")
    values = _as_binary_array(values)
    if len(values) == 0:
        return torch.zeros(0, dtype=torch.int64)
    if pa.types.is_dictionary(values.type):  # each distinct value once, then its hash gathered per row
        indices = values.indices.to_numpy(zero_copy_only=False)
        return torch.from_numpy(_to_signed(_xxh64_values(values.dictionary))[indices])
    return torch.from_numpy(_to_signed(_xxh64_values(values)))


def _xxh64_values(values: pa.Array) -> np.ndarray:
    """XXH64 (seed 0) of each value of a string or binary Arrow array (no nulls), in one kernel call over its
    buffers: uint64 ``[N]``."""
    from ..kernels.numba_hash import xxh64_many

    if len(values) == 0 or pa.types.is_null(values.type):
        return np.zeros(len(values), np.uint64)
    large = pa.types.is_large_string(values.type) or pa.types.is_large_binary(values.type)
    _, offsets, data = values.buffers()
    offsets = np.frombuffer(offsets, np.int64 if large else np.int32)
    data = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    return xxh64_many(data, offsets, values.offset, len(values))


def null_key(column: str) -> int:
    """The key given to a null id in column ``column``: XXH64, seed :data:`NULL_SEED` (1), of the UTF-8 bytes of
    the column name, as signed int64. Each column gets its own key, so nulls of different features never share a
    row of a shared table.

    Raises:
        TypeError: ``column`` is not a string.

    Example:
        >>> null_key("C1") == null_key("C1") != null_key("C2")
        True
    """
    if not isinstance(column, str):
        raise TypeError(f"column must be a str, got {type(column).__name__}")
    return int(_to_signed(np.array([xxhash.xxh64_intdigest(column.encode("utf-8"), seed=NULL_SEED)]))[0])
