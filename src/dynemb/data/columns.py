"""Arrow columns to numpy arrays under the readers' rules for ids, dense values, labels and nulls.

Every function takes ``where`` (the file and column, for messages) and raises ``ValueError`` naming it.

Categorical ids:
    - integer columns are taken as they are (uint64 values ``>= 2**63`` are reinterpreted as signed int64,
      a bijection); bool columns give 0/1;
    - string and binary columns (plain or dictionary-encoded) are hashed by :func:`dynemb.data.hash_strings`;
    - text read from CSV has no type, so each value decides for itself: a canonical decimal integer in the
      int64 range (``0``, ``-12``, ``9223372036854775807``; no sign ``+``, no leading zeros) is taken as that
      integer, and any other text (``"007"``, ``"12.0"``, ``"abc"``) is hashed;
    - a null gets :func:`dynemb.data.null_key` of the column name.
Multi-hot ids: a list column (``list<string>``, ``list<int64>``, large or fixed-size lists) gives one bag per row,
its elements read by the rules above; a null element gets the null key, a null list is the bag ``[null key]``
and an empty list an empty bag. CSV text is split at a separator first (``"a|b|c"``); an empty CSV field is a
null (CSV cannot tell an empty list from a missing one), so it gives the bag ``[null key]``.
Dense values: any numeric or bool column, or text that parses as a number, as float32; null and NaN give 0.0.
Labels: numeric, bool or text equal to 0 or 1; a null or any other value is an error. With a positive label,
the value whose text equals it is 1 and every other non-null value 0.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .hashing import hash_strings, null_key

__all__ = ["categorical_ids", "multi_hot_ids", "dense_values", "label_values", "first_line"]

_DECIMAL = r"^(0|-?[1-9][0-9]{0,18})$"
_INT64_MAX_TEXT = "9223372036854775807"
_INT64_MIN_TEXT = "-9223372036854775808"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message: Arrow's messages can run over several lines."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_bytes(t: pa.DataType) -> bool:
    return _is_text(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _decoded(column: pa.Array) -> pa.Array:
    """Dictionary columns of strings stay encoded (hashing dedups through them); others are decoded."""
    if pa.types.is_dictionary(column.type) and not _is_bytes(column.type.value_type):
        return column.dictionary_decode()
    return column


def _decimal_int64(text: pa.Array) -> np.ndarray:
    """Mask of the canonical decimal integers that fit in int64 (string comparison is exact at equal length)."""
    negative = pc.starts_with(text, "-")
    short = pc.less(pc.utf8_length(text), pc.if_else(negative, 20, 19))
    in_range = pc.if_else(negative, pc.less_equal(text, _INT64_MIN_TEXT), pc.less_equal(text, _INT64_MAX_TEXT))
    fits = pc.and_(pc.match_substring_regex(text, _DECIMAL), pc.or_(short, in_range))
    return fits.to_numpy(zero_copy_only=False)


def _text_ids(text: pa.Array) -> np.ndarray:
    is_int = _decimal_int64(text)
    out = np.empty(len(text), dtype=np.int64)
    out[is_int] = pc.cast(text.filter(is_int), pa.int64()).to_numpy()
    out[~is_int] = hash_strings(text.filter(~is_int)).numpy()
    return out


def _valid_ids(column: pa.Array, where: str, decimal_text: bool) -> np.ndarray:
    """Ids of a null-free column."""
    t = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    if pa.types.is_uint64(t):
        return column.to_numpy().view(np.int64)
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return pc.cast(column, pa.int64()).to_numpy(zero_copy_only=False)
    if decimal_text and _is_text(t) and not pa.types.is_dictionary(column.type):
        return _text_ids(column)
    if _is_bytes(t):
        return hash_strings(column).numpy()
    raise ValueError(f"{where} has type {column.type}; categorical ids must be integers or strings")


def categorical_ids(column: pa.Array, name: str, where: str, decimal_text: bool = False) -> np.ndarray:
    """int64 ids of a categorical column (see the module docstring); ``decimal_text`` for CSV text."""
    column = _decoded(column)
    if not column.null_count and column.type == pa.int64():  # the common case: the ids are the values
        return column.to_numpy(zero_copy_only=False, writable=True)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    out = np.full(len(column), null_key(name), dtype=np.int64)
    if valid.any():
        out[valid] = _valid_ids(column.filter(valid), where, decimal_text)
    return out


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def multi_hot_ids(column: pa.Array, name: str, where: str, separator: str | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """int64 ids and bag offsets of a multi-hot column (see the module docstring).

    ``separator`` splits text columns (CSV) into lists; their elements then follow the CSV text rule.

    Shape:
        ``B`` rows -> ids ``[N]`` and offsets ``[B + 1]`` (bag ``i`` is ``ids[offsets[i]:offsets[i + 1]]``).
    """
    text = separator is not None and _is_text(column.type)
    if text:
        column = pc.split_pattern(column, separator)
    if not _is_list(column.type):
        raise ValueError(f"{where} has type {column.type}; multi-hot columns must be lists (list<string>, "
                         f"list<int64>, ...)" + (f" or text separated by {separator!r}" if separator else ""))
    null_list = column.is_null().to_numpy(zero_copy_only=False)
    lengths = pc.fill_null(pc.list_value_length(column), 1).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.zeros(len(column) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = np.full(int(offsets[-1]), null_key(name), dtype=np.int64)
    slots = np.ones(len(ids), dtype=bool)
    slots[offsets[:-1][null_list]] = False  # a null list holds one null key; every other slot is an element
    ids[slots] = categorical_ids(column.flatten(), name, where, decimal_text=text)
    return ids, offsets


def _as_float64(column: pa.Array, where: str, what: str) -> pa.Array:
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    t = column.type
    numeric = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)
    if not (numeric or pa.types.is_decimal(t) or pa.types.is_null(t) or _is_text(t)):
        raise ValueError(f"{where} has type {t}; {what}")
    try:
        return pc.cast(column, pa.float64())
    except pa.ArrowException as exc:
        raise ValueError(f"{where}: {what} ({first_line(exc)})") from None


def dense_values(column: pa.Array, where: str) -> np.ndarray:
    """float32 values of a dense column; null and NaN give 0.0."""
    values = _as_float64(column, where, "dense values must be numbers")
    if values.null_count:
        values = pc.fill_null(values, 0.0)
    out = values.to_numpy(zero_copy_only=False).astype(np.float32)
    out[np.isnan(out)] = 0.0
    return out


def label_values(column: pa.Array, where: str, first_row: int, positive: str | None = None) -> np.ndarray:
    """float32 0/1 labels; ``first_row`` is the file row of ``column[0]``, for messages.

    With ``positive``, labels are compared as text: a value whose text is ``positive`` (``">50K"``, ``"yes"``,
    ``"true"`` for a bool column) is 1 and any other non-null value 0."""
    if positive is not None:
        return _positive_labels(column, where, first_row, positive)
    hint = "; other labels need --positive-label VALUE (the value that means 1)"
    values = _as_float64(column, where, "labels must be 0 or 1" + hint)
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    y = values.to_numpy(zero_copy_only=False)
    bad = ~valid | ((y != 0.0) & (y != 1.0))
    if bad.any():
        i = int(bad.argmax())
        got = column[i].as_py()
        raise ValueError(f"{where}: labels must be 0 or 1, got {got!r} at row {first_row + i}{hint}")
    return y.astype(np.float32)


def _positive_labels(column: pa.Array, where: str, first_row: int, positive: str) -> np.ndarray:
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if column.null_count:
        i = int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
        raise ValueError(f"{where}: labels must not be null, got None at row {first_row + i}")
    try:
        text = pc.cast(column, pa.string())
    except pa.ArrowException as exc:
        raise ValueError(f"{where} has type {column.type}; --positive-label compares labels as text "
                         f"({first_line(exc)})") from None
    return pc.equal(text, positive).to_numpy(zero_copy_only=False).astype(np.float32)
