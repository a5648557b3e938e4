"""Before/after of one train-step contestant: the same contestant built from two source trees, side by side.

Each tree runs in its own process (``PYTHONPATH=<tree>/src``), on the same data and seeds; rounds are interleaved
(one step of each in turn) and each step is timed by the process's own CPU clock. Prints the median ms per step of
each tree, the spread (interquartile range, % of the median), ``before / after`` of the medians and ``paired``,
the median of the rounds' own ratios (steady under load that drifts between rounds).

``--same-process``: both trees in this one process instead (the before tree's package is copied and imported as
``dynemb_before``; dynemb contestants only), alternating steps, the order flipping each round. A process keeps its
fast or slow phase for its whole life on a shared virtual machine (30-50%, see ``train_step.py``), which two
processes do not share: differences of a few percent, such as a step's fixed cost, show only in one process.
``--batch``, ``--pooling`` and ``--vocab`` change the workload (``--batch 16 --pooling 1``: the fixed cost alone).

Run: ``.venv/bin/python benchmarks/train_step_ab.py --before /path/to/old/checkout --after . [--optimizers ...]
[--dists ...] [--steps 15] [--quick] [--same-process] [--batch B] [--pooling P] [--vocab V] [--json PATH]``.
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


def _workload(quick: bool, batch: int | None, pooling: int | None, vocab: int | None):
    from train_step_impls import Workload

    return Workload(4, vocab or (20_000 if quick else 1_000_000), 64, batch or (512 if quick else 4096), pooling or 20)


def _worker(contestant: str, opt: str, dist: str, quick: bool, steps: int, threads: int, shape: list[int]) -> None:
    """Build the contestant, then for each line on stdin run one step and answer its CPU seconds."""
    import torch

    sys.path.insert(0, HERE)
    from train_step_impls import CONTESTANTS, make_batches

    torch.set_num_threads(threads)
    w = _workload(quick, *[v or None for v in shape])
    batches = make_batches(w, dist, steps + 2)
    torch.manual_seed(0)
    trainer = CONTESTANTS[contestant](w, opt)
    for b in batches[:2]:  # warm-up (numba compiles, first-touch page faults)
        trainer.step(b)
    print("ready", flush=True)
    for i, _ in enumerate(sys.stdin):  # one line a step
        t = time.process_time()
        trainer.step(batches[2 + i % steps])
        print(time.process_time() - t, flush=True)


def _spawn(tree: str, args, opt: str, dist: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"), OMP_NUM_THREADS=str(args.threads))
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", args.contestant, opt, dist,
           str(int(args.quick)), str(args.steps), str(args.threads),
           *[str(v or 0) for v in (args.batch, args.pooling, args.vocab)]]
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the worker for {tree} failed to start")
    return p


def _step(p: subprocess.Popen) -> float:
    p.stdin.write("step\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def _two_processes(args, opt: str, dist: str) -> list[list[float]]:
    """CPU seconds of each step of the before and the after tree, each in its own process, steps interleaved."""
    procs = [_spawn(args.before, args, opt, dist), _spawn(args.after, args, opt, dist)]
    times = [[], []]
    for _ in range(args.steps):
        for k, p in enumerate(procs):
            times[k].append(_step(p))
    for p in procs:
        p.stdin.close()
        p.wait()
    return times


def _same_process(args, opt: str, dist: str) -> list[list[float]]:
    """CPU seconds of each step of the before and the after tree, built and stepped in this process."""
    import torch

    from train_step_impls import CONTESTANTS, alternated_steps, make_batches

    torch.set_num_threads(args.threads)
    w = _workload(args.quick, args.batch, args.pooling, args.vocab)
    batches = make_batches(w, dist, args.steps + 2)
    trainers = []
    for lib in (args.before_lib, args.after_lib):
        torch.manual_seed(0)
        trainers.append(CONTESTANTS[args.contestant](w, opt, lib=lib))
        for b in batches[:2]:
            trainers[-1].step(b)
    return alternated_steps([t.step for t in trainers], batches[2:], args.steps)


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
    ap.add_argument("--quick", action="store_true",
                    help="the --quick workload of train_step.py, 5 steps (--same-process: --steps)")
    ap.add_argument("--same-process", action="store_true", help="both trees in this process (dynemb contestants)")
    ap.add_argument("--batch", type=int, help="samples a step (default 4096; --quick 512)")
    ap.add_argument("--pooling", type=int, help="ids a sample and table (default 20)")
    ap.add_argument("--vocab", type=int, help="ids a table (default 1,000,000; --quick 20,000)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, HERE)
    if args.quick and not args.same_process:
        args.steps = min(args.steps, 5)
    if args.same_process:
        if not args.contestant.startswith("dynemb") or args.contestant == "dynemb-dyn-compiled":
            # compiled code calls dynemb's registered ops, which the copy registers again under the same names
            ap.error("--same-process builds eager dynemb contestants only")
        sys.path.insert(0, os.path.join(os.path.abspath(args.after), "src"))
        import dynemb

        if not os.path.abspath(dynemb.__file__).startswith(os.path.join(os.path.abspath(args.after), "")):
            ap.error(f"dynemb is imported from {dynemb.__file__}, not from --after {args.after}")
        from _common import load_tree_package

        args.after_lib, args.before_lib = dynemb, load_tree_package(args.before)
    from train_step_impls import DYNEMB_OPTIMIZERS  # after the --after tree's dynemb is on the path

    if unknown := [o for o in args.optimizers if o not in DYNEMB_OPTIMIZERS]:
        ap.error(f"--optimizers: {unknown} are not among {list(DYNEMB_OPTIMIZERS)}")
    rows = []
    print(f"{'optimizer':<16} {'ids':<8} {'before ms':>12} {'after ms':>12} {'before/after':>13} {'paired':>8}")
    for opt in args.optimizers:
        for dist in args.dists:
            times = _same_process(args, opt, dist) if args.same_process else _two_processes(args, opt, dist)
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
            json.dump({"contestant": args.contestant, "quick": args.quick, "same_process": args.same_process,
                       "workload": _workload(args.quick, args.batch, args.pooling, args.vocab).__dict__, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        c, o, d, q, s, t = sys.argv[2:8]
        _worker(c, o, d, q == "1", int(s), int(t), [int(v) for v in sys.argv[8:11]])
    else:
        main()
