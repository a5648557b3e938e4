"""Streaming safetensors files, checksummed while the bytes move (:mod:`.checksum`).

The layout is standard safetensors (8-byte little-endian header length, a JSON header, then the tensors' bytes
back to back), so ``safetensors.safe_open`` reads these files too. We stream them ourselves because the library
cannot hash while it writes or reads, and a checksum would cost a second pass over every file: here bytes go
between the tensor's memory and the file in chunks, and a helper thread hashes the chunks while the I/O goes on
(both release the GIL). Writes pass through a few page-aligned buffers and skip the page cache where they can
(:mod:`.block_file`); a background save's snapshot is laid out as its file from the start
(:mod:`.file_image`).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from .block_file import ALIGN, BlockFile, page_buffer, round_up
from .checksum import ALGORITHM, Digest, FileRecord, verify
from .errors import CheckpointError

__all__ = ["FileRecord", "FileLayout", "Digest", "write_tensors", "read_tensors", "verify_file", "byte_view",
           "file_layout", "flat_pieces", "CHUNK_BYTES"]

CHUNK_BYTES = 32 << 20
_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}

OnBytes = Callable[[int], object]


class _Malformed(Exception):
    """The file is not a well-formed safetensors file (reported with its checksum status)."""


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


def flat_pieces(t) -> Iterator[torch.Tensor]:
    """A column's elements in row-major order as 1-d pieces of about :data:`CHUNK_BYTES` each, on its device:
    views where its rows are dense (a strided column, such as a table's interleaved scores, stays a strided view;
    a copy is made only of a non-dense piece of a 2-d column). A streamed column (``pieces()``, see
    :mod:`dynemb.checkpoint.tiered_stream`) gives its own pieces, flattened."""
    if hasattr(t, "pieces"):
        for piece in t.pieces():
            yield from flat_pieces(piece)
        return
    t = t.detach()
    if t.dim() <= 1:
        flat = t.reshape(-1)
        step = max(1, CHUNK_BYTES // t.element_size())
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step]
        return
    row = max(1, t[0].numel() * t.element_size()) if t.shape[0] else 1
    step = max(1, CHUNK_BYTES // row)
    for start in range(0, t.shape[0], step):
        yield t[start : start + step].reshape(-1)


def _check(name: str, t) -> None:
    if hasattr(t, "pieces") and t.dtype in _CODES:
        return
    if not isinstance(t, torch.Tensor) or t.dtype not in _CODES or t.layout != torch.strided:
        got = f"{t.dtype} {t.layout}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"tensor {name!r} must be a dense tensor of dtype {', '.join(map(str, _CODES))}, got {got}")


class FileLayout(NamedTuple):
    """Where a file's parts go: ``head`` (the 8-byte header length, the JSON header and its padding), then the
    tensors ``names`` at ``offsets`` from the file's start; ``size`` bytes in all. Every tensor starts at a
    multiple of its element size (wide dtypes first, the header padded to 8 bytes), as safetensors does."""

    head: bytes
    names: list
    offsets: list
    size: int


def file_layout(tensors: Mapping[str, torch.Tensor], metadata: dict | None = None) -> FileLayout:
    """The layout of the safetensors file of ``tensors`` (name -> tensor) and ``metadata`` (str -> str).

    Raises:
        TypeError: a tensor of a dtype or layout safetensors cannot hold.
    """
    for name, t in tensors.items():
        _check(name, t)
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))  # wide dtypes first: aligned data
    header, offsets, offset = {}, [], 0
    for name in names:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offsets.append(offset)
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # keeps the data 8-byte aligned, as safetensors does
    start = 8 + len(head)
    return FileLayout(struct.pack("<Q", len(head)) + head, names, [start + o for o in offsets], start + offset)


class _Staging:
    """The bytes of a file on their way out: packed into a few page-aligned buffers (a torch copy from the
    column, GIL released, any device or stride), each hashed by the digest's thread while it is written whole
    (:class:`~.block_file.BlockFile`); a buffer is reused once its hash is done, so memory stays bounded."""

    COUNT = 2
    #: bytes a buffer: direct writes of 2 MiB run as fast as of 32 MiB here, and a save needs 4 MiB beyond its rows
    BYTES = 2 << 20

    def __init__(self, sink: BlockFile, digest: Digest, total: int, on_bytes: OnBytes | None) -> None:
        self.size = min(round_up(max(min(CHUNK_BYTES, self.BYTES), ALIGN)), round_up(max(total, 1)))
        self.buffers = [page_buffer(self.size) for _ in range(min(self.COUNT, -(-total // self.size) or 1))]
        self.hashed: list[Future | None] = [None] * len(self.buffers)
        self.sink, self.digest, self.on_bytes = sink, digest, on_bytes
        self.i = self.pos = self.written = 0

    def put_bytes(self, data: bytes) -> None:
        while data:
            k = min(len(data), self.size - self.pos)
            self.buffers[self.i][self.pos : self.pos + k] = data[:k]
            data, self.pos = data[k:], self.pos + k
            if self.pos == self.size:
                self.flush()

    def put(self, flat: torch.Tensor) -> None:
        """Append a 1-d piece's elements (its position in the file is a multiple of its element size, and so is
        every buffer's size: a buffer always has room for a whole element)."""
        elt, done, n = flat.element_size(), 0, flat.numel()
        while done < n:
            k = min(n - done, (self.size - self.pos) // elt)
            torch.frombuffer(self.buffers[self.i], dtype=flat.dtype, count=k, offset=self.pos).copy_(
                flat[done : done + k])
            done, self.pos = done + k, self.pos + k * elt
            if self.pos == self.size:
                self.flush()

    def flush(self) -> None:
        if not self.pos:
            return
        buffer, n = memoryview(self.buffers[self.i]), self.pos
        self.hashed[self.i] = self.digest.feed(buffer[:n])
        self.sink.write(buffer[: round_up(n)])  # the last block's padding is cut by finish
        self.written += n
        if self.on_bytes is not None:
            self.on_bytes(n)
        self.i, self.pos = (self.i + 1) % len(self.buffers), 0
        if self.hashed[self.i] is not None:
            self.hashed[self.i].result()  # the next buffer is read by the hash until it is done


def write_tensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict | None = None, on_bytes: OnBytes | None = None
) -> FileRecord:
    """Write ``tensors`` (name -> tensor, any device) as a safetensors file, fsync it, and return its record.

    ``metadata`` is a str -> str map kept in the header. ``on_bytes(n)`` is called as bytes are written. The bytes
    pass through two page-aligned buffers of 2 MiB and go to the device with ``O_DIRECT`` where the file system
    takes it (:mod:`.block_file`).
    """
    layout = file_layout(tensors, metadata)
    with BlockFile(path) as sink, Digest() as digest:
        staging = _Staging(sink, digest, layout.size, on_bytes)
        staging.put_bytes(layout.head)
        for name in layout.names:
            for piece in flat_pieces(tensors[name]):
                staging.put(piece)
        staging.flush()
        if staging.written != layout.size:  # a streamed column yielded other than its shape: no malformed file
            raise RuntimeError(f"{path}: wrote {staging.written} bytes, the header describes {layout.size}")
        sink.finish(layout.size)
        return digest.record(layout.size)


