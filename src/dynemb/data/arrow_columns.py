"""Arrow columns to numpy arrays under the readers' rules for ids, dense values, labels and nulls.

Every function takes ``where`` (the file and column, for messages) and raises ``ValueError`` naming it. The rules
for ids and for null and non-finite dense values are written once, as tables, in docs/cli.md ("Ids, nulls and
non-finite values"); in short:

Categorical ids: each id column has a type, ``"INT64"`` or ``"BYTES"`` (:data:`ID_TYPES`), decided once when a run
starts (see :meth:`dynemb.data.FileReader`) and saved with the model, so every format reads a value the same way:
    - ``INT64``: integer columns are taken as they are (uint64 values ``>= 2**63`` are reinterpreted as signed
      int64, a bijection; bool gives 0/1); text must be a canonical decimal int64 (:func:`decimal_int64`: ``0``,
      ``-12``, ``9223372036854775807``; no ``+``, no leading zeros), which is that integer; any other text is an
      error naming the column, the row and the value;
    - ``BYTES``: text and binary (plain or dictionary-encoded) are hashed by :func:`dynemb.data.hash_strings`,
      digit-only text included; an integer is hashed as its canonical decimal text, so ``85711`` and
      ``"85711"`` are one id;
    - a null gets :func:`dynemb.data.null_key` of the column name, whatever the type; a float column is an error.
Multi-hot ids: a list column (``list<string>``, ``list<int64>``, large or fixed-size lists) gives one bag per row,
its elements read by the rules above; a null element gets the null key, a null list is the bag ``[null key]``
and an empty list an empty bag. CSV text is split at a separator first (``"a|b|c"``); an empty CSV field is a
null (CSV cannot tell an empty list from a missing one), so it gives the bag ``[null key]``.
Dense values: any numeric or bool column, or text that parses as a number (``inf``, ``nan`` included), as
float32; a null is NaN and NaN and ``±inf`` stay as they are (a finite value beyond float32 becomes ``±inf``):
what they become is the model's rule (:meth:`dynemb.data.preprocess.Preprocessing.normalize`).
Labels: numeric, bool or text equal to 0 or 1; a null or any other value is an error. With a positive label,
the value whose text equals it is 1 and every other non-null value 0.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .string_ids import hash_strings, null_key

__all__ = ["ID_TYPES", "categorical_ids", "multi_hot_ids", "dense_values", "label_values", "decimal_int64",
           "first_line"]

ID_TYPES = ("INT64", "BYTES")
"""The types of an id column, named as the Open Inference Protocol's datatypes."""

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


def decimal_int64(text: pa.Array) -> np.ndarray:
    """Which values of a null-free string array are canonical decimal int64s: ``0`` or an optional ``-`` and 1-19
    digits without a leading zero, in ``[-2**63, 2**63 - 1]`` (string comparison is exact at equal length).

    Shape:
        ``[N]`` strings -> bool ``[N]``.

    Example:
        >>> decimal_int64(pa.array(["0", "-12", "007", "+1", "-0", "9223372036854775808", "1.0"])).tolist()
        [True, True, False, False, False, False, False]
    """
    negative = pc.starts_with(text, "-")
    short = pc.less(pc.utf8_length(text), pc.if_else(negative, 20, 19))
    in_range = pc.if_else(negative, pc.less_equal(text, _INT64_MIN_TEXT), pc.less_equal(text, _INT64_MAX_TEXT))
    fits = pc.and_(pc.match_substring_regex(text, _DECIMAL), pc.or_(short, in_range))
    return fits.to_numpy(zero_copy_only=False)


def _integer_text(column: pa.Array) -> pa.Array:
    """The canonical decimal text of an integer (or bool: 0/1) column, in one vectorized cast."""
    if pa.types.is_boolean(column.type):
        column = pc.cast(column, pa.int8())
    return pc.cast(column, pa.string())


def _text_ints(text: pa.Array, name: str, where: str, row_of: Callable[[int], int]) -> np.ndarray:
    """The integers of text that must be canonical decimal int64s (an ``INT64`` column)."""
    if not _is_text(text.type):
        raw = text.dictionary_decode() if pa.types.is_dictionary(text.type) else text
        try:
            text = pc.cast(raw, pa.string())
        except pa.ArrowException:  # binary that is not UTF-8: no value of it is a decimal integer
            text = None
            # the first value that is not UTF-8 (an error path: one Python pass is fine here)
            first = next(i for i, v in enumerate(raw.to_pylist()) if not _utf8(v))
    is_int = decimal_int64(text) if text is not None else None
    if is_int is None or not is_int.all():
        i = first if is_int is None else int(np.argmin(is_int))
        raise ValueError(f"{where}: {_shown(text, i)} at row {row_of(i)} is not an integer id, and the model reads "
                         f"{name!r} as INT64 ids (id_types in model.json)")
    return pc.cast(text, pa.int64()).to_numpy(zero_copy_only=False, writable=True)


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _shown(text, i: int) -> str:
    value = "a non-UTF-8 value" if text is None else repr(text[i].as_py())
    return value if len(value) <= 60 else value[:57] + "..."


