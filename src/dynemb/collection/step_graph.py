"""StepGraph: a training step with fixed batch shapes captured once as a CUDA graph and replayed while it is
steady, with eager steps whenever it is not.

A replay runs the step's kernels (lookups, MLPs, backward, sparse and dense updates) without Python, so whatever the
host does in a step must either not matter or be redone before the replay. For a collection whose tables all run in
execution groups (:mod:`dynemb.functional.grouped`) the host's part of a step is small and known: each group's room
check on Python numbers, each table's clock and stamps, each table's optimizer step and hyper-parameters. The
capture records the group calls; before each replay :meth:`GroupedLookup.replayed` redoes that part and writes the
values into the pinned buffers whose copies the graph recorded (:class:`~dynemb.table.group.HostValues`).

Which step replays (:meth:`StepGraph.eager_reason` says why not):

- never on a CPU, nor for a sharded collection (its exchange sizes depend on the data);
- never when a table runs outside the execution groups: admission tables (their filter decides on the host which
  keys get rows), tiered tables, lfu-family policies, static tables, tables with a sequence or ``max_norm``
  feature, non-fused optimizers; such a collection always trains eagerly;
- not a step whose batch shapes differ from the captured one (the last batch of an epoch), nor one in which a
  group must read its sizes back, grow a table or may evict (a bounded table near its capacity: once it is full,
  every step is eager), nor one after a table's storage moved (growth, a rehash, a load), which recaptures;
- not the first ``warmup`` steps, which run eagerly before the capture.

A capture that fails (an op that syncs with the host, e.g. a data-dependent shape in the dense model) turns the
graph off for good with a warning: every step is then eager, with the same results.

Example (a CUDA device, any module and optimizers; ``step`` returns the loss):
    >>> def step(batch):  # doctest: +SKIP
    ...     loss = loss_fn(model(batch), batch.labels); loss.backward(); opt.step(); opt.zero_grad(); return loss
    >>> graphed = StepGraph(step, model.embeddings)  # doctest: +SKIP
    >>> loss = graphed(batch)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

import torch

from ..kernels.dispatch import Backend, resolve_backend

__all__ = ["StepGraph"]


class StepGraph:
    """Runs ``step(batch)``, capturing it as a CUDA graph once it is steady and replaying it after (see the module).

    Args:
        step: one training step of a batch: forward, loss, backward, optimizer steps; returns the loss tensor.
        collection: the model's :class:`~dynemb.EmbeddingCollection` (its execution groups decide the replays).
        warmup: eager steps before the capture.
        enabled: False: always eager (``None``: on a CUDA device).

    Attributes:
        replays, eager_steps: counts of each kind of step; ``last_reason``: why the last step was eager (None
        after a replay).
    """

    def __init__(self, step: Callable, collection, warmup: int = 3, enabled: Optional[bool] = None) -> None:
        self.step, self.collection, self.warmup = step, collection, warmup
        self.enabled = enabled
        self.graph = None
        self.static_batch = None
        self.static_loss = None
        self.calls: list[tuple] = []  # (group lookup, its recorded calls)
        self.generations: tuple = ()
        self.shapes = None
        self.steps = self.replays = self.eager_steps = 0
        self.last_reason: Optional[str] = None
        self.failed: Optional[str] = None

    # ------------------------------------------------------------------ the decision
    def never_reason(self) -> Optional[str]:
        """Why this collection never replays (None: it may)."""
        if self.failed is not None:
            return f"the capture failed ({self.failed})"
        ec = self.collection
        if self.enabled is False:
            return "CUDA graphs are off"
        if ec.plan.sharded:
            return "a sharded collection exchanges data-sized messages"
        if not any(m.table.device.type == "cuda" for m in ec.plan.modules().values()):
            return "the tables are not on a CUDA device"
        return self.tables_reason()

    def tables_reason(self) -> Optional[str]:
        """Why the collection's tables and features never replay, whatever the device (None: they may)."""
        ec = self.collection
        grouped = {n for g in ec.plan.groups for n in g.names}
        for name in ec.plan.shards:
            if name not in grouped:
                return f"table {name!r} runs outside the execution groups (its own lookups talk to the host)"
        for fcfg in ec.feature_configs.values():
            if fcfg.combiner == "none" or fcfg.max_norm is not None:
                return f"feature {fcfg.name!r} is a sequence or clips rows (its table runs its own lookups)"
        for name, module in ec.plan.modules().items():
            if resolve_backend(module.table.backend, module.table.device) is Backend.TORCH:
                return f"table {name!r} runs on backend 'torch', whose group reference reads sizes back to the host"
        return None

    def eager_reason(self, batch) -> Optional[str]:
        """Why ``batch``'s step runs eagerly (None: it replays, or is captured when no graph exists yet)."""
        why = self.never_reason()
        if why is not None:
            return why
        if self.steps < self.warmup:
            return "warming up before the capture"
        if self.graph is None:
            return None
        if _shapes(batch) != self.shapes:
            return "the batch's shapes differ from the captured step's"
        if self._generations() != self.generations:
            return "a table's storage moved since the capture (growth, a rehash, a load)"
        for lookup, calls in self.calls:
            if not lookup.replay_fits(calls):
                return "a table must grow, read its size back or may evict this step"
        return None

    # ------------------------------------------------------------------ a step
    def __call__(self, batch):
        why = self.eager_reason(batch)
        self.steps += 1
        self.last_reason = why
        if why is not None:
            self.eager_steps += 1
            return self.step(batch)
        if self.graph is None or self._generations() != self.generations:
            return self._capture(batch)
        for lookup, calls in self.calls:
            lookup.replayed(calls)
        _copy_into(self.static_batch, batch)
        self.graph.replay()
        self.replays += 1
        return self.static_loss

    def _capture(self, batch):
        """Capture ``batch``'s step (its kernels run at the first replay, right after)."""
        lookups = [g.lookup for g in self.collection.plan.groups]
        self.static_batch = _clone(batch)
        for lookup in lookups:
            lookup.record()
        graph = torch.cuda.CUDAGraph()
        host = _host_state(self.collection)
        try:
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                self.static_loss = self.step(self.static_batch)
        except Exception as e:  # an op the capture cannot take: every step eager from now on, same results
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"dynemb: CUDA-graph capture of the training step failed; training eagerly ({e})",
                          stacklevel=3)
            self.graph = None
            _restore_host_state(host)  # the capture ran the step's host part, none of its kernels
            self.eager_steps += 1
            self.last_reason = self.never_reason()
            return self.step(batch)
        self.graph = graph
        self.calls = [(lookup, list(lookup.recorded())) for lookup in lookups]
        self.generations = self._generations()
        self.shapes = _shapes(batch)
        graph.replay()  # the captured step's kernels: this step's work (its host part ran during the capture)
        self.replays += 1
        return self.static_loss

    def _generations(self) -> tuple:
        return tuple((t.storage_generation, t.index.generation, id(t.index))
                     for m in self.collection.plan.modules().values() for t in [m.table])


