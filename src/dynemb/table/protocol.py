"""What every table offers: the seam between storage (KeyValueTable, StaticTable) and the layers above it.

Lookups, optimizers, checkpoints and exports use only this interface, so a dynamic and a static table run the same
code. A *row* is a storage position: rows ``0 .. size()-1`` of every column are live.
"""

from __future__ import annotations

import functools
from typing import Optional, Protocol, runtime_checkable

import torch

__all__ = ["EmbeddingTable", "is_table"]


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
        backend: the kernel backend of its operations (see :mod:`dynemb.kernels.dispatch`; None: the process
            default); ``torch`` runs no numba or Triton code.
        ids_are_rows: a key is its own row (a static table): nothing is found, inserted or moved.
        counts_occurrences: inserts need each key's number of occurrences (lfu scores, admission count them).
        keys_may_repeat: ``lookup_rows`` of a batch with repeated keys has the effects of the deduplicated batch
            with its counts (so a lookup may find every occurrence and group by row afterwards).
        row_moves: advances whenever a stored key may have moved to another row (see ``rows_unmoved_since``).
        op_handle: how compiled lookups name the table (set when a module registers it), or None.
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
    backend: object
    ids_are_rows: bool
    counts_occurrences: bool
    keys_may_repeat: bool
    op_handle: Optional[int]

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

    def check_ids(self, ids: torch.Tensor, name: str = "ids") -> torch.Tensor:
        """``ids`` validated for a lookup (dtype, device; a static table's range), flattened to ``[N]``."""

    def lookup_rows(self, keys: torch.Tensor, *, insert: bool, counts: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, bool]:
        """What a lookup asks of a table: ``(rows [N] int64, every key has a row)`` of checked keys ``[N]``, found
        or, with ``insert``, found or inserted as ``find_or_insert`` does (``counts [N]``: each key's occurrences,
        >= 1). No ``found`` tensor is built: on a small batch it costs more than the kernel that finds the rows."""

    def rows_unmoved_since(self, moves: int) -> bool:
        """Whether every row read when ``row_moves`` was ``moves`` still holds the key it held then."""

    def live_rows(self) -> int:
        """Rows ``0 .. live_rows()-1`` of the columns hold keys."""

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


#: the methods by which :func:`is_table` knows a table
_MARKS = ("lookup_rows", "find_or_insert", "find_rows", "export", "replace")


def is_table(obj) -> bool:
    """Whether ``obj`` is an :class:`EmbeddingTable`, judged by its class's methods. ``isinstance(obj,
    EmbeddingTable)`` reads every attribute of the protocol, properties included (100 us, and reading ``scores``
    writes a table's deferred stamps): lookups ask this instead.

    Example:
        >>> from dynemb.table import KeyValueTable
        >>> is_table(KeyValueTable(2)), is_table(torch.zeros(2))
        (True, False)
    """
    return _is_table_type(type(obj))


@functools.lru_cache(maxsize=64)
def _is_table_type(kind: type) -> bool:
    return all(callable(getattr(kind, name, None)) for name in _MARKS)
