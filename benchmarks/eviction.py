"""Eviction: what a bounded table keeps, per policy: hit rate on drifting traces against Belady, and model AUC.

Hit rate (``dynemb.data.replay``). Each trace is a :class:`dynemb.data.traces.DriftingTrace`: a power law
(alpha 1.05) over ``--slots`` popularity slots whose ids are replaced by new ids after a lifetime (log-uniform in
``[L/4, 4L]`` batches; 10% of the slots never turn over). Four drift speeds: ``L`` = 20, 100 and 1000 batches,
and no drift. Each batch's distinct ids go through ``find_or_insert`` of a real ``KeyValueTable`` with
``max_capacity`` = 10% and 30% of the trace's distinct ids; the first 10% of the batches fill the table and are
not scored. Belady's offline optimum runs on the same accesses. ``epoch_*`` move to a new epoch every 1/8 of the
trace. ``decayed_lfu+admit2`` adds ``admission=2``.

AUC (``dynemb.train.Trainer``). A DLRM on ``SyntheticClickLog`` (8 categorical features, 20,000 ids each, alpha
1.05, batch 1024), trained for ``--steps`` steps with each table bounded to 10% and 30% of the distinct ids it
sees, and unbounded; AUC on 8 held-out batches. Twice: without drift, and with each feature's ids drawn from a
``DriftingTrace`` (20,000 slots, L = 100 batches), labels from the same hidden model, and the held-out batches
taken right after the training ones. ``epoch_*`` are left out: the trainer never moves the epoch, so they equal
lru and lfu. Same seeds everywhere: runs differ only by the policy.

Cost: the median time of one score update (``touch_scores``) per policy on 13,312 and 131,072 distinct rows of a
1M-row table, timed round-robin.

Run: ``python benchmarks/eviction.py [--quick] [--json PATH] [--no-auc] [--plot PNG]``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import machine_info, median_times, parser, print_table, write_json  # noqa: E402

from dynemb.data import SyntheticClickLog  # noqa: E402
from dynemb.data.batch import Batch  # noqa: E402
from dynemb.data.traces import DriftingTrace  # noqa: E402
from dynemb.demo import plot_policies  # noqa: E402
from dynemb.table.hashing import mix64  # noqa: E402
from dynemb.table.policy import DEFAULT_BOUNDED, EvictionPolicy, touch_scores  # noqa: E402
from dynemb.data.replay import compare, policies, summarize, unique_accesses  # noqa: E402
from dynemb.train import Trainer, TrainConfig, build_dlrm  # noqa: E402

LIFETIMES = {"fast drift (L=20)": 20.0, "drift (L=100)": 100.0, "slow drift (L=1000)": 1000.0, "no drift": 1e12}
FRACTIONS = (0.1, 0.3)
AUC_POLICIES = ("lru", "lfu", "decayed_lfu")
AUC_LIFETIME = 100.0  # batches: ids turn over ~6 times in 600 steps


def hit_rates(args) -> list[dict]:
    rows = []
    for label, lifetime in LIFETIMES.items():
        trace = DriftingTrace(num_slots=args.slots, batch_size=args.batch, num_batches=args.batches,
                              lifetime=lifetime, seed=0)
        accesses = unique_accesses(trace.batches())
        candidates = policies(max(1, args.batches // 8))
        candidates.update({f"decayed_lfu h={h}": {"eviction": "decayed_lfu", "half_life": h} for h in args.half_lives})
        for row in compare(accesses, FRACTIONS, candidates, warmup=args.batches // 10):
            rows.append({"trace": label, **row})
    return rows


def touch_cost(args) -> list[dict]:
    """Median time of one score update per policy: ``rows`` distinct rows (with counts, as a training lookup
    passes them) of a 1M-row table, timed round-robin."""
    rows = []
    for n in (13_312, 131_072):  # 26 tables x 512 ids; 10x that
        g = torch.Generator().manual_seed(n)
        scores = {p: torch.zeros(1 << 20, dtype=torch.int64) for p in ("lru", "lfu", "decayed_lfu")}
        index = torch.randperm(1 << 20, generator=g)[:n]
        counts = torch.randint(1, 4, (n,), generator=g)
        tick = iter(range(1, 1 << 30))
        cases = {p: (lambda p=p, scores=scores, index=index, tick=tick, counts=counts: touch_scores(
            EvictionPolicy(p), scores[p], index, clock=next(tick), epoch=0, counts=counts)) for p in scores}
        times = median_times(cases, repeat=args.repeat or (5 if args.quick else 30), warmup=2)
        rows.append({"rows": n, **{f"{p}_ms": round(t * 1e3, 3) for p, t in times.items()},
                     "decayed_vs_lfu": round(times["decayed_lfu"] / times["lfu"], 1)})
    return rows


def click_data(steps: int, lifetime: float | None) -> tuple[list[Batch], list[Batch]]:
    """Training batches and 8 held-out batches of the AUC runs. With ``lifetime``, each feature's ids come from a
    :class:`DriftingTrace` (20,000 slots, that lifetime) and labels are redrawn from the same hidden model
    (``SyntheticClickLog.logits``); the held-out batches are the trace's next 8 batches: today's ids."""
    log = SyntheticClickLog(num_categorical=8, num_dense=13, vocab_sizes=20_000, batch_size=1024, seed=0)
    if lifetime is None:
        return [log.batch(i) for i in range(steps)], [log.batch(i, "eval") for i in range(8)]
    traces = [DriftingTrace(num_slots=20_000, batch_size=1024, lifetime=lifetime, seed=f) for f in range(8)]
    salts = mix64(torch.arange(1, 9) * 7919)  # distinct ids per feature: the traces' id sets would coincide

    def batch(i: int, split: str) -> Batch:
        base = log.batch(i, split)
        sparse = {name: t.batch(i) ^ salt for name, t, salt in zip(log.categorical_names, traces, salts)}
        logits = log.logits(Batch(base.dense, sparse, base.labels, {}))
        g = torch.Generator().manual_seed(i * 2 + (split == "eval"))
        return Batch(base.dense, sparse, (torch.rand(len(logits), generator=g) < torch.sigmoid(logits)).float(), {})

    return [batch(i, "train") for i in range(steps)], [batch(steps + i, "eval") for i in range(8)]


def auc_runs(args, lifetime: float | None = None) -> list[dict]:
    batches, evals = click_data(args.steps, lifetime)
    names = list(batches[0].sparse)
    per_table = sum(torch.unique(torch.cat([b.sparse[f] for b in batches])).numel() for f in names) / len(names)
    runs = [(None, None)] + [(f, p) for f in (FRACTIONS[:1] if args.quick else FRACTIONS)
                             for p in (("lru", "decayed_lfu") if args.quick else AUC_POLICIES)]
    rows = []
    for fraction, policy in runs:
        capacity = None if fraction is None else round(fraction * per_table)
        cfg = TrainConfig(steps=args.steps, dim=16, max_capacity=capacity, eviction=policy, eval_every=args.steps)
        torch.manual_seed(0)
        trainer = Trainer(build_dlrm(batches[0].dense.shape[1], names, cfg), cfg)
        started = time.perf_counter()
        history = trainer.fit(iter(batches), evals, progress=False, log_every=1e9)
        stats = trainer.table_stats()
        rows.append({"data": "no drift" if lifetime is None else f"drift (L={lifetime:g})", "fraction": fraction,
                     "policy": policy or "unbounded", "capacity_per_table": capacity,
                     "auc": round(history.last_auc, 4), "rows": stats["rows"],
                     "evicted_per_row": round(stats["evicted"] / max(stats["rows"], 1), 2),
                     "seconds": round(time.perf_counter() - started, 1)})
        print(f"  trained {rows[-1]}", file=sys.stderr, flush=True)
    base = rows[0]["auc"]
    for r in rows:
        r["auc_below_unbounded"] = round(base - r["auc"], 4)
    return rows


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=None, help="popularity slots per trace (default 50000; quick 10000)")
    p.add_argument("--batches", type=int, default=None, help="batches per trace (default 200; quick 60)")
    p.add_argument("--batch", type=int, default=None, help="ids per batch (default 4096; quick 1024)")
    p.add_argument("--steps", type=int, default=None, help="training steps per AUC run (default 600; quick 60)")
    p.add_argument("--no-auc", action="store_true", help="hit rates only")
    p.add_argument("--half-lives", type=lambda v: [int(h) for h in v.split(",") if h], default=[],
                   help="also replay decayed_lfu with these half-lives (comma-separated clock ticks)")
    p.add_argument("--plot", metavar="PNG", help="also plot the hit rates (bars per trace) to PNG")
    args = p.parse_args()
    torch.set_num_threads(1)
    quick = args.quick
    args.slots = args.slots or (10_000 if quick else 50_000)
    args.batches = args.batches or (60 if quick else 200)
    args.batch = args.batch or (1024 if quick else 4096)
    args.steps = args.steps or (60 if quick else 600)

    rows = hit_rates(args)
    table = [{**r, "hit_rate": f"{r['hit_rate']:.3f}", "gap_to_belady": f"{r['gap_to_belady']:.1f}",
              "evicted_per_row": f"{r['evicted_per_row']:.1f}" if "evicted_per_row" in r else "-"} for r in rows]
    print("hit rate of distinct ids per batch (gap to Belady in points)")
    print_table(table, ["trace", "fraction", "capacity", "policy", "hit_rate", "gap_to_belady", "evicted_per_row"])
    summary = summarize(rows, DEFAULT_BOUNDED.value)
    print()
    print_table(summary, list(summary[0]))
    worst = max(s["default_below_best_points"] for s in summary)
    print(f"\ndefault {DEFAULT_BOUNDED.value}: at most {worst:.2f} points below the best online policy")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plot_policies(plt, rows, Path(args.plot))
    costs = touch_cost(args)
    print("\nscore update per lookup (median ms, round-robin)")
    print_table(costs, list(costs[0]))
    aucs = [] if args.no_auc else auc_runs(args) + auc_runs(args, AUC_LIFETIME)
    if aucs:
        print("\nAUC (8 held-out batches of 1024)")
        print_table(aucs, list(aucs[0]))
    if args.json:
        write_json(args.json, {"benchmark": "eviction", "quick": quick, "machine": machine_info(),
                               "params": {k: getattr(args, k) for k in ("slots", "batches", "batch", "steps")},
                               "hit_rates": rows, "summary": summary, "default": DEFAULT_BOUNDED.value,
                               "default_worst_points_below_best": worst, "touch_cost": costs, "auc": aucs})


if __name__ == "__main__":
    main()