def _valid_ids(column: pa.Array, name: str, where: str, id_type: str, row_of: Callable[[int], int]) -> np.ndarray:
    """Ids of a null-free column of id type ``id_type``; ``row_of(i)``: the file row of ``column[i]``."""
    t = column.type.value_type if pa.types.is_dictionary(column.type) else column.type
    integer = pa.types.is_integer(t) or pa.types.is_boolean(t)
    if id_type == "INT64":
        if pa.types.is_uint64(t):
            return column.to_numpy(zero_copy_only=False, writable=True).view(np.int64)
        if integer:
            return pc.cast(column, pa.int64()).to_numpy(zero_copy_only=False, writable=True)
        if _is_bytes(t):
            return _text_ints(column, name, where, row_of)
    elif _is_bytes(t):
        return hash_strings(column).numpy()
    elif integer:
        return hash_strings(_integer_text(column)).numpy()
    raise ValueError(f"{where} has type {column.type}; categorical ids must be integers or strings")


def _check_id_type(id_type: str) -> None:
    if id_type not in ID_TYPES:
        raise ValueError(f"id_type must be one of {ID_TYPES}, got {id_type!r}")


def _ids(column: pa.Array, name: str, where: str, id_type: str, row_of: Callable[[int], int]) -> np.ndarray:
    column = _decoded(column)
    if not column.null_count:
        if column.type == pa.int64() and id_type == "INT64":  # the common case: the ids are the values
            return column.to_numpy(zero_copy_only=False, writable=True)
        return _valid_ids(column, name, where, id_type, row_of)
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    out = np.full(len(column), null_key(name), dtype=np.int64)
    if valid.any():
        positions = np.flatnonzero(valid)
        out[valid] = _valid_ids(column.filter(valid), name, where, id_type, lambda i: row_of(int(positions[i])))
    return out


