"""Where numba keeps the compiled CPU kernels: one directory per version of ``kernels/``'s sources.

numba's own cache (``cache=True``) sits in ``__pycache__`` beside each source file and is keyed by that file alone,
so a kernel whose helper lives in another file (``numba_math``'s intrinsics, ``numba_index._mix64``) would keep its
stale machine code after the helper changed, and it is keyed by the checkout's path, so a new clone or worktree
compiles everything again. Every cached kernel module imports this one before its first
``@numba.njit(cache=True)``; it puts a cache locator first in numba's list that, for the files of this package
only, uses ``~/.cache/dynemb/numba/<key>``, where the key hashes every ``.py`` file of this package with the numba
and Python versions. Any change to any kernel file starts a fresh directory; an unchanged checkout anywhere finds
its kernels compiled.

A cache directory the user chose (``NUMBA_CACHE_DIR``, read by numba into ``numba.config.CACHE_DIR``) is used as
numba uses it. Where the home directory cannot be written, numba's default place applies. Directories of other
keys unused for :data:`STALE_DAYS` are removed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

import numba
import numba.core.caching

__all__ = ["cache_key", "cache_root", "STALE_DAYS"]

STALE_DAYS = 14
_HERE = Path(__file__).resolve().parent


def cache_key(sources: Path | None = None) -> str:
    """A hex digest of the ``.py`` files of ``sources`` (by name and bytes; default: this package), numba's version
    and Python's.

    Example:
        >>> len(cache_key()), cache_key() == cache_key()
        (16, True)
    """
    sha = hashlib.sha256(f"{numba.__version__} {sys.version_info[:2]}".encode())
    for path in sorted((sources or _HERE).glob("*.py")):
        sha.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return sha.hexdigest()[:16]


def cache_root() -> Path:
    """The directory that holds one cache directory per key."""
    return Path.home() / ".cache" / "dynemb" / "numba"


class _SourcesLocator(numba.core.caching._CacheLocator):  # the base of numba's own locators
    """numba's cache locator for the files of this package: one directory per :func:`cache_key`, whatever the
    checkout's path or the files' times; other files go to the next locator of numba's list."""

    def __init__(self, py_func, path: Path) -> None:
        self._path, self._lineno = path, py_func.__code__.co_firstlineno

    @classmethod
    def from_function(cls, py_func, py_file):
        if numba.config.CACHE_DIR or Path(py_file).resolve().parent != _HERE:  # the user's directory, or not ours
            return None
        self = cls(py_func, _directory())
        try:
            self.ensure_cache_path()
        except OSError:  # an unwritable home: numba's default place
            return None
        return self

    def get_cache_path(self) -> str:
        return str(self._path)

    def get_source_stamp(self) -> str:
        return self._path.name  # the key: the directory changes with any source, so nothing in it is stale

    def get_disambiguator(self) -> str:
        return str(self._lineno)



@functools.cache
def _directory() -> Path:
    """This key's directory; directories of other keys unused for :data:`STALE_DAYS` are removed on the way."""
    root, key = cache_root(), cache_key()
    target = root / key
    cutoff = time.time() - STALE_DAYS * 86400
    if root.is_dir():
        for other in root.iterdir():
            if other.name != key and other.is_dir() and other.stat().st_mtime < cutoff:
                shutil.rmtree(other, ignore_errors=True)
    target.mkdir(parents=True, exist_ok=True)
    os.utime(target)  # marks it used
    return target


def _install() -> None:
    impl = getattr(numba.core.caching, "CacheImpl", None) or getattr(numba.core.caching, "_CacheImpl", None)
    classes = getattr(impl, "_locator_classes", None)  # CacheImpl since numba 0.61, _CacheImpl before
    if isinstance(classes, list) and _SourcesLocator not in classes:  # a numba without the list: its default place
        classes.insert(0, _SourcesLocator)


_install()
