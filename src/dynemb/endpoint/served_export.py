"""``dynemb serve --export DIR``: a model written by :func:`dynemb.serving.export_model`, on the endpoint.

The model's inputs are the tensors its example inputs flattened into, named as the export names them (see
``export_model``: ``dense``, ``features_values``, ``features_lengths``, ...), each with its datatype and shape
(``-1``: any size) in the model metadata; a request gives every one of them, with that datatype and rank and
the fixed sizes of its shape. Outputs are the program's (``output``, or one per output path). Relations between
sizes (a ``KeyedJaggedTensor``'s lengths being features x batch rows) are checked by the program: a request that
breaks one gets a 400 that names the inputs.

Requests are not joined into one forward pass (a jagged input cannot be concatenated row-wise): each runs alone.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import numpy as np
import torch

from ..serving import ExportedModel
from ..serving.exported_model import check_input_names
from .inference_protocol import _inputs_by_name
from .model import newest_version
from .wire import RequestError, first_wrong_json

_JSON_OK = {"b": {bool}, "i": {int}, "u": {int}, "f": {int, float}}
"""The Python types of JSON values an input of each numpy kind takes (no bool as a number, no null)."""

__all__ = ["ServedExport", "PLATFORM"]

PLATFORM = "dynemb_torch_export"
_DATATYPES = {"int64": "INT64", "int32": "INT32", "int16": "INT16", "int8": "INT8", "uint8": "UINT8",
              "float64": "FP64", "float32": "FP32", "float16": "FP16", "bool": "BOOL"}
_NUMPY = {"INT64": np.int64, "INT32": np.int32, "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8,
          "FP64": np.float64, "FP32": np.float32, "FP16": np.float16, "BOOL": np.bool_}


# Integer datatypes an integer input also takes, widened without loss (as a collection takes ids of a narrower
# integer dtype): Triton clients often send INT32 ids to a model traced with int64 ones.
_NARROWER = {"INT64": ("INT32", "INT16", "INT8", "UINT8"), "INT32": ("INT16", "INT8", "UINT8"),
             "INT16": ("INT8", "UINT8")}


def _datatype(dtype: str) -> str:
    try:
        return _DATATYPES[dtype]
    except KeyError:
        raise TypeError(f"no Open Inference Protocol datatype for an input or output of dtype {dtype}") from None


class _Request:
    """One request's tensors by input name; ``len()`` is its rows (dim 0 of the model's batch input)."""

    def __init__(self, tensors: dict, rows: int) -> None:
        self.tensors, self.rows = tensors, rows

    def __len__(self) -> int:
        return self.rows


class ServedExport(ExportedModel):
    """An :class:`~dynemb.serving.ExportedModel` with the endpoint's :class:`~dynemb.endpoint.service.Servable`
    methods (metadata, request decoding, inference) and what ``--watch`` and ``/metrics`` read."""

    joins_batches = False  # see the module docstring

    def metadata(self) -> dict:
        tensor = lambda t: {"name": t["name"], "datatype": _datatype(t["dtype"]), "shape": t["shape"]}  # noqa: E731
        return {"platform": PLATFORM, "inputs": [tensor(t) for t in self.inputs],
                "outputs": [tensor(t) for t in self.outputs]}

    def decode_request(self, request: Any, max_rows: int) -> _Request:
        """The tensors of an infer request, each checked against the model's input of its name.

        Raises:
            RequestError: a missing, unknown, mistyped or mis-shaped input, or more than ``max_rows`` rows; the
                message names the input.
        """
        given = _inputs_by_name(request)
        names = [t["name"] for t in self.inputs]
        check_input_names(given, names, RequestError)
        outputs = [t["name"] for t in self.outputs]
        for o in request.get("outputs") or []:
            if not isinstance(o, dict) or o.get("name") not in outputs:
                raise RequestError(f"output {o.get('name') if isinstance(o, dict) else o!r} is not an output of "
                                   f"this model (it has {outputs})")
        tensors = {spec["name"]: _tensor(given[spec["name"]], spec) for spec in self.inputs}
        return _Request(tensors, self._rows(tensors, max_rows))

    def _rows(self, tensors: dict, max_rows: int) -> int:
        """A request's rows, from the input that gives them (the batch rule of the export: its dim 0, divided by
        the keys of a ``KeyedJaggedTensor``'s lengths); a RequestError when they are more than ``max_rows``."""
        batch, divisor = self.program.batch_input, self.program.batch_divisor
        if batch is None:
            return 1
        size = int(tensors[batch].shape[0])
        rows = size // divisor
        if rows > max_rows:
            given = f"{rows} rows" if divisor == 1 else \
                f"{size} lengths, {rows} rows of {divisor} keys (a KeyedJaggedTensor's lengths are keys x rows)"
            raise RequestError(f"input {batch!r}: {given}, more than max_batch_size ({max_rows})")
        return rows

    @staticmethod
    def join(batches: list):
        raise NotImplementedError("requests to an exported model are not joined (joins_batches is False)")

    def infer(self, batch: _Request) -> tuple[dict, int]:
        """``({output: tensor}, the version that computed them)``."""
        return self(batch.tensors)

    def table_stats(self) -> dict:
        return self.ps.stats(self.name)

    def newest_version(self) -> Optional[tuple[int, float]]:
        return newest_version(self.export)


