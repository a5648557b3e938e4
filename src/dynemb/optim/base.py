"""SparseOptimizer: the base of optimizers whose per-row state lives in the table's slot columns.

An optimizer updates only the rows a step touched (lazy semantics, like ``torch.optim.SparseAdam``): the values
and slot rows are gathered, updated with batched torch ops and scattered back. Per-row state therefore moves with
its row through eviction, export and checkpoints. Scalar state (step counters) is kept per table here.

Two modes:
- ``fused=False`` (default): backward records ``(keys, grad)`` per table; :meth:`step` applies them.
- ``fused=True``: backward applies the update at once and no gradient is kept (TorchRec/fbgemm style). With
  fused updates, look each table up once per step (EmbeddingCollection does) for results equal to step mode.
"""

from __future__ import annotations

import copy
from typing import Iterable

import torch

from ..functional import current_rows
from ..table import KeyValueTable
from ..table.static import StaticTable

__all__ = ["SparseOptimizer", "tables_of"]


def tables_of(obj) -> list:
    """The tables behind a DynamicEmbedding, an EmbeddingCollection, a table, or a list of those."""
    if isinstance(obj, (KeyValueTable, StaticTable)):
        return [obj]
    if hasattr(obj, "dynemb_tables"):
        return list(obj.dynemb_tables())
    table = getattr(obj, "table", None)
    if isinstance(table, (KeyValueTable, StaticTable)):
        return [table]
    if isinstance(obj, Iterable) and not isinstance(obj, torch.Tensor):
        return [t for item in obj for t in tables_of(item)]
    raise TypeError(
        "tables must be DynamicEmbedding, EmbeddingCollection, KeyValueTable or a list of them, "
        f"got {type(obj).__name__}"
    )


class SparseOptimizer:
    """Base class. Subclasses define ``slots`` and ``_update``.

    Args:
        tables: what to optimize (see :func:`tables_of`); ``None`` makes an unbound spec for a ``TableConfig``.
        fused: apply updates inside backward.
        **hparams: algorithm hyper-parameters (``lr``, ...).
    """

    #: slot name -> (width, initial value); width ``None`` means the table's ``dim``.
    slots: dict = {}

    def __init__(self, tables=None, *, fused: bool = False, **hparams) -> None:
        lr = hparams.get("lr")
        if lr is not None and (not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr < 0):
            raise ValueError(f"lr must be a float >= 0, got {lr!r}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {fused!r}")
        self.defaults = dict(hparams)
        self.fused = fused
        self.tables: list = []
        self._scalars: list[dict] = []
        if tables is not None:
            self.add_tables(tables)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"{type(self).__name__}({args}, fused={self.fused})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.defaults == other.defaults and self.fused == other.fused

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.defaults.items())), self.fused))

    @property
    def name(self) -> str:
        return type(self).__name__.lower()

    def slot_key(self, slot: str) -> str:
        return f"{self.name}.{slot}"

    def slot_widths(self, dim: int) -> dict:
        return {k: (dim if w is None else w, init) for k, (w, init) in self.slots.items()}

    def bind(self, tables) -> "SparseOptimizer":
        """A copy of this spec bound to ``tables`` (used by ``TableConfig(optimizer=...)``)."""
        bound = copy.copy(self)
        bound.defaults = dict(self.defaults)
        bound.tables, bound._scalars = [], []
        bound.add_tables(tables)
        return bound

    def add_tables(self, tables) -> None:
        for table in tables_of(tables):
            if any(t is table for t in self.tables):
                continue
            owner = table.sparse_optimizer
            if owner is not None and owner is not self:
                raise ValueError(f"table is already bound to {owner!r}; one optimizer per table")
            for slot, (width, init) in self.slot_widths(table.dim).items():
                table.add_slot(self.slot_key(slot), width, init=self._slot_init(slot, init))
            table.sparse_optimizer = self
            self.tables.append(table)
            self._scalars.append(self._initial_scalars())

    def _slot_init(self, slot: str, init) -> float:
        return float(self.defaults[init]) if isinstance(init, str) else float(init)

    def _initial_scalars(self) -> dict:
        return {"step": 0}

    # ------------------------------------------------------------------ stepping
    def apply_gradient(self, table, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Update ``rows`` (``[U]`` int64, unique, >= 0) of ``table`` with ``grad`` (``[U, D]``)."""
        i = next(i for i, t in enumerate(self.tables) if t is table)
        scalars = self._scalars[i]
        scalars["step"] += 1
        if rows.numel() == 0:
            return
        with torch.no_grad():
            self._update(table, rows, grad.float(), scalars)
        table.mark_updated(rows)

    def _update(self, table, rows: torch.Tensor, grad: torch.Tensor, scalars: dict) -> None:
        raise NotImplementedError

    def step(self) -> None:
        """Apply the gradients recorded since :meth:`zero_grad` (step mode; a no-op when fused)."""
        if self.fused:
            return
        for table in self.tables:
            pending = table.sparse_grad
            if pending is None or pending.empty():
                continue
            keys, rows, grad = pending.coalesce(with_rows=True)
            rows = current_rows(table, keys, rows)  # cheaper than a new find when rows are still current
            kept = rows >= 0  # keys evicted since forward lose their gradient, like any evicted row
            if not bool(kept.all()):
                rows, grad = rows[kept], grad[kept]
            self.apply_gradient(table, rows, grad)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for table in self.tables:
            pending = table.sparse_grad
            if pending is not None:
                pending.clear()

    # ------------------------------------------------------------------ helpers for subclasses
    @staticmethod
    def _gather(table, name: str | None, rows: torch.Tensor) -> torch.Tensor:
        source = table.values if name is None else table.slot(name)
        return source.index_select(0, rows).float()

    @staticmethod
    def _scatter(table, name: str | None, rows: torch.Tensor, value: torch.Tensor) -> None:
        target = table.values if name is None else table.slot(name)
        target.index_copy_(0, rows, value.to(target.dtype))

    @staticmethod
    def _add(table, name: str | None, rows: torch.Tensor, delta: torch.Tensor) -> None:
        """``target[rows] += delta`` for unique ``rows``. On float32 storage this is one read-modify-write pass
        (``index_add_``) instead of a gather and a scatter, each a random access per row. (Scale ``delta``
        beforehand: ``index_add_(..., alpha=)`` is several times slower on CPU.)"""
        target = table.values if name is None else table.slot(name)
        if target.dtype == torch.float32:
            target.index_add_(0, rows, delta)
        else:
            SparseOptimizer._scatter(table, name, rows, SparseOptimizer._gather(table, name, rows).add_(delta))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Hyper-parameters and per-table scalar state (JSON-able). Per-row state is in the tables' slots."""
        return {"type": type(self).__name__, "defaults": dict(self.defaults), "fused": self.fused,
                "tables": [dict(s) for s in self._scalars]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("type") != type(self).__name__:
            raise ValueError(f"state is for optimizer {state.get('type')!r}, not {type(self).__name__!r}")
        if len(state["tables"]) != len(self.tables):
            raise ValueError(f"state has {len(state['tables'])} tables, this optimizer has {len(self.tables)}")
        # JSON (checkpoint manifests) turns tuples such as Adam's betas into lists
        self.defaults.update({k: tuple(v) if isinstance(self.defaults.get(k), tuple) else v
                              for k, v in state["defaults"].items()})
        self._scalars = [dict(s) for s in state["tables"]]
