"""SparseOptimizer: the base of optimizers whose per-row state lives in the table's slot columns.

An optimizer updates only the rows a step touched (lazy semantics, like ``torch.optim.SparseAdam``): the values
and slot rows are gathered, updated with batched torch ops and scattered back. Per-row state therefore moves with
its row through eviction, export and checkpoints. Scalar state (step counters) is kept per table here.

Each optimizer is a ``torch.optim.Optimizer`` with one param group per bound table, so torch's LR schedulers
drive it: a group's ``lr`` (and every other hyper-parameter in it) is what that table's next update uses.

Two modes:
- ``fused=False`` (default): backward records ``(keys, grad)`` per table; :meth:`step` applies them.
- ``fused=True``: backward applies the update at once and no gradient is kept (TorchRec/fbgemm style). With
  fused updates, look each table up once per step (EmbeddingCollection does) for results equal to step mode.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Iterable

import torch

from ..functional import current_rows
from ..functional.grads import PooledGrad, row_kernels
from ..functional.pooling import sorted_row_grad
from ..serialization import Serializable, lookup, type_name
from ..table.protocol import is_table

__all__ = ["SparseOptimizer", "GroupsOptimizer", "tables_of"]

_NO_CONTEXT = contextlib.nullcontext()


def tables_of(obj) -> list:
    """The tables behind a DynamicEmbedding, an EmbeddingCollection, a table, or a list of those."""
    if is_table(obj):
        return [obj]
    if hasattr(obj, "dynemb_tables"):
        return list(obj.dynemb_tables())
    table = getattr(obj, "table", None)
    if is_table(table):
        return [table]
    if isinstance(obj, Iterable) and not isinstance(obj, torch.Tensor):
        return [t for item in obj for t in tables_of(item)]
    raise TypeError(
        "tables must be DynamicEmbedding, EmbeddingCollection, KeyValueTable or a list of them, "
        f"got {type(obj).__name__}"
    )


class GroupsOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose param groups hold no Parameters: a table's hyper-parameters, or the groups
    of other optimizers. torch's LR schedulers need exactly this (an ``Optimizer`` with ``param_groups``); step
    hooks and profiling work as for any torch optimizer. Copies and pickles keep every attribute (torch's own
    ``__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``)."""

    def _init_groups(self, defaults: dict) -> None:
        """``torch.optim.Optimizer.__init__`` with no group yet (it insists on one: an empty one, dropped)."""
        super().__init__([{"params": []}], defaults)
        self.param_groups.clear()

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._patch_step_function()


