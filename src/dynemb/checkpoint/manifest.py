"""Manifests: naming, reading and validating them, and following incremental chains."""

from __future__ import annotations

from pathlib import Path

from .errors import CheckpointError
from .fsutil import LATEST, TMP_PREFIX, read_json, read_pointer
from .checksum import FileRecord, record_from_json

__all__ = ["FORMAT", "SERVING_FORMAT", "FORMAT_VERSION", "MANIFEST", "checkpoint_name", "resolve", "read_manifest",
           "chain", "complete", "file_record"]

FORMAT = "dynemb.checkpoint"
SERVING_FORMAT = "dynemb.serving"
FORMAT_VERSION = 4
#: Version 1 named tables by module path (and merged stacked tables); version 2 names the user's tables; version 3
#: writes dtypes and initializers as dynemb.serialization names them ("float32", {"type": "uniform", ...}) where
#: version 2 wrote str(dtype) and class names, which tables.canonical_config reads; version 4 checks files with
#: xxh3-128 and names the algorithm in each file record, where versions 2 and 3 wrote {"sha256", "bytes"}, which
#: checksum.record_from_json reads (a dynemb that reads up to version 3 says so rather than missing the sha256).
MIN_FORMAT_VERSION = 2
MANIFEST = "manifest.json"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def resolve(path) -> Path:
    """The checkpoint directory ``path`` names: itself if it holds a manifest, else what ``path/latest`` says."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    name = read_pointer(path)
    if name is None:
        if not path.exists():
            raise CheckpointError(f"{path}: no such directory (expected a checkpoint: a directory with a {MANIFEST} "
                                  f"or a '{LATEST}' pointer)")
        if not path.is_dir():
            raise CheckpointError(f"{path}: a file, not a checkpoint (a directory with a {MANIFEST} or a '{LATEST}' "
                                  "pointer)")
        # a run directory (dynemb train --out) holds checkpoints rather than being one: name them
        inner = sorted(str(c) for c in path.iterdir() if c.is_dir() and ((c / MANIFEST).is_file()
                                                                         or (c / LATEST).is_file()))
        if inner:
            raise CheckpointError(f"{path}: a directory of checkpoints, not one (a run directory?); give one of "
                                  f"{', '.join(inner)}")
        raise CheckpointError(f"{path}: no checkpoint here (neither a {MANIFEST} nor a '{LATEST}' pointer)")
    return path / name


def read_manifest(directory: Path, fmt: str = FORMAT) -> dict:
    """Read ``directory/manifest.json`` and check its format and version."""
    file = directory / MANIFEST
    manifest = read_json(file)
    if manifest.get("format") != fmt:
        raise CheckpointError(f"{file}: 'format' is {manifest.get('format')!r}, expected {fmt!r}")
    version = manifest.get("format_version")
    if not isinstance(version, int) or not MIN_FORMAT_VERSION <= version <= FORMAT_VERSION:
        raise CheckpointError(f"{file}: 'format_version' is {version!r}; this dynemb reads versions "
                              f"{MIN_FORMAT_VERSION} to {FORMAT_VERSION} (version 1, of dynemb 0.1, named tables "
                              "by their storage layout; a newer version was written by a newer dynemb)")
    return manifest


def chain(directory: Path, fmt: str = FORMAT) -> list[tuple[Path, dict]]:
    """``(directory, manifest)`` of the full checkpoint and every delta up to ``directory``, oldest first."""
    links = []
    while True:
        manifest = read_manifest(directory, fmt)
        links.append((directory, manifest))
        if manifest.get("kind") == "full":
            return links[::-1]
        parent = manifest.get("parent")
        if not isinstance(parent, str) or not parent or "/" in parent or parent.startswith("."):
            raise CheckpointError(f"{directory / MANIFEST}: an incremental checkpoint needs a 'parent' directory "
                                  f"name, got {parent!r}")
        if any(d.name == parent for d, _ in links):
            raise CheckpointError(f"{directory / MANIFEST}: parent {parent!r} makes the chain a cycle")
        directory = directory.parent / parent
        if not (directory / MANIFEST).is_file():
            raise CheckpointError(f"{links[-1][0] / MANIFEST}: its parent checkpoint {directory} is missing; an "
                                  "incremental checkpoint needs its whole chain")


def complete(root: Path, fmt: str = FORMAT) -> dict[str, dict]:
    """Manifests of the complete directories in ``root`` by name (temp directories are ignored)."""
    if not root.is_dir():
        return {}
    return {d.name: read_manifest(d, fmt) for d in sorted(root.iterdir())
            if not d.name.startswith(TMP_PREFIX) and (d / MANIFEST).is_file()}


def file_record(manifest: dict, directory: Path, rel: str) -> FileRecord:
    """The checksum record the manifest keeps for file ``rel`` (either form, see :mod:`.checksum`)."""
    files = manifest.get("files")
    return record_from_json(files.get(rel) if isinstance(files, dict) else None,
                            f"{directory / MANIFEST}: file {rel!r}")
