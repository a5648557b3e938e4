"""Training a DLRM on click logs: the loop behind ``dynemb train`` and ``dynemb demo``.

One loop serves one process and ``torchrun``: under torch.distributed the tables are sharded by
DistributedEmbeddingCollection, the dense MLPs are wrapped in DistributedDataParallel, and each rank reads its own
slice of the data.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from . import optim
from .optim.combined import CombinedOptimizer
from .collection import EmbeddingCollection
from .collection.step_graph import StepGraph
from .data.batch import Batch
from .data.metrics import held_out_auc
from .table import tier_traffic
from .models import DLRM, dlrm_tables
from .checks import check_int
from .serialization import Serializable, registered, serializable

__all__ = ["TrainConfig", "Trainer", "History", "Pipeline", "SPARSE_OPTIMIZERS", "DEFAULT_PATIENCE", "build_dlrm"]

DEFAULT_PATIENCE = 5
"""Evaluations without improvement before training stops (see ``TrainConfig.patience``)."""

SPARSE_OPTIMIZERS = registered(optim.SparseOptimizer)
"""The sparse optimizers by kind (``"sgd"``, ``"adagrad"``, ...): the registry's (:mod:`dynemb.serialization`)."""


@serializable("train")
@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(Serializable):
    """Training settings; ``to_dict()``/``from_dict()`` write and read them (the model card's ``config``).

    Attributes:
        steps: most training steps (``None``: until the batches run out).
        seconds: stop after this much training time as well (``None``: no time limit).
        dim: embedding width.
        optimizer: sparse optimizer of the tables: one of :data:`SPARSE_OPTIMIZERS`.
        lr: its learning rate; ``dense_lr`` is Adam's for the MLPs.
        max_capacity: rows per table (per rank when sharded); ``None``: unbounded.
        eviction: eviction policy of bounded tables.
        admission: a new id gets a row from its ``admission``-th sighting (``None``: at once).
        eval_every: evaluate AUC and log loss every this many steps (and at the end).
        patience: stop after this many evaluations in a row without a lower held-out log loss than the best so
            far (early stopping); 0 never stops early. The best model is tracked either way.
        checkpoint_dir: save checkpoints there every ``checkpoint_every`` steps and at the end (once: a final
            step that is a multiple of ``checkpoint_every`` is saved once). The periodic saves are written in the
            background (``save(..., blocking=False)``: a host snapshot of the rows, then a thread) while training
            goes on; the last one is written before ``fit`` returns. Tiered tables are saved blocking.
        best_dir: save the model of each new best evaluation there (a checkpoint root of its own, holding one
            checkpoint: pruning of ``checkpoint_dir`` never removes it); ``None``: the best is not saved.
        resume: continue from the newest checkpoint in ``checkpoint_dir`` or ``best_dir``.
    """

    steps: Optional[int] = 1000
    seconds: Optional[float] = None
    dim: int = 16
    optimizer: str = "adagrad"
    lr: float = 0.05
    dense_lr: float = 1e-3
    max_capacity: Optional[int] = None
    eviction: Optional[str] = None
    admission: Optional[int] = None
    eval_every: int = 100
    patience: int = DEFAULT_PATIENCE
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    best_dir: Optional[str] = None
    resume: bool = False

    def __post_init__(self):
        if self.optimizer not in SPARSE_OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(SPARSE_OPTIMIZERS)}, got {self.optimizer!r}")
        check_int(self.steps, "steps", minimum=1, allow_none=True)
        for name in ("dim", "eval_every"):
            check_int(getattr(self, name), name, minimum=1)
        check_int(self.checkpoint_every, "checkpoint_every", minimum=0)
        check_int(self.patience, "patience", minimum=0)
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume=True needs checkpoint_dir")


def build_dlrm(num_dense: int, features: Iterable[str], cfg: TrainConfig, optimizer: bool = True) -> DLRM:
    """A DLRM with one dynamic table per feature, sharded when torch.distributed is initialized; ``optimizer``
    False: tables without ``cfg``'s sparse optimizer (a model that only scores: no slots, no torch optimizer)."""
    spec = SPARSE_OPTIMIZERS[cfg.optimizer](lr=cfg.lr, fused=True) if optimizer else None
    tables, feats = dlrm_tables(list(features), cfg.dim, optimizer=spec, max_capacity=cfg.max_capacity,
                                eviction=cfg.eviction, admission=cfg.admission)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from .collection import DistributedEmbeddingCollection

        embeddings = DistributedEmbeddingCollection(tables, feats)
    else:
        embeddings = EmbeddingCollection(tables, feats)
    with warnings.catch_warnings():  # no dense columns: the bottom MLP's first layer is empty, which is fine
        warnings.filterwarnings("ignore", "Initializing zero-element tensors")
        return DLRM(num_dense, embeddings, cfg.dim)


