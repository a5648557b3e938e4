"""Admission: a new key gets a stored, trained row only after it has been seen ``threshold`` times.

Counts are exact and memory-bounded: candidates are counted in a small LFU :class:`KeyValueTable` of at most
``max_tracked`` keys (26-52 bytes of index and ~28 bytes of row state per int64 key). When more candidates are
pending, the least-seen ones are forgotten and start over, so admission can come later than ``threshold``, never
earlier. A count-min sketch would over-count under collisions and could admit a key too early. Once admitted, a
key's counter is dropped.

The table that owns an admission filter builds that counting table (:meth:`FrequencyAdmission.attach`), so this
module imports no table class and the table module imports this one without a cycle.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..checks import check_int
from ..serialization import Serializable, serializable
from .rows import Rows

__all__ = ["FrequencyAdmission"]


@serializable("frequency")
class FrequencyAdmission(Serializable):
    """Admit a key on its ``threshold``-th sighting (each occurrence in a batch counts).

    Args:
        threshold: sightings needed; 1 admits every key.
        max_tracked: most candidate keys counted at once.

    As a config it is ``(threshold, max_tracked)``: two filters with equal settings are equal, whatever they
    counted, and ``to_dict``/``from_dict`` give ``{"type": "frequency", "threshold": ..., "max_tracked": ...}``.

    Example:
        >>> from dynemb.table import KeyValueTable
        >>> t = KeyValueTable(2, admission=FrequencyAdmission(2))
        >>> _ = t.find_or_insert(torch.tensor([5, 6, 6]))
        >>> t.contains(torch.tensor([5, 6])).tolist()
        [False, True]
    """

    def __init__(self, threshold: int, max_tracked: int = 1 << 20) -> None:
        self.threshold = check_int(threshold, "threshold", minimum=1)
        self.max_tracked = check_int(max_tracked, "max_tracked", minimum=1)
        self._counts = None
        self._new_counter: Callable[[int], Any] | None = None

    def attach(self, new_counter: Callable[[int], Any]) -> None:
        """Called by the table that owns this filter: ``new_counter(max_tracked)`` builds the empty LFU table
        (its own key dtype and device, one value per key) in which candidates are counted, on first need."""
        self._new_counter = new_counter

    def admit(self, keys: torch.Tensor, unique: torch.Tensor, occurrences: torch.Tensor | None = None) -> torch.Tensor:
        """Count ``keys`` (``[N]``, every occurrence of absent keys, or each standing for ``occurrences``) and say
        which of ``unique`` are admitted."""
        if self.threshold == 1:
            return torch.ones(unique.numel(), dtype=torch.bool, device=unique.device)
        counts = self._counter()
        counts.find_or_insert(keys, counts=occurrences)
        rows = counts.find_rows(unique)
        seen = torch.where(rows >= 0, counts.scores.index_select(0, rows.clamp(min=0)), 0)
        admitted = seen >= self.threshold
        counts.erase(unique[admitted])
        return admitted

    def _counter(self):
        if self._counts is None:
            if self._new_counter is None:
                raise RuntimeError("this FrequencyAdmission counts nothing until a table owns it (admission=...)")
            self._counts = self._new_counter(self.max_tracked)
        return self._counts

    @property
    def counter(self):
        """The table counting pending candidates (keys and their counts as LFU scores), or None before any."""
        return self._counts

    def restore(self, keys: torch.Tensor, counts: torch.Tensor) -> None:
        """Make the pending candidates exactly ``keys [M]`` with ``counts [M]`` (int64), in that row order."""
        if self._counts is None and keys.numel() == 0:
            return
        table = self._counter()
        values = torch.zeros(keys.numel(), 1, dtype=table.dtype, device=keys.device)
        table.replace(Rows(keys, values, counts, {}))

    def _config_fields(self) -> dict:
        return {"threshold": self.threshold, "max_tracked": self.max_tracked}

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and self._config_fields() == other._config_fields()

    def __hash__(self) -> int:
        return hash((self.threshold, self.max_tracked))

    def __repr__(self) -> str:
        return f"FrequencyAdmission(threshold={self.threshold}, max_tracked={self.max_tracked})"

    def describe(self) -> dict:
        """The record kept in checkpoint manifests: :meth:`to_dict`."""
        return self.to_dict()
