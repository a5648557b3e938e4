"""Where a table's gradient goes: straight into a fused optimizer, or kept (``SparseGrad``) until ``step()``."""

from __future__ import annotations

import warnings
import weakref
from typing import Callable, NamedTuple, Optional

import torch

from ..kernels.dispatch import Kernels, kernels_for
from ..table.ops import gather_rows
from .pooling import sorted_row_grad

__all__ = ["SparseGrad", "PooledGrad", "current_rows", "deliver_gradient", "deliver_pooled_gradient", "read_rows",
           "TableRows", "row_kernels"]


def row_kernels(table) -> Kernels:
    """The kernels of ``table``'s backend and device for work on its value rows (:meth:`Kernels.for_rows`: the row
    families serve float32 rows only)."""
    return kernels_for(table.backend, table.device).for_rows(table.dtype)


class PooledGrad(NamedTuple):
    """How the rows of one lookup sum a pooled gradient ``[B, D]``: row ``u`` sums ``weights[j] * grad[bag[j]]``
    over ``j in order[starts[u]:starts[u + 1]]`` (``order`` ``[N]``: the ids grouped by unique row, from the call's
    one sort; ``starts`` ``[U + 1]``; ``bag`` ``[N]`` int32 or int64: each id's bag, or None where id ``j`` is bag
    ``j``; ``weights`` ``[N]`` or None)."""

    order: Optional[torch.Tensor]
    starts: Optional[torch.Tensor]
    bag: Optional[torch.Tensor]
    weights: Optional[torch.Tensor]

