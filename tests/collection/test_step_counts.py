"""The collection's part of a steady training step talks to the host at most once and costs a fixed number of
torch ops and Triton launches, whatever the number of tables (issue 43, item 2).

A steady step: tables of dim 16 with fused Adagrad, one feature each, 5% of every batch never seen before, no table
growing, evicting or admitting. Counted on CPU tensors under Triton's interpreter, backend ``triton``: every torch
op dispatched (a ``TorchDispatchMode``), every Triton launch (the interpreter's launcher, whose own tensor
bookkeeping is not counted), and every read of device data on the host: ``.item()``, ``bool()`` and ``int()`` of a
tensor (``_local_scalar_dense``), ``.tolist()``, ``.numpy()``, and the ops whose output shape depends on the data
(``nonzero``, ``unique``, ``masked_select``, ``bincount``, ``repeat_interleave`` without ``output_size``, boolean
indexing). The loss and its backward are the test's, not counted. On a GPU the same step runs under
``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import collections
import functools
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import dynemb  # noqa: E402
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402
from dynemb.kernels import use_backend  # noqa: E402

# The counter is the benchmark's (benchmarks/step_counts.py), so that CI asserts what the benchmark prints.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from step_counts import _Counter, _counting, _Loss  # noqa: E402

counting = functools.partial(_counting, torch.device("cpu"))  # CPU tensors: Triton's interpreter launches

pytestmark = pytest.mark.triton

BATCH = 256
MAX_STEP_COST = 200  # torch ops plus Triton launches of the collection's part of a step


def _model(tables: int) -> EmbeddingCollection:
    configs = [TableConfig(name=f"t{i}", dim=16, optimizer=dynemb.optim.Adagrad(lr=0.05, fused=True), seed=i)
               for i in range(tables)]
    return EmbeddingCollection(configs, [FeatureConfig(name=f"f{i}", table=f"t{i}") for i in range(tables)])


def _batches(tables: int, steps: int, new_share: float = 0.05):
    """Batches of one id a sample a table: after the first, ``new_share`` of each never seen before."""
    g = torch.Generator().manual_seed(tables)
    seen = [torch.randint(-(2**62), 2**62, (BATCH,), generator=g) for _ in range(tables)]
    yield {f"f{i}": ids for i, ids in enumerate(seen)}
    fresh = int(BATCH * new_share)
    for _ in range(steps - 1):
        batch = {}
        for i in range(tables):
            old = seen[i][torch.randint(0, seen[i].numel(), (BATCH - fresh,), generator=g)]
            new = torch.randint(-(2**62), 2**62, (fresh,), generator=g)
            seen[i] = torch.cat([seen[i], new])
            batch[f"f{i}"] = torch.cat([old, new])[torch.randperm(BATCH, generator=g)]
        yield batch


def _step(ec: EmbeddingCollection, batch: dict, counter=None) -> None:
    out = ec(batch)
    loss = _Loss.apply(counter or _Counter(), *out.values())
    loss.backward()
    ec.optimizer.step()
    ec.optimizer.zero_grad()


def _steady_step_cost(tables: int, backend: str = "triton"
                      ) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    with use_backend(backend):
        ec = _model(tables)
        *warm, counted = list(_batches(tables, 4))
        for batch in warm:
            _step(ec, batch)
        sizes = [len(m) for m in ec.embeddings.values()]  # read now: the counted step is the steady one
        with counting() as (counter, launches):
            _step(ec, counted, counter)
    grown = [len(m) - s for m, s in zip(ec.embeddings.values(), sizes)]
    assert all(0 < n <= BATCH * 0.05 for n in grown), grown  # new ids arrived and were inserted
    return counter.ops, counter.reads, launches


@pytest.mark.slow  # about 25 s under the interpreter: make test runs it, make test-quick the numba one below
def test_a_steady_step_reads_nothing_back_and_costs_the_same_at_2_and_26_tables():
    few_ops, few_reads, few_launches = _steady_step_cost(2)
    ops, reads, launches = _steady_step_cost(26)
    cost = sum(ops.values()) + sum(launches.values())
    assert sum(reads.values()) <= 1 and sum(few_reads.values()) <= 1, (reads, few_reads)
    assert cost <= MAX_STEP_COST, (ops.most_common(), launches)
    assert cost == sum(few_ops.values()) + sum(few_launches.values()), (ops - few_ops, few_ops - ops)
    assert sum(launches.values()) == 4, launches  # find (claim, publish), pool, update: one each for all tables


def test_a_steady_step_on_numba_costs_the_same_at_2_and_26_tables():
    """On numba (CPU) a kernel call hands the host's own memory to compiled code (``.numpy()`` is a view, no read):
    the torch ops and the other reads are counted, and are the same at 2 tables as at 26."""
    few_ops, few_reads, _ = _steady_step_cost(2, "numba")
    ops, reads, _ = _steady_step_cost(26, "numba")
    for counted in (reads, few_reads):
        counted.pop("numpy", None)
    assert sum(reads.values()) <= 1 and sum(few_reads.values()) <= 1, (reads, few_reads)
    assert sum(ops.values()) <= MAX_STEP_COST, ops.most_common()
    assert ops == few_ops, (ops - few_ops, few_ops - ops)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_steady_step_on_a_gpu_makes_no_sync():
    ec = _model(26).cuda()
    batches = [{f: ids.cuda() for f, ids in b.items()} for b in _batches(26, 4)]
    with use_backend("triton"):
        for batch in batches[:-1]:
            _step(ec, batch)
        [len(m) for m in ec.embeddings.values()]  # the sizes are read back before the steady step
        torch.cuda.set_sync_debug_mode("error")
        try:
            _step(ec, batches[-1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
