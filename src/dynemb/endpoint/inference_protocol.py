"""The Open Inference Protocol (KServe v2) tensors of a served model: metadata, request decoding, responses.

Inputs, ``B`` rows per request:

=======================  ======================  ========  ==============================================
tensor                   datatype                shape     holds
=======================  ======================  ========  ==============================================
``{column}``             BYTES or an integer     ``[B]``   a categorical column: ids read by the column's
                                                           id type in the model (below); JSON ``null`` is
                                                           a null id
``{column}``             BYTES or an integer     ``[N]``   a multi-hot column: the ids of every row,
                                                           concatenated
``{column}__lengths``    INT32                   ``[B]``   ... and how many of them each row has
``{column}``             FP32 (or FP64, or an    ``[B]``   a dense column, raw (normalized by the server);
                         integer: as ``predict``           ``null``, NaN and ``±inf`` allowed
                         reads an integer column)
=======================  ======================  ========  ==============================================

An input of one value a row (an id column, lengths, a dense column) may also come as ``[B, 1]``, the column a Triton
client sends for each feature: it reads as ``[B]``, bit-equal. The metadata reports ``[-1]``.

Output: ``probability``, FP64 ``[B]`` (the bits ``dynemb predict`` writes). Ids and dense values go through
:mod:`dynemb.data.arrow_columns`, the code the file readers use, and the model's
:class:`~dynemb.data.preprocess.Preprocessing`, so a request scores exactly as the same rows read from a Parquet or
CSV file. Each id column has the model's id type (the metadata reports it as the input's datatype): an ``INT64``
column takes integers, and BYTES text that is a canonical decimal int64 (other text is a 400 naming the input and
the value); a ``BYTES`` column hashes text, and hashes an integer as its decimal text, so ``85711`` and ``"85711"``
are one id. Dense ``null``/NaN, ``inf`` and ``-inf`` read as the training mean, max and min (the rule of
docs/cli.md), silently: the endpoint counts nothing per request."""

from __future__ import annotations

import itertools
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from ..data.batch import Batch
from ..data.arrow_columns import categorical_ids, dense_values, multi_hot_ids
from ..data.preprocess import Preprocessing
from ..serving.exported_model import check_input_names
from .wire import RequestError, first_wrong_json

__all__ = ["LENGTHS", "OUTPUT", "model_metadata", "decode_request", "encode_response"]

LENGTHS = "__lengths"
OUTPUT = "probability"
INTEGER_TYPES = ("INT64", "INT32", "INT16", "INT8", "UINT64", "UINT32", "UINT16", "UINT8")
ID_TYPES = ("BYTES", *INTEGER_TYPES)
DENSE_TYPES = ("FP32", "FP64")
DENSE_INPUT_TYPES = DENSE_TYPES + INTEGER_TYPES  # what a dense input takes: the metadata says FP32


def _tensor(name: str, datatype: str, shape: list) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape}


def model_metadata(name: str, version: int, prep: Preprocessing) -> dict:
    """The ``GET /v2/models/{name}`` object: inputs (``-1`` is a free size) and the output. An id column's datatype
    is its id type in the model (``INT64`` or ``BYTES``; both datatypes, and INT32, are read by that type)."""
    inputs = [_tensor(c, prep.id_types[c], [-1]) for c in prep.categorical]
    for c in prep.multi_hot:
        inputs += [_tensor(c, prep.id_types[c], [-1]), _tensor(c + LENGTHS, "INT32", [-1])]
    inputs += [_tensor(c, "FP32", [-1]) for c in prep.dense]
    return {"name": name, "versions": [str(version)], "platform": "dynemb_dlrm", "inputs": inputs,
            "outputs": [_tensor(OUTPUT, "FP64", [-1])]}


def _inputs_by_name(request: Any) -> dict:
    if not isinstance(request, dict):
        raise RequestError(f"the request must be a JSON object, got {type(request).__name__}")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError("the request must have a non-empty list 'inputs'")
    by_name = {}
    for i, t in enumerate(inputs):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RequestError(f"inputs[{i}] must be an object with a string 'name'")
        if t["name"] in by_name:
            raise RequestError(f"input {t['name']!r} is given twice")
        by_name[t["name"]] = t
    return by_name


