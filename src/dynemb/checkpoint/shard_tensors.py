"""The tensors of a shard file: their names, and :func:`check_shard`, which checks them against the table config.

Below :mod:`.tables` (how tables become these tensors) and :mod:`.tiered_stream` (how a tiered table's rows
stream to and from them), which both read them.
"""

from __future__ import annotations

from ..serialization import canonical_dtype, lookup, type_name
from .errors import CheckpointError

__all__ = ["KEYS", "VALUES", "SCORES", "DELETED", "ORDER", "SLOT", "ADMISSION_KEYS", "ADMISSION_COUNTS", "check_shard",
           "canonical_config"]

KEYS, VALUES, SCORES, DELETED, ORDER, SLOT = "keys", "values", "scores", "deleted_keys", "order", "slot."
ADMISSION_KEYS, ADMISSION_COUNTS = "admission.keys", "admission.counts"


def check_shard(cols: dict, config: dict, file, *, delta: bool) -> int:
    """Check names, dtypes and shapes of a shard's tensors against the table config; returns its row count.

    Raises:
        CheckpointError: naming ``file`` and the tensor.
    """
    if KEYS not in cols or cols[KEYS].dim() != 1:
        raise CheckpointError(f"{file}: tensor 'keys' is missing or not 1-D")
    n = cols[KEYS].shape[0]
    config = canonical_config(config)
    expected = {KEYS: (config["key_dtype"], [n]), VALUES: (config["dtype"], [n, config["dim"]]),
                SCORES: ("int64", [n])}
    expected.update({SLOT + s: (spec["dtype"], [n, spec["dim"]]) for s, spec in config["slots"].items()})
    if ADMISSION_KEYS in cols or ADMISSION_COUNTS in cols:
        m = len(cols.get(ADMISSION_KEYS, ()))
        expected.update({ADMISSION_KEYS: (config["key_dtype"], [m]), ADMISSION_COUNTS: ("int64", [m])})
    if delta:
        expected[DELETED] = (config["key_dtype"], [len(cols.get(DELETED, ()))])
        if ORDER in cols:
            expected[ORDER] = (config["key_dtype"], [len(cols[ORDER])])
    for name in sorted(set(cols) | set(expected)):
        if name not in expected:
            raise CheckpointError(f"{file}: unexpected tensor {name!r}")
        if name not in cols:
            raise CheckpointError(f"{file}: tensor {name!r} is missing")
        got, (dtype, shape) = cols[name], expected[name]
        if canonical_dtype(got.dtype) != dtype or list(got.shape) != shape:
            raise CheckpointError(f"{file}: tensor {name!r} is {canonical_dtype(got.dtype)} {list(got.shape)}, "
                                  f"expected {dtype} {shape}")
    return n


def canonical_config(config: dict) -> dict:
    """A saved table config (a manifest's ``config``, or an export entry) as this dynemb writes it, for comparing.

    The reader of the older shape: manifests of format version 2 wrote dtypes as ``str(dtype)``
    (``"torch.float32"``) and named initializers by class (``{"type": "Uniform", ...}``); both become today's
    names (``"float32"``, ``"uniform"``). Values that name nothing known are kept as they are, for the comparison
    to report.
    """
    if not isinstance(config, dict):
        return config
    out = dict(config)
    for field in ("dtype", "key_dtype"):
        if field in out:
            out[field] = canonical_dtype(out[field])
    if isinstance(out.get("slots"), dict):
        out["slots"] = {n: {**s, "dtype": canonical_dtype(s.get("dtype"))} if isinstance(s, dict) else s
                        for n, s in out["slots"].items()}
    for field in ("initializer", "admission"):
        record = out.get(field)
        if isinstance(record, dict) and lookup(record.get("type")) is not None:
            out[field] = {**record, "type": type_name(lookup(record["type"]))}
    return out
