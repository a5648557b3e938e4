"""Distributed training step on gloo: steps/s at world 1 and 2, bytes on the wire against the floor, dedup ratio.

    python benchmarks/distributed_step.py [--quick] [--json PATH]
    python benchmarks/distributed_step.py --device cuda --backend nccl [--quick]   # one GPU: an NCCL world-1 step

``--device cuda`` puts each rank's shards on GPU ``rank`` (the kernels' ``auto`` backend is then triton) and times
with a CUDA synchronize around the step; ``--backend nccl`` needs it. With fewer than two GPUs it runs world 1 only
(the issue's one-GPU check). Not yet run on a GPU: no task so far had one.

Each rank trains 4 row-sharded dynamic tables (dim 64, pooling factor 10, power-law ids, fused Adagrad) on its
own batch of the same size, so world 2 does twice the global work of world 1. With the dense model (the default;
``--no-dense``: the lookup alone) the step is the main job's: ``dynemb.models.DLRM``'s bottom and top MLPs (its
defaults, as ``dynemb train`` builds them, 13 dense inputs) over the pooled rows, BCE loss, backward, the MLPs in
DistributedDataParallel and stepped by Adam. "key a2a ms" is the exposed time of the key exchange per step: the
wall time the step spends blocked in the all-to-alls of key counts and keys (the stages a pipelined step would run
while the previous batch computes) on the step's own thread.

``--pipeline`` instead runs paired rounds of plain and pipelined steps (:class:`dynemb.train.Pipeline`: the next
batch's loading, copy, dedup and key all-to-alls on a worker thread over a process group of their own while the
current batch computes) and reports each loop's median step and exposed key exchange: plain, the step's key
all-to-alls; pipelined, the time the step waited for the worker.

``--background-save`` then goes on training while ``save(..., blocking=False)`` writes a checkpoint of the
model (tables, MLPs, optimizer) and reports the median step in that window against the median without.

The wire floor per rank and step is
``unique keys x 8 + rows served x dim x 4 + unique keys x dim x 4`` (keys out, rows back to requesters, gradients
back to owners): only deduplicated keys and rows may cross.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

import dynemb  # noqa: E402
from dynemb import DistributedEmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402
from dynemb.checkpoint import save  # noqa: E402
from dynemb.distributed.launch import spawn  # noqa: E402
from dynemb.models.dlrm import DLRM  # noqa: E402
from dynemb.train import Pipeline  # noqa: E402

TABLES, DIM, POOL, VOCAB, ALPHA = 4, 64, 10, 1_000_000, 1.05
NUM_DENSE = 13  # Criteo's dense columns


def zipf_ids(n: int, g: torch.Generator) -> torch.Tensor:
    """Power-law ranks over VOCAB, spread over int64 by an odd multiplier (a bijection)."""
    u = torch.rand(n, generator=g, dtype=torch.float64)
    ranks = ((VOCAB ** (1 - ALPHA) - 1) * u + 1) ** (1 / (1 - ALPHA))
    return ranks.long().clamp(max=VOCAB) * -7046029254386353131


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _count_key_exchange(ec) -> dict:
    """Seconds and calls of the collection's all-to-alls of keys and key counts, by wrapping its executor's
    ``_a2a`` (a benchmark's view into the internals: empty if the executor has none)."""
    seen = {"key_seconds": 0.0}
    executor = getattr(ec, "executor", None)
    a2a = getattr(executor, "_a2a", None)
    if a2a is None:
        return seen

    def timed_a2a(send, send_counts, recv_counts, what, *rest):
        start = time.perf_counter()
        try:
            return a2a(send, send_counts, recv_counts, what, *rest)
        finally:
            if "key" in what:  # the caller's thread (exposed) apart from a pipeline's worker (hidden)
                into = "key_seconds" if threading.current_thread() is threading.main_thread() else "staged_seconds"
                seen[into] = seen.get(into, 0.0) + time.perf_counter() - start

    executor._a2a = timed_a2a
    return seen


def _rank_main(rank: int, world: int, batch: int, steps: int, warmup: int, out: str, device: str = "cpu",
               dense: bool = True, background_save: bool = False) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    tables = [TableConfig(name=f"t{i}", dim=DIM, seed=i, optimizer=dynemb.optim.Adagrad(lr=0.05, fused=True))
              for i in range(TABLES)]
    features = [FeatureConfig(name=f"f{i}", table=f"t{i}") for i in range(TABLES)]
    ec = DistributedEmbeddingCollection(tables, features, timeout=120, device=device)
    keyed = _count_key_exchange(ec)
    model = dense_opt = None
    if dense:
        model = DLRM(NUM_DENSE, ec, DIM).to(device)
        if world > 1:
            model.bottom = DistributedDataParallel(model.bottom)
            model.top = DistributedDataParallel(model.top)
        dense_opt = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("embeddings")],
                                     lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    offsets = (torch.arange(batch) * POOL).to(device)

    def one_step() -> None:
        batch_ids = {f"f{i}": (zipf_ids(batch * POOL, g).to(device), offsets) for i in range(TABLES)}
        if model is None:
            pooled = ec(batch_ids)
            torch.cat(list(pooled.values()), 1).sum().backward()
            return
        inputs = SimpleNamespace(dense=torch.randn(batch, NUM_DENSE, generator=g).to(device))
        labels = torch.randint(0, 2, (batch,), generator=g).float().to(device)
        logits = model(inputs, pooled=ec(batch_ids))
        torch.nn.functional.binary_cross_entropy_with_logits(logits, labels).backward()
        dense_opt.step()
        dense_opt.zero_grad()

    times, cpu, comm, keys_s, sent, floor, ids_total, unique_total = [], [], [], [], [], [], 0, 0
    state = g.get_state()
    for step in range(warmup + steps):
        g.set_state(state)  # the ids one_step draws, counted here first
        uniques = sum(torch.unique(zipf_ids(batch * POOL, g)).numel() for _ in range(TABLES))
        g.set_state(state)
        before, key_before = dict(ec.comm_stats), keyed["key_seconds"]
        _sync(device)
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        one_step()
        _sync(device)
        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        state = g.get_state()
        if step < warmup:
            continue
        times.append(elapsed)
        cpu.append(elapsed_cpu)
        keys_s.append(keyed["key_seconds"] - key_before)
        comm.append(ec.comm_stats["seconds"] - before["seconds"])
        sent.append(ec.comm_stats["bytes_sent"] - before["bytes_sent"])
        served = ec.comm_stats["keys_received"] - before["keys_received"]  # rows this rank serves as owner
        floor.append(uniques * 8 + served * DIM * 4 + uniques * DIM * 4)
        ids_total += batch * POOL * TABLES
        unique_total += uniques
    during, save_s, pause_s = [], 0.0, 0.0
    if background_save:  # training goes on while the checkpoint of this step is written
        root = tempfile.mkdtemp(prefix="dynemb-bg-save-")
        whole = model if model is not None else ec
        _sync(device)
        start = time.perf_counter()
        handle = save(root, whole, dense_opt, step=warmup + steps, blocking=False)
        pause_s = time.perf_counter() - start
        flag_device = device if dist.get_backend(ec.group) == "nccl" else torch.device("cpu")

        def every_rank_done() -> bool:  # ranks must agree on the number of steps: each has collectives
            flag = torch.tensor([int(handle.done())], device=flag_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return bool(flag.item())

        while not every_rank_done() or len(during) < 3:
            t0 = time.perf_counter()
            one_step()
            _sync(device)
            during.append(time.perf_counter() - t0)
        handle.wait()
        save_s = time.perf_counter() - start
        shutil.rmtree(root, ignore_errors=True)
    stats = torch.tensor([statistics.median(times), statistics.median(cpu), statistics.median(comm), sum(sent) / steps,
                          sum(floor) / steps, ids_total / unique_total, statistics.median(keys_s),
                          statistics.median(during) if during else 0.0, save_s, pause_s], dtype=torch.float64)
    if dist.get_backend(ec.group) == "nccl":
        stats = stats.to(device)
    dist.all_reduce(stats, group=ec.group)  # mean over ranks
    if rank == 0:
        keys = ["step_s", "cpu_s", "comm_s", "bytes_sent", "floor_bytes", "dedup_ratio", "key_a2a_s",
                "step_during_save_s", "save_s", "save_pause_s"]
        with open(out, "w") as f:
            json.dump(dict(zip(keys, (stats / world).tolist())), f)


def _pipeline_main(rank: int, world: int, batch: int, steps: int, warmup: int, rounds: int, out: str,
                   device: str = "cpu") -> None:
    """Paired rounds of ``steps`` plain and ``steps`` pipelined steps of the DLRM step (alternating, so that load
    hits both alike); per step: wall time and the exposed key exchange (plain: the step's key all-to-alls;
    pipelined: the time the step waited for the worker, which also covers the batch's loading and dedup)."""
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    tables = [TableConfig(name=f"t{i}", dim=DIM, seed=i, optimizer=dynemb.optim.Adagrad(lr=0.05, fused=True))
              for i in range(TABLES)]
    features = [FeatureConfig(name=f"f{i}", table=f"t{i}") for i in range(TABLES)]
    ec = DistributedEmbeddingCollection(tables, features, timeout=120, device=device)
    keyed = _count_key_exchange(ec)
    model = DLRM(NUM_DENSE, ec, DIM).to(device)
    if world > 1:
        model.bottom = DistributedDataParallel(model.bottom)
        model.top = DistributedDataParallel(model.top)
    dense_opt = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("embeddings")], lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    offsets = (torch.arange(batch) * POOL).to(device)

    def batches(n: int):
        for _ in range(n):  # loading: drawn (and copied to the device) where the loop asks for the batch
            yield SimpleNamespace(ids={f"f{i}": (zipf_ids(batch * POOL, g).to(device), offsets)
                                       for i in range(TABLES)},
                                  dense=torch.randn(batch, NUM_DENSE, generator=g).to(device),
                                  labels=torch.randint(0, 2, (batch,), generator=g).float().to(device))

    def step(b) -> None:
        logits = model(b, pooled=ec(b.ids))
        torch.nn.functional.binary_cross_entropy_with_logits(logits, b.labels).backward()
        dense_opt.step()
        dense_opt.zero_grad()

    result = {"plain": {"step": [], "exposed": [], "hidden": []}, "pipelined": {"step": [], "exposed": [],
                                                                                  "hidden": []}}
    for r in range(rounds + 1):  # round 0: warm-up of both
        for mode in ("plain", "pipelined"):
            pipe = Pipeline(ec, batches(warmup + steps), enabled=mode == "pipelined", inputs=lambda b: b.ids)
            it = iter(pipe)
            for s in range(warmup + steps):
                _sync(device)
                dist.barrier()
                k0, h0, w0 = keyed["key_seconds"], keyed.get("staged_seconds", 0.0), pipe.wait_s
                start = time.perf_counter()
                step(next(it))
                _sync(device)
                elapsed = time.perf_counter() - start
                if r == 0 or s < warmup:
                    continue
                rec = result[mode]
                rec["step"].append(elapsed)
                rec["exposed"].append(keyed["key_seconds"] - k0 + pipe.wait_s - w0)
                rec["hidden"].append(keyed.get("staged_seconds", 0.0) - h0)
            next(it, None)  # the end of the batches: the pipeline's worker is done
    med = [statistics.median(result[m][k]) for m in ("plain", "pipelined") for k in ("step", "exposed", "hidden")]
    # paired: each round's own ratio (its pipelined median over its plain median), then the median over rounds
    for k in ("exposed", "step"):
        per_round = [statistics.median(result["pipelined"][k][r * steps:(r + 1) * steps])
                     / max(statistics.median(result["plain"][k][r * steps:(r + 1) * steps]), 1e-12)
                     for r in range(rounds)]
        med.append(statistics.median(per_round))
    stats = torch.tensor(med, dtype=torch.float64)
    stats = stats.to(device) if dist.get_backend(ec.group) == "nccl" else stats
    dist.all_reduce(stats, group=ec.group)  # mean over ranks
    if rank == 0:
        names = [f"{m}_{k}_s" for m in ("plain", "pipelined") for k in ("step", "exposed", "hidden")] + \
            ["paired_exposed_ratio", "paired_step_ratio"]
        with open(out, "w") as f:
            json.dump({**dict(zip(names, (stats / world).tolist())), "load": os.getloadavg()}, f)


