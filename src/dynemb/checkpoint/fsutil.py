"""Crash-safe directory commits: write into a temp dir, fsync, rename; small JSON files and the ``latest`` pointer.

A checkpoint (or serving export) becomes visible only by the rename of its complete, fsynced temp directory, and
``latest`` moves only after that, by an atomic ``os.replace``. A process killed at any point therefore leaves the
previous ``latest`` pointing at a complete directory; what it leaves behind is a ``.tmp-*`` directory, ignored by
readers and removed by later pruning.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import CheckpointError

__all__ = ["staging", "write_json", "read_json", "write_pointer", "read_pointer", "remove_dir", "TMP_PREFIX",
           "LATEST"]

TMP_PREFIX = ".tmp-"
LATEST = "latest"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def staging(root: Path, name: str) -> Iterator[Path]:
    """Yield an empty temp dir in ``root``; when the block succeeds, publish it as ``root/name`` atomically.

    Raises:
        ValueError: ``root/name`` already exists.
    """
    if not root.is_dir():
        root.mkdir(parents=True)
        fsync_dir(root.parent)
    final = root / name
    if final.exists():
        raise ValueError(f"{final} already exists; checkpoints are never overwritten (delete it or pick another step)")
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
            fsync_dir(sub)
        fsync_dir(tmp)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, obj, *, atomic: bool = False) -> None:
    """Write ``obj`` as JSON and fsync; with ``atomic``, through a temp file and ``os.replace``."""
    target = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}") if atomic else path
    with open(target, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    if atomic:
        os.replace(target, path)
        fsync_dir(path.parent)


def read_json(path: Path) -> dict:
    """Parse a JSON object file, with errors naming it."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def write_pointer(root: Path, name: str, **info) -> None:
    """Point ``root/latest`` at the complete directory ``root/name``, atomically."""
    write_json(root / LATEST, {"name": name, **info}, atomic=True)


def read_pointer(root: Path) -> str | None:
    """The directory name ``root/latest`` points at, or None when there is no pointer."""
    if not (root / LATEST).is_file():
        return None
    name = read_json(root / LATEST).get("name")
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        raise CheckpointError(f"{root / LATEST}: 'name' must be a directory name, got {name!r}")
    return name


def remove_dir(path: Path) -> None:
    """Delete a directory so that readers never see it half-deleted: rename it to a temp name first."""
    trash = path.with_name(f"{TMP_PREFIX}{path.name}-deleted-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash)
