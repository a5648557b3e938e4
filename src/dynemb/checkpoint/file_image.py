"""A background save's snapshot, laid out as the file it becomes: copied and checksummed by the caller, written by
the save's threads.

:class:`FileImage` holds the bytes of one safetensors file (header, then each tensor at its offset) in
page-aligned memory. ``save(..., blocking=False)`` makes one per file, starts its thread, and copies the tensors in
on the caller's thread (:meth:`FileImage.fill`): the pages are taken a 32 MiB chunk at a time just before they are
needed (``MADV_POPULATE_WRITE``, cheaper than a fault each, huge pages where the system gives them; a helper thread
at the caller's priority takes them up to :data:`AHEAD_BYTES` ahead, while training waits anyway), and each 1 MiB is
copied (a torch copy) and then added to the file's checksum while it is still in the core's cache, so the checksum
costs the caller little and the save's threads nothing. Those threads (:meth:`FileImage.write`) only write each
chunk already copied, two in flight, with ``O_DIRECT`` straight from this memory (the device reads it: almost no
CPU), so a save whose threads get only a sliver of a core beside training still writes at the disk's pace. A chunk's
memory goes back to the OS once it is on disk: the snapshot's cost is at most the files' bytes, and in practice what
the copy gets ahead of the disk.
"""

from __future__ import annotations

import ctypes
import errno
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
#: how far ahead of the copy the fill's helper takes pages (the memory it holds before the copy needs it)
AHEAD_BYTES = 4 * CHUNK_BYTES
_POPULATE_WRITE = 23  # madvise(2) advice (Linux 5.14+): take a range's pages now, without writing them