@dataclasses.dataclass
class History:
    """What the loop measured: per-step rows and per-evaluation rows, ready for plots and reports."""

    steps: list = dataclasses.field(default_factory=list)
    evals: list = dataclasses.field(default_factory=list)

    @property
    def last_auc(self) -> float:
        return self.evals[-1]["auc"] if self.evals else float("nan")


class Trainer:
    """Trains a DLRM with BCE loss; dense MLPs use Adam, tables their fused sparse optimizer.

    Every evaluation is also a model selection: the model with the lowest held-out log loss so far is the best
    (:attr:`best_step`, saved to ``best_dir``), and ``patience`` evaluations in a row without a lower one stop
    training (:attr:`stopped` is then ``"early"``). Under torch.distributed every rank takes rank 0's loss for
    these decisions, so all ranks stop at the same step and save together.

    :meth:`fit`'s eager steps are pipelined (:class:`Pipeline`: the next batch's loading, copy, dedup and key
    exchange run while the current batch computes; bit-identical results); ``pipeline=False`` runs the plain loop.

    Example:
        >>> from dynemb.data import SyntheticClickLog
        >>> data = SyntheticClickLog(num_categorical=2, num_dense=2, batch_size=64)
        >>> cfg = TrainConfig(steps=3, dim=4, eval_every=3)
        >>> trainer = Trainer(build_dlrm(2, data.categorical_names, cfg), cfg)
        >>> history = trainer.fit(data.batches("train"), [data.batch(0, "eval")], progress=False)
        >>> len(history.steps), 0.0 <= history.last_auc <= 1.0, trainer.best_step
        (3, True, 3)
    """

    def __init__(self, model: DLRM, cfg: TrainConfig, cuda_graph: Optional[bool] = None,
                 pipeline: bool = True) -> None:
        self.model, self.cfg = model, cfg
        self.pipeline = pipeline  # fit's loop is a Pipeline (False: the plain loop, for debugging)
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.distributed else 0
        dense = [p for n, p in model.named_parameters()]
        if self.distributed:
            self.model.bottom = nn.parallel.DistributedDataParallel(model.bottom)
            self.model.top = nn.parallel.DistributedDataParallel(model.top)
        on_cuda = bool(dense) and dense[0].device.type == "cuda"
        # capturable: Adam's step counts live on the device, so that a CUDA graph replays its step
        self.optimizer = CombinedOptimizer({"sparse": model.embeddings.optimizer,
                                            "dense": torch.optim.Adam(dense, lr=cfg.dense_lr, capturable=on_cuda)})
        # On a CUDA device the steady steps replay one captured CUDA graph (collection.step_graph); the others,
        # and every step of a collection that never replays, run eagerly. cuda_graph False: always eager.
        self.graph = StepGraph(self._eager_step, model.embeddings, enabled=cuda_graph) \
            if on_cuda and cuda_graph is not False else None
        self.step = 0
        self._saved_step: Optional[int] = None
        self._pending = None  # the periodic background save still being written
        self.best_step: Optional[int] = None
        """The step of the evaluation with the lowest held-out log loss (``None`` before the first)."""
        self.best_loss = math.inf
        self.bad_evals = 0  # evaluations since the best
        self.stopped: Optional[str] = None
        """Why :meth:`fit` stopped before its end: ``"early"`` (patience spent), ``"interrupted"`` (``should_stop``)."""
        self.history = History()
        self.loss_fn = nn.BCEWithLogitsLoss()

    # ------------------------------------------------------------------ checkpoints
    def resume(self) -> Optional[int]:
        """Load the newest checkpoint of ``checkpoint_dir`` and ``best_dir`` (the best one is the newest when a
        run ended between two saves); returns the step to continue from, or ``None`` (nothing changed) when
        neither holds a checkpoint."""
        from .checkpoint import load

        root = newest_checkpoint(self.cfg.checkpoint_dir, self.cfg.best_dir)
        if root is None:
            return None
        manifest = load(root, self.model, self.optimizer)
        self.step = int(manifest["step"])
        self._saved_step = self.step if root == self.cfg.checkpoint_dir else None
        state = (manifest.get("extra") or {}).get("early_stopping") or {}
        self.bad_evals = int(state.get("bad_evals", 0))
        best = _best_of(self.cfg.best_dir)  # the saved best is the reference, whatever checkpoint was loaded
        if best is not None:
            self.best_step, self.best_loss = best
        elif state.get("best_loss") is not None:
            self.best_step, self.best_loss = state["best_step"], float(state["best_loss"])
        return self.step

    def save(self, blocking: bool = True) -> None:
        """Checkpoint the current step into ``checkpoint_dir`` (nothing if this step is saved already). With
        ``blocking=False`` the files are written in the background (not for tiered tables, whose rows may not fit a
        snapshot); :meth:`wait_for_save` waits for them and raises what that save raised."""
        from .checkpoint import save

        if self._saved_step == self.step:
            return
        self.wait_for_save()
        blocking = blocking or self.model.embeddings.tiered
        out = save(self.cfg.checkpoint_dir, self.model, self.optimizer, step=self.step, keep_last=3,
                   extra=self._extra(), blocking=blocking)
        self._pending = None if blocking else out
        self._saved_step = self.step

    def wait_for_save(self) -> None:
        """Wait for the background checkpoint still being written, if any; raise its error (on every rank)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def save_best(self) -> None:
        """Checkpoint the current step into ``best_dir``, replacing the best saved there."""
        from .checkpoint import save
        from .checkpoint.fsutil import remove_dir
        from .checkpoint.manifest import checkpoint_name

        stale = Path(self.cfg.best_dir) / checkpoint_name(self.step)
        # A resumed run re-evaluating a step whose best was saved after the last checkpoint; rank 0 owns the
        # directory (the other ranks' part of the save waits for it).
        if self.rank == 0 and stale.exists():
            remove_dir(stale)
        save(self.cfg.best_dir, self.model, self.optimizer, step=self.step, keep_last=1, extra=self._extra())

    def _extra(self) -> dict:
        best = None if self.best_step is None else self.best_loss
        return {"config": dataclasses.asdict(self.cfg),
                "early_stopping": {"best_step": self.best_step, "best_loss": best, "bad_evals": self.bad_evals}}

    @property
    def patience_spent(self) -> bool:
        """Whether ``patience`` evaluations in a row brought no improvement (never with ``patience=0``)."""
        return bool(self.cfg.patience) and self.bad_evals >= self.cfg.patience

    # ------------------------------------------------------------------ loop
    def fit(self, batches: Iterator[Batch], eval_batches: list[Batch], progress: Optional[bool] = None,
            on_metrics: Optional[Callable[[str, dict], None]] = None, log_every: float = 10.0,
            should_stop: Optional[Callable[[], bool]] = None) -> History:
        """Train until ``steps``, ``seconds``, the end of ``batches``, early stopping or ``should_stop``;
        ``batches`` must start at the current step (see :meth:`resume`). Saves the last checkpoint (and each new
        best) when the config names the directories.

        Args:
            batches: training batches.
            eval_batches: evaluated every ``eval_every`` steps and at the end (not after ``should_stop``).
            progress: a progress bar (``True``), a log line to stderr every ``log_every`` seconds (``False``), or
                (``None``) a bar when stderr is a terminal and log lines otherwise. Only rank 0 reports.
            on_metrics: called with ``("train", row)`` after each step and ``("eval", row)`` after each
                evaluation (the rows of :class:`History`).
            log_every: seconds between log lines.
            should_stop: asked after each step; ``True`` (on any rank) ends training after that step, with
                :attr:`stopped` ``"interrupted"`` (a Ctrl-C handler, a deadline).
        """
        cfg, model = self.cfg, self.model
        model.train()
        report = on_metrics or (lambda kind, row: None)
        bar = _progress(None if cfg.seconds or cfg.steps is None else cfg.steps, self.step, progress,
                        self.rank == 0, log_every)
        start, samples, first = time.perf_counter(), 0, self.step
        remaining = None if cfg.steps is None else max(cfg.steps - self.step, 0)
        self.stopped = "early" if self.patience_spent else None  # a resumed run that had stopped early
        batches = itertools.islice(batches, 0 if self.stopped else remaining)
        if self.graph is None:  # (not under a CUDA graph: its replays read the inputs it captured)
            batches = iter(Pipeline(model, batches, enabled=self.pipeline))
        if model.embeddings.tiered:
            batches = _ahead(batches, lambda b: model.embeddings.prefetch(model.sparse_inputs(b)))
            self._tier_counts = tier_traffic(model.embeddings.dynemb_tables())["counts"]  # a step's traffic from here
        for batch in batches:
            loss = self.train_step(batch)
            self.step += 1
            samples += len(batch)
            elapsed = time.perf_counter() - start
            row = {"step": self.step, "loss": loss.item(), "samples_per_s": samples / max(elapsed, 1e-9),
                   **self.table_stats()}
            self.history.steps.append(row)
            report("train", row)
            if self.step % cfg.eval_every == 0:
                self._select(eval_batches, report)
            if cfg.checkpoint_dir and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save(blocking=False)
            last_auc = self.history.last_auc
            bar.set_postfix(loss=f"{row['loss']:.4f}", auc="-" if last_auc != last_auc else f"{last_auc:.4f}",
                            rows=row["rows"], evicted=row["evicted"], sps=f"{row['samples_per_s']:.0f}",
                            refresh=False)
            bar.update(1)
            if self.patience_spent:
                self.stopped = "early"
                break
            if should_stop is not None and self._any_rank(should_stop()):
                self.stopped = "interrupted"
                break
            # Every rank's clock differs: the deadline is rank 0's, so that all ranks stop at one step.
            if cfg.seconds is not None and self._from_rank0(float(elapsed >= cfg.seconds)):
                break
        bar.close()
        evaluated = self.history.evals and self.history.evals[-1]["step"] == self.step
        if self.stopped is None and self.step > first and not evaluated:  # a resumed run at its end: done before
            self._select(eval_batches, report, periodic=False)
        if cfg.checkpoint_dir:
            self.save()
        self.wait_for_save()
        return self.history

    def _select(self, eval_batches: list[Batch], report: Callable[[str, dict], None], periodic: bool = True) -> None:
        """Evaluate; a lower held-out log loss than the best so far makes this step the best (saved). Only the
        periodic evaluations count against patience: a run cut short by ``steps`` and resumed stops where one
        uninterrupted run would have."""
        row = self.evaluate(eval_batches)
        report("eval", row)
        loss = self._from_rank0(row["loss"])
        if loss < self.best_loss:  # NaN never improves
            self.best_step, self.best_loss, self.bad_evals = self.step, loss, 0
            if self.cfg.best_dir:
                self.save_best()
        elif periodic:
            self.bad_evals += 1

    def _from_rank0(self, value: float) -> float:
        """Rank 0's ``value`` on every rank: decisions that lead to collective saves must be the same."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=_collective_device())
        dist.broadcast(t, 0)
        return float(t.item())

    def _any_rank(self, flag: bool) -> bool:
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32, device=_collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def train_step(self, batch: Batch) -> torch.Tensor:
        """One optimization step on ``batch`` (forward, BCE loss, backward, the optimizers' step): what :meth:`fit`
        runs for each batch, without its counting and logging. Returns the loss (a 0-d tensor; on a CUDA graph's
        replay the graph's own, which the next step overwrites)."""
        if self.graph is not None:
            return self.graph(batch)
        return self._eager_step(batch)

    def _eager_step(self, batch: Batch) -> torch.Tensor:
        loss = self.loss_fn(self.model(batch), batch.labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    @torch.no_grad()
    def evaluate(self, batches: list[Batch]) -> dict:
        """AUC and log loss on ``batches`` (no rows are inserted: eval mode); the AUC is NaN when the rows hold one
        class only."""
        self.model.eval()
        logits = torch.cat([self.model(b) for b in batches])
        labels = torch.cat([b.labels for b in batches])
        self.model.train()
        with warnings.catch_warnings():  # said once a run: every periodic evaluation reads the same rows
            warnings.simplefilter("ignore" if self.history.evals else "default")
            area = held_out_auc(logits, labels)
        row = {"step": self.step, "auc": area, "loss": float(self.loss_fn(logits, labels))}
        self.history.evals.append(row)
        return row

    def table_stats(self) -> dict:
        """Rows, evictions and bytes of every table, all ranks together (a collective when the tables are sharded:
        every rank calls it, as every rank runs :meth:`fit`); with tiered tables also this rank's tiers' traffic
        since the previous call (one training step): ``tier_bytes_moved``, ``tier_rows_up``/``tier_rows_down`` and
        the step's ``tier_fast_hit_rate``/``tier_slow_hit_rate`` (see :func:`dynemb.table.tier_traffic`)."""
        tables = self.model.embeddings.dynemb_tables()
        row = self.model.embeddings.table_totals()  # all ranks together (a collective when sharded)
        if self.model.embeddings.tiered:
            traffic = tier_traffic(tables, getattr(self, "_tier_counts", None))
            self._tier_counts = traffic.pop("counts")
            row.update(traffic)
        return row


def _collective_device() -> torch.device:
    """Where a small tensor for a collective must live: NCCL moves CUDA tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def newest_checkpoint(last, best) -> Optional[str]:
    """Of the checkpoint roots ``last`` and ``best`` (either may be None or hold none), the one whose newest
    checkpoint has the higher step (``last`` on a tie), or None: what a resume continues from."""
    found = [(step, -i, root) for i, root in enumerate([last, best]) if (step := _latest_step(root)) is not None]
    return max(found, key=lambda f: f[:2])[2] if found else None


def _latest_step(root: Optional[str]) -> Optional[int]:
    """The step ``root/latest`` points at, or ``None`` without a root or a checkpoint in it."""
    from .checkpoint.fsutil import read_json

    if root is None or not (Path(root) / "latest").is_file():
        return None
    return int(read_json(Path(root) / "latest")["step"])


def _best_of(root: Optional[str]) -> Optional[tuple[int, float]]:
    """``(step, held-out log loss)`` of the best checkpoint saved in ``root``, or ``None``."""
    from .checkpoint.manifest import read_manifest, resolve

    if _latest_step(root) is None:
        return None
    state = (read_manifest(resolve(root)).get("extra") or {}).get("early_stopping") or {}
    if state.get("best_loss") is None:
        return None
    return int(state["best_step"]), float(state["best_loss"])


class Pipeline:
    """A pipelined training loop's batches: while batch ``i`` computes, batch ``i + 1``'s stages that change no
    state (loading from ``batches``, validation, the copy to the device, deduplication and, sharded, the key
    all-to-all) run on a worker thread (on CUDA in a side stream). Lookups, inserts, evictions and updates stay in
    batch order on the caller's thread, so results are bit-identical to the plain loop.

    ``model``: a :class:`~dynemb.models.DLRM` (its ``embeddings`` and ``sparse_inputs``) or an
    :class:`~dynemb.collection.EmbeddingCollection` with ``inputs(batch)``, the features the loop will pass to its
    forward (the same tensors). Iterate it as the batches themselves; each batch yielded goes through the forward
    before the next is asked for, as a training loop does (one that is not is dropped, its stages unused).

    Sharded, the key exchange runs over a process group of the pipeline's own (made once per collection, a
    collective on the default group), one batch after another on every rank, so the two groups' collectives never
    interleave differently across ranks. ``enabled=False`` (``Trainer(..., pipeline=False)``;
    ``dynemb train --no-pipeline``) yields the batches as they are: the plain loop, for debugging.

    :attr:`wait_s` is the time the caller's thread waited for the staged stages (what the pipeline left exposed).

    Example:
        >>> from dynemb.data import SyntheticClickLog
        >>> data = SyntheticClickLog(num_categorical=2, num_dense=2, batch_size=8)
        >>> model = build_dlrm(2, data.categorical_names, TrainConfig(dim=4))
        >>> for batch in Pipeline(model, itertools.islice(data.batches("train"), 3)):
        ...     logits = model(batch)  # [8]
    """

    def __init__(self, model: nn.Module, batches: Iterable, enabled: bool = True,
                 inputs: Optional[Callable] = None) -> None:
        self.batches, self.enabled = iter(batches), bool(enabled)
        self.collection: EmbeddingCollection = model if isinstance(model, EmbeddingCollection) else model.embeddings
        self.inputs = inputs if inputs is not None else model.sparse_inputs
        self.wait_s = 0.0
        self.group = _pipeline_group(self.collection) if self.enabled else None
        device = self.collection._device
        self.stream = torch.cuda.Stream(device) if self.enabled and device.type == "cuda" else None

    def _stage(self) -> Optional[tuple]:
        """Load the next batch and run its stateless stages (on the worker thread; on CUDA in the side stream,
        the loader's copies to the device included)."""
        if self.stream is None:
            return self._load_and_stage(None)
        with torch.cuda.stream(self.stream):
            return self._load_and_stage(self.stream)

    def _load_and_stage(self, stream) -> Optional[tuple]:
        batch = next(self.batches, None)
        if batch is None:
            return None
        features = self.inputs(batch)
        staged = self.collection.stage(features, self.group)
        done = None
        if stream is not None:
            done = torch.cuda.Event()
            done.record(stream)
        return batch, features, staged, done

    def __iter__(self) -> Iterator[Batch]:
        if not self.enabled:
            yield from self.batches
            return
        ahead = _Worker(self._stage)
        try:
            while True:
                start = time.perf_counter()
                got = ahead.result()
                self.wait_s += time.perf_counter() - start
                if got is None:
                    return
                batch, features, staged, done = got
                if done is not None:  # the compute stream reads what the side stream wrote
                    torch.cuda.current_stream().wait_event(done)
                    _record_stream((batch, staged), torch.cuda.current_stream())
                ready: Future = Future()
                ready.set_result(staged)
                self.collection.expect(features, ready)
                ahead = _Worker(self._stage)  # batch i + 1's stages, while the caller computes batch i
                try:
                    yield batch
                finally:
                    self.collection.forget(features)
        finally:
            ahead.result()  # the staged collective ran on every rank: wait for it before leaving


class _Worker:
    """One call of ``fn`` on a thread of its own; :meth:`result` waits for it (and raises what it raised)."""

    def __init__(self, fn: Callable) -> None:
        self._out: Optional[tuple] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="dynemb-pipeline", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable) -> None:
        try:
            self._out = fn()
        except BaseException as e:  # noqa: BLE001  (raised on the caller's thread)
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out


