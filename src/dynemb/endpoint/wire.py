"""An infer request's body as Python objects: JSON (simdjson, orjson) or JSON plus binary tensors.

Numeric tensor data arrives as numpy arrays where it can (binary tensors; JSON ``data`` whose values are all of
the datatype's JSON type), so that no Python object is made per value; anything else stays as JSON reads it, for
:func:`~dynemb.endpoint.inference_protocol.decode_request` to check and name.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Optional

import numpy as np

try:  # 3x faster than json on a request of a few hundred rows; the endpoint works without it
    from orjson import dumps as dumps_json, loads as _loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads

    def dumps_json(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

try:  # numeric `data` arrays straight into numpy, no Python object per value: 0.3 ms for a request orjson + Arrow
    import simdjson  # take 1 ms over (256 rows x 39 columns, after a forward pass cooled the caches)
except ImportError:  # pragma: no cover - depends on the environment
    simdjson = None

__all__ = ["RequestError", "parse_body", "dumps_json", "binary_bytes", "NUMPY_DTYPES"]


class RequestError(ValueError):
    """A request the model cannot score; the message names the input. Answered with HTTP 400."""


NUMPY_DTYPES = {"INT64": "<i8", "INT32": "<i4", "FP32": "<f4", "FP64": "<f8",
                "BOOL": "|u1",  # read as bytes: a byte other than 0 is True once cast, never an invalid bool
                "INT16": "<i2", "INT8": "|i1", "UINT64": "<u8", "UINT32": "<u4", "UINT16": "<u2", "UINT8": "|u1",
                "FP16": "<f2"}
"""The datatypes read into numpy arrays (binary tensors, gRPC raw contents), as their little-endian dtypes: what a
datatype is good for is the model's to say."""


_JSON_TYPES = {"strings": (str, bytes), "numbers": (int, float), "integers": (int,), "booleans": (bool,)}


def first_wrong_json(data, what: str, null: bool = True) -> Optional[str]:
    """The first value of JSON ``data`` (a list, nested lists read row-major) that is not one of ``what``
    (``"strings"``, ``"numbers"``, ``"integers"``, ``"booleans"``; a bool is none but the last), or a null where
    ``null`` is False, said as ``"number 7 at position 0"``; None when every value is one (or ``data`` is no
    list). Error paths only: it walks the values in Python."""
    if not isinstance(data, list):
        return None
    while data and all(isinstance(row, list) for row in data):
        data = list(itertools.chain.from_iterable(data))
    ok = _JSON_TYPES[what]
    for at, value in enumerate(data):
        if value is None:
            if null:
                continue
        elif isinstance(value, ok) and (what == "booleans" or not isinstance(value, bool)):
            continue
        kind = "null" if value is None else {bool: "bool", list: "list", dict: "object", int: "number",
                                             float: "number"}.get(type(value), "string")
        shown = "" if value is None else " " + (repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "...")
        return f"{kind}{shown} at position {at}"
    return None


def parse_body(body: bytes, json_length: Optional[int] = None) -> Any:
    """The request object of an infer body: JSON, or with the binary tensor extension (``json_length`` from the
    ``Inference-Header-Content-Length`` header) JSON followed by the raw tensors, whose ``data`` is filled in here.

    Raises:
        RequestError: the body is not JSON, a binary tensor does not fit the body, or bytes follow the last one.
    """
    head = body if json_length is None else body[:json_length]
    if json_length is None and simdjson is not None:
        request = _parse_json(head)
        if request is not _UNREAD:
            return request
    try:
        request = _loads(head)
    except (ValueError, UnicodeDecodeError) as exc:
        request = _loads_non_finite(head, exc)
    if json_length is None or not isinstance(request, dict) or not isinstance(request.get("inputs"), list):
        return request
    at = json_length
    for t in request["inputs"]:
        size = (t.get("parameters") or {}).get("binary_data_size") if isinstance(t, dict) else None
        if size is None:
            continue
        name = t.get("name")
        if not isinstance(size, int) or size < 0 or at + size > len(body):
            raise RequestError(f"input {name!r}: binary_data_size {size!r} does not fit the body")
        raw, at = body[at:at + size], at + size
        if t.get("datatype") == "BYTES":
            t["data"] = binary_bytes(raw, name)
        elif t.get("datatype") not in NUMPY_DTYPES:
            raise RequestError(f"input {name!r}: datatype {t.get('datatype')!r} is none this server reads "
                               f"({', '.join(['BYTES', *NUMPY_DTYPES])})")
        elif size % np.dtype(NUMPY_DTYPES[t["datatype"]]).itemsize:
            raise RequestError(f"input {name!r}: binary_data_size {size} is not a whole number of "
                               f"{t['datatype']} values")
        else:
            t["data"] = np.frombuffer(raw, dtype=NUMPY_DTYPES[t["datatype"]])  # no Python objects per value
    if at != len(body):  # bytes no input claims: a binary_data_size short of its tensor, most likely
        raise RequestError(f"the body has {len(body) - at} bytes after the JSON part and the inputs' binary data "
                           f"({json_length} + the binary_data_size of each input = {at} of {len(body)} bytes): each "
                           "binary input's binary_data_size must be its tensor's bytes")
    return request