def categorical_ids(column: pa.Array, name: str, where: str, id_type: str, first_row: int = 0) -> np.ndarray:
    """int64 ids of a categorical column whose ids are of type ``id_type`` (see the module docstring).

    Args:
        column: the column's values (any Arrow integer, bool, string or binary type; dictionaries too).
        name: the column name (its null key).
        where: the file and column, for messages.
        id_type: ``"INT64"`` or ``"BYTES"``, the column's type in the model.
        first_row: the file row of ``column[0]``, for messages.

    Raises:
        ValueError: a float column, or text of an ``INT64`` column that is not a canonical decimal int64 (the
            message names the value and its row).

    Shape:
        ``[B]`` values -> ``[B]`` ids.

    Example:
        >>> categorical_ids(pa.array(["85711", None]), "zip", "zip", "INT64")[0]
        np.int64(85711)
        >>> a = categorical_ids(pa.array([85711]), "zip", "zip", "BYTES")
        >>> b = categorical_ids(pa.array(["85711"]), "zip", "zip", "BYTES")
        >>> bool(a[0] == b[0] != 85711)
        True
    """
    _check_id_type(id_type)
    return _ids(column, name, where, id_type, lambda i: first_row + i)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def multi_hot_ids(column: pa.Array, name: str, where: str, id_type: str, separator: str | None = None,
                  first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """int64 ids and bag offsets of a multi-hot column whose elements are ids of type ``id_type`` (see the module
    docstring and :func:`categorical_ids`).

    ``separator`` splits text columns (CSV) into lists; their elements are then text.

    Shape:
        ``B`` rows -> ids ``[N]`` and offsets ``[B + 1]`` (bag ``i`` is ``ids[offsets[i]:offsets[i + 1]]``).
    """
    _check_id_type(id_type)
    if separator is not None and _is_text(column.type):
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

    def row_of(i: int) -> int:  # element i of the flattened lists -> its row (only for a message)
        return first_row + int(np.searchsorted(offsets, np.flatnonzero(slots)[i], side="right")) - 1

    ids[slots] = _ids(column.flatten(), name, where, id_type, row_of)
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


NULL_TEXT = ("NA", "N/A", "n/a", "NULL", "null", "Null", "None", "<NA>", "#N/A")
"""Text a dense column reads as null (then as the training mean, as an empty CSV field): the spellings R, SQL
exports and pandas write for a missing number (pandas' ``read_csv`` reads them as NaN too)."""


def dense_values(column: pa.Array, where: str, first_row: int | None = None) -> np.ndarray:
    """float32 values of a dense column, raw: a null is NaN, NaN and ``±inf`` stay (the model's rule replaces
    them, see :meth:`dynemb.data.preprocess.Preprocessing.normalize`). Text is read as a number; an empty field
    and the text of :data:`NULL_TEXT` (``NA``, ``null``, ...) are null. ``first_row``: the file row of
    ``column[0]``, for messages.

    Raises:
        ValueError: text that is no number, naming ``where``, the value and (with ``first_row``) its row.

    Example:
        >>> dense_values(pa.array([1.5, None, float("inf")]), "x").tolist()
        [1.5, nan, inf]
        >>> dense_values(pa.array(["2", "NA", "null", "-inf"]), "x").tolist()
        [2.0, nan, nan, -inf]
    """
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    text = _is_text(column.type)
    if text:
        missing = pc.is_in(column, value_set=pa.array(NULL_TEXT, column.type))
        if pc.any(missing).as_py():
            column = pc.if_else(missing, pa.scalar(None, column.type), column)
    try:
        values = _as_float64(column, where, "dense values must be numbers")
    except ValueError:
        if not text:
            raise
        i, value = _first_not_a_number(column)
        at = "" if first_row is None else f" at row {first_row + i}"
        raise ValueError(f"{where}: dense values must be numbers, got {value!r}{at} (text ids belong in a "
                         f"categorical column; a missing number is an empty field or one of {', '.join(NULL_TEXT)})"
                         ) from None
    if values.null_count:  # a null is NaN
        values = pc.fill_null(values, float("nan"))
    with np.errstate(over="ignore"):  # a finite float64 beyond float32 becomes inf, as a cast does
        return values.to_numpy(zero_copy_only=False).astype(np.float32)


def _first_not_a_number(column: pa.Array) -> tuple[int, str]:
    """The index and text of the first value of a text column that does not cast to float64 (for the message of
    a cast that failed: a loop over the column only then)."""
    for i, value in enumerate(column.to_pylist()):
        if value is not None:
            try:
                pc.cast(pa.array([value]), pa.float64())
            except pa.ArrowException:
                return i, value
    return 0, column[0].as_py()


POSITIVE_LABEL_HINT = "; other labels need --positive-label VALUE (the value that means 1)"
"""The end of a label error: what ``dynemb train`` takes for labels that are not 0/1 (``eval`` says otherwise)."""


def label_values(column: pa.Array, where: str, first_row: int, positive: str | None = None) -> np.ndarray:
    """float32 0/1 labels; ``first_row`` is the file row of ``column[0]``, for messages.

    With ``positive``, labels are compared as text: a value whose text is ``positive`` (``">50K"``, ``"yes"``,
    ``"true"`` for a bool column) is 1 and any other non-null value 0."""
    if positive is not None:
        return _positive_labels(column, where, first_row, positive)
    hint = POSITIVE_LABEL_HINT
    try:
        values = _as_float64(column, where, "labels must be 0 or 1" + hint)
    except ValueError:
        text = column.dictionary_decode() if pa.types.is_dictionary(column.type) else column
        if not _is_text(text.type):
            raise
        # the labels the user has, not pyarrow's parse error: they show which value --positive-label wants
        seen = pc.unique(text.drop_null())
        shown = ", ".join(repr(v) for v in seen[:5].to_pylist()) + (", ..." if len(seen) > 5 else "")
        raise ValueError(f"{where}: labels must be 0 or 1, got text ({shown}){hint}") from None
    valid = values.is_valid().to_numpy(zero_copy_only=False)
    y = values.to_numpy(zero_copy_only=False)
    bad = ~valid | ((y != 0.0) & (y != 1.0))
    if bad.any():
        i = int(bad.argmax())
        got = column[i].as_py()
        raise ValueError(f"{where}: labels must be 0 or 1, got {got!r} at row {first_row + i}{hint}")
    return y.astype(np.float32)


def _may_be_written_by(t: pa.DataType, positive: str) -> bool:
    """Whether a value of the numeric or bool type ``t`` can have ``positive`` as its text: it parses as one, and
    that value's text is ``positive`` again (a float 1.0 reads '1', a bool 'true': '1.0' or 'True' never match)."""
    try:
        return pc.cast(pc.cast(pa.array([positive]), t), pa.string())[0].as_py() == positive
    except pa.ArrowException:
        return False


def _positive_labels(column: pa.Array, where: str, first_row: int, positive: str) -> np.ndarray:
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    if column.null_count:
        i = int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
        raise ValueError(f"{where}: labels must not be null, got None at row {first_row + i}")
    numeric = pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_decimal(
        column.type) or pa.types.is_boolean(column.type)
    if numeric and not _may_be_written_by(column.type, positive):
        # a run trained on '>50K' resumed or evaluated on a file of 0/1 labels read every label as 0 (a resume
        # trained on them and kept the degenerate model as its best)
        raise ValueError(f"{where} has type {column.type}, whose values never read as the positive label "
                         f"{positive!r} (labels are compared as text): give labels as the run was trained on them "
                         f"(text such as {positive!r}), or 0/1 labels to a run trained without --positive-label")
    try:
        text = pc.cast(column, pa.string())
    except pa.ArrowException as exc:
        raise ValueError(f"{where} has type {column.type}; --positive-label compares labels as text "
                         f"({first_line(exc)})") from None
    return pc.equal(text, positive).to_numpy(zero_copy_only=False).astype(np.float32)
