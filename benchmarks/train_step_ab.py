"""Before/after of one train-step contestant: the same contestant built from two source trees, side by side.

Each tree runs in its own process (``PYTHONPATH=<tree>/src``), on the same data and seeds; rounds are interleaved
(one step of each in turn) and each step is timed by the process's own CPU clock. Prints the median ms per step of
each tree, the spread (interquartile range, % of the median), ``before / after`` of the medians and ``paired``,
the median of the rounds' own ratios (steady under load that drifts between rounds).

Run: ``.venv/bin/python benchmarks/train_step_ab.py --before /path/to/old/checkout --after . [--optimizers ...]
[--dists ...] [--steps 15] [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _worker(contestant: str, opt: str, dist: str, quick: bool, steps: int, threads: int) -> None:
    """Build the contestant, then for each line on stdin run one step and answer its CPU seconds."""
    import torch

    sys.path.insert(0, HERE)
    from train_step_impls import CONTESTANTS, Workload, make_batches

    torch.set_num_threads(threads)
    w = Workload(4, 20_000 if quick else 1_000_000, 64, 512 if quick else 4096, 20)
    batches = make_batches(w, dist, steps + 2)
    torch.manual_seed(0)
    trainer = CONTESTANTS[contestant](w, opt)
    for b in batches[:2]:  # warm-up (numba compiles, first-touch page faults)
        trainer.step(b)
    print("ready", flush=True)
    for i, line in enumerate(sys.stdin):
        t = time.process_time()
        trainer.step(batches[2 + i % steps])
        print(time.process_time() - t, flush=True)


def _spawn(tree: str, args, opt: str, dist: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"), OMP_NUM_THREADS=str(args.threads))
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", args.contestant, opt, dist,
           str(int(args.quick)), str(args.steps), str(args.threads)]
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the worker for {tree} failed to start")
    return p


def _step(p: subprocess.Popen) -> float:
    p.stdin.write("step\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def _stats(times: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(times, n=4)
    med = statistics.median(times)
    return med * 1e3, 100 * (q[2] - q[0]) / med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="checkout of the old code (its src/ is imported)")
    ap.add_argument("--after", default=os.path.dirname(HERE), help="checkout of the new code (default: this one)")
    ap.add_argument("--contestant", default="dynemb-dyn-fused")
    ap.add_argument("--optimizers", nargs="+", default=["sgd", "rowwise_adagrad"])
    ap.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
    ap.add_argument("--steps", type=int, default=15, help="timed steps per tree (interleaved)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the --quick workload of train_step.py, 5 steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps = min(args.steps, 5)
    rows = []
    print(f"{'optimizer':<16} {'ids':<8} {'before ms':>12} {'after ms':>12} {'before/after':>13} {'paired':>8}")
    for opt in args.optimizers:
        for dist in args.dists:
            procs = [_spawn(args.before, args, opt, dist), _spawn(args.after, args, opt, dist)]
            times = [[], []]
            for _ in range(args.steps):
                for k, p in enumerate(procs):
                    times[k].append(_step(p))
            for p in procs:
                p.stdin.close()
                p.wait()
            (b, bs), (a, as_) = _stats(times[0]), _stats(times[1])
            # the median of each round's before/after: load that drifts between rounds (a shared machine) cancels
            paired = statistics.median(tb / ta for tb, ta in zip(*times))
            rows.append({"optimizer": opt, "ids": dist, "before_ms": b, "before_spread_pct": bs, "after_ms": a,
                         "after_spread_pct": as_, "speedup": b / a, "paired_speedup": paired,
                         "before_times": times[0], "after_times": times[1]})
            print(f"{opt:<16} {dist:<8} {b:8.2f} ±{bs:2.0f}% {a:8.2f} ±{as_:2.0f}% {b / a:13.3f} {paired:8.3f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"contestant": args.contestant, "quick": args.quick, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        c, o, d, q, s, t = sys.argv[2:8]
        _worker(c, o, d, q == "1", int(s), int(t))
    else:
        main()
