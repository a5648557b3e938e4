"""Planner balance: the largest rank's bytes over the mean, for Criteo Kaggle's 26 tables (and with four 100M-row
tables added), at world 8 and 64, beside today's ``auto_plan``. Plans only: no rank is started.

    python benchmarks/plan_balance.py [--quick] [--json PATH]

Tables: dim 128, float32, RowWiseAdagrad (a row is 512 + 8 + 8 + 4 bytes), at the data set's public
cardinalities (3 to 10.1M ids); the four added tables have 100M rows each. Budget: 80 GiB a rank, 8 ranks a node.
Target: largest rank <= 1.1x the mean and within the budget.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

import dynemb  # noqa: E402
from dynemb import TableConfig  # noqa: E402
from dynemb.distributed.planner import plan_tables  # noqa: E402
from dynemb.distributed.sharding import auto_plan  # noqa: E402

CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
BUDGET = 80 << 30


def tables(big: int) -> list:
    opt = dynemb.optim.RowWiseAdagrad(lr=0.01)
    out = [TableConfig(name=f"c{i}", dim=128, vocabulary_size=v, optimizer=opt) for i, v in enumerate(CRITEO_KAGGLE)]
    return out + [TableConfig(name=f"big{i}", dim=128, vocabulary_size=10**8, optimizer=opt) for i in range(big)]


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rows = []
    for big in (0, 4):
        for world in (8, 64):
            configs = tables(big)
            start = time.perf_counter()
            planned = plan_tables(configs, world, memory_per_rank=BUDGET, ranks_per_node=8)
            seconds = time.perf_counter() - start
            today = plan_tables(configs, world, pins=auto_plan(configs, world))  # auto_plan's, estimated alike
            for name, plan in (("plan_tables", planned), ("auto_plan", today)):
                largest = max(t.bytes for t in plan.rank_totals())
                kinds = sorted({s.kind.value for s in plan.shardings.values()})
                rows.append({"tables": len(configs), "world": world, "planner": name,
                             "largest GiB": f"{largest / 2**30:.2f}",
                             "mean GiB": f"{sum(t.bytes for t in plan.rank_totals()) / world / 2**30:.2f}",
                             "max/mean": f"{plan.imbalance():.3f}", "fits 80 GiB": "yes" if largest <= BUDGET else "no",
                             "kinds": "+".join(kinds),
                             "plan ms": f"{seconds * 1e3:.1f}" if name == "plan_tables" else "-"})
    print_table(rows, ["tables", "world", "planner", "largest GiB", "mean GiB", "max/mean", "fits 80 GiB", "kinds",
                       "plan ms"])
    if args.json:
        write_json(args.json, {"machine": machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
