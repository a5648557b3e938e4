"""Accessors shared by the tables whose row-aligned tensors live in one ``_cols`` dict."""

from __future__ import annotations

import torch

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
    #: how compiled lookups (``dynemb.functional.ops``) name this table; set when a module registers it
    op_handle = None

    @property
    def write_marks(self) -> dict:
        """Per stream (``"checkpoint"``, ``"serving"``): where this table was last written to or loaded from, and
        the clock that covers (see :mod:`dynemb.checkpoint.lineage`). Kept by the table, not in a registry."""
        marks = self.__dict__.get("_write_marks")
        if marks is None:
            marks = self.__dict__["_write_marks"] = {}
        return marks

    @property
    def values(self) -> torch.Tensor:
        """Value storage ``[capacity, D]``; rows ``0 .. size-1`` are live. Reallocated on growth: don't keep it."""
        return self._cols["value"]

    @property
    def scores(self) -> torch.Tensor:
        """Score storage ``[capacity]`` int64."""
        return self._cols["score"]

    def slot(self, name: str) -> torch.Tensor:
        """Storage ``[capacity, d]`` of optimizer slot ``name``."""
        return self._cols[f"slot:{name}"]

    @property
    def slot_names(self) -> list[str]:
        return list(self._slot_init)