def _loads_non_finite(text: bytes, error: Exception) -> Any:
    """JSON with the bare ``NaN``, ``Infinity`` and ``-Infinity`` tokens that JSON lacks but many writers emit
    (tritonclient's JSON mode among them), or with a number past float64, read by the standard library, which
    takes them as floats (1e400: inf): the values then meet the model's rules for non-finite values like any
    other. Text that is not JSON even so raises a RequestError with ``error``, the fast parser's reason."""
    # a number past float64 (1e400) is JSON too, which the fast parsers refuse: read as +-inf, as Python reads it
    past_float64 = "infinity when parsed" in str(error)
    if not past_float64 and not any(token in text for token in (b"NaN", b"Infinity")):
        raise RequestError(f"the request body is not valid JSON ({error})")
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError):
        raise RequestError(f"the request body is not valid JSON ({error})") from None


_BUFFER = {"INT64": ("i", np.int64), "INT32": ("i", np.int64), "FP32": ("d", np.float64), "FP64": ("d", np.float64)}


_UNREAD = object()


def _python(value):
    """A simdjson value as Python objects (what ``json.loads`` gives)."""
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    return value.as_list() if isinstance(value, simdjson.Array) else value


def _data(data, kind: Optional[tuple]):
    """An input's ``data``: a numpy array when ``kind`` (buffer type, dtype) reads every value, else as JSON."""
    if kind is None or not isinstance(data, simdjson.Array):
        return _python(data)
    try:
        return np.frombuffer(data.as_buffer(of_type=kind[0]), dtype=kind[1])
    except (TypeError, ValueError):  # a value of another type, a null, out of range: checked as a list
        return data.as_list()


def _parse_json(text: bytes) -> Any:
    """A JSON request as :func:`json.loads` reads it, except that the ``data`` of a numeric input whose values
    are all of its datatype's JSON type (integers; numbers) is a numpy array (int64; float64), as binary tensors
    are. Any other ``data`` stays a list, for the checks of :func:`decode_request` to name what is wrong with it.
    A nested ``data`` array is read flat, in row-major order, as the protocol allows. ``_UNREAD`` when simdjson
    cannot read the text (invalid JSON, an integer past 64 bits): the plain parser then reads it, or says why not."""
    parser = simdjson.Parser()
    try:
        doc = parser.parse(text)
    except (ValueError, RuntimeError):  # not JSON, or integers past 64 bits: the plain parser says which
        return _UNREAD
    if not (isinstance(doc, simdjson.Object) and isinstance(doc.get("inputs"), simdjson.Array)):
        return _python(doc)
    request = {key: _python(doc[key]) for key in doc.keys() if key != "inputs"}
    request["inputs"] = inputs = []
    for t in doc["inputs"]:
        if not isinstance(t, simdjson.Object):
            inputs.append(_python(t))
            continue
        item = {key: _python(t[key]) for key in t.keys() if key != "data"}
        if "data" in t:
            item["data"] = _data(t["data"], _BUFFER.get(item.get("datatype")))
        inputs.append(item)
    return request


def binary_bytes(raw: bytes, name):
    """BYTES elements of the binary extension (each a 4-byte little-endian length, then the bytes) as an Arrow
    binary array, split by one numba pass (no Python object an element). The bytes are kept as sent, UTF-8 text or
    not: an id column hashes them as they are, as ``dynemb predict`` hashes a binary Parquet column.

    Raises:
        RequestError: an element runs past the end of the tensor (the message names the input and the offset).
    """
    import pyarrow as pa

    from ..kernels.numba_hash import split_length_prefixed

    split = split_length_prefixed(np.frombuffer(raw, np.uint8))
    if not isinstance(split, tuple):
        raise RequestError(f"input {name!r}: truncated binary BYTES element at byte {split} of {len(raw)}")
    offsets, data = split
    return pa.Array.from_buffers(pa.large_binary(), len(offsets) - 1,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(data)])
