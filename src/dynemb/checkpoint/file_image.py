"""A background save's snapshot, laid out as the file it becomes: copied in by the caller, written by the save.

:class:`FileImage` holds the bytes of one safetensors file (header, then each tensor at its offset) in
page-aligned memory. ``save(..., blocking=False)`` makes one per file, starts its thread, and copies the tensors in
on the caller's thread (:meth:`FileImage.fill`, a torch copy per chunk, GIL released); the thread meanwhile writes
every chunk already copied (:meth:`FileImage.write`: the checksum on the digest's thread, the write with ``O_DIRECT``
from this very memory), so hashing and writing overlap the copy, and the only copy of the bytes is the snapshot's.
A chunk's memory goes back to the OS once it is hashed and on disk, so the snapshot's cost, the files' bytes, shrinks
as the save goes.
"""

from __future__ import annotations

import mmap
import threading
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch

from .block_file import ALIGN, BlockFile, page_buffer, round_up
from .errors import CheckpointError
from .tensorfile import CHUNK_BYTES, Digest, FileRecord, OnBytes, file_layout, flat_pieces

__all__ = ["FileImage"]


class FileImage:
    """The bytes of the safetensors file of ``tensors`` and ``metadata``, filled by :meth:`fill` and written by
    :meth:`write` (another thread, at the same time).

    Args:
        tensors: name -> tensor (any device; a streamed column with ``materialize()`` is materialized).
        metadata: str -> str map kept in the header.

    Example:
        >>> import tempfile, pathlib, torch
        >>> from dynemb.checkpoint.tensorfile import read_tensors, write_tensors
        >>> tmp = pathlib.Path(tempfile.mkdtemp())
        >>> t = {"x": torch.arange(6.0).view(2, 3)}
        >>> image = FileImage(t)
        >>> image.fill()                                  # the caller's copy
        >>> record = image.write(tmp / "a.safetensors")   # usually on another thread, while fill runs
        >>> record == write_tensors(tmp / "b.safetensors", t)
        True
        >>> read_tensors(tmp / "a.safetensors", record)[0]["x"].tolist()
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], metadata: Optional[dict] = None) -> None:
        tensors = {n: t.materialize() if hasattr(t, "materialize") else t for n, t in tensors.items()}
        self._layout = file_layout(tensors, metadata)
        self.size = self._layout.size
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self._tensors: Optional[dict] = tensors
        self._memory = page_buffer(self.size, populate=True)  # the pages now, cheaper than a fault each
        head = self._layout.head
        self._memory[: len(head)] = head
        self._filled = len(head)
        self._error: Optional[BaseException] = None
        self._changed = threading.Condition()

    def fill(self) -> None:
        """Copy the tensors in, in file order, a chunk at a time; :meth:`write` follows. Call it once, on the
        thread that owns the tensors (they must not change until it returns).

        Raises:
            Whatever the copy raised (say, a device error); :meth:`write` then fails too.
        """
        try:
            for name, offset in zip(self._layout.names, self._layout.offsets):
                for piece in flat_pieces(self._tensors[name]):
                    n = piece.numel()
                    if n:
                        torch.frombuffer(self._memory, dtype=piece.dtype, count=n, offset=offset).copy_(piece)
                    offset += n * piece.element_size()
                    self._advance(offset)
        except BaseException as e:
            self.abort(e)
            raise
        finally:
            self._tensors = None  # the live columns are no longer needed: nothing keeps them from changing

    def _advance(self, filled: int) -> None:
        with self._changed:
            self._filled = filled
            self._changed.notify_all()

    def abort(self, error: BaseException) -> None:
        """Make :meth:`write` fail (the fill will not complete)."""
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def _wait(self, end: int) -> None:
        with self._changed:
            while self._filled < end and self._error is None:
                self._changed.wait()
            if self._error is not None:
                raise CheckpointError(f"the snapshot for this file failed: {self._error!r}") from self._error

    def write(self, path: Path, on_bytes: Optional[OnBytes] = None) -> FileRecord:
        """Write the file to ``path`` as the bytes are filled in, fsync it, return its record (the record
        :func:`~dynemb.checkpoint.tensorfile.write_tensors` of the same tensors returns), and free the memory.

        Raises:
            CheckpointError: the fill failed. OSError: the write did.
        """
        view = memoryview(self._memory)  # slices of it are what the hash and the write read: no copy
        step = round_up(max(CHUNK_BYTES, ALIGN))
        pending: deque = deque()  # (start, end, the hash's future) of chunks written, not yet freed
        try:
            with BlockFile(path) as sink, Digest() as digest:
                for start in range(0, self.size, step):
                    end = min(start + step, self.size)
                    self._wait(end)
                    pending.append((start, end, digest.feed(view[start:end])))
                    sink.write(view[start : round_up(end)])  # zeros beyond the file's end, cut by finish
                    if on_bytes is not None:
                        on_bytes(end - start)
                    while pending and pending[0][2].done():
                        self._free(*pending.popleft()[:2])
                sink.finish(self.size)
                record = digest.record(self.size)
        finally:
            self._free(0, self.size)
        return record

    def _free(self, start: int, end: int) -> None:
        """Give ``[start, end)``'s pages back to the OS (reads would see zeros; nothing reads them again)."""
        if hasattr(self._memory, "madvise"):
            self._memory.madvise(mmap.MADV_DONTNEED, start, round_up(end) - start)
