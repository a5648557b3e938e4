"""Pooled lookups as registered custom ops (``torch.library``), so ``torch.compile`` sees one opaque op per table.

The hash table, its numba kernels and the optimizer update are Python and data-dependent: traced by Dynamo they would
break the graph (or crash, when Dynamo follows a call into numba). Under ``torch.compile`` a pooled lookup is instead
``dynemb::pooled_lookup``, whose fake kernel only states shapes (``[B, D]`` sums and ``U`` unique keys, a size known
only at run time, so they come padded to ``N`` with the count beside them), and whose backward is
``dynemb::pooled_backward``, which hands the row gradient to the table's optimizer. Both run the eager path's own
functions (find/insert, pooling straight from the table, the bag-sum backward, ``deliver_gradient``), so compiled and
eager results are bit-identical.

Tables cannot be op arguments, so an op names its table by a handle (``table.op_handle``) in a registry of weak
references, filled when an embedding module is built.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from ..table.ops import all_nonnegative
from .find import find_unique
from .grads import deliver_gradient, read_rows
from .pooling import bag_sum_grad

__all__ = ["register_table", "is_registered", "pooled_lookup_op", "anchor_of", "eager_anchor"]

_TABLES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_ANCHORS: dict[int, torch.Tensor] = {}


def register_table(table) -> int:
    """Give ``table`` the handle (``table.op_handle``) by which the custom ops reach it. Modules register their
    tables when they are built: compiled code cannot."""
    if table.op_handle is None:
        table.op_handle = id(table)
        _TABLES[table.op_handle] = table
        _ANCHORS[table.op_handle] = torch.empty(0, requires_grad=True)
        weakref.finalize(table, _ANCHORS.pop, table.op_handle, None)
    return table.op_handle


def is_registered(table) -> bool:
    """Whether ``table`` holds a handle of its own. A copy (deepcopy, pickle) comes without one
    (``RowColumns.__getstate__``); its module registers it."""
    return table.op_handle is not None and _TABLES.get(table.op_handle) is table


def eager_anchor(table) -> torch.Tensor:
    """The differentiable input of an eager lookup of ``table``: its op anchor when it has a handle (made once,
    where a new leaf costs microseconds a call), else a new leaf (a table copied without its module)."""
    return anchor_of(table) if table.op_handle is not None else torch.empty(0, requires_grad=True)


def anchor_of(table) -> torch.Tensor:
    """The table's op anchor: the one differentiable input of its lookups, so that autograd runs their backward
    (the table is no tensor). One per table, so no two tables' backward calls can be folded into one; made at
    registration because compiled code cannot create a tensor that requires grad. Its gradient is always empty."""
    return _ANCHORS[table.op_handle]


def _table(handle: int):
    table = _TABLES.get(handle)
    if table is None:
        raise RuntimeError(f"dynemb: the table of handle {handle} is gone (the compiled function outlived it)")
    return table


def _check_offsets(ids: torch.Tensor, offsets: torch.Tensor) -> None:
    """The data-dependent offset checks, made at run time inside the op (compiled code cannot make them)."""
    n = ids.numel()
    if offsets.numel() and bool(((offsets[0] != 0) | (offsets[1:] < offsets[:-1]).any() | (offsets[-1] > n)).item()):
        raise ValueError(f"offsets must start at 0, never decrease and stay <= the number of ids ({n})")


@torch.library.custom_op("dynemb::pooled_lookup", mutates_args=())
def pooled_lookup_op(anchor: torch.Tensor, handle: int, ids: torch.Tensor, offsets: torch.Tensor,
                     weights: Optional[torch.Tensor], train: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum-pooled rows of ``ids [N]`` in bags ``offsets [B]`` of table ``handle``; inserts when ``train``.

    Returns ``(sums [B, D], unique keys [N], their rows [N], inverse [N], count [])``: only the first ``count``
    unique keys and rows are real. Padding them to ``N`` keeps every shape static, so the compiler needs no
    data-dependent size.
    """
    table = _table(handle)
    _check_offsets(ids, offsets)
    with torch.set_grad_enabled(train):  # find_unique inserts only with grad mode on, as eager lookups do
        _, unique, rows, inverse, _ = find_unique(table, ids, train, checked=False)
    if all_nonnegative(rows):
        sums = F.embedding_bag(rows.index_select(0, inverse), table.values, offsets, mode="sum",
                               per_sample_weights=weights)
    else:  # keys without a row (admission) read their initializer row
        sums = F.embedding_bag(inverse, read_rows(table, unique, rows), offsets, mode="sum",
                               per_sample_weights=weights)
    n, count = ids.numel(), unique.numel()
    padded_keys = torch.zeros(n, dtype=ids.dtype, device=ids.device)
    padded_keys[:count] = unique
    padded_rows = torch.full((n,), -1, dtype=torch.int64, device=ids.device)
    padded_rows[:count] = rows
    return sums, padded_keys, padded_rows, inverse.clone(), torch.tensor(count, dtype=torch.int64)


@pooled_lookup_op.register_fake
def _(anchor, handle, ids, offsets, weights, train):
    table = _table(handle)
    n = ids.numel()
    return (torch.empty(offsets.shape[0], table.dim, dtype=table.dtype, device=ids.device),
            ids.new_empty(n), ids.new_empty(n, dtype=torch.int64), ids.new_empty(n, dtype=torch.int64),
            torch.empty((), dtype=torch.int64))


@torch.library.custom_op("dynemb::pooled_backward", mutates_args=())
def pooled_backward_op(handle: int, grad: torch.Tensor, unique: torch.Tensor, rows: torch.Tensor,
                       inverse: torch.Tensor, offsets: torch.Tensor, weights: Optional[torch.Tensor],
                       count: torch.Tensor) -> torch.Tensor:
    """Reduce ``grad [B, D]`` to the unique keys' rows and hand it to the table's optimizer. Returns an empty
    tensor: the gradient of the lookup's anchor, so the call stays in the backward graph."""
    u = int(count)
    deliver_gradient(_table(handle), unique[:u], rows[:u],
                     bag_sum_grad(grad.contiguous(), inverse, offsets, weights, u))
    return torch.zeros(0)


@pooled_backward_op.register_fake
def _(handle, grad, unique, rows, inverse, offsets, weights, count):
    return torch.zeros(0)


def _setup_context(ctx, inputs, output):
    _, handle, _, offsets, weights, _ = inputs
    _, unique, rows, inverse, count = output
    ctx.handle = handle
    ctx.save_for_backward(unique, rows, inverse, offsets, weights, count)


def _backward(ctx, grad, *unused):
    unique, rows, inverse, offsets, weights, count = ctx.saved_tensors
    done = pooled_backward_op(ctx.handle, grad, unique, rows, inverse, offsets, weights, count)
    return done, None, None, None, None, None


pooled_lookup_op.register_autograd(_backward, setup_context=_setup_context)
