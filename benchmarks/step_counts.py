"""What the collection's part of a steady training step asks of the host: torch ops dispatched, Triton launches and
reads of device data, per step, at 2 and 26 tables (issue 43, item 2; ``tests/collection/test_step_counts.py``
asserts the bounds in CI).

The model: tables of dim 16 with fused Adagrad, one feature each, batch ``--batch`` (default 512), ``--new-ids``
(default 5%) of each batch never seen before, after warm steps; the loss is a sum whose own ops are not counted.
Ops: every op a ``TorchDispatchMode`` sees. Launches: Triton kernel launches (``JITFunction.run`` on a GPU, the
interpreter's launcher on CPU). Reads: ``.item()``/``bool()``/``int()`` (``_local_scalar_dense``), ``.tolist()``,
``.cpu()``-style copies to the host, and ops whose output shape depends on the data (``nonzero``, ``unique``,
``masked_select``, ``bincount``, ``repeat_interleave`` without ``output_size``); on a GPU also
``torch.cuda.set_sync_debug_mode("warn")``'s warnings ("syncs"). On CPU run it under ``TRITON_INTERPRET=1`` for the
triton backend.

Run: ``python benchmarks/step_counts.py [--device cuda] [--backends triton numba] [--tables 2 26] [--json PATH]``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

import dynemb  # noqa: E402
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402
from dynemb.kernels import use_backend  # noqa: E402

_DATA_SHAPED = {"nonzero", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive", "masked_select",
                "bincount", "_local_scalar_dense"}


class _Counter(TorchDispatchMode):
    """Every dispatched op by name, and the reads of device data among them, while not paused (the CI test,
    tests/collection/test_step_counts.py, counts with this class)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.reads, self.paused = collections.Counter(), collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            name = func._schema.name.split("::")[-1]
            self.ops[name] += 1
            if name in _DATA_SHAPED or (name == "repeat_interleave" and kwargs.get("output_size") is None):
                self.reads[name] += 1
            if name in ("index", "index_put", "index_put_") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None):
                self.reads["boolean indexing"] += 1
            if name in ("_to_copy", "copy_") and any(isinstance(a, torch.Tensor) and a.device.type == "cuda"
                                                     for a in args) and kwargs.get("device", None) == "cpu":
                self.reads["to cpu"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _counting(device: torch.device, numpy_reads: bool = True):
    """``(counter, launches)`` of the block. ``numpy_reads=False``: ``.numpy()`` is numba's zero-copy view of host
    rows, no read of device data."""
    counter, launches = _Counter(), collections.Counter()
    patches = []
    try:
        import triton
        from triton.runtime import jit

        if os.environ.get("TRITON_INTERPRET") == "1":
            import triton.runtime.interpreter as interpreter

            real = interpreter.GridExecutor.__call__

            def launch(self, *args, **kwargs):
                launches[self.fn.__name__] += 1
                counter.paused += 1  # the interpreter's own tensor copies are no ops of the step
                try:
                    return real(self, *args, **kwargs)
                finally:
                    counter.paused -= 1
            patches.append((interpreter.GridExecutor, "__call__", real, launch))
        else:
            real_run = jit.JITFunction.run

            def run(self, *args, **kwargs):
                if not kwargs.get("warmup", False):
                    launches[self.fn.__name__] += 1
                return real_run(self, *args, **kwargs)
            patches.append((jit.JITFunction, "run", real_run, run))
        del triton
    except ImportError:
        pass
    def reader(real, what):
        def read(self, *args, **kwargs):
            if not counter.paused:
                counter.reads[what] += 1
            return real(self, *args, **kwargs)
        return read
    for what in ("tolist", "numpy") if numpy_reads else ("tolist",):
        method = getattr(torch.Tensor, what)
        patches.append((torch.Tensor, what, method, reader(method, what)))
    for owner, name, _, new in patches:
        setattr(owner, name, new)
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            with counter:
                yield counter, launches
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        for owner, name, old, _ in patches:
            setattr(owner, name, old)
        counter.reads["syncs"] += sum("synchroniz" in str(w.message) for w in caught)


class _Loss(torch.autograd.Function):
    """A sum of the outputs whose forward and backward the counter does not see."""

    @staticmethod
    def forward(ctx, counter, *outputs):
        ctx.counter, ctx.shapes = counter, [o.shape for o in outputs]
        ctx.device = outputs[0].device
        counter.paused += 1
        try:
            return sum(o.sum() for o in outputs)
        finally:
            counter.paused -= 1

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.paused += 1
        try:
            return (None, *(torch.ones(shape, device=ctx.device) * grad for shape in ctx.shapes))
        finally:
            ctx.counter.paused -= 1


def steady_step(backend: str, tables: int, batch: int, new_ids: float, device: torch.device) -> dict:
    with use_backend(backend):
        configs = [TableConfig(name=f"t{i}", dim=16, optimizer=dynemb.optim.Adagrad(lr=0.05, fused=True), seed=i)
                   for i in range(tables)]
        ec = EmbeddingCollection(configs, [FeatureConfig(name=f"f{i}", table=f"t{i}") for i in range(tables)],
                                 device=device)
        g = torch.Generator().manual_seed(tables)
        seen = [torch.randint(-(2**62), 2**62, (batch,), generator=g) for _ in range(tables)]
        fresh = int(batch * new_ids)

        def make():
            out = {}
            for i in range(tables):
                old = seen[i][torch.randint(0, seen[i].numel(), (batch - fresh,), generator=g)]
                new = torch.randint(-(2**62), 2**62, (fresh,), generator=g)
                seen[i] = torch.cat([seen[i], new])
                out[f"f{i}"] = torch.cat([old, new])[torch.randperm(batch, generator=g)].to(device)
            return out

        def step(batch, counter):
            loss = _Loss.apply(counter, *ec(batch).values())
            loss.backward()
            ec.optimizer.step()
            ec.optimizer.zero_grad()

        step({f"f{i}": ids.to(device) for i, ids in enumerate(seen)}, _Counter())
        for _ in range(2):
            step(make(), _Counter())
        [len(m) for m in ec.embeddings.values()]  # sizes read back before the counted step
        counted = make()
        with _counting(device, numpy_reads=backend != "numba") as (counter, launches):
            step(counted, counter)
    reads = {k: v for k, v in counter.reads.items() if v}
    return {"backend": backend, "tables": tables, "ops": sum(counter.ops.values()), "launches": sum(launches.values()),
            "ops+launches": sum(counter.ops.values()) + sum(launches.values()), "reads": sum(reads.values()),
            "which reads": ", ".join(f"{k} {v}" for k, v in sorted(reads.items())) or "-"}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", nargs="+", default=None, help="default: triton, and numba on cpu")
    p.add_argument("--tables", type=int, nargs="+", default=[2, 26])
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--new-ids", type=float, default=0.05)
    args = p.parse_args()
    device = torch.device(args.device)
    backends = args.backends or (["triton"] if device.type == "cuda" else ["triton", "numba"])
    info = machine_info()
    print(f"{device} ({info['cuda'] or info['cpu_model']}); batch {args.batch}, {args.new_ids:.0%} new ids, the "
          "collection's part of one steady step (forward, backward, sparse update)")
    rows = [steady_step(b, t, args.batch, args.new_ids, device) for b in backends for t in args.tables]
    print_table(rows, ["backend", "tables", "ops", "launches", "ops+launches", "reads", "which reads"])
    if args.json:
        write_json(args.json, {"benchmark": "step_counts", "machine": info, "device": str(device), "results": rows})


if __name__ == "__main__":
    main()