def _size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _one_a_row(inputs: dict, names: list) -> dict:
    """``inputs`` with each of ``names`` (inputs of one value a row) given as ``[n, 1]`` read as ``[n]``: a Triton
    client sends each feature as a column ``[B, 1]`` of a batch. Nested JSON ``data`` (``[[v], [v], ...]``) is
    flattened. The request's own dicts are left as they are (copies replace them)."""
    out = inputs
    for name in names:
        t = inputs.get(name)
        shape = t.get("shape") if isinstance(t, dict) else None
        if not (isinstance(shape, list) and len(shape) == 2 and shape[1] == 1 and _size(shape[0])
                and not isinstance(shape[1], bool)):
            continue
        data = t.get("data")
        if isinstance(data, list) and data and all(isinstance(v, list) and len(v) == 1 for v in data):
            data = [v[0] for v in data]  # JSON nested by rows (simdjson reads numeric ones flat already)
        elif isinstance(data, np.ndarray) and data.ndim > 1:
            data = data.reshape(-1)
        if out is inputs:
            out = dict(inputs)
        out[name] = {**t, "shape": [shape[0]], "data": data}
    return out


def _data(t: dict, datatypes: tuple, rows: Optional[int], one_a_row: bool = True) -> list:
    """The flat data of input ``t``, checked against ``datatypes``, its shape and (when given) ``rows``;
    ``one_a_row``: an input of one value a row (an ``[n, 1]`` one was read as ``[n]`` by :func:`_one_a_row`)."""
    name, datatype, shape, data = t["name"], t.get("datatype"), t.get("shape"), t.get("data")
    if datatype not in datatypes:
        allowed = " or ".join([", ".join(datatypes[:-1]), datatypes[-1]] if len(datatypes) > 1 else datatypes)
        if datatypes == ID_TYPES:
            allowed = f"BYTES or an integer datatype ({', '.join(INTEGER_TYPES)})"
        elif datatypes == DENSE_INPUT_TYPES:
            allowed = f"FP32, FP64 or an integer datatype ({', '.join(INTEGER_TYPES)})"
        raise RequestError(f"input {name!r}: datatype must be {allowed}, got {datatype!r}")
    if not (isinstance(shape, list) and len(shape) == 1 and _size(shape[0])):
        if not one_a_row:
            raise RequestError(f"input {name!r}: shape must be [n], one size (all the rows' ids, concatenated), "
                               f"got {shape!r}")
        hint = ""
        if isinstance(shape, list) and len(shape) == 2 and shape[0] == 1 and _size(shape[1]):
            hint = " (a [1, n] row is not read as n rows: send [n] or [n, 1])"
        raise RequestError(f"input {name!r}: shape must be [n] or [n, 1], n rows of one value each, got "
                           f"{shape!r}{hint}")
    if not isinstance(data, (list, np.ndarray, pa.Array)):  # an ndarray, Arrow array: a binary tensor (parse_body)
        raise RequestError(f"input {name!r}: 'data' must be a JSON list")
    if len(data) != shape[0]:
        raise RequestError(f"input {name!r}: shape {shape} but {len(data)} values")
    if rows is not None and shape[0] != rows:
        raise RequestError(f"input {name!r}: {shape[0]} rows, but the batch has {rows}")
    return data


# What each datatype's values may be, as the Arrow types pyarrow infers for them (JSON null: the null type):
# one C pass checks every value's JSON type, where a typed conversion would turn 1.5 into 1 and true into 1.0.
_INTEGERS = tuple(pa.type_for_alias(t) for t in ("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16",
                                                   "uint8"))
# BYTES: JSON strings, or the bytes of a binary tensor as sent (binary_bytes: hashed as they are, UTF-8 or not)
_VALUES = {"BYTES": ("strings", (pa.string(), pa.large_binary(), pa.binary()), None),
           "FP32": ("numbers", (pa.int64(), pa.float64(), pa.float32()), pa.float64()),
           "FP64": ("numbers", (pa.int64(), pa.float64(), pa.float32()), pa.float64()),
           # any integer datatype: what a Parquet integer column is to the readers (UINT64 kept unsigned: ids
           # >= 2**63 are reinterpreted as int64 by the id rules, as a uint64 column's are)
           **{t: ("integers", _INTEGERS, pa.uint64() if t == "UINT64" else pa.int64()) for t in INTEGER_TYPES}}
