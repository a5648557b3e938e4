"""Training-step throughput: forward (pooled lookups), a tiny dense head, backward and the sparse update.

Side by side in one run, timed interleaved (one step of each implementation in turn, medians of repeats):

- ``dynemb-dyn-fused`` / ``dynemb-dyn-step``: EmbeddingCollection over dynamic tables (``vocabulary_size=None``),
  optimizer fused into backward or applied by ``optimizer.step()``. Pre-warmed with the whole id space (in a
  random order) so that steps measure the steady state, not inserts.
- ``dynemb-static``: the same collection with ``vocabulary_size=V`` (dense tables), fused optimizer.
- ``torch-bag``: ``T x nn.EmbeddingBag(sparse=True)`` with a torch optimizer (SGD, Adagrad for RowWiseAdagrad,
  SparseAdam for Adam).
- ``torchrec``: TorchRec EmbeddingBagCollection sharded by DistributedModelParallel on a one-process gloo group,
  optimizer fused into backward (fbgemm TBE), when torchrec is installed (``benchmarks/install_torchrec.sh``).

Workload: ``T`` tables x ``V`` ids, dim ``D``, batch ``B``, pooling factor ``P`` (ids + offsets bags, sum
pooling), one feature per table; ids uniform or power law (Zipf, alpha 1.05, hot ids scattered over the id space).
The head is ``concat -> Linear(T*D, 1) -> sum``, updated by ``torch.optim.SGD`` in every implementation.

Every measurement reports steps/s from wall time and from CPU time (``time.process_time``, the CPU time of all
the process's threads), both medians of the same interleaved steps; ``--clock`` picks the one the targets'
``met`` column is judged on.

Run: ``.venv/bin/python benchmarks/train_step.py [--quick] [--json PATH] [--threads 1 2] [--clock cpu]``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, median_times, parser, print_table, using_threads, write_json  # noqa: E402

import dynemb  # noqa: E402
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
DISTRIBUTIONS = ("uniform", "zipf")
LR = 0.01


@dataclass(frozen=True)
class Workload:
    tables: int
    vocab: int
    dim: int
    batch: int
    pooling: int
    alpha: float = 1.05

    @property
    def features(self) -> list[str]:
        return [f"f{t}" for t in range(self.tables)]


# ----------------------------------------------------------------------------------------------- data
def draw_ids(w: Workload, dist: str, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` ids in ``[0, V)``: uniform, or Zipf(alpha) ranks mapped to ids through a fixed permutation."""
    if dist == "uniform":
        return torch.randint(0, w.vocab, (n,), generator=g)
    ranks = torch.arange(1, w.vocab + 1, dtype=torch.float64)
    cdf = ranks.pow(-w.alpha).cumsum(0)
    cdf /= cdf[-1].clone()
    rank = torch.searchsorted(cdf, torch.rand(n, dtype=torch.float64, generator=g)).clamp_(max=w.vocab - 1)
    perm = torch.randperm(w.vocab, generator=torch.Generator().manual_seed(1234))
    return perm[rank]


