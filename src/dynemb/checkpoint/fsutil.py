"""Crash-safe directory commits: write into a temp dir, fsync, rename; small JSON files and the ``latest`` pointer.

A checkpoint (or serving export) becomes visible only by the rename of its complete, fsynced temp directory, and
``latest`` moves only after that, by an atomic ``os.replace``. A process killed at any point therefore leaves the
previous ``latest`` pointing at a complete directory; what it leaves behind is a ``.tmp-*`` entry, ignored by
readers. Every temp name ends in ``-<pid>-<random>-<host>`` (the writer's process id and a hash of its host name),
so the next :func:`open_staging` in that root on that host removes what dead writers left (:func:`remove_orphans`);
leftovers of other hosts go with ``keep_last`` pruning.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from .errors import CheckpointError

__all__ = ["staging", "open_staging", "publish", "abandon", "remove_orphans", "temp_name", "write_json", "read_json",
           "write_pointer", "read_pointer", "remove_dir", "TMP_PREFIX", "LATEST"]

TMP_PREFIX = ".tmp-"
LATEST = "latest"
#: ``<pid>-<random>-<host hash>`` at the end of every temp name this module makes
_WRITER = re.compile(r"-(?P<pid>\d+)-[0-9a-f]{8}-(?P<host>[0-9a-f]{8})$")


def _host() -> str:
    """A short hash of this host's name: temp names say which host wrote them without spelling the name out."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temp_name(name: str) -> str:
    """A temp name for ``name`` in the same directory: ``.tmp-<name>-<pid>-<random>-<host>``.

    Example:
        >>> temp_name("step-00000001").startswith(".tmp-step-00000001-")
        True
    """
    return f"{TMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{_host()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_orphans(root: Path) -> list[str]:
    """Remove the temp entries in ``root`` that writers on this host left when they died (a SIGKILLed save, an
    out-of-memory kill); returns their names. Entries of live processes, of other hosts and of unknown writers
    (names without the writer's id, of older dynemb versions) stay: only ``keep_last`` pruning removes those.
    """
    removed, host = [], _host()
    for entry in root.glob(TMP_PREFIX + "*"):
        match = _WRITER.search(entry.name)
        if match is None or match["host"] != host or _alive(int(match["pid"])):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
        removed.append(entry.name)
    return removed


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_staging(root: Path, name: str) -> Path:
    """Make an empty temp directory in ``root`` (created if needed) for what becomes ``root/name``, after removing
    what dead writers on this host left there (:func:`remove_orphans`).

    Raises:
        ValueError: ``root/name`` already exists.
    """
    if not root.is_dir():
        root.mkdir(parents=True)
        fsync_dir(root.parent)
    final = root / name
    if final.exists():
        raise ValueError(f"{final} already exists; checkpoints are never overwritten (delete it or pick another step)")
    remove_orphans(root)
    tmp = root / temp_name(name)
    tmp.mkdir()
    return tmp


def publish(tmp: Path, root: Path, name: str) -> Path:
    """fsync everything under the temp directory ``tmp``, then rename it to ``root/name`` atomically."""
    for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(sub)
    fsync_dir(tmp)
    os.rename(tmp, root / name)
    fsync_dir(root)
    return root / name


def abandon(tmp: Path) -> None:
    """Remove an unpublished temp directory and what was written into it."""
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def staging(root: Path, name: str) -> Iterator[Path]:
    """Yield an empty temp dir in ``root``; when the block succeeds, publish it as ``root/name`` atomically.

    Raises:
        ValueError: ``root/name`` already exists.
    """
    tmp = open_staging(root, name)
    try:
        yield tmp
        publish(tmp, root, name)
    except BaseException:
        abandon(tmp)
        raise


def write_json(path: Path, obj, *, atomic: bool = False) -> None:
    """Write ``obj`` as JSON and fsync; with ``atomic``, through a temp file and ``os.replace``."""
    target = path.with_name(temp_name(path.name)) if atomic else path
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
    trash = path.with_name(temp_name(f"{path.name}-deleted"))
    os.rename(path, trash)
    shutil.rmtree(trash)
