"""Accessors shared by the tables whose row-aligned tensors live in one ``_cols`` dict."""

from __future__ import annotations

import torch

from ..checks import VALUE_DTYPES, check_dtype
from .huge_pages import to_storage

__all__ = ["RowColumns"]


class RowColumns:
    """``values``, ``scores`` and slot access over ``self._cols`` (and the slot names in ``self._slot_init``), and
    the table state the layers above keep on a table (see :class:`~dynemb.table.protocol.EmbeddingTable`)."""

    _cols: dict
    _slot_init: dict
    #: the optimizer bound to this table (one per table); set by ``SparseOptimizer.add_tables``
    sparse_optimizer = None
    #: gradients recorded in backward and waiting for ``step()`` (step mode), a ``functional.SparseGrad``
    sparse_grad = None
    #: how compiled lookups (``dynemb.functional.custom_ops``) name this table; set when a module registers it
    op_handle = None
    #: whether lookups with autograd pass gradients to this table; False freezes it (``requires_grad_(False)``)
    requires_grad = True

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickle) carries no op handle: its original's would lead compiled lookups to the
        # original. The module that holds the copy registers it (whatever order a copier rebuilds them in).
        ledger = self.__dict__.get("_ledger")
        if ledger is not None and ledger.pending:  # a copy carries its size, not the group's device counter
            ledger.settle()
        state = self.__dict__.copy()
        state.pop("op_handle", None)
        state.pop("_ledger", None)
        return state

    @property
    def write_marks(self) -> dict:
        """Per stream (``"checkpoint"``, ``"serving"``): where this table was last written to or loaded from, and
        the clock that covers (see :mod:`dynemb.checkpoint.write_marks`). Kept by the table, not in a registry."""
        marks = self.__dict__.get("_write_marks")
        if marks is None:
            marks = self.__dict__["_write_marks"] = {}
        return marks

    def _column(self, name: str) -> torch.Tensor:
        """Column ``name`` as stored, for the hot accessors (``RowStore`` reads it without settling stamps)."""
        return self._cols[name]

    @property
    def values(self) -> torch.Tensor:
        """Value storage ``[capacity, D]``; rows ``0 .. size-1`` are live. Reallocated on growth: don't keep it."""
        return self._column("value")

    @property
    def scores(self) -> torch.Tensor:
        """Score storage ``[capacity]`` int64. Read it again after a lookup rather than keep it: a table may defer a
        lookup's stamps until they are read (``RowStore._defer_stamps``)."""
        return self._cols["score"]

    def cast(self, dtype: torch.dtype) -> None:
        """Convert the value rows to ``dtype`` (float32, float16 or bfloat16); new rows are made in it from then
        on. Optimizer slots keep their dtype (float32).

        Raises:
            TypeError: ``dtype`` is not a value dtype; nothing changes.
        """
        check_dtype(dtype, VALUE_DTYPES, "dtype")
        if dtype != self.dtype:
            self._cols["value"] = to_storage(self._cols["value"], dtype=dtype)
            self.dtype = dtype
            self.storage_generation = getattr(self, "storage_generation", 0) + 1

    def slot(self, name: str) -> torch.Tensor:
        """Storage ``[capacity, d]`` of optimizer slot ``name``."""
        return self._column(f"slot:{name}")

    @property
    def slot_names(self) -> list[str]:
        return list(self._slot_init)