def read_tensors(
    path: Path, expected: FileRecord | None = None, on_bytes: OnBytes | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """Read a safetensors file into CPU tensors, checking its checksum and size against ``expected``.

    Returns:
        ``(tensors, metadata)``.

    Raises:
        CheckpointError: the file is missing, its size or checksum differ from ``expected``, or it is malformed.
    """
    size = _checked_size(path, expected)
    try:
        tensors, metadata, digest = _read(path, size, expected, on_bytes)
    except _Malformed as e:
        if expected is not None:
            verify(path, expected)  # a damaged file is reported as one, not as a malformed header
        raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None
    if expected is not None:
        verify(path, expected, digest)
    return tensors, metadata


def _checked_size(path: Path, expected: FileRecord | None) -> int:
    try:
        size = os.path.getsize(path)
    except OSError:
        raise CheckpointError(f"{path}: file is missing") from None
    if expected is not None and size != expected.bytes:
        raise CheckpointError(f"{path}: size is {size} bytes, the manifest says {expected.bytes} (truncated?)")
    return size


def verify_file(path: Path, expected: FileRecord | None = None) -> dict:
    """Check ``path``'s size and checksum against ``expected`` in one streaming pass (O(buffer) memory) and return
    its layout, ``{name: (dtype, shape, offset of its data in the file)}``, without reading any tensor.

    Raises:
        CheckpointError: the file is missing, its size or checksum differ from ``expected``, or it is malformed.
    """
    size = _checked_size(path, expected)
    if expected is not None:
        verify(path, expected)
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


def _read(path: Path, size: int, expected: FileRecord | None, on_bytes: OnBytes | None):
    """``(tensors, metadata, checksum)``, the checksum by ``expected``'s algorithm (the default's without one)."""
    threaded = size > CHUNK_BYTES  # hashing overlaps reading only when there is more than one chunk to read
    with open(path, "rb") as f, Digest(expected.algorithm if expected is not None else ALGORITHM,
                                       threaded) as digest:
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


def _fill(f, t: torch.Tensor, digest: Digest, on_bytes: OnBytes | None) -> None:
    view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
    for start in range(0, len(view), CHUNK_BYTES):
        chunk = view[start : start + CHUNK_BYTES]
        if f.readinto(chunk) != len(chunk):
            raise _Malformed("file ends inside tensor data")
        digest.feed(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
