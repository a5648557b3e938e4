"""``dynemb serve --watch``: apply the new versions of the served export, in order, while serving.

A background thread reads the export root's ``latest`` pointer every ``interval_s``. When it names a version above
the one served, the versions in between (``version-<n>`` directories, full or delta) are applied one by one in
increasing order through :meth:`ServedModel.apply_update`, so a delta is never applied before its parent. Requests
keep being answered meanwhile; the parameter server swaps rows under its locks (no torn rows). A version that fails
to apply is reported (once while its error stays the same) and retried at every poll; later versions wait for it.
A full version whose rows are of another dtype than the ones served (``dynemb export --dtype``) is served in its own
dtype, as a server started on it would serve it (the parameter server installs it as a load does).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path
from typing import Optional

from ..checkpoint.fsutil import read_pointer
from . import WATCH_INTERVAL_S
from .model import ServedModel

__all__ = ["ExportWatcher", "pending_versions", "wait_for_export", "WATCH_INTERVAL_S"]

log = logging.getLogger(__name__)
_VERSION = re.compile(r"^version-(\d+)$")


def pending_versions(root: Path, served: int) -> list[Path]:
    """The version directories of export ``root`` above ``served``, up to the one ``latest`` names, in order."""
    name = read_pointer(Path(root))
    match = _VERSION.match(name or "")
    if match is None or int(match.group(1)) <= served:
        return []
    newest = int(match.group(1))
    found = {int(m.group(1)): p for p in Path(root).iterdir() if (m := _VERSION.match(p.name)) and p.is_dir()}
    return [found[v] for v in sorted(found) if served < v <= newest]


def wait_for_export(root: Path, interval_s: float, timeout_s: Optional[float] = None,
                    echo=print) -> None:
    """Wait until export ``root`` has a version (a training run publishing there has written its first one).

    Raises:
        TimeoutError: none came within ``timeout_s``.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    told = False
    while read_pointer(Path(root)) is None:
        if not told:
            echo(f"waiting for the first version in {root} (dynemb train --publish-every writes it)", flush=True)
            told = True
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no version appeared in {root} within {timeout_s} s")
        time.sleep(interval_s)


class ExportWatcher:
    """Polls ``model.export`` and applies new versions in order (see the module docstring).

    Args:
        model: the served model.
        interval_s: seconds between polls, > 0.

    Raises:
        ValueError: ``interval_s`` is not positive.
    """

    def __init__(self, model: ServedModel, interval_s: float = WATCH_INTERVAL_S) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.model, self.interval_s = model, interval_s
        self.version = model.version
        self.applied: list[int] = []
        self.errors = 0
        self._failure: Optional[tuple] = None  # (version directory, error) last logged
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> list[int]:
        """Apply every pending version now, in order; returns the versions applied (stops at the first failure)."""
        done = []
        for directory in pending_versions(self.model.export, self.version):
            version = int(_VERSION.match(directory.name).group(1))
            try:
                self.model.apply_update(directory)
            except Exception as exc:  # noqa: BLE001 - the server keeps serving the version it has
                self.errors += 1
                # once a version and error: a refused version is retried at every poll, and an operator's log
                # should not fill with the same line each interval_s
                failure = (directory.name, str(exc))
                report = log.error if failure != self._failure else log.debug
                report("dynemb serve --watch: cannot apply %s (%s); retrying at every poll (logged again when the "
                       "error changes)", directory, exc)
                self._failure = failure
                break
            self._failure = None
            log.info("dynemb serve --watch: now serving version %d (%s)", version, directory.name)
            self.version = version
            done.append(version)
        self.applied += done
        return done

    def start(self) -> "ExportWatcher":
        self._thread = threading.Thread(target=self._loop, name="dynemb-export-watch", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
