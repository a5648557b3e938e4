"""Training-step throughput: forward (pooled lookups), a tiny dense head, backward and the sparse update.

Contestants (``benchmarks/train_step_impls.py``), each in its own process:

- ``dynemb-dyn-fused``: EmbeddingCollection over dynamic tables (``vocabulary_size=None``), optimizer fused into
  backward, pre-warmed with the whole id space (in a random order) so that steps measure the steady state;
  ``dynemb-dyn-step`` (``--contestants``): the same with ``optimizer.step()``; ``dynemb-dyn-bounded``
  (``--contestants``): the same with ``max_capacity=2V``, a bound the ids never reach, under the policy a bound gets
  by default (``decayed_lfu``): what keeping eviction scores costs a step; ``dynemb-dyn-evicting``: a bound of
  ``V/2``, so that every step inserts ids and evicts as many rows;
- ``dynemb-static``: the same collection with ``vocabulary_size=V`` (dense tables), fused optimizer;
- ``torch-bag``: ``T x nn.EmbeddingBag(sparse=True)`` with a torch optimizer (SGD, Adagrad for RowWiseAdagrad,
  SparseAdam for Adam);
- ``torchrec``: TorchRec EmbeddingBagCollection (fbgemm CPU TBE, optimizer fused into backward) sharded by
  DistributedModelParallel on a one-process gloo group; installed by ``benchmarks/install_torchrec.sh``.

Workload: ``T`` tables x ``V`` ids, dim ``D``, batch ``B``, pooling factor ``P`` (sum pooling), one feature per
table; ids uniform or Zipf (alpha 1.05, hot ids scattered over the id space); the head is
``concat -> Linear(T*D, 1) -> sum`` with ``torch.optim.SGD``. Every process builds the same data from the same
seeds. Rounds are interleaved: one step of each contestant in turn (only one process runs at a time), so that
noise on a shared machine hits all alike. Reported: median steps/s from CPU time (``time.process_time`` of the
contestant's own process) and wall time, and the spread (interquartile range of the step times, % of the median).
Ratios are of CPU-time steps/s within one measurement, two ways: of the medians (``ratio_vs_torchrec``,
``ratio_vs_torch_bag``), and ``paired``: the median of each round's own ratio, which holds steady when the machine's
load drifts between rounds. A target is met when both reach it. Beside each contestant's speed: the share of its
process's memory on transparent huge pages (read after its trainer is built), the share of its CPU time spent in
the kernel and its minor page faults a step, which tell a contestant that runs slow for its own reasons from a slow
machine.

``--sessions K`` repeats the whole measurement K times, each with fresh contestant processes, and reports the
median over sessions of each number (each session's own numbers are kept in the JSON). On a shared virtual machine
one process can run 30-50% slower for its whole life (seen on the 2-core KVM guest of BENCHMARKS.md): pairing rounds
within one session cannot remove that, fresh processes can. Pinning every process to one core (``taskset -c 1
...``: the contestants inherit it, and run one at a time anyway) narrowed the spread between sessions there.

Run: ``.venv/bin/python benchmarks/train_step.py [--quick] [--json PATH] [--threads 1] [--contestants ...]``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402
from train_step_impls import CONTESTANTS, DISTRIBUTIONS, OPTIMIZERS, Workload, make_batches  # noqa: E402
from train_step_impls import torchrec_available  # noqa: E402

DEFAULT_CONTESTANTS = ["dynemb-dyn-fused", "dynemb-static", "torch-bag", "torchrec"]
DYNEMB = ("dynemb-dyn-fused", "dynemb-dyn-step", "dynemb-dyn-compiled", "dynemb-static")


# ----------------------------------------------------------------------------------------------- one process each
def _worker(conn, name: str, w: Workload, dists: list[str], count: int, threads: int) -> None:
    """A contestant's process: ``("build", opt)`` makes its trainer and answers its process's memory
    (:func:`memory_state`), ``("step", dist)`` runs one step on the next batch and answers ``(wall s, cpu s, system
    cpu s, minor page faults)``, ``None`` ends it. Errors are answered as ``("error", message)``."""
    torch.set_num_threads(threads)
    batches = {d: make_batches(w, d, count) for d in dists}
    calls = {d: 0 for d in dists}
    trainer = None
    while (cmd := conn.recv()) is not None:
        try:
            if cmd[0] == "build":
                trainer = None  # free the previous optimizer's tables first
                torch.manual_seed(0)
                trainer = CONTESTANTS[name](w, cmd[1])
                calls = {d: 0 for d in dists}
                conn.send(("ok", memory_state()))
                continue
            dist = cmd[1]
            before = resource.getrusage(resource.RUSAGE_SELF)
            wall, cpu = time.perf_counter(), time.process_time()
            trainer.step(batches[dist][calls[dist] % count])
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            after = resource.getrusage(resource.RUSAGE_SELF)
            conn.send((wall, cpu, after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt))
            calls[dist] += 1
        except Exception as e:  # reported to the driver, which drops the contestant for this optimizer
            conn.send(("error", f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"))


def memory_state() -> dict:
    """This process's anonymous memory and how much of it sits on transparent huge pages, in MB (Linux; else
    empty): a contestant whose tables missed huge pages runs slower for its whole life, and this tells it apart
    from a slow machine."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)  # "Name:   1234 kB"
        return {"anon_mb": int(fields["Anonymous"].split()[0]) >> 10,
                "huge_mb": int(fields["AnonHugePages"].split()[0]) >> 10}
    except (OSError, KeyError, ValueError, IndexError):
        return {}


