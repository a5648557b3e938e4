"""GPU engine benchmarks (issue 16): the hash index, find+gather and a training step, per kernel backend, with
static ``index_select`` / ``nn.EmbeddingBag`` as the floor.

Measured (``--device cuda``: backends triton and torch; ``--device cpu``: auto (numba) and torch, for a smoke run):

- ``find``: ``HashIndex.find`` of ``--batch`` stored keys in an index of ``--keys`` keys at load 0.40 (int64 keys,
  pointer only, HierarchicalKV's setting); keys/s;
- ``insert``: ``HashIndex.insert`` of ``--batch`` new keys into the same index (the keys are erased, untimed,
  after each run); keys/s; for triton also ``find_or_insert`` of those new keys in one launch (no hash sort);
- ``find+gather``: rows of ``--batch`` keys from a ``[keys, 64]`` float32 table: ``find`` then ``index_select``
  (torch), ``triton_index.find_gather`` (one launch), and ``index_select`` of known rows (the floor); GB/s of
  bytes read and written and the fraction of ``--hbm-tbs`` (3.0 TB/s: the issue's H100 roofline);
- ``train``: ``T`` tables x ``V`` rows, dim 64, batch ``B``, pooling 20, sum, RowWiseAdagrad fused into backward
  vs ``T x nn.EmbeddingBag(sparse=True)`` with ``torch.optim.Adagrad``; steps/s. dynemb runs the tables as
  ``DynamicEmbedding`` s looked up one by one (each backend), as an ``EmbeddingCollection`` (its tables in one
  execution group: one launch an operation for all), and, with triton, as an ``EmbeddingCollection`` of static
  tables (``vocabulary_size``: no hash table, dynemb's own Triton pooling and update): the cost of the hash table
  alone is the grouped dynamic collection against it. ``--train-runs N`` repeats the comparison N times.

Timings: medians of ``--repeat`` interleaved rounds; on CUDA each timed call ends with a device synchronize.
Run: ``python benchmarks/gpu_ops.py --device cuda [--quick] [--json PATH]``; ``benchmarks/train_step.py --device
cuda`` runs the ``train`` part.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Case, fmt_rate, machine_info, median_times, parser, print_table, write_json  # noqa: E402

import dynemb  # noqa: E402
from dynemb.functional import embedding_lookup_sparse  # noqa: E402
from dynemb.kernels import use_backend  # noqa: E402
from dynemb.table import HashIndex  # noqa: E402
from dynemb.table.hashing import mix64  # noqa: E402

TARGETS = {"find keys/s": 3e9, "insert keys/s": 1e9, "find+gather roofline": 0.5, "train vs EmbeddingBag": 0.8}


def _clock(device: torch.device):
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(device), time.perf_counter())[1]
    return time.perf_counter


def _keys(start: int, n: int, device) -> torch.Tensor:
    return mix64(torch.arange(start, start + n, dtype=torch.int64, device=device))  # distinct, pseudo-random


def _index(backend: str, keys: torch.Tensor, chunk: int) -> HashIndex:
    idx = HashIndex(torch.int64, keys.device, capacity=keys.numel(), backend=backend)
    for i, part in enumerate(keys.split(chunk)):
        idx.insert(part, torch.arange(i * chunk, i * chunk + part.numel(), device=keys.device))
    return idx


def index_ops(backends: list[str], n: int, batch: int, dim: int, repeat: int, device, hbm: float) -> list[dict]:
    keys = _keys(0, n, device)
    query = keys[torch.randperm(n, device=device)[:batch]]
    new = _keys(n, batch, device)
    values = torch.randn(n, dim, device=device)
    rows_known = torch.randint(0, n, (batch,), device=device)
    out = []
    for backend in backends:
        idx = _index(backend, keys, batch)
        load = n / idx.slots

        def insert(idx=idx):
            idx.insert(new, torch.arange(batch, device=device))

        def erase(idx=idx):
            idx.remove(idx.find_slots(new))

        cases = {"find": lambda idx=idx: idx.find(query), "insert": Case(insert, teardown=erase),
                 "find+gather": lambda idx=idx: values.index_select(0, idx.find(query).clamp_(min=0))}
        if backend == "triton":
            from dynemb.kernels import triton_index

            table = (idx._buckets.view(torch.int64), idx._key_cols, idx.overflow)
            counter = torch.zeros(1, dtype=torch.int32, device=device)
            cases["find+gather"] = lambda table=table, idx=idx: triton_index.find_gather(*table, query, idx._shift,
                                                                                         values)
            cases["find_or_insert"] = Case(  # new keys, one launch, no host sync; erased again untimed
                lambda table=table, idx=idx, counter=counter: triton_index.find_or_insert(*table, new, idx._shift,
                                                                                          counter),
                teardown=lambda table=table, idx=idx: triton_index.erase(*table, new, idx._shift))
        with use_backend(backend):
            t = median_times(cases, repeat=repeat, clock=_clock(device))
        out.append(_row(backend, t, batch, dim, load, hbm))
        del idx
    t = median_times({"gather": lambda: values.index_select(0, rows_known)}, repeat=repeat, clock=_clock(device))
    gbs = _gather_bytes(batch, dim) / t["gather"]
    out.append({"backend": "static index_select", "find+gather GB/s": f"{gbs / 1e9:.1f}",
                "roofline": f"{gbs / hbm:.2f}"})
    return out


def _gather_bytes(batch: int, dim: int) -> int:
    # per key: the key (8 B), its bucket (64 B: 5 int64 keys + 5 int32 rows), its row (4 * dim) read, the row
    # written; plus the row id (4 B) written
    return batch * (8 + 64 + 8 * dim + 4)


def _row(backend: str, t: dict, batch: int, dim: int, load: float, hbm: float) -> dict:
    gbs = _gather_bytes(batch, dim) / t["find+gather"]
    return {"backend": backend, "load": f"{load:.2f}", "find keys/s": fmt_rate(batch / t["find"]),
            "insert keys/s": fmt_rate(batch / t["insert"]), "find+gather GB/s": f"{gbs / 1e9:.1f}",
            "roofline": f"{gbs / hbm:.2f}", "_find": batch / t["find"], "_insert": batch / t["insert"],
            "_roofline": gbs / hbm,
            **({"find_or_insert keys/s": fmt_rate(batch / t["find_or_insert"])} if "find_or_insert" in t else {})}


# ----------------------------------------------------------------------------------------------- training step
class _Step:
    """One training step: pooled lookups of ``T`` features, a linear head, backward, sparse and dense updates."""

    def __init__(self, tables: int, dim: int, device) -> None:
        self.head = nn.Linear(tables * dim, 1, device=device)
        self.head_opt = torch.optim.SGD(self.head.parameters(), lr=0.01)

    def __call__(self, batch) -> None:
        self.head(torch.cat(self.pooled(batch), dim=1)).sum().backward()
        self.sparse_step()
        self.head_opt.step()
        self.head_opt.zero_grad()

    def sparse_step(self) -> None:
        pass


class _Dynemb(_Step):
    def __init__(self, tables, vocab, dim, device, backend) -> None:
        super().__init__(tables, dim, device)
        self.backend = backend
        with use_backend(backend):
            self.embs = [dynemb.DynamicEmbedding(dim, device=device, init_capacity=vocab, seed=t)
                         for t in range(tables)]
            self.opt = dynemb.optim.RowWiseAdagrad(self.embs, lr=0.01, fused=True)
            ids = torch.randperm(vocab, device=device)
            for e in self.embs:  # every id stored: steps measure the steady state
                for part in ids.split(1 << 20):
                    e.table.find_or_insert(part)

    def pooled(self, batch):
        with use_backend(self.backend):
            return [embedding_lookup_sparse(e, ids, offsets, combiner="sum") for e, (ids, offsets) in
                    zip(self.embs, batch)]

    def __call__(self, batch) -> None:
        with use_backend(self.backend):
            super().__call__(batch)


class _Collection(_Step):
    """The tables as one EmbeddingCollection (dynamic, or static with ``static``), each a feature of bags."""

    def __init__(self, tables, vocab, dim, device, backend, static: bool = False) -> None:
        super().__init__(tables, dim, device)
        self.backend = backend
        with use_backend(backend):
            configs = [dynemb.TableConfig(name=f"t{t}", dim=dim, seed=t,
                                          optimizer=dynemb.optim.RowWiseAdagrad(lr=0.01, fused=True),
                                          **({"vocabulary_size": vocab} if static else {"init_capacity": vocab}))
                       for t in range(tables)]
            self.ec = dynemb.EmbeddingCollection(configs, [dynemb.FeatureConfig(name=f"f{t}", table=f"t{t}")
                                                           for t in range(tables)], device=device)
            if not static:
                ids = torch.randperm(vocab, device=device)
                for name in self.ec.embeddings:  # every id stored: steps measure the steady state
                    for part in ids.split(1 << 20):
                        self.ec.embeddings[name].table.find_or_insert(part)

    def pooled(self, batch):
        out = self.ec({f"f{t}": (ids, offsets) for t, (ids, offsets) in enumerate(batch)})
        return [out[f"f{t}"] for t in range(len(batch))]

    def __call__(self, batch) -> None:
        with use_backend(self.backend):
            super().__call__(batch)


class _Bag(_Step):
    def __init__(self, tables, vocab, dim, device) -> None:
        super().__init__(tables, dim, device)
        self.bags = nn.ModuleList(nn.EmbeddingBag(vocab, dim, mode="sum", sparse=True, device=device)
                                  for _ in range(tables))
        self.opt = torch.optim.Adagrad(self.bags.parameters(), lr=0.01)  # torch has no row-wise Adagrad

    def pooled(self, batch):
        return [bag(ids, offsets) for bag, (ids, offsets) in zip(self.bags, batch)]

    def sparse_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


def train(backends: list[str], tables: int, vocab: int, batch: int, repeat: int, device, dim: int = 64,
          pooling: int = 20) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    offsets = torch.arange(0, batch * pooling, pooling, device=device)
    batches = [[(torch.randint(0, vocab, (batch * pooling,), generator=g).to(device), offsets)
                for _ in range(tables)] for _ in range(4)]
    contestants = {f"dynemb {b}": _Dynemb(tables, vocab, dim, device, b) for b in backends}
    contestants.update({f"dynemb collection {b}": _Collection(tables, vocab, dim, device, b) for b in backends})
    if "triton" in backends:  # the same model on static tables through dynemb's Triton kernels
        contestants["dynemb static triton"] = _Collection(tables, vocab, dim, device, "triton", static=True)
    contestants["nn.EmbeddingBag"] = _Bag(tables, vocab, dim, device)
    calls = {name: 0 for name in contestants}

    def run(name):
        calls[name] += 1
        contestants[name](batches[calls[name] % len(batches)])

    t = median_times({name: (lambda name=name: run(name)) for name in contestants}, repeat=repeat, warmup=2,
                     clock=_clock(device))
    floor = 1 / t["nn.EmbeddingBag"]
    static = t.get("dynemb static triton")
    return [{"contestant": name, "steps/s": f"{1 / s:.1f}", "vs EmbeddingBag": f"{(1 / s) / floor:.2f}",
             "vs static": "-" if static is None else f"{static / s:.2f}", "_ratio": (1 / s) / floor}
            for name, s in t.items()]


def main(argv=None, only: str | None = None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--keys", type=int, default=None, help="index keys (default 64M on cuda, 1M on cpu; quick 2^16)")
    p.add_argument("--batch", type=int, default=None, help="keys per call (default 1M on cuda; quick 8192)")
    p.add_argument("--vocab", type=int, default=None, help="train: rows per table (default 10M on cuda)")
    p.add_argument("--train-batch", type=int, default=None, help="train: batch (default 16384)")
    p.add_argument("--backends", nargs="+", default=None, help="default: triton torch on cuda, auto torch on cpu")
    p.add_argument("--hbm-tbs", type=float, default=3.0, help="roofline bandwidth in TB/s (default 3.0)")
    p.add_argument("--only", choices=["index", "train"], default=only)
    p.add_argument("--train-runs", type=int, default=1, help="train: how many times to run the comparison")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())
    backends = args.backends or (["triton", "torch"] if cuda else ["auto", "torch"])
    quick = args.quick
    n = args.keys or (1 << 16 if quick else (64 << 20 if cuda else 1 << 20))
    batch = args.batch or (8192 if quick else (1 << 20 if cuda else 65536))
    vocab = args.vocab or (20_000 if quick else (10_000_000 if cuda else 1_000_000))
    tbatch = args.train_batch or (512 if quick else 16384)
    repeat = args.repeat or (3 if quick else 10)
    info = machine_info()
    print(f"{device} ({info['cuda'] or info['cpu_model']}); backends {backends}; repeat {repeat}", flush=True)
    result = {"benchmark": "gpu_ops", "device": str(device), "machine": info, "targets": TARGETS}
    if args.only in (None, "index"):
        # find and insert return row ids only (HKV's pointer-only setting), so one table of dim 64 serves all three
        rows = index_ops(backends, n, batch, 64, repeat, device, args.hbm_tbs * 1e12)
        print(f"\nindex: {n} int64 keys, batch {batch}; find+gather at dim 64, float32")
        print_table(rows, ["backend", "load", "find keys/s", "insert keys/s", "find_or_insert keys/s",
                           "find+gather GB/s", "roofline"])
        result["index"] = rows
    if args.only in (None, "train"):
        result["train"] = []
        for run in range(args.train_runs):
            rows = train(backends, 4, vocab, tbatch, repeat, device)
            print(f"\ntrain step (run {run + 1} of {args.train_runs}): 4 tables x {vocab} rows, dim 64, batch "
                  f"{tbatch}, pooling 20, RowWiseAdagrad fused")
            print_table(rows, ["contestant", "steps/s", "vs EmbeddingBag", "vs static"])
            result["train"].append(rows)
    if args.json:
        write_json(args.json, result)


def from_train_step(args) -> None:
    """``benchmarks/train_step.py --device cuda``: its options, forwarded to the ``train`` part here."""
    argv = ["--device", args.device, "--only", "train"] + (["--quick"] if args.quick else [])
    for flag, value in (("--json", args.json), ("--repeat", args.repeat), ("--vocab", args.vocab)):
        argv += [flag, str(value)] if value else []
    main(argv)


if __name__ == "__main__":
    main()