_RANGES = {t: (int(np.iinfo(t.lower()).min), int(np.iinfo(t.lower()).max)) for t in INTEGER_TYPES}
_ARROW = {t: pa.type_for_alias(t.lower()) for t in INTEGER_TYPES}


def _array(t: dict, data) -> pa.Array:
    """``data`` of input ``t`` as an Arrow array of its datatype's type (nulls kept).

    Raises:
        RequestError: a value of another JSON type than the datatype's (a bool, a float for INT64, ...).
    """
    what, accepted, target = _VALUES[t["datatype"]]
    try:
        try:
            array = data if isinstance(data, pa.Array) else pa.array(data)
        except OverflowError:  # JSON integers past int64: UINT64 ids may be
            if t["datatype"] != "UINT64" or not isinstance(data, list) or bool in set(map(type, data)):
                raise
            array = pa.array(data, type=pa.uint64())
    except (TypeError, ValueError, OverflowError, pa.ArrowException) as exc:
        wrong = first_wrong_json(data, what)
        if wrong is not None:  # values of mixed JSON types: pyarrow's message names whichever it met second
            raise RequestError(f"input {t['name']!r}: {t['datatype']} values must be {what}, got {wrong}") from None
        raise RequestError(f"input {t['name']!r}: {t['datatype']} values must be {what} "
                           f"({str(exc).splitlines()[0]})") from None
    # pyarrow reads a bool after a float as 1.0 / 0.0 (after an int, it refuses it): one C-speed look at the types
    bad = array.type not in accepted or (array.type == pa.float64() and isinstance(data, list)
                                          and bool in set(map(type, data)))
    if array.type != pa.null() and bad:
        got = "bool" if array.type in accepted else str(array.type)
        raise RequestError(f"input {t['name']!r}: {t['datatype']} values must be {what}, got {got} values")
    limits = _RANGES.get(t["datatype"])
    if limits is not None and array.type != _ARROW[t["datatype"]] and len(array) > array.null_count:
        # values read wider than their datatype (JSON: as int64): within its range?
        low, high = (v.as_py() for v in pc.min_max(array).values())
        if low < limits[0] or high > limits[1]:
            raise RequestError(f"input {t['name']!r}: {t['datatype']} values must be in [{limits[0]}, {limits[1]}], "
                               f"got {low if low < limits[0] else high}")
    if target is None:  # BYTES: text or bytes as they came; all-null data as text, as the readers read it
        return array.cast(pa.string()) if array.type == pa.null() else array
    return array if array.type == target else array.cast(target)


def _column_ids(t: dict, array: pa.Array, column: str, id_type: str) -> np.ndarray:
    try:
        return categorical_ids(array, column, f"input {t['name']!r}", id_type)
    except (TypeError, ValueError, OverflowError, pa.ArrowException) as exc:  # the message names the input
        raise RequestError(str(exc).splitlines()[0]) from None


def _bag_ids(t: dict, lengths: np.ndarray, column: str, id_type: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [N], offsets [B + 1])`` of a multi-hot input: the readers' code, on a list array of its values."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    bags = pa.LargeListArray.from_arrays(pa.array(offsets), _array(t, _data(t, ID_TYPES, None, False)))
    try:
        return multi_hot_ids(bags, column, f"input {t['name']!r}", id_type)
    except (TypeError, ValueError, OverflowError, pa.ArrowException) as exc:  # the message names the input
        raise RequestError(str(exc).splitlines()[0]) from None


def _lengths(t: dict, rows: int, total: int, column: str) -> np.ndarray:
    array = _array(t, _data(t, ("INT32",), rows))
    lengths = array.to_numpy(zero_copy_only=False) if array.null_count == 0 else None
    if lengths is None or ((lengths < 0) | (lengths >= 2**31)).any():
        raise RequestError(f"input {t['name']!r}: lengths must be integers >= 0")
    if int(lengths.sum()) != total:
        raise RequestError(f"input {t['name']!r}: lengths sum to {int(lengths.sum())}, but input {column!r} "
                           f"has {total} ids")
    return lengths