def _host_state(collection) -> tuple[list, list]:
    """What a step changes on the host in grouped tables (clocks, optimizer step counts, group bounds): kept
    before a capture, so that a failed one leaves it unchanged."""
    tables, groups = [], []
    for g in collection.plan.groups:
        for table in g.lookup.tables:
            opt = table.sparse_optimizer
            scalars = opt._scalars[opt._index(table)] if opt is not None else {}
            tables.append((table, table.clock, scalars, dict(scalars)))
        groups.extend((group, list(group._bound), group.pending) for group in g.lookup._groups.values()
                      if group is not None)
    return tables, groups


def _restore_host_state(state: tuple[list, list]) -> None:
    tables, groups = state
    for table, clock, scalars, kept in tables:
        table.clock = clock
        scalars.clear()
        scalars.update(kept)
    for group, bound, pending in groups:
        group._bound, group.pending = bound, pending


def _tensors(batch) -> list:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for k in sorted(batch, key=str) for t in _tensors(batch[k])]
    if isinstance(batch, (list, tuple)):
        return [t for x in batch for t in _tensors(x)]
    if dataclasses.is_dataclass(batch):
        return [t for f in dataclasses.fields(batch) for t in _tensors(getattr(batch, f.name))]
    return []


def _shapes(batch) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.device) for t in _tensors(batch))


def _clone(batch):
    """A copy of ``batch`` whose tensors the graph reads (each replay copies the next batch into them)."""
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, dict):
        return {k: _clone(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_clone(x) for x in batch)
    if dataclasses.is_dataclass(batch):
        return dataclasses.replace(batch, **{f.name: _clone(getattr(batch, f.name)) for f in dataclasses.fields(batch)
                                             if f.init})
    return batch


def _copy_into(static, batch) -> None:
    for dst, src in zip(_tensors(static), _tensors(batch)):
        dst.copy_(src, non_blocking=True)
