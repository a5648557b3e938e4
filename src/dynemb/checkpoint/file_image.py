"""A background save's snapshot, laid out as the file it becomes: copied and checksummed by the caller, written by
the save's threads.

:class:`FileImage` holds the bytes of one safetensors file (header, then each tensor at its offset) in page-aligned
chunks of 32 MiB. ``save(..., blocking=False)`` makes one per file, starts its thread, and copies the tensors in on
the caller's thread (:meth:`FileImage.fill`): each 1 MiB is copied (a torch copy) and then added to the file's
checksum while it is still in the core's cache, so the checksum costs the caller little and the save's threads
nothing. Those threads (:meth:`FileImage.write`) only write each chunk already copied, two in flight, with
``O_DIRECT`` straight from its memory (the device reads it: almost no CPU), so a save whose threads get only a sliver
of a core beside training still writes at the disk's pace. A chunk written goes back to the copy, which fills it
again with a later part of the file: its pages stay taken, and taking fresh pages (zeroed by the kernel; as costly as
the copy) is only needed for as many chunks as the copy gets ahead of the disk. That is also the snapshot's memory:
at most the file's bytes, in practice a fraction, given back when the file is written.
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

from .block_file import ALIGN, BlockFile, page_buffer, round_up
from .checksum import ALGORITHM, FileRecord, hasher
from .errors import CheckpointError
from .tensorfile import CHUNK_BYTES, OnBytes, file_layout, flat_pieces

__all__ = ["FileImage"]

#: bytes copied, then hashed, at a time by the fill: they stay in the core's L2 cache between the two
HASH_BYTES = 1 << 20
#: chunks being written at once (each by a thread of its own): the next write is queued at the device while a
#: starved thread waits to run again
WRITES_IN_FLIGHT = 2
#: madvise(2) advice that takes a range's pages now, without writing them (Linux 5.14+; Python names it from 3.13)
_POPULATE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def _new_chunk(size: int) -> mmap.mmap:
    """``size`` bytes of fresh page-aligned memory with its pages taken now, in one call (huge pages where the system
    gives them), rather than a fault at a time during the copy."""
    global _POPULATE
    memory = page_buffer(size, huge=True)
    if _POPULATE is not None:
        try:
            memory.madvise(_POPULATE)
        except OSError:  # a kernel before 5.14: the copy takes them a fault at a time
            _POPULATE = None
    return memory


class FileImage:
    """The bytes of the safetensors file of ``tensors`` and ``metadata``, filled (and checksummed) by :meth:`fill`
    and written by :meth:`write` (another thread, at the same time).

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
        # a multiple of every element's size: no element straddles two chunks
        self._chunk = round_up(max(CHUNK_BYTES, ALIGN))
        self._chunks: list = [None] * -(-self.size // self._chunk)  # chunk k's memory, from its copy to its write
        self._spare: list = []  # written chunks' memory, its pages still taken, for the copy to fill again
        self._all: list = []  # every chunk's memory, to give back at the end
        self._filled = 0  # bytes copied and hashed, from the start; == size once the record is known too
        self._record: Optional[FileRecord] = None
        self._error: Optional[BaseException] = None
        self._changed = threading.Condition()

    def _memory(self, k: int) -> mmap.mmap:
        """Chunk ``k``'s memory (the fill's): a spare chunk's if there is one, else fresh."""
        memory = self._chunks[k]  # only the fill sets it
        if memory is not None:
            return memory
        with self._changed:
            memory = self._spare.pop() if self._spare else None
        if memory is None:
            memory = _new_chunk(min(self._chunk, round_up(self.size)))  # (its pages taken outside the lock)
            self._all.append(memory)
        with self._changed:
            self._chunks[k] = memory
        return memory

    def _put(self, offset: int, data) -> None:
        """Copy ``data`` (a bytes-like object) into the image at ``offset``, across chunks."""
        data = memoryview(data).cast("B")
        while len(data):
            k, at = divmod(offset, self._chunk)
            n = min(len(data), self._chunk - at)
            self._memory(k)[at : at + n] = data[:n]
            data, offset = data[n:], offset + n

    def _hash(self, digest, start: int, end: int) -> None:
        while start < end:
            k, at = divmod(start, self._chunk)
            n = min(end - start, self._chunk - at)
            digest.update(memoryview(self._memory(k))[at : at + n])
            start += n

    def fill(self) -> None:
        """Copy the tensors in, in file order, and checksum them as they are copied; :meth:`write` follows. Call
        it once, on the thread that owns the tensors (they must not change until it returns).

        Raises:
            Whatever the copy raised (say, a device error); :meth:`write` then fails too.
        """
        hashed, digest = 0, hasher(ALGORITHM)
        try:
            self._put(0, self._layout.head)
            for name, offset in zip(self._layout.names, self._layout.offsets):
                for piece in flat_pieces(self._tensors[name]):
                    n, size, done = piece.numel(), piece.element_size(), 0
                    # a CPU piece 1 MiB at a time (hashed while in cache); a device piece a chunk at a time
                    most = max(1, HASH_BYTES // size) if piece.device.type == "cpu" else n
                    while done < n:
                        k, at = divmod(offset, self._chunk)
                        count = min(n - done, most, (self._chunk - at) // size)
                        torch.frombuffer(self._memory(k), dtype=piece.dtype, count=count, offset=at).copy_(
                            piece[done : done + count])
                        done, offset = done + count, offset + count * size
                        self._hash(digest, hashed, offset)  # the header and any padding before it too
                        hashed = offset
                        if offset < self.size:
                            self._advance(offset)
            self._hash(digest, hashed, self.size)
            with self._changed:
                self._record = FileRecord(digest.hexdigest(), self.size, ALGORITHM)
            self._advance(self.size)
        except BaseException as e:
            self.abort(e)
            raise
        finally:
            self._tensors = None  # the live columns are no longer needed: nothing keeps them from changing

    def _advance(self, filled: int) -> None:
        with self._changed:
            before, self._filled = self._filled, filled
            if filled == self.size or filled // self._chunk != before // self._chunk:  # writers wait for chunks
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
        :func:`~dynemb.checkpoint.tensorfile.write_tensors` of the same tensors returns, computed by the fill), and
        free the memory.

        Raises:
            CheckpointError: the fill failed. OSError: the write did.
        """
        lock, failed = threading.Lock(), threading.Event()

        def write_every(first: int) -> None:  # chunks first, first + WRITES_IN_FLIGHT, ...
            try:
                for k in range(first, len(self._chunks), WRITES_IN_FLIGHT):
                    start = k * self._chunk
                    end = min(start + self._chunk, self.size)
                    self._wait(end)
                    if failed.is_set():
                        return
                    memory = self._chunks[k]
                    # zeros (or an earlier chunk's bytes) beyond the file's end, cut by finish
                    sink.write_at(memoryview(memory)[: round_up(end - start)], start)
                    with self._changed:
                        self._chunks[k] = None
                        self._spare.append(memory)  # its pages are kept for the copy of a later chunk
                    if on_bytes is not None:
                        with lock:
                            on_bytes(end - start)
            except BaseException:
                failed.set()
                raise

        try:
            with BlockFile(path) as sink, ThreadPoolExecutor(max(1, WRITES_IN_FLIGHT - 1)) as helpers:
                # the helpers inherit this thread's priority (Linux: a new thread takes its creator's nice value)
                others = [helpers.submit(write_every, k) for k in range(1, min(WRITES_IN_FLIGHT, len(self._chunks)))]
                try:
                    write_every(0)
                finally:
                    errors = [f.exception() for f in others]
                for error in errors:
                    if error is not None:
                        raise error
                self._wait(self.size)
                sink.finish(self.size)
                return self._record
        finally:
            self._give_back()

    def _give_back(self) -> None:
        """Give every chunk's pages back to the OS (a failed write's fill may still copy: it takes them again)."""
        with self._changed:
            memories, self._spare = list(self._all), []
        for memory in memories:
            if hasattr(memory, "madvise"):
                memory.madvise(mmap.MADV_DONTNEED)
