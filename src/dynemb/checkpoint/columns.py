"""The tensors of a shard file: their names, and :func:`check_shard`, which checks them against the table config.

Below :mod:`.tables` (how tables become these tensors) and :mod:`.stream` (how a tiered table's rows stream to and
from them), which both read them.
"""

from __future__ import annotations

from .errors import CheckpointError

__all__ = ["KEYS", "VALUES", "SCORES", "DELETED", "ORDER", "SLOT", "ADMISSION_KEYS", "ADMISSION_COUNTS", "check_shard"]

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
    expected = {KEYS: (config["key_dtype"], [n]), VALUES: (config["dtype"], [n, config["dim"]]),
                SCORES: ("torch.int64", [n])}
    expected.update({SLOT + s: (spec["dtype"], [n, spec["dim"]]) for s, spec in config["slots"].items()})
    if ADMISSION_KEYS in cols or ADMISSION_COUNTS in cols:
        m = len(cols.get(ADMISSION_KEYS, ()))
        expected.update({ADMISSION_KEYS: (config["key_dtype"], [m]), ADMISSION_COUNTS: ("torch.int64", [m])})
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
        if str(got.dtype) != dtype or list(got.shape) != shape:
            raise CheckpointError(f"{file}: tensor {name!r} is {got.dtype} {list(got.shape)}, expected {dtype} {shape}")
    return n
