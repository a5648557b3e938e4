"""Planner estimates against a real run: each rank's rows, bytes and lookups a step, measured in a 4-rank gloo run
of a planned model, over the planner's estimates.

    python benchmarks/plan_estimates.py [--quick] [--json PATH]

1. 4 ranks train a model (row-sharded) on power-law ids and save a checkpoint, which records each table's rows
   and unique ids a step (``observed``);
2. ``plan_from_checkpoint`` plans the next run (4 ranks, no table small enough to replicate; ``item`` pinned
   column-wise and ``query`` table-row-wise on ranks 2 and 3, so every keyed kind is checked);
3. 4 ranks build the planned model and load the checkpoint (it reshards): rows held (the live rows of its
   shards) and bytes (those rows' values, keys, scores and optimizer slots) are measured then; they train more
   steps of the same traffic, measuring the keys its shards find a step (the keys it received) and the bytes it
   sent a step. Each over the planner's estimate for that rank; target: within 10% (0.9 to 1.1). The rows after
   the steps are shown too: dynamic tables keep growing, which a plan from observed rows does not foresee.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

import dynemb  # noqa: E402
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402
from dynemb.checkpoint import load, save  # noqa: E402
from dynemb.distributed.launch import spawn  # noqa: E402
from dynemb.distributed.sharding import Sharding  # noqa: E402
from dynemb.distributed.strategy import KINDS  # noqa: E402

WORLD = 4
# (name, dim, vocabulary (static) or None, id range, power-law alpha or 0 for uniform, ids a sample)
TABLES = [("user", 32, None, 1_000_000, 1.05, 4), ("item", 64, None, 300_000, 1.1, 4),
          ("query", 16, None, 50_000, 0.0, 2), ("ad", 16, 40_000, 40_000, 0.0, 2),
          ("tag", 8, None, 3_000, 0.0, 2), ("geo", 8, 2_000, 2_000, 0.0, 1)]


def configs():
    opt = dynemb.optim.Adagrad(lr=0.05, fused=True)
    tables = [TableConfig(name=n, dim=d, vocabulary_size=v, seed=i, optimizer=opt)
              for i, (n, d, v, _, _, _) in enumerate(TABLES)]
    return tables, [FeatureConfig(name=n, table=n) for n, *_ in TABLES]


def batch(g: torch.Generator, size: int) -> dict:
    out = {}
    for name, _, vocab, high, alpha, per in TABLES:
        n = size * per
        if alpha:
            u = torch.rand(n, generator=g, dtype=torch.float64)
            ids = (((high ** (1 - alpha) - 1) * u + 1) ** (1 / (1 - alpha))).long().clamp(max=high - 1)
            ids = ids * -7046029254386353131 if vocab is None else ids  # spread over int64 (a bijection)
        else:
            ids = torch.randint(0, high, (n,), generator=g)
        out[name] = ids.view(size, per)
    return out


def step(ec, b) -> None:
    sum(o.sum() for o in ec(b).values()).backward()


def _first(rank, world, root, size, steps):
    tables, features = configs()
    ec = EmbeddingCollection(tables, features, plan={t.name: "row" for t in tables}, timeout=300)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        step(ec, batch(g, size))
    save(root, ec, step=steps)


def _planned(rank, world, root, plan_json, size, steps, out):
    tables, features = configs()
    plan = {name: Sharding.from_dict(d) for name, d in json.loads(plan_json).items()}
    ec = EmbeddingCollection(tables, features, plan=plan, timeout=300)
    load(root, ec)
    rows, nbytes = held(ec)  # what the plan placed: the checkpoint's rows, resharded
    g = torch.Generator().manual_seed(100 + rank)
    before = dict(ec.comm_stats)
    for _ in range(steps):
        step(ec, batch(g, size))
    received = (ec.comm_stats["keys_received"] - before["keys_received"]) / steps
    sent = (ec.comm_stats["bytes_sent"] - before["bytes_sent"]) / steps
    remote = (ec.comm_stats["bytes_remote"] - before["bytes_remote"]) / steps
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rows": rows, "bytes": nbytes, "rows_after": held(ec)[0], "lookups": received, "sent": sent,
                   "remote": remote}, f)


def held(ec) -> tuple[int, int]:
    """Live rows of this rank's shards and their bytes (values, key, score, optimizer slots)."""
    rows = nbytes = 0
    for shard in ec.logical_tables().values():
        t = shard.table
        if t is None:
            continue
        n = t.size()
        rows += n
        nbytes += n * (t.values.element_size() * t.dim + t.key_dtype.itemsize + 8
                       + sum(t.slot(s).shape[1] * t.slot(s).element_size() for s in t.slot_names))
    return rows, nbytes


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    from dynemb.checkpoint.planning import plan_from_checkpoint

    size, first_steps, steps = (256, 6, 3) if args.quick else (1024, 20, 5)
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "ckpt")
        spawn(_first, WORLD, root, size, first_steps, threads=1)
        # two tables pinned so that every keyed kind is checked: column and table_row beside the planner's own
        plan = plan_from_checkpoint(root, WORLD, replicate_bytes=0,
                                    pins={"item": "column", "query": ("table_row", (2, 3))})
        print(plan, "\n")
        spawn(_planned, WORLD, root, json.dumps(plan.to_dict()), size, steps, tmp, threads=1)
        measured = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(WORLD)]
    rows = []
    for rank, (got, est) in enumerate(zip(measured, plan.rank_totals())):
        rows.append({"rank": rank, "rows": got["rows"], "rows/est": f"{got['rows'] / est.rows:.3f}",
                     "after steps": f"{got['rows_after'] / est.rows:.3f}",
                     "bytes/est": f"{got['bytes'] / est.bytes:.3f}", "lookups/step": f"{got['lookups']:.0f}",
                     "lookups/est": f"{got['lookups'] / est.lookups:.3f}" if est.lookups else "n/a",
                     "sent/step": f"{got['sent']:.0f}", "sent/est wire": f"{got['sent'] / est.wire:.3f}"
                     if est.wire else "n/a"})
    print_table(rows, list(rows[0]))
    # every kind's own floor (stated in its module), at the accesses the checkpoint observed, over what was sent
    floor = sum(KINDS[s.kind].wire_floor(s, plan.stats[n], WORLD) for n, s in plan.shardings.items())
    sent = sum(m["remote"] for m in measured)
    print(f"\nbytes on the wire a step (to other ranks), all ranks: {sent:,.0f}; the kinds' floors: {floor:,.0f}; "
          f"wire/floor {sent / floor:.3f} (target <= 1.1)")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "rows": rows, "plan": plan.to_dict(),
                               "wire_over_floor": sent / floor})


if __name__ == "__main__":
    main()
