"""The train-step contestants of ``benchmarks/train_step.py``: the workload, its data and one ``Trainer`` per
implementation. Each contestant is built in its own process (see ``train_step.py``); everything here is
deterministic in its seeds, so every process sees the same ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import time

import torch
from torch import nn

import dynemb

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adam")
# every sparse optimizer dynemb has; train_step_ab.py (dynemb against dynemb) takes any of them
DYNEMB_OPTIMIZERS = (*OPTIMIZERS, "adagrad", "ftrl")
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


def alternated_steps(steppers: list, batches: list, rounds: int) -> list[list[float]]:
    """CPU seconds (this process's clock) of each of ``steppers`` (callables taking a batch) over ``rounds`` rounds:
    one call of each a round, on ``batches[r % len(batches)]``, the order reversed every other round, so that
    neither side always runs first after the other has warmed or cooled the caches."""
    times = [[] for _ in steppers]
    for r in range(rounds):
        order = range(len(steppers)) if r % 2 == 0 else reversed(range(len(steppers)))
        for k in order:
            start = time.process_time()
            steppers[k](batches[r % len(batches)])
            times[k].append(time.process_time() - start)
    return times


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


def dynemb_optimizer(opt: str, fused: bool, lib=dynemb):
    # an unknown name is an error, not a silent Adam (train_step_ab.py's "adagrad" and "ftrl" once ran Adam)
    cls = {"sgd": lib.optim.SGD, "rowwise_adagrad": lib.optim.RowWiseAdagrad, "adam": lib.optim.Adam,
           "adagrad": lib.optim.Adagrad, "ftrl": lib.optim.FTRL}.get(opt)
    if cls is None:
        raise ValueError(f"optimizer must be one of {DYNEMB_OPTIMIZERS}, got {opt!r}")
    return cls(lr=LR, fused=fused)


class Dynemb(Trainer):
    def __init__(self, w: Workload, opt: str, *, static: bool, fused: bool, compiled: bool = False,
                 bound: float | None = None, lib=dynemb) -> None:
        # lib: the dynemb package to build from (train_step_ab.py --same-process loads an older tree beside it)
        super().__init__(w)
        # bound: max_capacity as a fraction of the ids, under the policy a bound gets by default (decayed_lfu); 2.0
        # is never reached (the step pays for the scores only), 0.5 evicts on every step
        bound = {"max_capacity": int(bound * w.vocab)} if bound else {}
        tables = [lib.TableConfig(name=f"t{t}", dim=w.dim, vocabulary_size=w.vocab if static else None,
                                  optimizer=dynemb_optimizer(opt, fused, lib), combiner="sum", seed=t,
                                  init_capacity=w.vocab if not static else 8192, **bound)
                  for t in range(w.tables)]
        features = [lib.FeatureConfig(name=f"f{t}", table=f"t{t}") for t in range(w.tables)]
        self.ec = lib.EmbeddingCollection(tables, features)
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
        elif opt in ("adagrad", "adam"):
            self.opt = (torch.optim.Adagrad if opt == "adagrad" else torch.optim.SparseAdam)(params, lr=LR)
        else:
            raise ValueError(f"torch-bag has no sparse {opt!r}")
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
        from dynemb.distributed.launch import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)


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


CONTESTANTS = {  # the dynemb ones also take lib= (see Dynemb)
    "dynemb-dyn-fused": lambda w, opt, **kw: Dynemb(w, opt, static=False, fused=True, **kw),
    "dynemb-dyn-step": lambda w, opt, **kw: Dynemb(w, opt, static=False, fused=False, **kw),
    "dynemb-dyn-bounded": lambda w, opt, **kw: Dynemb(w, opt, static=False, fused=True, bound=2.0, **kw),
    "dynemb-dyn-evicting": lambda w, opt, **kw: Dynemb(w, opt, static=False, fused=True, bound=0.5, **kw),
    "dynemb-dyn-compiled": lambda w, opt, **kw: Dynemb(w, opt, static=False, fused=True, compiled=True, **kw),
    "dynemb-static": lambda w, opt, **kw: Dynemb(w, opt, static=True, fused=True, **kw),
    "torch-bag": TorchBag,
    "torchrec": TorchRec,
}