class SparseOptimizer(GroupsOptimizer, Serializable):
    """Base class. Subclasses define ``slots`` and ``_update``, and register their :attr:`kind` with
    ``@serializable("<kind>")``.

    Args:
        tables: what to optimize (see :func:`tables_of`); ``None`` makes an unbound spec for a ``TableConfig``.
        fused: apply updates inside backward.
        **hparams: algorithm hyper-parameters (``lr``, ...): the ``defaults``.

    A spec is a config (:mod:`dynemb.serialization`): ``to_dict()`` gives its kind, hyper-parameters and
    ``fused`` (not its tables or state), and ``SparseOptimizer.from_dict`` builds an unbound spec of that kind.

    ``param_groups`` holds one group per table, in the order of ``tables``: a dict of the table's hyper-parameters,
    ``defaults`` when it is bound, as torch builds a param group (its ``"params"`` is empty: a table is not a
    Parameter). Each update reads its table's group, so a torch LR scheduler (``StepLR``, ``LambdaLR`` with one
    function per table, ...) or an edit of ``group["lr"]`` sets the lr of the next update. :meth:`state_dict`
    saves the groups (with the scheduler's ``initial_lr``); an unbound spec has none.

    Example:
        >>> import dynemb
        >>> emb = dynemb.DynamicEmbedding(2, initializer="zeros")
        >>> opt = dynemb.optim.SGD([emb], lr=1.0)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> for _ in range(2):
        ...     emb(torch.tensor([7])).sum().backward(); opt.step(); opt.zero_grad(); sched.step()
        >>> emb.find(torch.tensor([7])).tolist(), opt.param_groups[0]["lr"]  # steps of lr 1.0, then 0.5
        ([[-1.5, -1.5]], 0.25)
    """

    #: slot name -> (width, initial value); width ``None`` means the table's ``dim``.
    slots: dict = {}
    _not_config = ("tables",)
    #: whether an update reads a statistic of the whole row (RowWiseAdagrad's mean square): a column shard of the
    #: table then gets the other shards' parts of it (:meth:`share_row_squares`) before it updates
    row_statistic: bool = False

    def __init__(self, tables=None, *, fused: bool = False, **hparams) -> None:
        lr = hparams.get("lr")
        if lr is not None and (not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr < 0):
            raise ValueError(f"lr must be a float >= 0, got {lr!r}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {fused!r}")
        self.fused = fused
        self._unbind(dict(hparams))
        if tables is not None:
            self.add_tables(tables)

    def _unbind(self, defaults: dict) -> None:
        """No tables, no groups, fresh torch optimizer state (hooks)."""
        self._init_groups(defaults)
        self.tables: list = []
        self._scalars: list[dict] = []

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.defaults.items())
        return f"{type(self).__name__}({args}, fused={self.fused})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.defaults == other.defaults and self.fused == other.fused

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(self.defaults.items())), self.fused))

    @property
    def kind(self) -> str | None:
        """The optimizer's kind: the registered type name of its class or of the nearest registered base
        (``"sgd"``, ``"adagrad"``, ``"rowwise_adagrad"``, ``"adam"``, ``"ftrl"``), which the kernels,
        ``TrainConfig.optimizer``, the CLI and saved state use; None for one of no registered kind
        (``OptimizerWrapper``)."""
        return _kind_of(type(self))

    @property
    def name(self) -> str:
        """The prefix of its slot columns (``"rowwiseadagrad.sum"``): kept as files of dynemb 0.1 name them."""
        return type(self).__name__.lower()

    def _config_fields(self) -> dict:
        return {**self.defaults, "fused": self.fused}

    def slot_key(self, slot: str) -> str:
        return f"{self.name}.{slot}"

    def slot_widths(self, dim: int) -> dict:
        return {k: (dim if w is None else w, init) for k, (w, init) in self.slots.items()}

    def bind(self, tables) -> "SparseOptimizer":
        """A copy of this spec bound to ``tables`` (used by ``TableConfig(optimizer=...)``)."""
        bound = copy.copy(self)
        bound._unbind(dict(self.defaults))
        bound.add_tables(tables)
        return bound

    def add_tables(self, tables) -> None:
        """Bind more tables: each gets its slots and a param group of the ``defaults``."""
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
            self.add_param_group({"params": []})

    def _slot_init(self, slot: str, init) -> float:
        return float(self.defaults[init]) if isinstance(init, str) else float(init)

    def _initial_scalars(self) -> dict:
        return {"step": 0}

    # ------------------------------------------------------------------ stepping
    def _index(self, table) -> int:
        return next(i for i, t in enumerate(self.tables) if t is table)

    def kernel_slots(self, table) -> tuple[str, tuple[str, ...]] | None:
        """``(kind, slot column names)`` of the ``sparse_update`` kernel that would update ``table`` (bound here),
        or None when no kernel implements this optimizer or a slot is not float32: what a grouped update needs to
        know before it runs (:mod:`dynemb.functional.grouped`)."""
        i = self._index(table)
        scalars = self._scalars[i]
        args = self.kernel_args(self.param_groups[i], {**scalars, "step": scalars["step"] + 1})  # the next update's
        if args is None:
            return None
        kind, _, slots = args
        keys = tuple(self.slot_key(name) for name in slots)
        if any(table.slot(k).dtype != torch.float32 for k in keys):
            return None
        return kind, keys

    def next_update(self, table) -> tuple[str, tuple]:
        """Count one update of ``table`` (its step, as :meth:`apply_gradient` does) and return the kernel's ``(kind,
        hparams)`` for it, from the table's param group: a grouped update applies it in one launch for many tables
        (only for an optimizer with a kernel, :meth:`kernel_slots`)."""
        i = self._index(table)
        scalars = self._scalars[i]
        scalars["step"] += 1
        kind, hparams, _ = self.kernel_args(self.param_groups[i], scalars)
        return kind, hparams

    def apply_gradient(self, table, rows: torch.Tensor, grad: torch.Tensor, pooled: PooledGrad | None = None,
                       stamped: bool = False) -> None:
        """Update ``rows`` (``[U]`` int64, unique, >= 0) of ``table`` with the hyper-parameters of the table's param
        group. The gradient is ``grad [U, D]``, or with ``pooled``, the pooled gradient ``grad [B, D]`` that each
        row sums over its ids (see :class:`PooledGrad`): a kernel then applies it without a ``[U, D]`` tensor.
        ``stamped``: the rows already carry the table's current version stamp (a fused update right after the
        lookup that touched them), so :meth:`mark_updated` is skipped."""
        i = self._index(table)
        scalars = self._scalars[i]
        scalars["step"] += 1
        shared = table.__dict__.pop("shared_row_squares", None)
        if rows.numel() == 0:
            return
        group = self.param_groups[i]
        if shared is not None:  # a column shard: the row statistic spans the other shards' columns too
            with torch.no_grad():
                self._update_shared(table, rows, grad.float(), group, scalars, shared)
            if not stamped:
                table.mark_updated(rows)
            return
        kernels = row_kernels(table).optim
        args = self.kernel_args(group, scalars) if kernels else None
        # a fused update runs in the backward, already without grad: entering no_grad again costs microseconds
        with torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT:
            if args is not None and all(table.slot(self.slot_key(n)).dtype == torch.float32 for n in args[2]):
                kind, hparams, slots = args
                p = pooled if pooled is not None else PooledGrad(None, None, None, None)
                kernels.sparse_update(kind, hparams, table.values, tuple(table.slot(self.slot_key(n)) for n in slots),
                                      rows, grad.float().contiguous(), *p)
            else:
                if pooled is not None:
                    grad = sorted_row_grad(grad, *pooled)
                self._update(table, rows, grad.float(), group, scalars)
        if not stamped:
            table.mark_updated(rows)

    # ------------------------------------------------------------------ column shards
    def row_square_part(self, table, grad: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``[U]``: this column shard's part of each row's statistic for an update by ``grad [U, d]`` of rows that
        hold ``values [U, d]`` (only where :attr:`row_statistic`)."""
        raise NotImplementedError

    def share_row_squares(self, table, keys: torch.Tensor, others: torch.Tensor, dim: int) -> None:
        """Before the next update of ``table`` (a column shard of a ``dim``-wide table), record ``others [U]``, the
        other shards' parts of the statistic of the rows of ``keys [U]`` (unique, the table's keys). Several
        backwards before one ``step()`` add up."""
        keys, others = keys.to(torch.int64), others.float()
        previous = table.__dict__.get("shared_row_squares")
        if previous is not None:
            keys, inverse = torch.unique(torch.cat([previous.keys, keys]), return_inverse=True)
            others = torch.zeros(keys.numel(), device=others.device).index_add_(
                0, inverse, torch.cat([previous.others, others]))
        else:
            keys, order = torch.sort(keys)
            others = others.index_select(0, order)
        table.shared_row_squares = SharedRowSquares(keys, others, dim)

    def _update_shared(self, table, rows, grad, group, scalars, shared: "SharedRowSquares") -> None:
        raise NotImplementedError

    def kernel_args(self, group: dict, scalars: dict) -> tuple[str, tuple, tuple] | None:
        """``(kind, hparams, slot names)`` of the ``sparse_update`` kernel contract (:mod:`dynemb.kernels.dispatch`)
        for the next update of a table with param group ``group`` and scalar state ``scalars`` (step counted), or
        None when no kernel implements this optimizer (then :meth:`_update` runs)."""
        return None

    def _update(self, table, rows: torch.Tensor, grad: torch.Tensor, group: dict, scalars: dict) -> None:
        raise NotImplementedError

    def step(self, closure=None):
        """Apply the gradients recorded since :meth:`zero_grad` (step mode; a no-op when fused). ``closure``, as
        for torch optimizers, recomputes the loss first and is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.fused:
            return loss
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
        return loss

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
        """Hyper-parameters (``defaults`` and each table's param group) and per-table scalar state, JSON-able.
        Per-row state is in the tables' slots."""
        return {"type": self.kind or type(self).__name__, "defaults": dict(self.defaults), "fused": self.fused,
                "tables": [dict(s) for s in self._scalars],
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("type")
        if saved != (self.kind or type(self).__name__) and lookup(saved) is not type(self):  # or a 0.1 class name
            raise ValueError(f"state is for optimizer {saved!r}, not {self.kind or type(self).__name__!r}")
        if len(state["tables"]) != len(self.tables):
            raise ValueError(f"state has {len(state['tables'])} tables, this optimizer has {len(self.tables)}")
        groups = state.get("param_groups", [state["defaults"]] * len(self.tables))  # saved before groups existed
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state has {len(groups)} param groups, this optimizer has {len(self.param_groups)}")
        self.defaults.update(_as_before(self.defaults, state["defaults"]))
        for group, saved in zip(self.param_groups, groups):
            group.update(_as_before(group, saved))
        self._scalars = [dict(s) for s in state["tables"]]


@dataclasses.dataclass(frozen=True)
class SharedRowSquares:
    """The other column shards' parts of a row statistic, by key (sorted), for a table ``dim`` columns wide."""

    keys: torch.Tensor
    others: torch.Tensor
    dim: int

    def lookup(self, keys: torch.Tensor) -> torch.Tensor:
        """``[N]`` parts of ``keys`` (0 for a key not recorded)."""
        keys = keys.to(torch.int64)
        at = torch.searchsorted(self.keys, keys).clamp_(max=max(self.keys.numel() - 1, 0))
        if self.keys.numel() == 0:
            return torch.zeros(keys.numel(), device=keys.device)
        return torch.where(self.keys[at] == keys, self.others[at], torch.zeros((), device=keys.device))


def _kind_of(cls: type) -> str | None:
    """The type name of ``cls`` or of its nearest registered base (once per class: kernel_args asks every update)."""
    return next((k for c in cls.__mro__ if (k := type_name(c)) is not None), None)


def _as_before(current: dict, saved: dict) -> dict:
    """``saved`` with the tuples JSON made lists (checkpoint manifests) turned back into tuples, such as Adam's
    betas."""
    return {k: tuple(v) if isinstance(current.get(k), tuple) else v for k, v in saved.items() if k != "params"}
