"""``dynemb train``: train a DLRM on the user's files into a run directory (see :mod:`dynemb.job.card`).

The steps: read the columns' layout; hold out rows (a separate file, or a seeded ``eval_fraction`` of the rows,
see :mod:`dynemb.data.stream`); compute the dense statistics over the training rows; write the model card; train
for ``epochs`` (each a shuffled pass over every training row), ``steps`` or ``seconds``, evaluating a few held-out
batches every ``eval_every`` steps, keeping the best model and stopping early after ``patience`` evaluations
without improvement (see :class:`~dynemb.train.Trainer`); save the last checkpoint; evaluate the best model on
every held-out row; write the final metrics, the plot and return the summary that the command prints as its last
line.

A run that ends early stays resumable: with ``interruptible``, a Ctrl-C (or SIGTERM) ends training after the
current step and saves it (:class:`Interrupted`); a failed save leaves the previous checkpoint; ``resume`` starts
from the newest checkpoint, the last or the best, or from step 0 when there is none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Optional, Union

import torch
import torch.distributed as dist

from ..checkpoint import load
from ..data import FileReader, SyntheticClickLog
from ..data.formats import CRITEO_CATEGORICAL, CRITEO_DENSE, CRITEO_LABEL, list_files
from ..data.preprocess import DataWarning, Preprocessing, dense_statistics
from ..checks import check_int, resolve_device
from ..train import Trainer, TrainConfig, build_dlrm
from .card import CARD, CHECKPOINT, CHECKPOINT_BEST, METRICS, ModelCard, read_card, write_card
from .publish import EXPORT, Publisher
from .report import MetricsLog, plot_run
from .score import evaluate, positives_counted
from .sources import FileSource, SyntheticSource, epochs, every_nth

__all__ = ["RunSpec", "train_run", "Interrupted", "auto_epochs", "AUTO_MAX_STEPS", "AUTO_MAX_EPOCHS", "SYNTHETIC_STEPS"]

# epochs="auto": early stopping decides, within 20 epochs and 20,000 steps (10M samples at batch 512, about 20
# minutes on one core); measured on real data (BENCHMARKS.md, "Main job on files").
AUTO_MAX_STEPS, AUTO_MAX_EPOCHS = 20_000, 20
SYNTHETIC_STEPS = 500  # synthetic data, when none of epochs, steps and seconds is given


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """The data and the run directory of a training run (the model's settings are a :class:`TrainConfig`).

    Attributes:
        out: the run directory.
        data: the training file or directory; ``None`` trains on synthetic click logs.
        eval_data: a held-out file or directory; ``None`` holds out ``eval_fraction`` of ``data``'s rows.
        format: the files' format; ``None`` infers it from the suffixes.
        label, categorical, multi_hot, dense: the columns. A Criteo file with none of them named reads all of
            Criteo's columns.
        positive_label: labels whose text equals it are 1, every other label 0 (``">50K"``, ``"yes"``); ``None``:
            labels must be 0/1 or booleans. Kept in the model card: evaluation and resume apply it.
        list_separator: separator of the ids in a multi-hot CSV field.
        eval_fraction: the held-out share of ``data`` when there is no ``eval_data``, in ``(0, 1)``.
        seed: the seed of the split, the shuffles, the synthetic data and torch (the MLPs' initial weights).
        epochs: passes over the training rows; ``"auto"`` for :func:`auto_epochs`; ``None`` for a run bounded
            by ``steps`` or ``seconds``.
        batch_size: samples per step.
        shuffle_buffer: rows of the shuffle window (files larger than twice this are shuffled within it).
        eval_batches: held-out batches of each periodic evaluation (the final one uses every held-out row).
        stats_rows: the most training rows the dense statistics are computed from.
        device: ``"cpu"`` or ``"cuda"`` (or ``"cuda:N"``).
        resume: continue the run in ``out`` from its newest checkpoint (same columns, same preprocessing), or
            from step 0 when it has none.
        publish_every: write a serving version every this many steps and after the last one (0: none); see
            :mod:`dynemb.job.publish`.
        publish_dir: the export root of those versions (default ``out/export``, what ``dynemb serve --model out``
            serves).

    Raises:
        ValueError: a field is out of range or the columns are missing (the message names the option).
    """

    out: str
    data: Optional[str] = None
    eval_data: Optional[str] = None
    format: Optional[str] = None
    label: Optional[str] = None
    categorical: tuple[str, ...] = ()
    multi_hot: tuple[str, ...] = ()
    dense: tuple[str, ...] = ()
    positive_label: Optional[str] = None
    list_separator: str = "|"
    eval_fraction: float = 0.05
    seed: int = 0
    epochs: Union[int, str, None] = None
    batch_size: int = 2048
    shuffle_buffer: int = 500_000
    eval_batches: int = 16
    stats_rows: int = 1_000_000
    device: str = "cpu"
    resume: bool = False
    publish_every: int = 0
    publish_dir: Optional[str] = None

    def __post_init__(self) -> None:
        resolve_device(self.device, "device")  # torch's own error for a missing GPU is a bare AssertionError
        if self.epochs != "auto":
            check_int(self.epochs, "epochs", minimum=1, allow_none=True)
        for name in ("batch_size", "shuffle_buffer", "eval_batches", "stats_rows"):
            check_int(getattr(self, name), name, minimum=1)
        check_int(self.publish_every, "publish_every", minimum=0)
        if self.publish_dir is not None and not self.publish_every:
            raise ValueError("publish_dir needs publish_every (steps between published versions)")
        if not (isinstance(self.eval_fraction, float) and 0.0 < self.eval_fraction < 1.0):
            raise ValueError(f"eval_fraction must be a number in (0, 1), got {self.eval_fraction!r}")
        if self.positive_label is not None and (not isinstance(self.positive_label, str) or not self.positive_label):
            raise ValueError(f"positive_label must be a non-empty string, got {self.positive_label!r}")
        if self.data is None and (self.eval_data or self.epochs or self.positive_label):
            raise ValueError("synthetic data is an endless stream of 0/1 labels: eval_data, epochs and "
                             "positive_label need data (--data)")


def train_run(spec: RunSpec, cfg: TrainConfig, *, progress: Optional[bool] = None, log_every: float = 10.0,
              echo=print, on_publish=None, interruptible: bool = False, pipeline: bool = True) -> dict:
    """Train into ``spec.out`` and return the summary: held-out ``auc``, ``logloss`` and ``rows``, plus the
    ``step``, the training ``samples`` of this call, ``table_rows``, ``evicted``, ``seconds`` and ``run`` (and
    ``published``, the version directories written, with ``spec.publish_every``; ``on_publish`` is called after
    each, see :class:`~dynemb.job.publish.Publisher`).

    The summary's ``auc``, ``logloss`` and ``rows`` are the best model's (``model`` is ``"best"``, its step
    ``best_step``; ``stopped_early`` says whether patience ended training); ``table_rows`` and ``evicted`` describe
    the tables as training left them.

    ``cfg.checkpoint_dir``, ``cfg.best_dir`` and ``cfg.resume`` are replaced by ``out/checkpoint``,
    ``out/checkpoint-best`` and ``spec.resume``. Under torchrun every rank calls this; rank 0 writes the card and
    metrics.

    With ``interruptible`` (``dynemb train``; only in the main thread), the first SIGINT or SIGTERM ends training
    after the current step: the last checkpoint is saved, then :class:`Interrupted` (a KeyboardInterrupt) is
    raised. A second SIGINT raises KeyboardInterrupt at once.

    ``pipeline`` (:class:`~dynemb.train.Pipeline`): the next batch's loading, copy, dedup and key exchange run
    while the current batch computes; ``False`` runs them in the step (the same results; for debugging).

    Torch's random numbers (the MLPs' initial weights, ...) are drawn from ``spec.seed`` inside the call (the
    caller's generator state is restored after it): identical calls give identical runs.

    Raises:
        ValueError: bad data or options, ``out`` holding another run without ``resume``, or no held-out row.
        Interrupted: see ``interruptible``.
    """
    devices = [torch.device(spec.device)] if torch.device(spec.device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(spec.seed)
        return _train_run(spec, cfg, progress, log_every, echo, on_publish, interruptible, pipeline)


def _train_run(spec: RunSpec, cfg: TrainConfig, progress, log_every, echo, on_publish, interruptible,
               pipeline: bool = True) -> dict:
    started = time.perf_counter()
    run = Path(spec.out)
    cfg = dataclasses.replace(cfg, checkpoint_dir=str(run / CHECKPOINT), best_dir=str(run / CHECKPOINT_BEST),
                              resume=spec.resume)
    _check_run_dir(run, cfg.resume)
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if distributed:
        dist.barrier()  # every rank has checked the directory before rank 0 writes into it
    source, prep, data = _source(spec, run, cfg.resume)
    device = torch.device(spec.device)

    def ready(batch):
        return prep.normalize(batch.to(device))

    periodic = [ready(b) for b in itertools.islice(source.held_out(), spec.eval_batches)]
    if not periodic:
        raise ValueError(f"{spec.data}: no held-out rows (eval_fraction {spec.eval_fraction} of the rows is none); "
                         "raise --eval-fraction or pass --eval-data")
    positive = data.get("positive_label")
    if cfg.resume and positive is not None and not any(bool((b.labels > 0).any()) for b in periodic):
        # a new run checks its training rows (no label equal to it is an error); a resume reads no statistics pass,
        # so its held-out rows say it: a file that writes the label otherwise ('>50K.') would train on all zeros
        rows = sum(len(b) for b in periodic)
        warnings.warn(f"{spec.data}: no label of the first {rows:,} held-out rows equals the run's positive label "
                      f"{positive!r} (its model.json; compared as text): if this file writes it otherwise, every "
                      "label reads as 0 and the resume trains on zeros", DataWarning, stacklevel=2)
    card = ModelCard(preprocessing=prep, config=dataclasses.replace(cfg, resume=False, checkpoint_dir=None,
                                                                    best_dir=None), data=data)
    model = build_dlrm(len(prep.dense), prep.features, cfg).to(device)
    trainer = Trainer(model, cfg, pipeline=pipeline)
    # The card only once the model is built: a setting the model refuses (max_capacity past 2**31 - 1) must leave
    # `out` as it was, not holding a card that makes the corrected command "not empty" and --resume refuse it.
    if rank == 0 and not cfg.resume:
        write_card(run, card)
    if cfg.resume:
        if trainer.resume() is None:
            echo(f"no checkpoint in {run} yet: training it from step 0")
        else:
            echo(f"resumed from {run} at step {trainer.step}")
    stream = itertools.islice(epochs(source, data["epochs"]), trainer.step * world, None)
    samples = 0

    def counted(batches):
        nonlocal samples
        for batch in batches:
            samples += len(batch)
            yield ready(batch)

    publisher = None
    if spec.publish_every:
        publisher = Publisher(spec.publish_dir or run / EXPORT, model, spec.publish_every, on_publish=on_publish)

    with MetricsLog(run / METRICS, enabled=rank == 0, after_step=trainer.step if cfg.resume else None) as log:
        def on_metrics(kind: str, row: dict) -> None:
            log.write(kind, row)
            if publisher is not None:
                publisher.after(kind, row)

        with _stop_signals(interruptible and _main_thread(), echo) as should_stop:
            trainer.fit(counted(every_nth(stream, rank, world)), periodic, progress, on_metrics=on_metrics,
                        log_every=log_every, should_stop=should_stop)
        if trainer.stopped == "interrupted":
            raise Interrupted(trainer.step, run / CHECKPOINT)
        if publisher is not None:
            publisher.publish(trainer.step)  # the final model (fit's last step may fall between two versions)
        stats = trainer.table_stats()  # of the model trained, before the best replaces it
        best = trainer.best_step
        if best is not None and best != trainer.step:
            load(run / CHECKPOINT_BEST, model)
        final = evaluate(model, map(ready, source.held_out()))
        summary = {**final, "model": "best" if best is not None else "last", "best_step": best,
                   "step": trainer.step, "stopped_early": trainer.stopped == "early", "samples": samples,
                   "table_rows": stats["rows"], "evicted": stats["evicted"],
                   "seconds": round(time.perf_counter() - started, 2), "run": str(run)}
        if publisher is not None:
            summary["published"] = [str(path) for _, path in publisher.published]
        log.write("final", summary)
    if rank == 0:
        write_card(run, dataclasses.replace(card, metrics={**final, "model": summary["model"], "step": best}))
        plot_run(run)
    return summary


class Interrupted(KeyboardInterrupt):
    """Training stopped at a Ctrl-C (or SIGTERM) after saving a checkpoint of its last step; ``--resume``
    continues from it.

    Attributes:
        step: the last step trained (and saved).
        checkpoint: the checkpoint root it was saved to.
    """

    def __init__(self, step: int, checkpoint: Path) -> None:
        super().__init__(f"interrupted at step {step}; saved a checkpoint in {checkpoint}")
        self.step, self.checkpoint = step, checkpoint


@contextlib.contextmanager
def _stop_signals(enabled: bool, echo):
    """Yield ``should_stop`` for :meth:`Trainer.fit`: true after a first Ctrl-C (SIGINT) or SIGTERM, which end
    training after the current step (with a checkpoint); a second Ctrl-C raises KeyboardInterrupt at once."""
    if not enabled:
        yield None
        return
    received = []

    def handler(signum, frame):
        if not received:
            received.append(signum)
            print("dynemb train: stopping after this step to save a checkpoint (Ctrl-C again to abort without it)",
                  file=sys.stderr, flush=True)
        elif signum == signal.SIGINT:  # a second SIGTERM (torchrun sends one after the terminal's SIGINT) waits
            raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield lambda: bool(received)
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # signal handlers can only be set there


def _check_run_dir(run: Path, resume: bool) -> None:
    if run.exists() and not run.is_dir():  # not "[Errno 20] Not a directory" once the data is read
        raise ValueError(f"--out {run}: a file, not a directory; the run directory is a new or empty directory "
                         "(or, with --resume, a run's)")
    if resume and not (run / CARD).is_file():
        raise ValueError(f"{run}: nothing to resume (no {CARD}); drop --resume to start a new run there")
    if not resume and run.exists() and any(run.iterdir()):
        raise ValueError(f"{run}: not empty; pass --resume to continue the run there, or choose another --out")


def _source(spec: RunSpec, run: Path, resume: bool):
    """``(source, preprocessing, data description)`` of a run."""
    if spec.data is None:
        log = SyntheticClickLog(batch_size=spec.batch_size, seed=spec.seed)
        source = SyntheticSource(log, spec.eval_batches)
        columns = dict(label="label", categorical=log.categorical_names, multi_hot=(), dense=log.dense_names)
        data = {"synthetic": {"seed": spec.seed, "eval_batches": spec.eval_batches}, "batch_size": spec.batch_size}
        id_types = dict.fromkeys(log.categorical_names, "INT64")  # the generator's ids are integers
    else:
        columns, fmt = _columns(spec)
        positive = _positive_label(spec, run, resume)
        reader = dict(columns, batch_size=spec.batch_size, format=fmt, list_separator=spec.list_separator,
                      positive_label=positive)
        # The run's id types, decided once: from the data on a new run, from model.json on resume (a column the
        # run lacks fails the columns check below).
        known = read_card(run).preprocessing.id_types if resume else None
        ids = [*columns["categorical"], *columns["multi_hot"]]
        train = FileReader(spec.data, **reader, id_types=None if known is None else {c: known.get(c, "BYTES")
                                                                                   for c in ids},
                           id_rows=spec.stats_rows)
        id_types = train.id_types
        held = (FileReader(spec.eval_data, **{**reader, "format": spec.format}, id_types=id_types)
                if spec.eval_data else None)
        source = FileSource(train=train, held=held, eval_fraction=spec.eval_fraction, seed=spec.seed,
                            shuffle_buffer=spec.shuffle_buffer)
        data = {"train": str(spec.data), "eval": spec.eval_data, "format": fmt, "split_seed": spec.seed,
                "eval_fraction": None if spec.eval_data else spec.eval_fraction, "batch_size": spec.batch_size,
                "shuffle_buffer": spec.shuffle_buffer, "positive_label": positive}
    if resume:
        prep = read_card(run).preprocessing
        saved = dict(label=prep.label, categorical=prep.categorical, multi_hot=prep.multi_hot, dense=prep.dense)
        if saved != {k: (v if k == "label" else tuple(v)) for k, v in columns.items()}:
            raise ValueError(f"{run}: the run was trained on columns {saved}; --resume needs the same columns")
        saved = read_card(run).data
        _warn_other_data(run, saved, data)
        return source, prep, {**saved, "epochs": saved["epochs"] if spec.epochs == "auto" else spec.epochs}
    positives = []
    stats = dense_statistics(positives_counted(source.training_rows(), positives), columns["dense"],
                             spec.stats_rows, where=f"{spec.data or 'synthetic data'} (training rows)")
    rows = stats.rows  # the pass also counts the rows
    if data.get("positive_label") is not None and not sum(positives):
        raise ValueError(f"--positive-label {spec.positive_label!r}: no label in the first {rows:,} training rows "
                         "equals it (labels are compared as text, exactly)")
    prep = Preprocessing(**columns, dense_mean=stats.mean, dense_std=stats.std, dense_min=stats.min,
                         dense_max=stats.max, dense_rows=rows, list_separator=spec.list_separator, id_types=id_types)
    counted = rows < spec.stats_rows and spec.data is not None  # the pass reached the end of the data
    data["train_rows"] = rows if counted else None
    data["epochs"] = auto_epochs(data["train_rows"], spec.batch_size) if spec.epochs == "auto" else spec.epochs
    return source, prep, data


def _warn_other_data(run: Path, saved: dict, given: dict) -> None:
    """Warn when a resumed run is given other data (files, held-out file or split) than it was trained on: the
    resume skips as many batches of the new data as it trained steps, and its best model is then compared across
    two held-out sets."""
    keys = ("train", "eval", "split_seed", "eval_fraction")
    was = {k: saved.get(k) for k in keys if "synthetic" not in saved}
    now = {k: given.get(k) for k in keys if "synthetic" not in given}
    same_path = lambda a, b: a == b or (a is not None and b is not None and  # noqa: E731
                                        Path(a).resolve() == Path(b).resolve())
    changed = [k for k in keys if not (same_path(was.get(k), now.get(k)) if k in ("train", "eval")
                                       else was.get(k) == now.get(k))]
    if changed:
        shown = ", ".join(f"{k} {was.get(k)!r} -> {now.get(k)!r}" for k in changed)
        warnings.warn(f"{run}: resumed on other data than the run was trained on ({shown}): the resume skips as "
                      "many batches of it as the run trained, and the best model is compared across two held-out "
                      "sets; to train on new data, start a new run (another --out)", DataWarning, stacklevel=3)


def _positive_label(spec: RunSpec, run: Path, resume: bool) -> Optional[str]:
    """The run's positive label: ``spec``'s, or on resume the card's (a different one given is an error)."""
    if not resume:
        return spec.positive_label
    saved = read_card(run).data.get("positive_label")
    if spec.positive_label is not None and spec.positive_label != saved:
        raise ValueError(f"--positive-label {spec.positive_label!r} contradicts the run being resumed: {run} was "
                         f"trained with {'no --positive-label' if saved is None else repr(saved)} (its model.json)")
    return saved


def auto_epochs(train_rows: Optional[int], batch_size: int) -> int:
    """The most epochs of a run without ``epochs``: :data:`AUTO_MAX_EPOCHS`, fewer when they would take more than
    :data:`AUTO_MAX_STEPS` steps, at least 1; 1 when the training rows were not counted (more than ``stats_rows``:
    a large data set gets one pass). Early stopping usually ends the run sooner.

    Example:
        >>> auto_epochs(37_000, 512), auto_epochs(800_000, 512), auto_epochs(None, 512)
        (20, 12, 1)
    """
    if not train_rows:
        return 1
    per_epoch = math.ceil(train_rows / batch_size)
    return max(1, min(AUTO_MAX_EPOCHS, AUTO_MAX_STEPS // per_epoch))


def _columns(spec: RunSpec) -> tuple[dict, str]:
    """The columns to read (Criteo's when a Criteo file names none) and the training data's format."""
    fmt = list_files(Path(spec.data), spec.format)[1]
    named = spec.label or spec.categorical or spec.multi_hot or spec.dense
    if fmt == "criteo" and not named:
        return dict(label=CRITEO_LABEL, categorical=CRITEO_CATEGORICAL, multi_hot=(), dense=CRITEO_DENSE), fmt
    if not spec.label or not (spec.categorical or spec.multi_hot):
        raise ValueError("--data needs --label and --categorical (or --multi-hot) naming its columns")
    return dict(label=spec.label, categorical=tuple(spec.categorical), multi_hot=tuple(spec.multi_hot),
                dense=tuple(spec.dense)), fmt
