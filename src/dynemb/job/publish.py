"""``dynemb train --publish-every N``: versioned serving exports written while training, for ``dynemb serve --watch``.

The first publish is a full export, each later one a delta of the rows written since the previous (see
:func:`dynemb.checkpoint.export_for_serving`); each also carries the dense part (``dense=True``), so a server
following the run scores with the tables and the MLPs of one training step. Every version is written to a staging
directory and renamed into place before ``latest`` points at it: a watcher never sees half a version.

A published version is the model being trained at that step, not the best one so far: a server following the run
serves what training has now. :func:`serving_export` gives ``dynemb serve`` (without ``--watch``) an export of
the run's best model instead, or of its last.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Optional

from torch import nn

from ..checkpoint.export_format import export_for_serving
from ..checks import check_int

__all__ = ["Publisher", "EXPORT", "EXPORT_BEST", "serving_export", "run_lock"]

EXPORT = "export"
"""The run directory's export root: where ``dynemb serve --model RUN --watch`` looks, and where a run publishes by
default."""
EXPORT_BEST = "export-best"
"""The run directory's export root of its best model: what ``dynemb serve --model RUN`` serves by default."""
_SOURCE = "source.json"  # in EXPORT_BEST: {"step": N}, the best checkpoint its newest version was written from


def serving_export(run, use: str = "best") -> Path:
    """The export root that serves run ``run``'s best model (``use="last"``: its last one), written if needed.

    ``"best"``: ``RUN/export-best``, given a new full version whenever the best checkpoint changed since its newest
    one. ``"last"``: ``RUN/export`` (the versions ``--publish-every`` wrote; else one export of the last
    checkpoint, written once). Each version carries the MLPs (``dense=True``).

    Example:
        >>> # serving_export("runs/clicks")  ->  Path("runs/clicks/export-best"), holding the best model
    """
    from ..checkpoint.fsutil import read_json, write_json
    from .card import load_model, model_checkpoint

    run = Path(run)
    _, kind, step = model_checkpoint(run, use)
    root = run / (EXPORT_BEST if kind == "best" else EXPORT)
    with run_lock(run):  # servers started together write one version, not one each
        if kind == "last":
            if not (root / "latest").is_file():
                export_for_serving(root, load_model(run, use="last", optimizer=False)[0], dense=True)
            return root
        source = root / _SOURCE
        if not (root / "latest").is_file() or not source.is_file() or read_json(source).get("step") != step:
            export_for_serving(root, load_model(run, use="best", optimizer=False)[0], dense=True)
            write_json(source, {"step": step}, atomic=True)
    return root


@contextlib.contextmanager
def run_lock(run: Path):
    """An exclusive lock on run directory ``run`` (``RUN/.export.lock``, ``flock``) for as long as the block runs:
    processes that would each write a missing export (``dynemb serve`` processes started together) take turns, and
    the later ones find the export written. Where ``fcntl`` is missing (Windows) or the directory is read-only,
    no lock."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    try:
        handle = open(Path(run) / ".export.lock", "a+b")  # noqa: SIM115 (closed below)
    except OSError:  # a read-only run directory: nothing can be written there anyway
        yield
        return
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


class Publisher:
    """Writes a serving version of ``model`` to ``root`` every ``every`` training steps.

    Args:
        root: the export root (``RUN/export`` by default in ``dynemb train``).
        model: the model being trained (a collective call under torchrun: every rank publishes).
        every: steps between versions, >= 1.
        model_name: the model id the root's exports carry (see ``export_for_serving``).
        on_publish: called as ``on_publish(step, version_dir, model)`` after each version is in place (tests and
            benchmarks pace training with it, or score the model of that version).

    Example:
        >>> # trainer.fit(..., on_metrics=publisher.after)  publishes at steps N, 2N, ...; then
        >>> # publisher.publish(trainer.step)                 publishes the final step (if not published yet)
    """

    def __init__(self, root, model: nn.Module, every: int, model_name: Optional[str] = None,
                 on_publish: Optional[Callable[[int, Path, nn.Module], None]] = None) -> None:
        check_int(every, "publish_every", minimum=1)
        self.root, self.model, self.every, self.model_name = Path(root), model, every, model_name
        self.on_publish = on_publish
        self.published: list[tuple[int, Path]] = []  # (training step, version directory)

    def after(self, kind: str, row: dict) -> None:
        """An ``on_metrics`` hook of :meth:`dynemb.train.Trainer.fit`: publishes after every ``every``-th step."""
        if kind == "train" and row["step"] % self.every == 0:
            self.publish(row["step"])

    def publish(self, step: int) -> Optional[Path]:
        """Write the version of training step ``step`` (a full export first, then deltas); ``None`` when that step
        was published already."""
        if self.published and self.published[-1][0] == step:
            return None
        out = export_for_serving(self.root, self.model, incremental=bool(self.published), model_name=self.model_name,
                                 dense=True)
        self.published.append((step, out))
        if self.on_publish is not None:
            self.on_publish(step, out, self.model)
        return out