def _tensor(t: dict, spec: dict) -> torch.Tensor:
    """Input ``t`` of a request as a tensor of ``spec``'s dtype and shape."""
    name, want = spec["name"], _datatype(spec["dtype"])
    datatype, shape, data = t.get("datatype"), t.get("shape"), t.get("data")
    if datatype != want and datatype not in _NARROWER.get(want, ()):
        also = f" (or the narrower {', '.join(_NARROWER[want])})" if want in _NARROWER else ""
        raise RequestError(f"input {name!r}: datatype must be {want}{also}, got {datatype!r}")
    expected = spec["shape"]
    if len(expected) == 1 and isinstance(shape, list) and len(shape) == 2 and shape[1] == 1 \
            and not isinstance(shape[1], bool):
        shape = shape[:1]  # a column [n, 1], as Triton clients send each feature: read as [n]
    if not (isinstance(shape, list) and len(shape) == len(expected)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        if len(expected) == 1:  # what the CLI models' inputs say: both forms taken, and why [1, n] is not
            row = isinstance(shape, list) and len(shape) == 2 and shape[0] == 1
            raise RequestError(f"input {name!r}: shape must be [n] or a column [n, 1], n >= 0 (the model's shape is "
                               f"{expected}, -1: any size), got {shape!r}"
                               + (" (a [1, n] row is not read as n values: send [n])" if row else ""))
        raise RequestError(f"input {name!r}: shape must be {len(expected)} sizes >= 0 (the model's shape is "
                           f"{expected}, -1: any size), got {shape!r}")
    fixed = [(i, e) for i, (d, e) in enumerate(zip(shape, expected)) if e != -1 and d != e]
    if fixed:
        raise RequestError(f"input {name!r}: shape {shape}, but size {fixed[0][0]} must be {fixed[0][1]} "
                           f"(the model's shape is {expected})")
    if not isinstance(data, (list, np.ndarray)):
        raise RequestError(f"input {name!r}: 'data' must be a JSON list or a binary tensor")
    kind = np.dtype(_NUMPY[want]).kind
    if isinstance(data, list):
        # numpy reads a bool among integers as 0/1 and a null as an object: JSON types are checked first (one
        # C-speed look; the Python walk of first_wrong_json only on an error)
        what = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers"}[kind]
        flat = data
        while flat and all(isinstance(row, list) for row in flat):
            flat = list(itertools.chain.from_iterable(flat))
        if not set(map(type, flat)) <= _JSON_OK[kind]:
            wrong = first_wrong_json(data, what, null=False)
            if wrong is not None:
                raise RequestError(f"input {name!r}: {want} values must be {what}, got {wrong}")
        try:
            array = np.asarray(data)
        except ValueError:
            raise RequestError(f"input {name!r}: 'data' must be a flat list of numbers (or nested lists of "
                               "equal lengths)") from None
        accepted = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}[kind] if array.size else array.dtype.kind
        if array.dtype.kind not in accepted:
            what = {"b": "booleans", "i": "integers", "u": "integers", "f": "numbers"}[kind]
            raise RequestError(f"input {name!r}: {want} values must be {what}, got {array.dtype.kind!r} "
                               f"({array.dtype}) values")
    else:
        array = data
    count = int(np.prod(shape, dtype=np.int64))
    if array.size != count:
        raise RequestError(f"input {name!r}: shape {shape} holds {count} values, got {array.size}")
    with np.errstate(over="ignore"):
        converted = np.array(array, dtype=_NUMPY[want]).reshape(shape)
    if kind in "iu" and array.dtype != converted.dtype and not np.array_equal(converted, array.reshape(shape)):
        raise RequestError(f"input {name!r}: values out of the range of {want}")
    return torch.from_numpy(converted)
