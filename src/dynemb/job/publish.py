"""``dynemb train --publish-every N``: versioned serving exports written while training, for ``dynemb serve --watch``.

The first publish is a full export, each later one a delta of the rows written since the previous (see
:func:`dynemb.checkpoint.export_for_serving`); each also carries the dense part (``dense=True``), so a server
following the run scores with the tables and the MLPs of one training step. Every version is written to a staging
directory and renamed into place before ``latest`` points at it: a watcher never sees half a version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from torch import nn

from ..checkpoint.export_format import export_for_serving
from ..table.checks import check_int

__all__ = ["Publisher", "EXPORT"]

EXPORT = "export"
"""The run directory's export root: where ``dynemb serve --model RUN`` looks, and where a run publishes by default."""


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
