"""Where a train step goes, phase by phase: dynemb contestants side by side in one process.

Each contestant of ``benchmarks/train_step_impls.py`` (default: the dynamic and the static table, fused) is built
in this one process; steps alternate between them (the order flips every round), and the CPU time of each step
and of each kernel call inside it is recorded. Kernel calls are timed by wrapping the numba entry points (dedup,
find, stamps written, deferred or settled, pooled forward, fused update); "other" is the rest of the step (autograd,
the head, Python). One process means one machine state for all: the difference between contestants is what their
code adds, which separate processes, each with its own slow or fast phase, blur (see ``train_step.py``). ``torchrec``
may join them (its whole step is "other"): TorchRec against dynemb in one process, where ``train_step.py`` keeps
every contestant in its own.

Prints ms a step per phase (each a median over rounds, so they need not add up to the step's median; means let a
slow first touch of a table's pages skew them), each contestant's step time over the first's, paired round by round,
and writes JSON with ``--json PATH``. ``--quick``: a small workload, well under a minute. The extra contestant
``dynemb-dyn-by-key`` is ``dynemb-dyn-fused`` with every training lookup grouped by key (``lookup._groups_by_row``
off), to measure what grouping by row gives.

Run: ``.venv/bin/python benchmarks/train_step_phases.py [--quick] [--optimizer sgd] [--dist uniform]
[--repeat 40] [--vocab 1000000] [--contestants dynemb-dyn-fused dynemb-static] [--json PATH]``. ``--vocab``: ids a table
(a small one keeps every table in cache, where the kernels' arithmetic and the step's fixed costs show).
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402
from train_step_impls import CONTESTANTS, Workload, alternated_steps, make_batches  # noqa: E402

# (module, function) of each phase's kernel entry point; the first that a step calls is timed
PHASES = {
    "dedup": ("dynemb.kernels.numba_pool", "dedup"),
    "find": ("dynemb.kernels.numba_index", "find"),
    "stamps": ("dynemb.kernels.numba_pool", "fill_pair"),
    "stamp (one column)": ("dynemb.kernels.numba_pool", "fill_rows"),
    "stamps deferred": ("dynemb.kernels.numba_pool", "mark_rows"),
    "stamps settled": ("dynemb.kernels.numba_pool", "settle_marks"),
    "pooled forward": ("dynemb.kernels.numba_pool", "pool"),
    "fused update": ("dynemb.kernels.numba_optim", "sparse_update"),
}


def _timed_phases(spent: collections.Counter, current: list) -> None:
    """Wrap each phase's entry point so that its CPU time is added to ``spent[(current[0], phase)]``."""
    import importlib

    for phase, (module, name) in PHASES.items():
        mod = importlib.import_module(module)
        inner = getattr(mod, name)

        def timed(*args, _inner=inner, _phase=phase, **kwargs):
            start = time.process_time()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[(current[0], _phase)] += time.process_time() - start

        setattr(mod, name, timed)


BY_KEY = "dynemb-dyn-by-key"


def _by_key_for(current: list) -> None:
    """Make training lookups group by key while ``current[0]`` is :data:`BY_KEY`."""
    from dynemb.functional import lookup

    rule = lookup._groups_by_row
    lookup._groups_by_row = lambda table: current[0] != BY_KEY and rule(table)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "rowwise_adagrad", "adam"])
    p.add_argument("--dist", default="uniform", choices=["uniform", "zipf"])
    p.add_argument("--contestants", nargs="+", default=["dynemb-dyn-fused", "dynemb-static"],
                   choices=[c for c in CONTESTANTS if c.startswith("dynemb") or c == "torchrec"] + [BY_KEY])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab", type=int, help="ids per table (default 1,000,000; --quick 20,000)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    w = Workload(4, args.vocab or (20_000 if args.quick else 1_000_000), 64, 512 if args.quick else 4096, 20)
    rounds = args.repeat or (10 if args.quick else 40)
    spent, current = collections.Counter(), ["warm-up"]
    _timed_phases(spent, current)
    _by_key_for(current)
    batches = make_batches(w, args.dist, 10)
    trainers = {}
    for name in args.contestants:
        torch.manual_seed(0)
        trainers[name] = CONTESTANTS["dynemb-dyn-fused" if name == BY_KEY else name](w, args.optimizer)
    for batch in batches[:2]:  # compile and warm every path
        for name, trainer in trainers.items():
            current[0] = name
            trainer.step(batch)
    spent.clear()

    per_step = collections.defaultdict(list)  # (contestant, phase) -> CPU seconds of each step

    def stepper(name, trainer):
        def step(batch):
            current[0] = name  # the phases of this step are this contestant's
            before = {phase: spent[(name, phase)] for phase in PHASES}
            start = time.process_time()
            trainer.step(batch)
            total = time.process_time() - start
            for phase in PHASES:
                per_step[(name, phase)].append(spent[(name, phase)] - before[phase])
            per_step[(name, "other")].append(total - sum(spent[(name, p)] - before[p] for p in PHASES))
        return step

    times = alternated_steps([stepper(n, t) for n, t in trainers.items()], batches[2:], rounds)
    steps = dict(zip(trainers, times))
    rows, first = [], steps[args.contestants[0]]
    for name, times in steps.items():
        row = {"contestant": name, "step ms (median)": round(1e3 * statistics.median(times), 2),
               "vs first (paired)": round(statistics.median(t / f for t, f in zip(times, first)), 3)}
        for phase in (*PHASES, "other"):
            row[phase] = round(1e3 * statistics.median(per_step[(name, phase)]), 2)
        rows.append(row)
    info = machine_info()
    print(f"cpu: {info['cpu_model']}; {w}; {args.optimizer}, {args.dist} ids; threads {args.threads}; "
          f"{rounds} alternated rounds; CPU ms a step")
    print_table(rows, ["contestant", "step ms (median)", "vs first (paired)", *PHASES, "other"])
    if args.json:
        write_json(args.json, {"machine": info, "workload": w.__dict__, "optimizer": args.optimizer,
                               "dist": args.dist, "rounds": rounds, "rows": rows,
                               "step_times": {k: v for k, v in steps.items()}})


if __name__ == "__main__":
    main()
