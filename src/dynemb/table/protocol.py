"""What every table offers: the seam between storage (KeyValueTable, StaticTable) and the layers above it.

Lookups, optimizers, checkpoints and exports use only this interface, so a dynamic and a static table run the same
code. A *row* is a storage position: rows ``0 .. size()-1`` of every column are live.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

__all__ = ["EmbeddingTable"]


@runtime_checkable
class EmbeddingTable(Protocol):
    """A table of rows keyed by int32/int64 keys.

    Attributes:
        dim, dtype, key_dtype, device: row width ``D``, value dtype, key dtype, where the rows live.
        initializer, seed: how a key's initial row is made (a pure function of ``(seed, key)`` for built-ins).
        clock: advances once per inserting lookup; rows written are stamped with it.
        max_capacity: most rows kept (``None``: unbounded).
        sparse_optimizer: the optimizer bound to the table (one per table), or None.
        sparse_grad: gradients recorded in backward and waiting for ``step()`` (step mode), or None.
        requires_grad: whether lookups with autograd pass gradients to the table (False: frozen).
    """

    dim: int
    dtype: torch.dtype
    key_dtype: torch.dtype
    device: torch.device
    seed: int
    clock: int
    max_capacity: Optional[int]
    sparse_optimizer: object
    sparse_grad: object
    requires_grad: bool

    @property
    def values(self) -> torch.Tensor:
        """``[capacity, D]`` value storage."""

    @property
    def scores(self) -> torch.Tensor:
        """``[capacity]`` int64 scores."""

    @property
    def row_keys(self) -> torch.Tensor:
        """``[capacity]`` the key stored in each row."""

    @property
    def slot_names(self) -> list[str]:
        """Names of the optimizer slot columns."""

    def slot(self, name: str) -> torch.Tensor:
        """``[capacity, d]`` storage of optimizer slot ``name``."""

    def cast(self, dtype: torch.dtype) -> None:
        """Convert the value rows to ``dtype`` (slots keep theirs)."""

    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        """Add an optimizer slot column (rows start at ``init``)."""

    def size(self) -> int:
        """Live rows."""

    def find_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """``[N]`` keys -> ``[N]`` int64 rows, ``-1`` where a key has none. Changes nothing."""

    def find_or_insert(self, keys: torch.Tensor, scores=None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of ``[N]`` unique keys, inserting missing ones: ``(rows [N], found [N] bool)``."""

    def initial_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """``[N, D]`` rows the initializer gives ``keys``."""

    def mark_updated(self, rows: torch.Tensor) -> None:
        """Stamp ``rows`` as written now (incremental checkpoints pick them up)."""

    def changes_since(self, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows written after clock version, keys deleted since)``."""

    def export(self):
        """Copies of every live row: ``Rows(keys, values, scores, slots)``."""

    def replace(self, rows) -> None:
        """Make the table hold exactly ``rows`` (a static table: overwrite those ids' rows)."""