class SparseGrad:
    """Gradients recorded for one table between ``zero_grad`` and ``step``: ``(keys, rows, grad)`` batches."""

    def __init__(self) -> None:
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    #: parts kept before they are summed into one, so that backward passes without a step stay bounded in memory
    MAX_PARTS = 8

    def add(self, keys: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        self._parts.append((keys, rows, grad.float()))
        if len(self._parts) > self.MAX_PARTS:
            self.coalesce()

    def empty(self) -> bool:
        return not self._parts

    def clear(self) -> None:
        self._parts.clear()

    def coalesce(self, with_rows: bool = False):
        """``(keys [U], grad [U, D])`` with each key once and its gradients summed; with ``with_rows``,
        ``(keys, rows, grad)`` where ``rows`` are the rows read in forward (-1 where batches were merged)."""
        if len(self._parts) > 1:
            keys, inverse = torch.unique(torch.cat([p[0] for p in self._parts]), return_inverse=True)
            grad = torch.cat([p[2] for p in self._parts])
            grad = torch.zeros(keys.numel(), grad.shape[1], device=grad.device).index_add_(0, inverse, grad)
            self._parts = [(keys, torch.full_like(keys, -1, dtype=torch.int64), grad)]
        keys, rows, grad = self._parts[0]
        return (keys, rows, grad) if with_rows else (keys, grad)



def current_rows(table, keys: torch.Tensor | Callable[[], torch.Tensor], rows: torch.Tensor,
                 moves: int | None = None) -> torch.Tensor:
    """``rows`` re-checked against the table: rows moved or reused since they were read are looked up again.
    (A static table's rows never move.) ``moves``: the table's ``row_moves`` when the lookup found ``rows``
    (every one >= 0 then); when the table says no row moved since (``rows_unmoved_since``), the check is
    skipped. ``keys`` may be a function that returns them, called only when the check runs."""
    if table.ids_are_rows:
        return rows
    if moves is not None and table.rows_unmoved_since(moves):
        return rows
    keys = _keys(keys)
    size = table.live_rows()
    check = kernels_for(table.backend, table.device).pool.rows_current  # optional in the pool family
    if check is not None and table.row_keys.is_contiguous() and check(table.row_keys, size, keys, rows):
        return rows
    stale = (rows < 0) | (rows >= size)
    stale |= gather_rows(table.row_keys, rows.clamp(0, max(size - 1, 0))) != keys
    if bool(stale.any()):  # all keys at once: a tiered table brings rows moved down since back up, pinning the rest
        rows = table.find_rows(keys)
    return rows



def _keys(keys: torch.Tensor | Callable[[], torch.Tensor]) -> torch.Tensor:
    return keys() if callable(keys) else keys


def deliver_gradient(table, keys: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
                     moves: int | None = None) -> None:
    """Hand the gradient ``grad [U, D]`` of ``keys [U]`` (read from ``rows [U]``) to the table's optimizer: applied
    at once when it is fused, else kept until ``step()``. Keys without a stored row lose their gradient, and a
    frozen table (``requires_grad`` False) all of it. ``moves``: as for :func:`current_rows`."""
    if not table.requires_grad:
        return
    rows = current_rows(table, keys, rows, moves)
    kept = rows >= 0  # keys not stored (admission, eviction) have no trainable row: their gradient is dropped
    if not bool(kept.all()):
        keys, rows, grad = keys[kept], rows[kept], grad[kept]
    optimizer = table.sparse_optimizer
    if optimizer is not None and optimizer.fused:
        optimizer.apply_gradient(table, rows, grad)
        return
    if optimizer is None and table not in _WARNED:  # the hot path's only cost: this check
        _warn_unbound(table)
    if table.sparse_grad is None:
        table.sparse_grad = SparseGrad()
    table.sparse_grad.add(keys, rows, grad)



#: the tables warned about gradients with no optimizer (once a table object; kept here, not written onto the table,
#: which functional/ knows only through the EmbeddingTable protocol)
_WARNED: "weakref.WeakSet" = weakref.WeakSet()


def _warn_unbound(table) -> None:
    """Warn, once per table object, that ``table`` got gradients with no optimizer bound to it: they accumulate
    (in its ``sparse_grad``) until an optimizer bound to it steps and zero_grads, which a model trained with only a
    ``torch.optim`` optimizer over its dense Parameters never does."""
    _WARNED.add(table)
    name = getattr(table, "name", None)
    what = f"table {name!r}" if name is not None else (
        f"a {type(table).__name__} (dim={table.dim}, key_dtype={table.key_dtype}, {table.size()} rows)")
    warnings.warn(f"{what} got gradients in backward but no optimizer is bound to it: they accumulate until an "
                  "optimizer bound to the table steps and zero_grads. Bind one, e.g. dynemb.optim.SGD([emb], lr=0.1) "
                  "or TableConfig(optimizer=dynemb.optim.SGD(lr=0.1)), or freeze the table with "
                  "requires_grad_(False). (Warned once per table.)", UserWarning, stacklevel=2)


def deliver_pooled_gradient(table, keys: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
                            pooled: PooledGrad, stamped_at: int | None = None, moves: int | None = None) -> None:
    """:func:`deliver_gradient` for a pooled gradient ``grad [B, D]`` (see :class:`PooledGrad`): a fused optimizer
    applies it straight (no ``[U, D]`` tensor) when every row is still current; otherwise the row gradient is
    built (by the ``row_grad`` kernel or torch) and delivered as usual. ``stamped_at``: the table's clock when the
    lookup touched (version-stamped) the rows; ``moves``: its ``row_moves`` then (see :func:`current_rows`).
    ``keys`` may be a function that returns them: a fused update of unmoved rows never calls it."""
    if not table.requires_grad:
        return
    optimizer = table.sparse_optimizer
    if optimizer is not None and optimizer.fused and current_rows(table, keys, rows, moves) is rows:
        stamped = stamped_at is not None and stamped_at == getattr(table, "clock", None)
        optimizer.apply_gradient(table, rows, grad, pooled, stamped)
        return
    kernels = row_kernels(table).pool
    if kernels and grad.dtype == torch.float32:
        row_grad = kernels.row_grad(grad, *pooled)
    else:
        row_grad = sorted_row_grad(grad, *pooled)
    deliver_gradient(table, _keys(keys), rows, row_grad, moves)



def read_rows(table, keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[U, D]`` rows of ``keys`` read from ``rows``; keys without a row (-1) get their initializer row."""
    values = gather_rows(table.values, rows.clamp(min=0))
    missing = (rows < 0).nonzero().squeeze(1)
    if missing.numel():
        values.index_copy_(0, missing, table.initial_rows(keys.index_select(0, missing)))
    return values



class TableRows(torch.autograd.Function):
    """Rows of unique keys as a differentiable ``[U, D]`` tensor; backward hands the gradient to the table."""

    @staticmethod
    def forward(ctx, anchor, table, keys, rows):
        ctx.table = table
        ctx.save_for_backward(keys, rows)
        return read_rows(table, keys, rows)

    @staticmethod
    def backward(ctx, grad):
        keys, rows = ctx.saved_tensors
        deliver_gradient(ctx.table, keys, rows, grad)
        return None, None, None, None
