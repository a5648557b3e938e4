"""Background saves: ``save(..., blocking=False)`` copies what it writes, then writes it on a thread of its own.

Consistency comes from a **snapshot**: before ``save`` returns, every tensor the checkpoint holds (the live rows of
this rank's tables: keys, values, scores, optimizer slots; the dense state; the optimizer state) is copied to host
memory, on the caller's thread, at the save's step. Training then changes the tables freely (updates, inserts,
evictions, compaction, growth, the fused kernels' in-place writes) while the thread writes the copies, so the files
equal a blocking save at that step. The copy is laid out as the files themselves (:class:`~.file_image.FileImage`:
page-aligned, header and tensors at their offsets), and the thread starts before it: it hashes and writes each chunk
as soon as the caller has copied it, with ``O_DIRECT`` straight from the snapshot where the file system allows. The
snapshot costs host memory the size of the files (for a full save, every live row of this rank's tables; for an
incremental one, its changed rows), given back a chunk at a time as the chunks reach the disk, and one memory copy
of those bytes on the caller's thread (a device-to-host copy for CUDA tables).

Saves run one at a time in a process: a save or load first waits for a background save still running
(:func:`wait_for_saves`), so incremental chains and ``latest`` follow the order of the calls. A serving export does
not wait (it writes another root, from the live tables, on the caller's thread), so publishing at the step of a
checkpoint does not stall training. Under
torch.distributed the thread's collectives go over a gloo group of the same ranks made for this purpose
(:func:`side_context`), never the training's group, whose collectives the caller's thread goes on issuing.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from .file_image import FileImage
from .ranks import RankContext

__all__ = ["SaveHandle", "snapshot", "fill", "side_context", "wait_for_saves"]

_RUNNING: list["SaveHandle"] = []
_RUNNING_LOCK = threading.Lock()
_SIDE_GROUPS: dict = {}  # id(training group) -> (that group, its side RankContext)


class SaveHandle:
    """A background save in progress, as ``save(..., blocking=False)`` returns it.

    Attributes:
        path: the checkpoint directory the save publishes (``root/step-<step>``) when it succeeds.

    Example:
        >>> import tempfile, torch, dynemb
        >>> from dynemb.checkpoint import save
        >>> emb = dynemb.DynamicEmbedding(4, seed=0)
        >>> _ = emb(torch.tensor([1, 2, 3]))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> handle = save(tmp.name, emb, step=5, blocking=False)
        >>> _ = emb(torch.tensor([4]))                 # training goes on; the save holds step 5's rows
        >>> handle.wait().name, handle.done(), handle.error
        ('step-00000005', True, None)
        >>> tmp.cleanup()
    """

    def __init__(self, path: Path, work: Callable[[], Path]) -> None:
        self.path = path
        self._error: Optional[BaseException] = None
        self._finished = threading.Event()
        # Not a daemon: an interpreter that reaches its end lets the save finish before it exits.
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"dynemb-save-{path.name}")
        with _RUNNING_LOCK:
            _RUNNING.append(self)
        self._thread.start()

    def _run(self, work: Callable[[], Path]) -> None:
        _lower_priority()
        try:
            work()
        except BaseException as e:  # noqa: BLE001  (kept for wait(), raised there)
            self._error = e
        finally:
            self._finished.set()
            with _RUNNING_LOCK:
                _RUNNING.remove(self)

    def done(self) -> bool:
        """Whether the save has ended (published, or failed: see :attr:`error`)."""
        return self._finished.is_set()

    @property
    def error(self) -> Optional[BaseException]:
        """The exception the save failed with, or None (also while it runs)."""
        return self._error if self.done() else None

    def wait(self, timeout: Optional[float] = None) -> Path:
        """Block until the save has ended; return its directory or raise its error.

        Under torch.distributed every rank's save ends the same way (each learns every rank's outcome from the
        save's own collectives), so ``wait`` returns on every rank or raises on every rank; it issues no collective
        itself, so ranks may call it at different times, or not at all.

        Args:
            timeout: seconds to wait at most; None waits for the end.

        Raises:
            TimeoutError: ``timeout`` passed first (the save goes on).
            Exception: the save's own error (a CheckpointError naming the rank that failed, an OSError, ...).
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the background save of {self.path} is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error is not None else "done"
        return f"SaveHandle({str(self.path)!r}, {state})"


#: how much nicer than the training threads a background save's threads run (Linux: per thread)
NICENESS = 10


def _lower_priority() -> None:
    """Make this thread (and the helper threads it starts, which inherit it) yield the CPU to training: on Linux
    a thread's nice value is its own. A save on a machine with idle cores writes as fast as a blocking one; on a
    saturated one it takes the cycles training leaves, instead of slowing the steps."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICENESS))
    except (AttributeError, OSError):  # not Linux, or not allowed: the save runs at the caller's priority
        pass


def wait_for_saves() -> None:
    """Wait for every background save of this process to end (their errors stay with their handles)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for handle in running:
        handle._finished.wait()


def snapshot(payloads: dict) -> dict:
    """``{file: (tensors, metadata)}`` -> ``{file: (FileImage, None)}``: each file's bytes in memory of its own,
    laid out but not copied yet (:func:`fill` copies)."""
    return {rel: (FileImage(tensors, metadata), None) for rel, (tensors, metadata) in payloads.items()}


def fill(images: dict) -> None:
    """Copy the current contents of every snapshot's tensors in, in the order the save's thread writes them."""
    for image, _ in images.values():
        image.fill()


def side_context(ctx: RankContext) -> RankContext:
    """``ctx`` over a gloo group of the same ranks, for a background save's collectives (a collective the first
    time, made by every rank's ``save``); ``ctx`` itself for one process."""
    if not ctx.distributed:
        return ctx
    group = ctx.group if ctx.group is not None else dist.group.WORLD
    known = _SIDE_GROUPS.get(id(group))
    if known is None or known[0] is not group:  # a group made since, at a recycled address
        ranks = dist.get_process_group_ranks(group)
        side = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        known = _SIDE_GROUPS[id(group)] = (group, RankContext(ctx.rank, ctx.world, side))
    return known[1]