def _pipeline_compare(args, p) -> None:
    world = 1 if args.device == "cuda" and torch.cuda.device_count() < 2 else 2
    batch, steps, warmup, rounds = (512, 4, 1, 3) if args.quick else (2048, 5, 1, args.repeat or 5)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "pipeline.json")
        spawn(_pipeline_main, world, batch, steps, warmup, rounds, path, args.device, backend=args.backend,
              threads=1)
        with open(path) as f:
            r = json.load(f)
    rows = [{"loop": m, "world": world, "batch/rank": batch, "step ms": round(r[f"{m}_step_s"] * 1e3, 1),
             "exposed key exchange ms": round(r[f"{m}_exposed_s"] * 1e3, 2),
             "key a2a on the worker ms": round(r[f"{m}_hidden_s"] * 1e3, 2)} for m in ("plain", "pipelined")]
    print(f"pipelined step, {world} rank(s), backend {args.backend}, device {args.device}; load average "
          f"{load_before[0]:.1f} before, {r['load'][0]:.1f} after; {os.cpu_count()} CPUs")
    print_table(rows, list(rows[0]))
    ratio = r["pipelined_exposed_s"] / r["plain_exposed_s"] if r["plain_exposed_s"] else None
    if ratio is not None:
        print(f"\nexposed key exchange, pipelined / plain: {ratio:.3f} (paired {r['paired_exposed_ratio']:.3f}; "
              f"target <= 0.2); step time {r['pipelined_step_s'] / r['plain_step_s']:.3f}x (paired "
              f"{r['paired_step_ratio']:.3f}x)")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "device": args.device, "backend": args.backend,
                               "rows": rows, "exposed_ratio": ratio, "paired_exposed_ratio": r["paired_exposed_ratio"],
                               "paired_step_ratio": r["paired_step_ratio"], "load": [load_before, r["load"]],
                               "date": time.strftime("%Y-%m-%d")})


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where each rank's shards live")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="process group backend")
    p.add_argument("--no-dense", action="store_true", help="the lookup and its backward alone, without the MLPs")
    p.add_argument("--background-save", action="store_true", help="then train during a background checkpoint")
    p.add_argument("--pipeline", action="store_true", help="instead: plain against pipelined steps "
                   "(dynemb.train.Pipeline), paired rounds, exposed key exchange per step")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.backend == "nccl" and args.device != "cuda":
        p.error(f"--backend nccl needs --device cuda, got --device {args.device}")
    if args.pipeline:
        _pipeline_compare(args, p)
        return
    worlds = (1,) if args.device == "cuda" and torch.cuda.device_count() < 2 else (1, 2)
    batch, steps, warmup = (512, 5, 2) if args.quick else (2048, args.repeat or 15, 3)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            path = os.path.join(tmp, f"w{world}.json")
            spawn(_rank_main, world, batch, steps, warmup, path, args.device, not args.no_dense, args.background_save,
                  backend=args.backend, threads=1)
            with open(path) as f:
                r = json.load(f)
            rows.append({"world": world, "batch/rank": batch, "steps/s": round(1 / r["step_s"], 2),
                         "step ms": round(r["step_s"] * 1e3, 1), "comm ms": round(r["comm_s"] * 1e3, 1),
                         "key a2a ms": round(r["key_a2a_s"] * 1e3, 2),
                         "compute ms": round((r["step_s"] - r["comm_s"]) * 1e3, 1),
                         "CPU ms/step": round(r["cpu_s"] * 1e3, 1),
                         "MB sent/step/rank": round(r["bytes_sent"] / 1e6, 3),
                         "wire/floor": round(r["bytes_sent"] / r["floor_bytes"], 3),
                         "dedup ratio": round(r["dedup_ratio"], 2)})
            if args.background_save:
                rows[-1].update({"step ms in save": round(r["step_during_save_s"] * 1e3, 1),
                                 "in save / without": round(r["step_during_save_s"] / r["step_s"], 3),
                                 "save s": round(r["save_s"], 3), "save pause ms": round(r["save_pause_s"] * 1e3, 1)})
    if args.device != "cpu":
        print(f"device {torch.cuda.get_device_name(0)}, backend {args.backend}")
    print(f"dense model: {'none (lookup only)' if args.no_dense else 'DLRM MLPs (bottom 64, top 64-32), DDP'}")
    print_table(rows, list(rows[0]))
    ratio = cpu_ratio = None
    if len(rows) == 2:
        w1, w2 = rows
        ratio = (w2["step ms"] - w2["comm ms"]) / w1["step ms"]
        cpu_ratio = w2["CPU ms/step"] / w1["CPU ms/step"]
        print(f"\nworld-2 step beyond its transfer time / world-1 step: {ratio:.2f}x wall, {cpu_ratio:.2f}x CPU time "
              f"(target <= 1.5x); wire/floor {w2['wire/floor']:.3f} (target <= 1.1)")
    if args.json:
        gpu = torch.cuda.get_device_name(0) if args.device != "cpu" else None
        write_json(args.json, {"machine": machine_info(), "device": args.device, "gpu": gpu, "backend": args.backend,
                               "rows": rows, "w2_compute_over_w1": ratio, "w2_cpu_over_w1": cpu_ratio,
                               "date": time.strftime("%Y-%m-%d")})


if __name__ == "__main__":
    main()
