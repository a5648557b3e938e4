"""Streaming safetensors files, hashed with sha256 while the bytes move.

The layout is standard safetensors (8-byte little-endian header length, a JSON header, then the tensors' bytes
back to back), so ``safetensors.safe_open`` reads these files too. We stream them ourselves because the library
cannot hash while it writes or reads, and a checksum would cost a second pass over every file: here bytes go
between the tensor's memory and the file in chunks, device tensors are copied a chunk at a time, and a helper
thread hashes the chunks while the I/O goes on (both release the GIL).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from .errors import CheckpointError

__all__ = ["FileRecord", "write_tensors", "read_tensors", "verify_file", "file_sha256", "byte_view", "CHUNK_BYTES"]

CHUNK_BYTES = 32 << 20
_HASH_BYTES = 4 << 20  # file_sha256's read buffer
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

OnBytes = Callable[[int], object]


class FileRecord(NamedTuple):
    """What a manifest keeps about a file: its sha256 (hex) and size in bytes."""

    sha256: str
    bytes: int


class _Malformed(Exception):
    """The file is not a well-formed safetensors file (reported with its checksum status)."""


class _Digest:
    """sha256 computed in order by one helper thread that trails the I/O: a file is written (or read) at full speed
    while hashing catches up, and the fsync ending a write overlaps the rest of the hashing. Only chunks copied off
    a device are waited for, to bound the memory they hold; other chunks are views of tensors that outlive us."""

    MAX_COPIES_IN_FLIGHT = 4

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._pool = ThreadPoolExecutor(1)
        self._last: Future | None = None
        self._copies: deque[Future] = deque()

    def feed(self, chunk: memoryview, copied: bool = False) -> None:
        self._last = self._pool.submit(self._sha.update, chunk)
        if copied:
            self._copies.append(self._last)
            while len(self._copies) > self.MAX_COPIES_IN_FLIGHT:
                self._copies.popleft().result()

    def hexdigest(self) -> str:
        if self._last is not None:
            self._last.result()
        return self._sha.hexdigest()

    def __enter__(self) -> _Digest:
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=True)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of CPU tensor ``t`` in row-major order, as a uint8 tensor (a view when ``t``'s memory is dense).

    ``Tensor.contiguous()`` is not enough: torch calls a tensor whose dims of size 1 have any stride contiguous,
    so a one-element column of an interleaved table (stride 2) comes back as it was, and a dtype view refuses it.

    Shape: ``[*S, K]`` -> ``[*S, K * element_size]``; a 0-d tensor -> ``[element_size]``.

    Example:
        >>> byte_view(torch.arange(4).reshape(2, 2)[:1, 0]).tolist()
        [0, 0, 0, 0, 0, 0, 0, 0]
        >>> byte_view(torch.tensor(1.0)).tolist()
        [0, 0, 128, 63]
    """
    if t.dim() == 0:  # a dtype view needs a dim to widen
        t = t.reshape(1)
    if t.stride(-1) != 1 or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(torch.uint8)


def _byte_chunks(t) -> Iterator[tuple[memoryview, bool]]:
    """``(bytes, copied)`` chunks of a tensor: views of contiguous CPU memory, or copies (device memory, strided
    columns such as a table's interleaved scores). A streamed column (``pieces()``, see
    :mod:`dynemb.checkpoint.tiered_stream`) is the chunks of its pieces, each counted as a copy so that the digest
    bounds how many it holds."""
    if hasattr(t, "pieces"):
        for piece in t.pieces():
            for chunk, _ in _byte_chunks(piece):
                yield chunk, True
        return
    flat = t.detach().reshape(-1)
    step = max(1, CHUNK_BYTES // max(1, t.element_size()))
    for start in range(0, flat.numel(), step):
        piece = flat[start : start + step]
        copied = piece.device.type != "cpu" or not piece.is_contiguous()
        yield memoryview(byte_view(piece.cpu()).numpy()), copied


def _check(name: str, t) -> None:
    if hasattr(t, "pieces") and t.dtype in _CODES:
        return
    if not isinstance(t, torch.Tensor) or t.dtype not in _CODES or t.layout != torch.strided:
        got = f"{t.dtype} {t.layout}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"tensor {name!r} must be a dense tensor of dtype {', '.join(map(str, _CODES))}, got {got}")


def _header(tensors: Mapping[str, torch.Tensor], names: list[str], metadata: dict | None) -> bytes:
    header, offset = {}, 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    return head + b" " * (-len(head) % 8)  # keeps the data 8-byte aligned, as safetensors does


def write_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict | None = None, on_bytes: OnBytes | None = None
) -> FileRecord:
    """Write ``tensors`` (name -> tensor, any device) as a safetensors file, fsync it, and return its record.

    ``metadata`` is a str -> str map kept in the header. ``on_bytes(n)`` is called as bytes are written.
    """
    for name, t in tensors.items():
        _check(name, t)
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))  # wide dtypes first: aligned data
    head = _header(tensors, names, metadata)
    chunks = itertools.chain([(memoryview(struct.pack("<Q", len(head)) + head), False)],
                             (c for name in names for c in _byte_chunks(tensors[name])))
    size, expected = 0, 8 + len(head) + sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    with open(path, "wb") as f, _Digest() as digest:
        for chunk, copied in chunks:
            digest.feed(chunk, copied)
            f.write(chunk)
            size += len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
        if size != expected:  # a streamed column yielded other than its shape: never leave a malformed file
            raise RuntimeError(f"{path}: wrote {size} bytes, the header describes {expected}")
        f.flush()
        os.fsync(f.fileno())
        return FileRecord(digest.hexdigest(), size)


