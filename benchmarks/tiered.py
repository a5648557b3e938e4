"""Tiered tables: training steps/s of tables 5x larger than their fast tier (20% of the rows in RAM, the rest in
memory-mapped row files on disk) against the same tables all in RAM, and whether both end with the same rows.

The workload is ``benchmarks/train_step.py``'s: ``T`` dynamic tables of ``V`` ids, dim ``D``, batch ``B`` bags
of ``P`` ids, power-law ids (Zipf, alpha 1.05, hot ids scattered over the id space), a linear head; the sparse
optimizer is fused into backward. Every table is pre-warmed with its whole id space, so steps measure the steady
state: in the tiered run, the rows a batch needs that are not in the fast tier come back from disk and others go
down. Implementations, timed interleaved (one step of each in turn, medians):

- ``all-in-ram``: ``TableConfig(...)`` with no bound.
- ``tiered-disk``: ``TableConfig(tiers=Tiers(fast_capacity=V // 5, slow=<tmp dir>))`` (``--fast-share``: 0.2).
- ``tiered-disk-prefetch``: the same, calling ``EmbeddingCollection.prefetch`` with the next batch after each
  step (inside the timed step: on CPU nothing overlaps, so this shows its cost, not a gain).

``exports_equal``: after the same batches, every table's export (keys, values, optimizer slots, scores) sorted by
key is bit-identical to the all-in-RAM run's.

Run: ``.venv/bin/python benchmarks/tiered.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, median_times, parser, print_table, write_json  # noqa: E402
from train_step_impls import Dynemb, Trainer, Workload, dynemb_optimizer, make_batches  # noqa: E402

from dynemb import EmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402
from dynemb.table import Tiers  # noqa: E402
from dynemb.table import tiered as tiered_module  # noqa: E402

FAST_SHARE = 0.2  # default of --fast-share


def target_ratio(fast_share: float) -> float:
    """Issue 47's CPU target for a fast-tier share: 0.5x the all-in-RAM step at 20% and above, 0.4x below."""
    return 0.5 if fast_share >= 0.2 else 0.4
OPTIMIZER = "rowwise_adagrad"


def prewarm(ec: EmbeddingCollection, w: Workload, share: float) -> None:
    """Insert every id, in chunks of a tenth of the fast tier (one call's rows all stay in the fast tier)."""
    ids = torch.randperm(w.vocab, generator=torch.Generator().manual_seed(7))
    for module in ec.embeddings.values():
        for chunk in ids.split(max(1, int(w.vocab * share / 10))):
            module.table.find_or_insert(chunk)
        if hasattr(module.table, "hits"):  # hit rates count training steps only
            module.table.hits = dict.fromkeys(module.table.hits, 0)


class AllInRam(Dynemb):
    def __init__(self, w: Workload, share: float) -> None:
        torch.manual_seed(0)  # the same head in every implementation
        self.share = share
        super().__init__(w, OPTIMIZER, static=False, fused=True)

    def _prewarm(self, w: Workload) -> None:
        prewarm(self.ec, w, self.share)


class Tiered(Dynemb):
    """The fused dynemb trainer over tiered tables; ``prefetch``: ``ec.prefetch(next batch)`` after each step."""

    def __init__(self, w: Workload, share: float, slow: str, batches: list[dict], prefetch: bool) -> None:
        torch.manual_seed(0)
        Trainer.__init__(self, w)
        tiers = Tiers(fast_capacity=int(w.vocab * share), slow=slow)
        tables = [TableConfig(name=f"t{t}", dim=w.dim, optimizer=dynemb_optimizer(OPTIMIZER, True), combiner="sum",
                              seed=t, tiers=tiers) for t in range(w.tables)]
        self.ec = EmbeddingCollection(tables, [FeatureConfig(name=f"f{t}", table=f"t{t}") for t in range(w.tables)])
        self.fused, self.features = True, w.features
        self.batches, self.prefetch, self.calls = batches, prefetch, 0
        prewarm(self.ec, w, share)

    def step(self, batch: dict) -> None:
        super().step(batch)
        self.calls += 1
        if self.prefetch:
            self.ec.prefetch(self.batches[self.calls % len(self.batches)])


def time_steps(impls: dict[str, Trainer], batches: list[dict], repeat: int, warmup: int) -> dict[str, dict]:
    """Median wall and CPU seconds a step of each implementation, one step of each in turn, all on the same
    batches (CPU time beside wall time: a step descheduled on a busy machine inflates only its wall time)."""
    calls = dict.fromkeys(impls, 0)
    cpu: dict[str, list[float]] = {name: [] for name in impls}

    def stepper(name: str):
        def run() -> None:
            start = time.process_time()
            impls[name].step(batches[calls[name] % len(batches)])
            if calls[name] >= warmup:
                cpu[name].append(time.process_time() - start)
            calls[name] += 1
        return run

    wall = median_times({name: stepper(name) for name in impls}, repeat=repeat, warmup=warmup)
    return {name: {"wall_s": wall[name], "cpu_s": statistics.median(cpu[name])} for name in impls}


def build(w: Workload, share: float, slow: str, batches: list[dict]) -> dict:
    impls = {"all-in-ram": AllInRam(w, share)}
    for name, prefetch in (("tiered-disk", False), ("tiered-disk-prefetch", True)):
        impls[name] = Tiered(w, share, os.path.join(slow, name), batches, prefetch)
    return impls