def decode_request(request: Any, prep: Preprocessing, max_rows: int) -> Batch:
    """The batch of rows an infer request holds (dense values raw, a null as NaN; labels 0), its ids read by each
    column's id type in ``prep`` (module docstring), as the file readers read them.

    Raises:
        RequestError: a missing, unknown, mistyped or mis-sized input, an id that the column's type cannot read
            (text that is no integer for an ``INT64`` column), or more than ``max_rows`` rows; the message names
            the input.
    """
    inputs = _inputs_by_name(request)
    _check_outputs(request.get("outputs"))
    expected = [*prep.categorical, *prep.multi_hot, *(c + LENGTHS for c in prep.multi_hot), *prep.dense]
    check_input_names(inputs, expected, RequestError)
    per_row = [*prep.categorical, *(c + LENGTHS for c in prep.multi_hot), *prep.dense]
    inputs = _one_a_row(inputs, per_row)
    _check_row_counts(inputs, per_row)
    first = inputs[(prep.categorical or [c + LENGTHS for c in prep.multi_hot] or prep.dense)[0]]
    rows = len(_data(first, (first.get("datatype"),), None))
    if rows > max_rows:
        raise RequestError(f"input {first['name']!r}: {rows} rows, more than max_batch_size ({max_rows})")
    batch = _numeric_batch(inputs, prep, rows)
    if batch is not None:
        return batch
    one_hot = _one_hot_ids(inputs, prep.categorical, rows, prep.id_types)
    sparse = {c: torch.from_numpy(ids) for c, ids in one_hot.items()}
    offsets = {}
    for c in prep.multi_hot:
        lengths = _lengths(inputs[c + LENGTHS], rows, len(_data(inputs[c], ID_TYPES, None, False)), c)
        ids, bounds = _bag_ids(inputs[c], lengths, c, prep.id_types[c])
        sparse[c], offsets[c] = torch.from_numpy(ids), torch.from_numpy(bounds)
    dense = np.zeros((len(prep.dense), rows), dtype=np.float32)
    tensors = [inputs[c] for c in prep.dense]
    datas = [_data(t, DENSE_INPUT_TYPES, rows) for t in tensors]
    if tensors and all(t["datatype"] in DENSE_TYPES for t in tensors):
        values = _joined(tensors, datas)
        dense[:] = dense_values(values, f"input {prep.dense[0]!r}").reshape(len(prep.dense), rows)
    elif tensors:  # integer columns too: each read as `predict` reads a Parquet integer column (its float64s)
        for k, (t, d) in enumerate(zip(tensors, datas)):
            try:
                dense[k] = dense_values(_array(t, d), f"input {t['name']!r}")
            except RequestError:
                raise
            except ValueError as exc:  # an integer float64 cannot hold exactly (past 2**53), as predict refuses it
                raise RequestError(str(exc)) from None
    return Batch(torch.from_numpy(dense.T.copy()), sparse, torch.zeros(rows), offsets)


def _check_row_counts(inputs: dict, names: list) -> None:
    """Inputs of one value a row must agree on the rows: the error names the input that differs from most of the
    others (a client that sends one short column is told which), with both counts."""
    counts = {n: s[0] for n in names if isinstance(s := inputs[n].get("shape"), list) and len(s) == 1
              and isinstance(s[0], int)}
    sizes = list(counts.values())
    if len(set(sizes)) > 1:
        common = max(sizes, key=sizes.count)  # ties: the first input's count
        odd = next(n for n, c in counts.items() if c != common)
        data = inputs[odd].get("data")
        if isinstance(data, (list, np.ndarray, pa.Array)) and len(data) != counts[odd]:
            # its shape is what disagrees with its own data (a client's typo in one shape): say that first
            raise RequestError(f"input {odd!r}: shape {inputs[odd]['shape']} but {len(data)} values")
        others = sizes.count(common)
        raise RequestError(f"input {odd!r}: {counts[odd]} rows, but {others} other input{'s' * (others > 1)} "
                           f"({', '.join(repr(n) for n, c in counts.items() if c == common)[:200]}) "
                           f"{'have' if others > 1 else 'has'} {common}")


