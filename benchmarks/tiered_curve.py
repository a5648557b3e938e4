"""Tiered tables across fast-tier shares: the fast tier's hit rate and the step time against the all-in-RAM step, one
``benchmarks/tiered.py`` run per share (same workload, same interleaved timing), drawn as one plot.

Run: ``.venv/bin/python benchmarks/tiered_curve.py [--quick] [--shares 0.05,0.1,0.2,0.3,0.5] [--json PATH]
[--plot PATH.png]``. The plot needs matplotlib (without it the table and JSON are still written).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

import tiered  # noqa: E402

SHARES = (0.05, 0.1, 0.2, 0.3, 0.5)


def measure(share: float, quick: bool, threads: int, repeat) -> dict:
    """One ``tiered.py`` run at ``share``: its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.json")
        argv = ["--fast-share", str(share), "--threads", str(threads), "--json", path]
        argv += ["--quick"] if quick else []
        argv += ["--repeat", str(repeat)] if repeat else []
        tiered.main(argv)
        with open(path) as f:
            return json.load(f)


def curve(runs: dict[float, dict]) -> list[dict]:
    """Per share: the fast tier's hit rate, the tiered step against the all-in-RAM one (wall and CPU), the rows of
    RAM the tiered tables use against the all-in-RAM tables."""
    rows = []
    for share, r in sorted(runs.items()):
        cpu = r["cpu_steps_per_s"]  # CPU time: a step descheduled on a busy machine inflates only its wall time
        rows.append({"fast_share": share, "fast_hit_rate": r["tiers"]["tiered-disk"]["fast_hit_rate"],
                     "ratio": r["ratio_vs_all_in_fast_tier"], "ratio_cpu": r["ratio_vs_all_in_fast_tier_cpu"],
                     "cpu_step_ms": 1e3 / cpu["tiered-disk"], "all_in_ram_cpu_step_ms": 1e3 / cpu["all-in-ram"],
                     "table_over_ram": r["table_over_ram"], "exports_equal": r["exports_equal"]})
    return rows


def plot(rows: list[dict], path: str, title: str) -> bool:
    """Hit rate and step-time ratio against the fast tier's share, saved to ``path``; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shares = [100 * r["fast_share"] for r in rows]
    fig, left = plt.subplots(figsize=(6.4, 4.0))
    left.plot(shares, [r["fast_hit_rate"] for r in rows], "o-", color="tab:blue", label="fast-tier hit rate")
    left.plot(shares, [r["ratio"] for r in rows], "s-", color="tab:orange", label="steps/s vs all in RAM (wall)")
    left.plot(shares, [r["ratio_cpu"] for r in rows], "s:", color="tab:red", label="steps/s vs all in RAM (CPU)")
    left.axhline(0.5, color="gray", linestyle=":", linewidth=1)
    left.set_xlabel("fast tier, % of each table's rows")
    left.set_ylim(0, 1.05)
    left.set_ylabel("hit rate (distinct keys a step); speed ratio")
    right = left.twinx()
    right.plot(shares, [r["cpu_step_ms"] for r in rows], "^--", color="tab:green", label="tiered step (CPU ms)")
    right.plot(shares, [r["all_in_ram_cpu_step_ms"] for r in rows], "v--", color="tab:gray",
               label="all-in-RAM step (CPU ms)")
    right.set_ylabel("CPU ms a step (median)")
    right.set_ylim(0, 1.1 * max(r["cpu_step_ms"] for r in rows))
    lines = left.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    labels = left.get_legend_handles_labels()[1] + right.get_legend_handles_labels()[1]
    left.legend(lines, labels, loc="lower right", fontsize=8)
    left.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--shares", default=",".join(map(str, SHARES)), help="fast-tier shares, comma-separated")
    p.add_argument("--plot", default=None, help="write the plot (PNG) to this path")
    args = p.parse_args(argv)
    runs = {float(s): measure(float(s), args.quick, args.threads, args.repeat) for s in args.shares.split(",")}
    rows = curve(runs)
    print_table([{k: f"{v:.3f}" if isinstance(v, float) else v for k, v in r.items()} for r in rows],
                list(rows[0]))
    machine = machine_info()
    w = next(iter(runs.values()))["workload"]
    if args.plot:
        title = (f"tiered.py{' --quick' if args.quick else ''}: {w['tables']} tables x {w['vocab']:,} rows, dim "
                 f"{w['dim']}, zipf {w['alpha']}, batch {w['batch']}x{w['pooling']}\n{args.threads} thread, "
                 f"{machine['cpu_model']}, row files on disk")
        print("plot:", args.plot if plot(rows, args.plot, title) else "matplotlib is not installed")
    if args.json:
        write_json(args.json, {"benchmark": "tiered_curve", "machine": machine, "workload": w, "curve": rows})


if __name__ == "__main__":
    main()