def _libc_madvise():
    """libc's ``madvise`` through ctypes, which releases the GIL for the call (``mmap.madvise`` keeps it), or
    None (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return madvise


_MADVISE = _libc_madvise()


def _take_pages(address: int, start: int, stop: int) -> None:
    """Take the pages of ``[start, stop)`` of the memory at ``address`` now, in one call; where the kernel cannot
    (before 5.14, not Linux) the copy takes them later, a fault at a time."""
    global _MADVISE
    if _MADVISE is not None and stop > start and _MADVISE(address + start, stop - start, _POPULATE_WRITE) != 0:
        if ctypes.get_errno() == errno.EINVAL:  # a kernel without it (the ranges are page-aligned)
            _MADVISE = None


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
        self._memory = page_buffer(self.size, huge=True)  # its pages are taken by the fill, ahead of its copy
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))  # (the export ends at once)
        head = self._layout.head
        self._memory[: len(head)] = head
        self._claimed = 0  # pages up to here are taken, or being taken, by the fill or its helper
        self._stopped = False  # the fill has ended: its helper stops
        self._filled = 0  # bytes copied and hashed, from the start; == size once the record is known too
        self._waits: list = []  # the ends the writers wait for: the fill wakes them only once one is reached
        self._record: Optional[FileRecord] = None
        self._error: Optional[BaseException] = None
        self._changed = threading.Condition()

    def fill(self) -> None:
        """Copy the tensors in, in file order, and checksum them as they are copied; :meth:`write` follows. Call
        it once, on the thread that owns the tensors (they must not change until it returns).

        Raises:
            Whatever the copy raised (say, a device error); :meth:`write` then fails too.
        """
        hashed, digest = 0, hasher(ALGORITHM)
        view = memoryview(self._memory)
        # Taking pages costs as much as the copy; a helper at the caller's priority does it ahead of the copy,
        # while the caller (training) waits anyway, and whatever it has not reached yet the caller takes itself.
        helper = threading.Thread(target=self._take_ahead, name="dynemb-snapshot-pages", daemon=True)
        helper.start()
        try:
            for name, offset in zip(self._layout.names, self._layout.offsets):
                for piece in flat_pieces(self._tensors[name]):
                    n, size = piece.numel(), piece.element_size()
                    # a CPU piece 1 MiB at a time (hashed while in cache); a device piece in one copy
                    step = max(1, HASH_BYTES // size) if piece.device.type == "cpu" else max(n, 1)
                    for start in range(0, n, step):
                        part = piece[start : start + step]
                        end = offset + part.numel() * size
                        self._take(end)
                        torch.frombuffer(self._memory, dtype=piece.dtype, count=part.numel(), offset=offset).copy_(part)
                        digest.update(view[hashed:end])  # the header and any padding before it too
                        hashed = offset = end
                        if end < self.size:
                            self._advance(end)
            digest.update(view[hashed : self.size])
            with self._changed:
                self._record = FileRecord(digest.hexdigest(), self.size, ALGORITHM)
            self._advance(self.size)
        except BaseException as e:
            self.abort(e)
            raise
        finally:
            self._tensors = None  # the live columns are no longer needed: nothing keeps them from changing
            with self._changed:
                self._stopped = True
                self._changed.notify_all()
            helper.join()

    def _take(self, end: int) -> None:
        """Take the pages up to ``end`` (rounded up to a chunk) that neither the fill nor its helper took yet."""
        with self._changed:
            start = self._claimed
            if end <= start:
                return
            stop = self._claimed = min(len(self._memory), round_up(max(end, start + CHUNK_BYTES)))
        _take_pages(self._address, start, stop)

    def _take_ahead(self) -> None:
        """The fill's helper: take a chunk's pages at a time, up to :data:`AHEAD_BYTES` beyond the copy (taking
        them writes nothing: the copy may overtake it)."""
        while True:
            with self._changed:
                while not self._stopped and self._claimed < len(self._memory) and (
                        self._claimed >= self._filled + AHEAD_BYTES):
                    self._changed.wait()
                if self._stopped or self._claimed >= len(self._memory) or _MADVISE is None:
                    return
                start = self._claimed
                stop = self._claimed = min(len(self._memory), round_up(start + CHUNK_BYTES))
            _take_pages(self._address, start, stop)

    def _advance(self, filled: int) -> None:
        with self._changed:
            before, self._filled = self._filled, filled
            # writers wait for a chunk's end, the helper for the copy to move a chunk on
            if (self._waits and filled >= min(self._waits)) or filled // CHUNK_BYTES != before // CHUNK_BYTES:
                self._changed.notify_all()

    def abort(self, error: BaseException) -> None:
        """Make :meth:`write` fail (the fill will not complete)."""
        with self._changed:
            self._error = error
            self._changed.notify_all()

    def _wait(self, end: int) -> None:
        with self._changed:
            self._waits.append(end)
            try:
                while self._filled < end and self._error is None:
                    self._changed.wait()
            finally:
                self._waits.remove(end)
            if self._error is not None:
                raise CheckpointError(f"the snapshot for this file failed: {self._error!r}") from self._error

    def write(self, path: Path, on_bytes: Optional[OnBytes] = None) -> FileRecord:
        """Write the file to ``path`` as the bytes are filled in, fsync it, return its record (the record
        :func:`~dynemb.checkpoint.tensorfile.write_tensors` of the same tensors returns, computed by the fill), and
        free the memory.

        Raises:
            CheckpointError: the fill failed. OSError: the write did.
        """
        view = memoryview(self._memory)  # slices of it are what the writes read: no copy
        step = round_up(max(CHUNK_BYTES, ALIGN))
        starts = range(0, self.size, step)
        lock, failed = threading.Lock(), threading.Event()

        def write_every(first: int) -> None:  # chunks first, first + WRITES_IN_FLIGHT, ...
            try:
                for start in starts[first::WRITES_IN_FLIGHT]:
                    end = min(start + step, self.size)
                    self._wait(end)
                    if failed.is_set():
                        return
                    sink.write_at(view[start : round_up(end)], start)  # zeros beyond the end, cut by finish
                    self._free(start, end)
                    if on_bytes is not None:
                        with lock:
                            on_bytes(end - start)
            except BaseException:
                failed.set()
                raise

        try:
            with BlockFile(path) as sink, ThreadPoolExecutor(max(1, WRITES_IN_FLIGHT - 1)) as helpers:
                # the helpers inherit this thread's priority (Linux: a new thread takes its creator's nice value)
                others = [helpers.submit(write_every, k) for k in range(1, min(WRITES_IN_FLIGHT, len(starts)))]
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
            self._free(0, self.size)

    def _free(self, start: int, end: int) -> None:
        """Give ``[start, end)``'s pages back to the OS (reads would see zeros; nothing reads them again)."""
        if hasattr(self._memory, "madvise"):
            self._memory.madvise(mmap.MADV_DONTNEED, start, round_up(end) - start)