def _numeric_batch(inputs: dict, prep: Preprocessing, rows: int) -> Optional[Batch]:
    """The batch of a request whose inputs are all numpy arrays of ``rows`` values, INT64 ids (from JSON or
    binary tensors) of ``INT64`` columns and FP32/FP64 dense values, built in a few numpy calls; ``None`` for any
    other request, which the general path reads (and checks, naming the input). Both give the same batch: an
    int64 id is itself, a dense value is its float32 (NaN and ``±inf`` kept for the dense rule)."""
    if prep.multi_hot or any(prep.id_types[c] != "INT64" for c in prep.categorical):
        return None
    ids, dense = [], []
    for names, datatypes, out in ((prep.categorical, ("INT64",), ids), (prep.dense, DENSE_TYPES, dense)):
        for c in names:
            t = inputs[c]
            data = t.get("data")
            if not (isinstance(data, np.ndarray) and t.get("datatype") in datatypes and t.get("shape") == [rows]
                    and data.shape == (rows,) and data.dtype.kind == ("i" if out is ids else "f")):
                return None
            out.append(data)
    sparse = {}
    if ids:
        stacked = np.stack(ids).astype(np.int64, copy=False)
        sparse = {c: torch.from_numpy(stacked[k]) for k, c in enumerate(prep.categorical)}
    values = np.zeros((rows, len(prep.dense)), dtype=np.float32)
    if dense:
        with np.errstate(over="ignore"):  # an FP64 value beyond float32 is inf, as the general path reads it
            values[:] = np.stack(dense, axis=1)
    return Batch(torch.from_numpy(values), sparse, torch.zeros(rows), {})


def _check_outputs(outputs: Any) -> None:
    """The request's ``outputs`` (optional): each one asked for must be one this model has."""
    if outputs is None:
        return
    if not isinstance(outputs, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                for o in outputs):
        raise RequestError(f"'outputs' must be a list of objects with a string 'name', got {outputs!r}"[:300])
    for o in outputs:
        if o["name"] != OUTPUT:
            raise RequestError(f"output {o['name']!r} is not an output of this model (it has [{OUTPUT!r}])")


def _joined(tensors: list, datas: list) -> pa.Array:
    """The values of inputs of one datatype, end to end, as one Arrow array: one conversion for all of them
    (a per-input one costs more than its values on a request of a few hundred rows). A bad value is looked for
    input by input, so the error names its input."""
    if all(isinstance(d, np.ndarray) for d in datas) and len({d.dtype for d in datas}) == 1:
        return _array(tensors[0], np.concatenate(datas))  # binary tensors of one dtype: nothing to look for
    if any(isinstance(d, np.ndarray) for d in datas):
        return pa.concat_arrays([_array(t, d) for t, d in zip(tensors, datas)])
    try:
        return _array({"name": tensors[0]["name"], "datatype": tensors[0]["datatype"]},
                      list(itertools.chain.from_iterable(datas)))
    except RequestError:
        for t, d in zip(tensors, datas):
            _array(t, d)
        raise


def _one_hot_ids(inputs: dict, columns: tuple, rows: int, id_types: dict) -> dict[str, np.ndarray]:
    """int64 ids ``[rows]`` of each one-hot column (see :func:`~dynemb.data.arrow_columns.categorical_ids`)."""
    datas = {c: _data(inputs[c], ID_TYPES, rows) for c in columns}
    out = {}
    for datatype, id_type in itertools.product(ID_TYPES, ("INT64", "BYTES")):
        group = [c for c in columns if inputs[c]["datatype"] == datatype and id_types[c] == id_type]
        if not group:
            continue
        joined = _joined([inputs[c] for c in group], [datas[c] for c in group])
        ids = None
        if not joined.null_count:  # no null: the column name plays no part, so one conversion for the group
            try:
                ids = _column_ids(inputs[group[0]], joined, group[0], id_type).reshape(len(group), rows)
            except RequestError:
                pass  # read again column by column, for the message to name the value's own input and row
        for k, c in enumerate(group):  # nulls get their column's own key
            out[c] = ids[k] if ids is not None else _column_ids(inputs[c], joined.slice(k * rows, rows), c, id_type)
    return out


def encode_response(name: str, version: int, request: dict, probabilities: torch.Tensor) -> dict:
    """The infer response: ``probability`` FP64 ``[B]``, with the request's ``id`` when it had one."""
    out = {"model_name": name, "model_version": str(version),
           "outputs": [{**_tensor(OUTPUT, "FP64", [probabilities.numel()]), "data": probabilities.tolist()}]}
    if isinstance(request, dict) and "id" in request:
        out["id"] = request["id"]
    return out
