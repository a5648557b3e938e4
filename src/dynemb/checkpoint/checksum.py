"""File checksums, in one place: the record a manifest keeps of each file, the checksum of a buffer, a stream of
buffers or a whole file, and the check of a file against its record.

Files are written with xxh3-128 checksums (:data:`ALGORITHM`, the ``xxhash`` package). A checksum here guards
against damage (a torn or truncated write, a flipped bit, a file replaced by another), not against someone forging
a file, and xxh3-128 does that at ~3 GB/s of one core of the project's Xeon where sha256 does 0.4 GB/s: a save
beside training gets a fraction of a core, and with sha256 the checksum set its write rate. Each record names its
algorithm (``{"algorithm": "xxh3-128", "checksum": hex, "bytes": n}``); a record of the earlier form
(``{"sha256": hex, "bytes": n}``, checkpoints and exports written before) is read as a sha256 record and checked
with sha256, so those still load. ``xxhash`` and ``hashlib`` both release the GIL while they hash a buffer, so the
hashing thread of :class:`Digest` runs beside the I/O and the training threads.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import xxhash

from .errors import CheckpointError

__all__ = ["ALGORITHM", "FileRecord", "Digest", "checksum", "file_checksum", "hasher", "record_of",
           "record_from_json", "verify"]

#: the algorithm of every file written from now on
ALGORITHM = "xxh3-128"
#: name -> a constructor of a hashlib-style object (``update``, ``hexdigest``); sha256: the records written before
_HASHES = {ALGORITHM: xxhash.xxh3_128, "sha256": hashlib.sha256}
_LEGACY = "sha256"  # the key of the earlier record form, {"sha256": hex, "bytes": n}
_READ_BYTES = 4 << 20  # file_checksum's read buffer


class FileRecord(NamedTuple):
    """What a manifest keeps about a file: its ``checksum`` (hex) by ``algorithm``, and its size in ``bytes``.

    Example:
        >>> record_of(b"abc").to_json()
        {'algorithm': 'xxh3-128', 'checksum': '06b05ab6733a618578af5f94892f3950', 'bytes': 3}
    """

    checksum: str
    bytes: int
    algorithm: str = ALGORITHM

    def to_json(self) -> dict:
        """The record as a manifest stores it."""
        return {"algorithm": self.algorithm, "checksum": self.checksum, "bytes": self.bytes}


def record_from_json(entry, where: str) -> FileRecord:
    """The record a manifest stored (:meth:`FileRecord.to_json`'s form, or the earlier ``{"sha256", "bytes"}``).

    Raises:
        CheckpointError: ``entry`` is neither form, or names an algorithm this dynemb does not know; the message
            starts with ``where``.
    """
    entry = entry if isinstance(entry, dict) else {}
    if "checksum" in entry or "algorithm" in entry:
        algorithm, value = entry.get("algorithm"), entry.get("checksum")
    else:
        algorithm, value = _LEGACY, entry.get(_LEGACY)
    if not isinstance(value, str) or not isinstance(entry.get("bytes"), int) or isinstance(entry["bytes"], bool):
        raise CheckpointError(f"{where}: expected a file record {{'algorithm', 'checksum', 'bytes'}} (or "
                              f"{{'sha256', 'bytes'}}), got {entry!r}"[:400])
    if algorithm not in _HASHES:
        raise CheckpointError(f"{where}: checksum algorithm {algorithm!r} is not one of {sorted(_HASHES)} (written "
                              "by a newer dynemb?)")
    return FileRecord(value, entry["bytes"], algorithm)


def hasher(algorithm: str = ALGORITHM):
    """A new hash object of ``algorithm`` (``update(buffer)``, ``hexdigest()``), for a caller that feeds a file's
    bytes itself (a background save's snapshot hashes them as it copies them).

    Example:
        >>> h = hasher()
        >>> h.update(b"ab"); h.update(b"c")
        >>> h.hexdigest() == record_of(b"abc").checksum
        True
    """
    return _HASHES[algorithm]()


def checksum(data, algorithm: str = ALGORITHM) -> str:
    """The checksum (hex) of ``data`` (bytes or any buffer) by ``algorithm``."""
    h = hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def record_of(data, algorithm: str = ALGORITHM) -> FileRecord:
    """The record of a file holding ``data`` (bytes)."""
    return FileRecord(checksum(data, algorithm), len(data), algorithm)


def file_checksum(path: Path, algorithm: str = ALGORITHM) -> str:
    """The checksum (hex) of the whole file ``path``, read through one buffer (memory O(buffer) for any file)."""
    h = hasher(algorithm)
    buffer = memoryview(bytearray(_READ_BYTES))
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            h.update(buffer[:n])
    return h.hexdigest()


def verify(path: Path, record: FileRecord, actual: str | None = None, data=None) -> None:
    """Check that file ``path`` matches ``record``'s checksum: ``actual``, its checksum by ``record.algorithm``
    computed while it was read, or else that of ``data`` (its bytes, read whole), or else the file's own.

    Raises:
        CheckpointError: the checksums differ, naming the file and the algorithm.
    """
    if actual is None:
        actual = checksum(data, record.algorithm) if data is not None else file_checksum(path, record.algorithm)
    if actual != record.checksum:
        raise CheckpointError(f"{path}: {record.algorithm} checksum mismatch (manifest {record.checksum[:16]}..., "
                              f"file {actual[:16]}...): the file is corrupt or was changed after it was written")


class Digest:
    """A file's checksum computed in order by one helper thread that trails the I/O: a file is written (or read)
    at full speed while hashing catches up, and the fsync ending a write overlaps the rest of the hashing.
    :meth:`feed` returns the chunk's future: a caller reuses or frees a chunk's memory only once it is done."""

    def __init__(self, algorithm: str = ALGORITHM, threaded: bool = True) -> None:
        self.algorithm = algorithm
        self._hash = hasher(algorithm)
        # threaded False: each chunk hashed as it is fed (a file of one chunk has no I/O to overlap, and a thread
        # started per file was most of the time of reading a model's small table files)
        self._pool = ThreadPoolExecutor(1) if threaded else None
        self._last: Future | None = None

    def feed(self, chunk: memoryview) -> Future:
        if self._pool is None:
            self._hash.update(chunk)
            self._last = Future()
            self._last.set_result(None)
        else:
            self._last = self._pool.submit(self._hash.update, chunk)
        return self._last

    def hexdigest(self) -> str:
        if self._last is not None:
            self._last.result()
        return self._hash.hexdigest()

    def record(self, size: int) -> FileRecord:
        """The record of the file of ``size`` bytes fed so far."""
        return FileRecord(self.hexdigest(), size, self.algorithm)

    def __enter__(self) -> Digest:
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