def read_tensors(
    path: Path, expected: FileRecord | None = None, on_bytes: OnBytes | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a safetensors file into CPU tensors, checking its sha256 and size against ``expected``.

    Returns:
        ``(tensors, metadata)``.

    Raises:
        CheckpointError: the file is missing, its size or sha256 differ from ``expected``, or it is malformed.
    """
    size = _checked_size(path, expected)
    try:
        tensors, metadata, digest = _read(path, size, on_bytes)
    except _Malformed as e:
        actual = file_sha256(path) if expected is not None else None
        if actual is not None and actual != expected.sha256:
            raise _mismatch(path, expected.sha256, actual) from None
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None
    if expected is not None and digest != expected.sha256:
        raise _mismatch(path, expected.sha256, digest)
    return tensors, metadata


def _mismatch(path: Path, want: str, got: str) -> CheckpointError:
    return CheckpointError(f"{path}: sha256 checksum mismatch (manifest {want[:16]}..., file {got[:16]}...): "
                           "the file is corrupt")


def _checked_size(path: Path, expected: FileRecord | None) -> int:
    try:
        size = os.path.getsize(path)
    except OSError:
        raise CheckpointError(f"{path}: file is missing") from None
    if expected is not None and size != expected.bytes:
        raise CheckpointError(f"{path}: size is {size} bytes, the manifest says {expected.bytes} (truncated?)")
    return size


def verify_file(path: Path, expected: FileRecord | None = None) -> dict:
    """Check ``path``'s size and sha256 against ``expected`` in one streaming pass (O(buffer) memory) and return
    its layout, ``{name: (dtype, shape, offset of its data in the file)}``, without reading any tensor.

    Raises:
        CheckpointError: the file is missing, its size or sha256 differ from ``expected``, or it is malformed.
    """
    size = _checked_size(path, expected)
    if expected is not None:
        actual = file_sha256(path)
        if actual != expected.sha256:
            raise _mismatch(path, expected.sha256, actual)
    try:
        with open(path, "rb") as f:
            prefix, head = _head(f, size)
            _, layout = _parse_header(head, size - len(prefix) - len(head))
    except _Malformed as e:
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None
    out, offset = {}, len(prefix) + len(head)
    for name, dtype, shape in layout:
        out[name] = (dtype, torch.Size(shape), offset)
        offset += torch.Size(shape).numel() * dtype.itemsize
    return out


def _head(f, size: int) -> tuple[bytes, bytes]:
    """The 8-byte header length and the JSON header of an open file of ``size`` bytes."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise _Malformed("shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > size - 8:
        raise _Malformed(f"header length {n} exceeds the file size {size}")
    return prefix, f.read(n)


def _read(path: Path, size: int, on_bytes: OnBytes | None):
    with open(path, "rb") as f, _Digest() as digest:
        prefix, head = _head(f, size)
        digest.feed(memoryview(prefix + head))
        metadata, layout = _parse_header(head, size - 8 - len(head))
        tensors = {}
        for name, dtype, shape in layout:
            t = torch.empty(shape, dtype=dtype)
            _fill(f, t, digest, on_bytes)
            tensors[name] = t
        return tensors, metadata, digest.hexdigest()


def _parse_header(head: bytes, data_bytes: int) -> tuple[dict, list]:
    try:
        header = json.loads(head)
        metadata = header.pop("__metadata__", None) or {}
        entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
        layout, offset = [], 0
        for name, entry in entries:
            dtype, shape = _DTYPES[entry["dtype"]], [int(s) for s in entry["shape"]]
            begin, end = (int(x) for x in entry["data_offsets"])
            numel = 1
            for s in shape:
                numel *= s
            if min(shape, default=0) < 0 or begin != offset or end - begin != numel * dtype.itemsize:
                raise _Malformed(f"tensor {name!r} has inconsistent offsets {entry['data_offsets']} or shape {shape}")
            layout.append((name, dtype, shape))
            offset = end
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise _Malformed(f"bad header ({type(e).__name__}: {e})") from None
    if offset != data_bytes:
        raise _Malformed(f"tensors cover {offset} bytes but the file holds {data_bytes} data bytes")
    return metadata, layout


def _fill(f, t: torch.Tensor, digest: _Digest, on_bytes: OnBytes | None) -> None:
    view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    for start in range(0, len(view), CHUNK_BYTES):
        chunk = view[start : start + CHUNK_BYTES]
        if f.readinto(chunk) != len(chunk):
            raise _Malformed("file ends inside tensor data")
        digest.feed(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))


def file_sha256(path: Path) -> str:
    """sha256 (hex) of a whole file."""
    sha = hashlib.sha256()
    buffer = memoryview(bytearray(_HASH_BYTES))  # one buffer reused: memory stays O(buffer) for any file
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            sha.update(buffer[:n])
    return sha.hexdigest()
