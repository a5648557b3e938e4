"""How the ranks of a save (or a serving export) write one directory together and publish it, or none of it.

Rank 0 makes the staging directory (:func:`open_shared`) and every rank writes its own files into it
(:func:`write_payloads`); :func:`commit` then gathers every rank's file records and outcome, and rank 0 writes the
manifest last, renames the directory into place and moves ``latest``, only when every rank wrote its files. A
failure on any rank is every rank's failure: each raises (its own exception, or a :class:`CheckpointError` naming
the rank that failed), and the staging directory is removed. The same code runs inline for a blocking save and on
a background save's thread (:mod:`.background`), there over a group of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .errors import CheckpointError
from .file_image import FileImage
from .fsutil import abandon, open_staging, publish, write_json, write_pointer
from .manifest import MANIFEST
from .progress import logger, transfer
from .ranks import RankContext
from .tensorfile import write_tensors

__all__ = ["open_shared", "write_payloads", "commit"]


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def open_shared(root: Path, name: str, ctx: RankContext) -> Path:
    """The staging directory of ``root/name``, made by rank 0, on every rank (a collective).

    Raises:
        ValueError: ``root/name`` exists already (on every rank: rank 0's error, named).
        OSError: rank 0 could not make it (the other ranks raise a CheckpointError naming it).
    """
    made, error = None, None
    if ctx.rank == 0:
        try:
            made = open_staging(root, name)
        except (OSError, ValueError) as e:
            error = e
    got = ctx.gather({"tmp": str(made) if made is not None else None,
                      "error": _describe(error) if error is not None else None})[0]
    if error is not None:
        raise error
    if got["error"] is not None:
        raise CheckpointError(f"rank 0 could not start writing {root / name}: {got['error']}")
    return Path(got["tmp"])


def write_payloads(directory: Path, payloads: dict, what: str) -> dict:
    """Write ``{relative path: (tensors, metadata)}`` under ``directory``; returns the manifest's file records.
    A background save's payloads are ``(FileImage, None)``: the snapshot, written as its caller fills it."""
    total = sum(tensors.nbytes if isinstance(tensors, FileImage) else
                sum(t.numel() * t.element_size() for t in tensors.values()) for tensors, _ in payloads.values())
    files = {}
    with transfer(what, total) as progress:
        for rel, (tensors, metadata) in payloads.items():
            (directory / rel).parent.mkdir(parents=True, exist_ok=True)
            if isinstance(tensors, FileImage):
                record = tensors.write(directory / rel, progress)
            else:
                record = write_tensors(directory / rel, tensors, metadata, progress)
            files[rel] = record.to_json()
    return files


def commit(ctx: RankContext, root: Path, name: str, tmp: Path, payloads: dict, entries: dict, what: str,
           manifest_of: Callable[[list], dict], pointer: dict, after: Callable[[], None] | None = None) -> Path:
    """Write this rank's ``payloads`` into ``tmp``; rank 0 then writes ``manifest_of(parts)`` (``parts``: every
    rank's ``{"files", "entries"}``, in rank order), publishes ``tmp`` as ``root/name``, points ``root/latest`` at
    it with ``pointer`` and calls ``after`` (pruning; its failure is only logged). A collective over ``ctx``.

    Returns:
        ``root / name``.

    Raises:
        On every rank when any rank failed: the failing rank its own exception, the others a CheckpointError naming
        it. ``tmp`` is removed then and ``latest`` is unchanged.
    """
    error = None
    try:
        files = write_payloads(tmp, payloads, what)
    except Exception as e:  # noqa: BLE001  (every rank must learn of it, or the others wait forever)
        error, files = e, {}
    parts = ctx.gather({"files": files, "entries": entries, "error": _describe(error) if error else None})
    failed = [f"rank {rank}: {part['error']}" for rank, part in enumerate(parts) if part["error"]]
    published = None
    if ctx.rank == 0:
        try:
            if failed:
                raise CheckpointError(f"{root / name} was not written: " + "; ".join(failed))
            write_json(tmp / MANIFEST, manifest_of(parts))
            publish(tmp, root, name)
            write_pointer(root, name, **pointer)
        except Exception as e:  # noqa: BLE001
            abandon(tmp)
            published = e
    outcome = ctx.gather(_describe(published) if published is not None else None)[0]
    if error is not None:
        raise error
    if published is not None:
        raise published
    if outcome is not None:
        raise CheckpointError(f"rank 0 could not publish {root / name}: {outcome}")
    if after is not None and ctx.rank == 0:
        try:
            after()
        except OSError as e:  # the checkpoint is in place; a leftover older one is not worth failing the save
            logger.warning("%s: pruning after the save failed: %s", root, e)
    return root / name