def _record_stream(value, stream) -> None:
    """Every tensor in ``value`` (nested lists, tuples, dicts, dataclasses) is in use on ``stream`` too."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _record_stream(v, stream)
    elif isinstance(value, dict):
        for v in value.values():
            _record_stream(v, stream)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _record_stream(getattr(value, f.name), stream)
    elif isinstance(value, SimpleNamespace):  # a batch of a script's own
        for v in vars(value).values():
            _record_stream(v, stream)


def _pipeline_group(collection: EmbeddingCollection):
    """The process group of a pipeline's key exchange (the collection's ranks and backend; made once)."""
    if not collection.sharded or collection.world == 1:
        return None
    group = getattr(collection, "_pipeline_group", None)
    if group is None:
        group = dist.new_group(ranks=dist.get_process_group_ranks(collection.group),
                               backend=dist.get_backend(collection.group))
        collection._pipeline_group = group
    return group


def _ahead(batches: Iterator[Batch], prefetch: Callable[[Batch], None]) -> Iterator[Batch]:
    """``batches``, reading one ahead: when a step is done, the next batch goes to ``prefetch`` before it is
    yielded (tiered tables bring its rows up; no result changes)."""
    upcoming = next(batches, None)
    while upcoming is not None:
        current, upcoming = upcoming, next(batches, None)
        yield current
        if upcoming is not None:
            prefetch(upcoming)


def _progress(total: Optional[int], initial: int, progress: Optional[bool], enabled: bool, log_every: float):
    """A tqdm bar on a terminal (or when ``progress``), else a :class:`LogLines` reporter."""
    if enabled and (progress or (progress is None and sys.stderr.isatty())):
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, mininterval=0.5)
    return LogLines(initial, log_every if enabled else None)


class LogLines:
    """The progress bar's interface for logs and pipes: one short line to stderr every ``every`` seconds (none
    when ``every`` is ``None``), e.g. ``step 1200  loss 0.4512  auc 0.7710  rows 123,456  8,210 samples/s``."""

    def __init__(self, initial: int, every: Optional[float]) -> None:
        self.step, self.every = initial, every
        self.last = time.monotonic()
        self.postfix: dict = {}

    def update(self, n: int = 1) -> None:
        self.step += n
        if self.every is not None and time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            fields = "  ".join(f"{k} {v}" for k, v in self.postfix.items())
            print(f"step {self.step}  {fields}", file=sys.stderr, flush=True)

    def set_postfix(self, refresh: bool = True, **fields) -> None:
        self.postfix = fields

    def close(self) -> None:
        pass