def exports_equal(a: EmbeddingCollection, b: EmbeddingCollection) -> bool:
    for name, module in a.embeddings.items():
        x, y = module.table.export(), b.embeddings[name].table.export()
        ox, oy = torch.argsort(x.keys), torch.argsort(y.keys)
        same = torch.equal(x.keys[ox], y.keys[oy]) and torch.equal(x.values[ox], y.values[oy])
        same &= torch.equal(x.scores[ox], y.scores[oy])
        same &= all(torch.equal(x.slots[s][ox], y.slots[s][oy]) for s in x.slots)
        if not same:
            return False
    return True


def tier_stats(ec: EmbeddingCollection) -> dict:
    tables = [m.table for m in ec.embeddings.values()]
    stats = [t.stats()["tiers"] for t in tables]
    return {"ram_bytes": sum(s["fast"]["bytes"] + s["index"]["bytes"] for s in stats),
            "fast_hit_rate": statistics.mean(s["fast"]["hit_rate"] for s in stats),
            "slow_hit_rate": statistics.mean(s["slow"]["hit_rate"] for s in stats),
            "fast_rows": sum(s["fast"]["rows"] for s in stats), "slow_rows": sum(s["slow"]["rows"] for s in stats),
            "fast_bytes": sum(s["fast"]["bytes"] for s in stats), "slow_bytes": sum(s["slow"]["bytes"] for s in stats)}


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--fast-share", type=float, default=FAST_SHARE, help="share of each table's rows in RAM")
    p.add_argument("--slow-dir", default=None, help="where the slow tiers' row files go (default: a temp dir)")
    p.add_argument("--row-files", choices=("log", "in-place"), default=None,
                   help="how rows going down are written to the row files (default: the library's, "
                        "tiered.ROW_FILES_AS_LOG)")
    args = p.parse_args(argv)
    if args.row_files is not None:
        tiered_module.ROW_FILES_AS_LOG = args.row_files == "log"
    row_files = "log" if tiered_module.ROW_FILES_AS_LOG else "in-place"
    torch.set_num_threads(args.threads)
    if args.quick:
        w, repeat, warmup = Workload(2, 100_000, 64, 512, 20), args.repeat or 25, 10
    else:
        w, repeat, warmup = Workload(4, 1_000_000, 64, 2048, 20), args.repeat or 30, 20
    batches = make_batches(w, "zipf", count=warmup + repeat + 1)
    print(f"workload: {w}, zipf alpha {w.alpha}; fast tier {args.fast_share:.0%} of each table; optimizer {OPTIMIZER} "
          f"(fused); threads {args.threads}; {warmup} warm-up + {repeat} timed steps each; row files: {row_files}",
          flush=True)
    with tempfile.TemporaryDirectory(dir=args.slow_dir) as slow:
        impls = build(w, args.fast_share, slow, batches)
        sec = time_steps(impls, batches, repeat, warmup)
        base = impls["all-in-ram"].ec
        equal = {name: exports_equal(impls[name].ec, base) for name in impls if name != "all-in-ram"}
        tiers = {name: tier_stats(impls[name].ec) for name in impls if name != "all-in-ram"}
        ram = sum(m.table.nbytes() for m in base.embeddings.values())
    rate = {k: 1.0 / v["wall_s"] for k, v in sec.items()}
    cpu_rate = {k: 1.0 / v["cpu_s"] for k, v in sec.items()}
    rows = [{"implementation": k, "steps/s": f"{rate[k]:.2f}", "cpu steps/s": f"{cpu_rate[k]:.2f}",
             "x all-in-ram": f"{rate[k] / rate['all-in-ram']:.2f}",
             "fast hit rate": f"{tiers[k]['fast_hit_rate']:.3f}" if k in tiers else "",
             "exports equal": equal.get(k, "")} for k in sec]
    print_table(rows, ["implementation", "steps/s", "cpu steps/s", "x all-in-ram", "fast hit rate", "exports equal"])
    ratio = rate["tiered-disk"] / rate["all-in-ram"]
    over = ram / tiers["tiered-disk"]["ram_bytes"]
    print(f"\nall in RAM: {ram / 2**20:.0f} MiB; tiered: {tiers['tiered-disk']['ram_bytes'] / 2**20:.0f} MiB of RAM "
          f"(fast tiers and the index of every key), so the tables are {over:.1f}x their RAM")
    target = target_ratio(args.fast_share)
    print(f"ratio_vs_all_in_fast_tier {ratio:.3f} (target >= {target}: {'met' if ratio >= target else 'NOT met'}); "
          f"exports_equal {all(equal.values())}")
    if args.json:
        write_json(args.json, {
            "benchmark": "tiered", "workload": w.__dict__, "fast_share": args.fast_share, "optimizer": OPTIMIZER,
            "threads": args.threads, "row_files": row_files, "repeat": repeat, "warmup": warmup,
            "machine": machine_info(),
            "steps_per_s": rate, "cpu_steps_per_s": cpu_rate,
            "ratio_vs_all_in_fast_tier": ratio, "target": target,
            "ratio_vs_all_in_fast_tier_cpu": cpu_rate["tiered-disk"] / cpu_rate["all-in-ram"],
            "ratio_with_prefetch": rate["tiered-disk-prefetch"] / rate["all-in-ram"],
            "exports_equal": all(equal.values()), "exports_equal_each": equal, "tiers": tiers,
            "all_in_ram_bytes": ram, "table_over_ram": over})


if __name__ == "__main__":
    main()