def make_batches(w: Workload, dist: str, count: int, seed: int = 0) -> list[dict]:
    """``count`` batches: feature -> ``(ids [B*P] int64, offsets [B])``."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(0, w.batch * w.pooling, w.pooling)
    return [{f: (draw_ids(w, dist, w.batch * w.pooling, g), offsets) for f in w.features} for _ in range(count)]


# ----------------------------------------------------------------------------------------------- implementations
class Trainer:
    """One implementation: ``step(batch)`` runs forward, head, backward and both updates."""

    def __init__(self, w: Workload) -> None:
        self.head = nn.Linear(w.tables * w.dim, 1)
        self.head_opt = torch.optim.SGD(self.head.parameters(), lr=LR)

    def pooled(self, batch: dict) -> torch.Tensor:
        raise NotImplementedError

    def sparse_step(self) -> None:
        pass

    def loss(self, batch: dict) -> torch.Tensor:
        return self.head(self.pooled(batch)).sum()

    def step(self, batch: dict) -> None:
        self.loss(batch).backward()
        self.sparse_step()
        self.head_opt.step()
        self.head_opt.zero_grad()


def dynemb_optimizer(opt: str, fused: bool):
    if opt == "sgd":
        return dynemb.optim.SGD(lr=LR, fused=fused)
    if opt == "rowwise_adagrad":
        return dynemb.optim.RowWiseAdagrad(lr=LR, fused=fused)
    return dynemb.optim.Adam(lr=LR, fused=fused)


class Dynemb(Trainer):
    def __init__(self, w: Workload, opt: str, *, static: bool, fused: bool, compiled: bool = False) -> None:
        super().__init__(w)
        tables = [TableConfig(name=f"t{t}", dim=w.dim, vocabulary_size=w.vocab if static else None,
                              optimizer=dynemb_optimizer(opt, fused), combiner="sum", seed=t,
                              init_capacity=w.vocab if not static else 8192)
                  for t in range(w.tables)]
        features = [FeatureConfig(name=f"f{t}", table=f"t{t}") for t in range(w.tables)]
        self.ec = EmbeddingCollection(tables, features)
        self.fused = fused
        self.features = w.features
        if not static:
            self._prewarm(w)
        if compiled:  # the collection forward and the head as one graph (dynemb's lookups are custom ops)
            self.loss = torch.compile(self.loss, fullgraph=True)

    def _prewarm(self, w: Workload) -> None:
        ids = torch.randperm(w.vocab, generator=torch.Generator().manual_seed(7))
        for module in self.ec.embeddings.values():  # insert every id, without a training step
            module.table.find_or_insert(ids)

    def pooled(self, batch):
        out = self.ec(batch)
        return torch.cat([out[f] for f in self.features], dim=1)

    def sparse_step(self):
        if not self.fused:
            self.ec.optimizer.step()
            self.ec.optimizer.zero_grad()


class TorchBag(Trainer):
    def __init__(self, w: Workload, opt: str) -> None:
        super().__init__(w)
        self.bags = nn.ModuleList(nn.EmbeddingBag(w.vocab, w.dim, mode="sum", sparse=True) for _ in w.features)
        params = list(self.bags.parameters())
        if opt == "sgd":
            self.opt = torch.optim.SGD(params, lr=LR)
        elif opt == "rowwise_adagrad":  # torch has no row-wise Adagrad; element-wise Adagrad takes sparse grads
            self.opt = torch.optim.Adagrad(params, lr=LR)
        else:
            self.opt = torch.optim.SparseAdam(params, lr=LR)
        self.features = w.features

    def pooled(self, batch):
        return torch.cat([bag(*batch[f]) for bag, f in zip(self.bags, self.features)], dim=1)

    def sparse_step(self):
        self.opt.step()
        self.opt.zero_grad()


def torchrec_available() -> str | None:
    """``None`` when torchrec can be used, else why not."""
    try:
        import torchrec  # noqa: F401
        from torchrec.distributed import DistributedModelParallel  # noqa: F401
    except Exception as e:  # an import of fbgemm can fail with OSError/RuntimeError on a mismatched torch
        return f"{type(e).__name__}: {e}".splitlines()[0][:120]
    return None


def _init_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchRec(Trainer):
    def __init__(self, w: Workload, opt: str) -> None:
        super().__init__(w)
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
        from torchrec.distributed import DistributedModelParallel
        from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
        from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

        _init_process_group()
        configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=w.dim, num_embeddings=w.vocab,
                                      feature_names=[f]) for t, f in enumerate(w.features)]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        cls = {"sgd": torch.optim.SGD, "rowwise_adagrad": RowWiseAdagrad, "adam": torch.optim.Adam}[opt]
        apply_optimizer_in_backward(cls, ebc.parameters(), {"lr": LR})
        self.model = DistributedModelParallel(ebc, device=torch.device("cpu"))
        self.kjt = KeyedJaggedTensor
        self.features = w.features
        self._cache: dict = {}

    def _kjt(self, batch):
        # Building the KeyedJaggedTensor is input preparation (a data loader's job), so it is cached per batch.
        key = id(batch)
        if key not in self._cache:
            ids = torch.cat([batch[f][0] for f in self.features])
            lengths = torch.cat([torch.diff(batch[f][1], append=torch.tensor([batch[f][0].numel()]))
                                 for f in self.features])
            self._cache[key] = self.kjt(keys=self.features, values=ids, lengths=lengths)
        return self._cache[key]

    def pooled(self, batch):
        return self.model(self._kjt(batch)).values()


def build(w: Workload, opt: str, with_torchrec: bool, compiled: bool = False) -> dict[str, Trainer]:
    impls: dict[str, Trainer] = {
        "dynemb-dyn-fused": Dynemb(w, opt, static=False, fused=True),
        "dynemb-dyn-step": Dynemb(w, opt, static=False, fused=False),
    }
    if compiled:
        impls["dynemb-dyn-compiled"] = Dynemb(w, opt, static=False, fused=True, compiled=True)
    if opt != "adam":  # no Adam target involves it, and Adam's two moment slots would add 3 GB at full size
        impls["dynemb-static"] = Dynemb(w, opt, static=True, fused=True)
    impls["torch-bag"] = TorchBag(w, opt)
    if with_torchrec:
        try:
            impls["torchrec"] = TorchRec(w, opt)
        except Exception as e:  # e.g. an optimizer fbgemm has no CPU kernel for
            print(f"  torchrec {opt}: not run ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    return impls


# ----------------------------------------------------------------------------------------------- timing
def time_steps(impls: dict[str, Trainer], batches: list[dict], repeat: int, warmup: int) -> dict[str, dict]:
    """Median wall and CPU seconds per step of each implementation, interleaved; all see the same batches.

    CPU time (``time.process_time``) is reported next to wall time because this shared machine is often
    oversubscribed: a descheduled step inflates its wall time but not its CPU time.
    """
    calls = {name: 0 for name in impls}
    cpu: dict[str, list[float]] = {name: [] for name in impls}

    def stepper(name):
        def run():
            start = time.process_time()
            impls[name].step(batches[calls[name] % len(batches)])
            if calls[name] >= warmup:
                cpu[name].append(time.process_time() - start)
            calls[name] += 1
        return run

    wall = median_times({name: stepper(name) for name in impls}, repeat=repeat, warmup=warmup)
    return {name: {"wall_s": wall[name], "cpu_s": statistics.median(cpu[name])} for name in impls}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


TARGETS = (  # (optimizers, implementation, baseline, goal)
    (("sgd", "rowwise_adagrad"), "dynemb-static", "torchrec", 1.0),
    (("sgd", "rowwise_adagrad"), "dynemb-dyn-fused", "torchrec", 0.7),
    (("sgd", "rowwise_adagrad"), "dynemb-dyn-step", "torchrec", 0.7),
    (("adam",), "dynemb-dyn-fused", "torch-bag", 1.0),
    (("adam",), "dynemb-dyn-step", "torch-bag", 1.0),
)


def targets(rows: list[dict], clock: str) -> list[dict]:
    """The issue's targets as ratios of steps/s within one measurement (same threads, ids and optimizer), from
    wall time and from CPU time; ``met`` is judged on ``clock``."""
    out = []
    for r in rows:
        for optimizers, impl, base, goal in TARGETS:
            if r["optimizer"] not in optimizers:
                continue
            wall = ratio(r["steps_per_s"].get(impl), r["steps_per_s"].get(base))
            cpu = ratio(r["cpu_steps_per_s"].get(impl), r["cpu_steps_per_s"].get(base))
            judged = cpu if clock == "cpu" else wall
            out.append({"optimizer": r["optimizer"], "ids": r["distribution"], "threads": r["threads"],
                        "target": f"{impl} >= {goal}x {base}", "goal": goal, "ratio_wall": wall, "ratio_cpu": cpu,
                        "met": None if judged is None else judged >= goal})
    return out


NAMES = ["dynemb-dyn-fused", "dynemb-dyn-step", "dynemb-dyn-compiled", "dynemb-static", "torch-bag", "torchrec"]


def report(rows: list[dict], checks: list[dict]) -> None:
    for key, title in (("steps_per_s", "steps/s from wall time"), ("cpu_steps_per_s", "steps/s from CPU time")):
        print(f"\n{title} (median of repeats; higher is better)")
        print_table([{"optimizer": r["optimizer"], "ids": r["distribution"], "threads": r["threads"],
                      **{n: r[key].get(n, "n/a") for n in NAMES}} for r in rows],
                    ["optimizer", "ids", "threads"] + NAMES)
    print("\ntargets (ratios of steps/s in the same measurement)")
    print_table(checks, ["optimizer", "ids", "threads", "target", "ratio_wall", "ratio_cpu", "met"])


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=None, help="torch thread counts (default: 1 2)")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=None)
    p.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=None)
    p.add_argument("--no-torchrec", action="store_true", help="skip TorchRec even when it is installed")
    p.add_argument("--compile", action="store_true",
                   help="add dynemb-dyn-compiled: dyn-fused under torch.compile(fullgraph=True)")
    args = p.parse_args(argv)
    if args.quick:  # small tables, one optimizer, one distribution, one thread: a smoke run well under a minute
        w, repeat, warmup = Workload(4, 20_000, 64, 512, 20), args.repeat or 3, 1
        threads, optimizers, dists = args.threads or [1], args.optimizers or ["rowwise_adagrad"], ["uniform"]
    else:
        w, repeat, warmup = Workload(4, 1_000_000, 64, 4096, 20), args.repeat or 15, 2
        threads, optimizers, dists = args.threads or [1, 2], args.optimizers or list(OPTIMIZERS), list(DISTRIBUTIONS)
    dists = args.distributions or dists
    why_not = torchrec_available() if not args.no_torchrec else "--no-torchrec"
    print(f"workload: {w}; threads {threads}; repeat {repeat}; torchrec: {why_not or 'yes'}; "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}")
    batches = {d: make_batches(w, d, count=warmup + repeat) for d in dists}
    rows = []
    for opt in optimizers:
        torch.manual_seed(0)
        impls = build(w, opt, with_torchrec=why_not is None, compiled=args.compile)
        for n in threads:
            with using_threads(n):
                for dist in dists:
                    sec = time_steps(impls, batches[dist], repeat, warmup)
                    rows.append({"optimizer": opt, "distribution": dist, "threads": n,
                                 "steps_per_s": {k: round(1.0 / v["wall_s"], 2) for k, v in sec.items()},
                                 "cpu_steps_per_s": {k: round(1.0 / v["cpu_s"], 2) for k, v in sec.items()}})
                    print(f"  {opt:16s} {dist:8s} threads={n}: wall/cpu steps/s  " + "  ".join(
                        f"{k} {rows[-1]['steps_per_s'][k]}/{rows[-1]['cpu_steps_per_s'][k]}" for k in sec),
                        flush=True)
        del impls
        gc.collect()
    checks = targets(rows, args.clock)
    report(rows, checks)
    if args.json:
        write_json(args.json, {"benchmark": "train_step", "workload": w.__dict__, "repeat": repeat,
                               "torchrec": why_not or "yes", "machine": machine_info(), "results": rows,
                               "targets": checks})


if __name__ == "__main__":
    main()
