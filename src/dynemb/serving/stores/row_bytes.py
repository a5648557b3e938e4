"""Keys and rows as bytes: the binary encoding shared by the out-of-process stores (Redis, RocksDB, LMDB).

A key is 8 bytes big-endian with the sign bit flipped, so byte order equals numeric order (``int64 min`` encodes
as all zeros); it follows a per-table (and per-shard) byte prefix. A row is the raw little-endian bytes of its
``D`` values. Conversions run through numpy ``void`` views, so building ``N`` byte strings costs one C loop, not a
Python loop over keys.
"""

from __future__ import annotations

import numpy as np
import torch

from ...checkpoint.tensorfile import byte_view
from .store import StoreCorruptError, TableSchema

__all__ = ["encode_keys", "decode_keys", "encode_rows", "decode_rows", "sort_keys", "unsort"]

_SIGN = np.uint64(1 << 63)


def encode_keys(keys: torch.Tensor, prefixes: np.ndarray, which: np.ndarray | None = None) -> list[bytes]:
    """``prefix + 8-byte key`` for each key.

    Args:
        keys: ``[N]`` int64 CPU tensor.
        prefixes: ``[P]`` uint8 (one prefix for all keys) or ``[S, P]`` uint8 (one per group).
        which: ``[N]`` group index of each key into ``prefixes`` when it is 2-D.

    Returns:
        ``N`` byte strings of length ``P + 8``.
    """
    n = keys.numel()
    flipped = keys.numpy().view(np.uint64) ^ _SIGN
    p = prefixes.shape[-1]
    out = np.empty((n, p + 8), dtype=np.uint8)
    out[:, :p] = prefixes if which is None else prefixes[which]
    out[:, p:] = flipped.astype(">u8").view(np.uint8).reshape(n, 8)
    return out.view(f"V{p + 8}").reshape(n).tolist()


def decode_keys(blobs: list[bytes]) -> torch.Tensor:
    """``[N]`` int64 keys from ``N`` 8-byte encoded keys without prefix (inverse of ``encode_keys``)."""
    flipped = np.frombuffer(b"".join(blobs), dtype=">u8").astype(np.uint64) ^ _SIGN
    return torch.from_numpy(flipped.view(np.int64).copy())


def encode_rows(values: torch.Tensor) -> list[bytes]:
    """One byte string per row of a contiguous ``[N, D]`` CPU tensor."""
    n = values.shape[0]
    raw = byte_view(values).numpy()
    return raw.view(f"V{raw.shape[1]}").reshape(n).tolist()


def decode_rows(blobs: list, schema: TableSchema, keys: list[bytes] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows from byte strings, with ``None`` for missing rows (returned as zeros, ``found`` False).

    Args:
        blobs: ``N`` items, each ``bytes`` (or a buffer) of ``schema.row_bytes``, or ``None``.
        schema: the table's schema.
        keys: the encoded keys, only used to name a corrupt row.

    Returns:
        ``(values [N, D], found [N] bool)``.

    Raises:
        StoreCorruptError: a row has another length than ``schema.row_bytes``.
    """
    n, width = len(blobs), schema.row_bytes
    items = np.empty(n, dtype=object)
    items[:] = blobs
    found = np.not_equal(items, None)
    items[~found] = bytes(width)
    joined = bytearray().join(items.tolist())
    if len(joined) != n * width:
        _raise_corrupt(items, width, schema, keys)
    raw = torch.frombuffer(joined, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)  # it refuses b""
    values = raw.view(schema.dtype).view(n, schema.dim)
    return values, torch.from_numpy(found.astype(np.bool_))


def _raise_corrupt(items: np.ndarray, width: int, schema: TableSchema, keys: list[bytes] | None) -> None:
    lengths = np.fromiter(map(len, items.tolist()), dtype=np.int64, count=items.size)
    bad = int(np.flatnonzero(lengths != width)[0])
    where = f"key {decode_keys([keys[bad][-8:]]).item()}" if keys is not None else f"position {bad}"
    raise StoreCorruptError(f"stored row for {where} has {lengths[bad]} bytes; the table's {schema} needs {width}")


def sort_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys in ascending order, order)``: sorted batches read faster from B-trees and LSM trees."""
    order = torch.from_numpy(np.argsort(keys.numpy()))
    return keys.index_select(0, order), order


def unsort(sorted_values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Put rows computed for ``keys[order]`` back at the positions of ``keys``."""
    return sorted_values.new_empty(sorted_values.shape).index_copy_(0, order, sorted_values)
