"""Accessors shared by the tables whose row-aligned tensors live in one ``_cols`` dict."""

from __future__ import annotations

import torch

__all__ = ["RowColumns"]


class RowColumns:
    """``values``, ``scores`` and slot access over ``self._cols`` (and the slot names in ``self._slot_init``)."""

    _cols: dict
    _slot_init: dict

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