class Contestant:
    def __init__(self, name: str, w: Workload, dists: list[str], count: int, threads: int) -> None:
        self.name = name
        self.conn, child = mp.get_context("spawn").Pipe()
        self.process = mp.get_context("spawn").Process(target=_worker, args=(child, name, w, dists, count, threads),
                                                       daemon=True)
        self.process.start()

    def ask(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(timeout=60)


def measure(contestants: list[Contestant], dist: str, repeat: int, warmup: int) -> dict[str, dict]:
    """Interleaved rounds (one step of each contestant in turn): medians and spread of the timed steps."""
    samples: dict[str, list] = {c.name: [] for c in contestants}
    for i in range(warmup + repeat):
        for c in contestants:
            got = c.ask("step", dist)
            if got[0] == "error":
                raise RuntimeError(f"{c.name}: {got[1]}")
            if i >= warmup:
                samples[c.name].append(got)
    out = {}
    for name, s in samples.items():
        cpu = sorted(x[1] for x in s)
        q1, q3 = cpu[len(cpu) // 4], cpu[(3 * len(cpu)) // 4]
        median = statistics.median(cpu)
        out[name] = {"steps_per_s": round(1 / statistics.median(x[0] for x in s), 2),
                     "cpu_steps_per_s": round(1 / median, 2), "spread_pct": round(100 * (q3 - q1) / median, 1),
                     "cpu_s": [x[1] for x in s],
                     # where a session runs slow: time in the kernel (page faults, compaction) and faults a step
                     # (a share of the sums: the kernel splits user and system time by ticks, too coarse a step)
                     "system_pct": round(100 * sum(x[2] for x in s) / max(sum(x[1] for x in s), 1e-9), 1),
                     "faults": statistics.median(x[3] for x in s)}
    return out


def paired(row: dict, name: str, base: str) -> float | None:
    """The median over rounds of each round's own ratio ``base CPU time / name CPU time``: steadier than the ratio
    of the two medians when the load on the machine drifts between rounds (both steps of a round see the same)."""
    got, ref = row["contestants"].get(name, {}).get("cpu_s"), row["contestants"].get(base, {}).get("cpu_s")
    if not got or not ref:
        return None
    return round(statistics.median(b / a for a, b in zip(got, ref)), 3)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


TARGETS = (  # (optimizers, contestant, baseline, goal): the targets
    (("sgd", "rowwise_adagrad"), "dynemb-dyn-fused", "torchrec", 1.2),
    (OPTIMIZERS, "dynemb-dyn-fused", "torch-bag", 1.0),
    (OPTIMIZERS, "dynemb-static", "torch-bag", 1.0),
)


def with_ratios(row: dict) -> dict:
    """``ratio_vs_torchrec`` and ``ratio_vs_torch_bag`` of every dynemb contestant (CPU-time steps/s, ratio of the
    medians), and the same ``paired`` (:func:`paired`)."""
    cpu = {k: v["cpu_steps_per_s"] for k, v in row["contestants"].items()}
    for base, key in (("torchrec", "ratio_vs_torchrec"), ("torch-bag", "ratio_vs_torch_bag")):
        row[key] = {k: ratio(cpu[k], cpu.get(base)) for k in cpu if k in DYNEMB}
        row[f"paired_{key}"] = {k: paired(row, k, base) for k in cpu if k in DYNEMB}
    return row


def targets(rows: list[dict]) -> list[dict]:
    """Each target of each row: its ratio of the medians and its paired ratio (with sessions, the median of the
    sessions' own), and whether both reach the goal."""
    out = []
    for r in rows:
        cpu = {k: v["cpu_steps_per_s"] for k, v in r["contestants"].items()}
        for optimizers, impl, base, goal in TARGETS:
            if r["optimizer"] in optimizers and impl in cpu:
                got, pair = _target_ratios(r, impl, base)
                out.append({"optimizer": r["optimizer"], "ids": r["distribution"], "target": f"{impl} >= {goal}x "
                            f"{base}", "ratio_cpu": got, "paired": pair,
                            "met": None if got is None or pair is None else got >= goal and pair >= goal,
                            "sessions": ", ".join("n/a" if g is None else f"{g:.2f}"
                                                  for g, _ in _session_ratios(r, impl, base))})
    return out


def _session_ratios(row: dict, impl: str, base: str) -> list[tuple[float | None, float | None]]:
    """``(ratio of the medians, paired ratio)`` of each session of ``row`` (one, without sessions)."""
    return [(ratio(c.get(impl, {}).get("cpu_steps_per_s"), c.get(base, {}).get("cpu_steps_per_s")),
             paired({"contestants": c}, impl, base)) for c in row.get("sessions", [row["contestants"]])]


def _target_ratios(row: dict, impl: str, base: str) -> tuple[float | None, float | None]:
    each = _session_ratios(row, impl, base)
    return _median([g for g, _ in each]), _median([p for _, p in each])


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def combine(sessions: list[list[dict]]) -> list[dict]:
    """The rows of several sessions (fresh processes each) as one: per contestant the median over sessions of
    its steps/s and spread, its step times of every session, and ratios as medians of the sessions' ratios. Each
    session's contestants stay under ``"sessions"``."""
    if len(sessions) == 1:
        return sessions[0]
    rows = []
    for first in sessions[0]:
        key = (first["optimizer"], first["distribution"])
        parts = [next(r for r in rows_ if (r["optimizer"], r["distribution"]) == key)["contestants"]
                 for rows_ in sessions]
        names = [n for n in first["contestants"] if all(n in p for p in parts)]
        contestants = {n: {m: _median([p[n].get(m) for p in parts])
                           for m in ("steps_per_s", "cpu_steps_per_s", "spread_pct", "system_pct", "faults")}
                       for n in names}
        for n in names:
            contestants[n]["cpu_s"] = [t for p in parts for t in p[n]["cpu_s"]]
        row = {k: first[k] for k in ("optimizer", "distribution", "threads")}
        row.update(contestants=contestants, sessions=parts)
        for base, name in (("torchrec", "ratio_vs_torchrec"), ("torch-bag", "ratio_vs_torch_bag")):
            ratios = {k: _target_ratios(row, k, base) for k in names if k in DYNEMB}
            row[name] = {k: r[0] for k, r in ratios.items()}
            row[f"paired_{name}"] = {k: r[1] for k, r in ratios.items()}
        rows.append(row)
    return rows


def report(rows: list[dict], checks: list[dict], names: list[str]) -> None:
    for key, title in (("cpu_steps_per_s", "steps/s from CPU time"), ("steps_per_s", "steps/s from wall time"),
                       ("spread_pct", "spread: IQR of CPU step times, % of median")):
        print(f"\n{title}")
        print_table([{"optimizer": r["optimizer"], "ids": r["distribution"],
                      **{n: r["contestants"].get(n, {}).get(key, "n/a") for n in names}} for r in rows],
                    ["optimizer", "ids"] + names)
    print("\ntargets (ratios of CPU-time steps/s within one run: of the medians, and paired round by round; with "
          "sessions, the median of the sessions' ratios; met when both reach the goal; sessions: each session's "
          "ratio of the medians)")
    print_table(checks, ["optimizer", "ids", "target", "ratio_cpu", "paired", "met", "sessions"])


def _run(procs: list[Contestant], args, repeat: int, warmup: int, rows: list[dict]) -> list[dict]:
    """Measure ``procs`` on every optimizer and distribution; their results join the matching rows of ``rows``."""
    for opt in args.optimizers:
        live, memory = [], {}
        for c in procs:
            got = c.ask("build", opt)
            if got[0] == "error":
                print(f"  {c.name} {opt}: not run ({got[1]})")
            else:
                live.append(c)
                memory[c.name] = got[1]
        for dist in args.distributions:
            row = next((r for r in rows if (r["optimizer"], r["distribution"]) == (opt, dist)), None)
            if row is None:
                row = {"optimizer": opt, "distribution": dist, "threads": args.threads, "contestants": {}}
                rows.append(row)
            measured = measure(live, dist, repeat, warmup)
            for name, m in measured.items():
                m["memory"] = memory[name]
            row["contestants"].update(measured)
            with_ratios(row)
            print(f"  {opt:16s} {dist:8s} CPU steps/s  " + "  ".join(
                f"{k} {v['cpu_steps_per_s']} ({_state(v)})" for k, v in row["contestants"].items()), flush=True)
    return rows


def _state(m: dict) -> str:
    """A contestant's process state beside its speed: huge-page share of its memory, system time, faults a step."""
    mem = m.get("memory") or {}
    huge = f"huge {mem['huge_mb'] / max(mem['anon_mb'], 1):.0%} of {mem['anon_mb']} MB, " if mem else ""
    return f"{huge}sys {m['system_pct']}%, {m['faults']:g} faults"


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads in every contestant (default 1)")
    p.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    p.add_argument("--distributions", nargs="+", choices=DISTRIBUTIONS, default=list(DISTRIBUTIONS))
    p.add_argument("--contestants", nargs="+", choices=sorted(CONTESTANTS), default=DEFAULT_CONTESTANTS)
    p.add_argument("--vocab", type=int, default=None, help="ids per table (default 1,000,000; --quick 20,000)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the GPU step of benchmarks/gpu_ops.py instead")
    p.add_argument("--alone", action="store_true",
                   help="run one contestant process at a time instead of interleaving their steps (warm caches)")
    p.add_argument("--sessions", type=int, default=1,
                   help="repeat the whole measurement with fresh processes and report medians over the sessions "
                        "(default 1)")
    p.add_argument("--no-thp", action="store_true",
                   help="leave THP_MEM_ALLOC_ENABLE alone (default: 1 in every contestant: torch allocates large "
                        "tensors on transparent huge pages, which random row access over large tables needs)")
    args = p.parse_args(argv)
    if args.device != "cpu":  # Triton kernels vs nn.EmbeddingBag on the GPU: see benchmarks/gpu_ops.py
        import gpu_ops

        return gpu_ops.from_train_step(args)
    if not args.no_thp:
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"  # read by torch in each contestant's fresh process
    w = Workload(4, args.vocab or (20_000 if args.quick else 1_000_000), 64, 512 if args.quick else 4096, 20)
    repeat, warmup = args.repeat or (5 if args.quick else 15), 2
    names = [n for n in args.contestants if n != "torchrec" or torchrec_available() is None]
    info = machine_info()
    print(f"cpu: {info['cpu_model']} ({info['nproc']} cores); workload: {w}; threads {args.threads}; repeat "
          f"{repeat}; torchrec: {torchrec_available() or 'yes'}; THP_MEM_ALLOC_ENABLE="
          f"{os.environ.get('THP_MEM_ALLOC_ENABLE')}", flush=True)
    groups = [[n] for n in names] if args.alone else [names]
    sessions = []
    for session in range(args.sessions):
        if args.sessions > 1:
            print(f"session {session + 1} of {args.sessions} (fresh processes)", flush=True)
        rows = []
        for group in groups:  # --alone: one contestant process at a time, each measured on its own
            procs = [Contestant(n, w, args.distributions, warmup + repeat, args.threads) for n in group]
            try:
                rows = _run(procs, args, repeat, warmup, rows)
            finally:
                for c in procs:
                    c.close()
        sessions.append(rows)
    rows = combine(sessions)
    checks = targets(rows)
    report(rows, checks, names)
    if args.json:
        write_json(args.json, {"benchmark": "train_step", "workload": w.__dict__, "repeat": repeat,
                               "threads": args.threads, "thp": os.environ.get("THP_MEM_ALLOC_ENABLE"),
                               "alone": args.alone, "sessions": args.sessions,
                               "machine": info, "results": rows, "targets": checks})


if __name__ == "__main__":
    main()
