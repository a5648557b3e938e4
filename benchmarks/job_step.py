"""The main job's training step: the model ``dynemb train`` builds with its defaults (a DLRM over the 26
categorical and 13 dense columns of ``SyntheticClickLog``, one dynamic table of dim 16 a column, fused Adagrad,
Adam for the MLPs), timed per batch size and device.

Each step is ``Trainer.train_step``, what ``Trainer.fit`` runs for each batch (forward, BCE loss, backward, the
combined optimizer's step and ``zero_grad``), without its logging. Batches are made ahead and placed on the
device; one untimed pass over them inserts their ids, so the timed rounds measure the steady state, in which every
id is already in its table. Rounds of ``--steps`` steps at batch 512 (in proportion fewer at larger batches) are
timed (CUDA: with a device synchronize at the end of each); medians of ``--repeat`` rounds. Devices are timed one
after the other, not interleaved: compare them within one run.

``--new-ids FRACTION`` makes every timed batch carry that share of ids never seen before (in each feature, fresh
random 62-bit ids in place of the first ids), as in training on a live log; the tables then keep growing, and a
step that must grow one pays for it. The batches are made before the timing.

``--one-table`` also times, in interleaved rounds, the same model with its tables' own lookups (``tables, no
groups``: the step before grouped execution) and with every feature in one shared table (``one table``: one dedup,
find, pool and update a step for all features, an upper bound on what grouping across tables can gain).

``--before TREE`` compares two source trees (``--after``: default this checkout) on CPU: each pair of rounds runs
this script once for each tree, each in a fresh process (``PYTHONPATH=<tree>/src``, CPU clock), in an order that
alternates, and reports both medians and ``paired``, the median of the pairs' own ratios. On a shared virtual
machine a process keeps a fast or slow phase for its whole life: fresh processes, many pairs. ``--same-process``
builds both trees' models in this one process instead (``TREE``'s package imported as ``dynemb_before``; the after
tree is this checkout) and alternates rounds of steps between them, the order flipping each round: a difference of
a few percent shows there, where a process's phase (30-50%) hides it between processes. Run it twice with ``TREE``
this checkout for the spread of a null comparison.

Run: ``python benchmarks/job_step.py [--devices cpu cuda] [--batch-sizes 512 4096] [--one-table] [--new-ids 0.05]
[--quick]
[--clock cpu] [--before TREE [--after TREE] [--pairs 12] [--same-process]] [--json PATH]``.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import CLOCKS, load_tree_package, machine_info, parser, print_table, write_json  # noqa: E402

from dynemb import EmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402
from dynemb.data import SyntheticClickLog  # noqa: E402
from dynemb.models import DLRM  # noqa: E402
from dynemb.train import SPARSE_OPTIMIZERS, Trainer, TrainConfig, build_dlrm  # noqa: E402


def with_new_ids(batches: list, fraction: float, count: int, seed: int = 1) -> list:
    """``count`` batches cycling through ``batches``, each with ``fraction`` of every feature's ids replaced by fresh
    random ids (62-bit: never seen before, but for a chance of about 2^-40 a step); ``fraction`` 0: the batches
    themselves."""
    if fraction <= 0:
        return [batches[i % len(batches)] for i in range(count)]
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        batch = batches[i % len(batches)]
        sparse = {}
        for name, ids in batch.sparse.items():
            k = int(ids.numel() * fraction)
            fresh = torch.randint(-(2**62), 2**62, (k,), generator=g).to(ids.device)
            sparse[name] = torch.cat([fresh, ids[k:]]) if k else ids
        out.append(dataclasses.replace(batch, sparse=sparse))
    return out


def _job(lib, batch_size: int, batches: int, new_ids: float = 0.0, count: int = 0):
    """``(trainer, batches)`` of the job's model at ``batch_size`` built from the package ``lib`` (dynemb, or another
    tree's copy), every id of the batches inserted; with ``new_ids``, ``count`` batches carrying that share of new
    ids (:func:`with_new_ids`)."""
    data = importlib.import_module(f"{lib.__name__}.data").SyntheticClickLog(batch_size=batch_size, seed=0)
    train = importlib.import_module(f"{lib.__name__}.train")
    cfg = train.TrainConfig()
    torch.manual_seed(0)
    trainer = train.Trainer(train.build_dlrm(data.num_dense, data.categorical_names, cfg), cfg)
    made = [data.batch(i) for i in range(batches)]
    for batch in made:
        trainer.train_step(batch)
    return trainer, (with_new_ids(made, new_ids, count) if new_ids else made)


def _model(data: SyntheticClickLog, cfg: TrainConfig, layout: str):
    """The job's DLRM in ``layout``: ``tables`` (the job's: its tables in execution groups), ``tables, no groups``
    (each table its own lookups, as before grouped execution), ``one table`` (its features share one table: one
    dedup, find, pool and update a step for all of them, an upper bound on what grouping can gain)."""
    torch.manual_seed(0)
    if layout != "one table":
        model = build_dlrm(data.num_dense, data.categorical_names, cfg)
        if layout == "tables, no groups":
            model.embeddings.plan.groups = []
        return model
    spec = SPARSE_OPTIMIZERS[cfg.optimizer](lr=cfg.lr, fused=True)
    tables = [TableConfig(name="shared", dim=cfg.dim, optimizer=spec)]
    features = [FeatureConfig(name=f, table="shared") for f in data.categorical_names]
    return DLRM(data.num_dense, EmbeddingCollection(tables, features), cfg.dim)


def measure(device: torch.device, batch_size: int, steps: int, repeat: int, batches: int,
            layouts: list[str], clock=CLOCKS["wall"], new_ids: float = 0.0) -> list[dict]:
    """One row per layout (see :func:`_model`), timed in interleaved rounds;
    ``new_ids``: the share of never-seen ids in each timed batch."""
    data = SyntheticClickLog(batch_size=batch_size, seed=0)
    cfg = TrainConfig()  # the job's defaults: dim 16, adagrad, lr 0.05
    made = [data.batch(i).to(device) for i in range(batches)]
    runs = {}
    for layout in layouts:
        model = _model(data, cfg, layout).to(device)
        runs[layout] = (model, Trainer(model, cfg))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _, trainer in runs.values():
        for batch in made:  # inserts every id of the timed batches, compiles kernels
            trainer.train_step(batch)
    timed = with_new_ids(made, new_ids, steps * repeat)
    times = {layout: [] for layout in runs}
    for r in range(repeat):
        for layout, (_, trainer) in runs.items():
            sync()
            start = clock()
            for i in range(steps):
                trainer.train_step(timed[r * steps + i])
            sync()
            times[layout].append((clock() - start) / steps)
    out = []
    for layout, (model, _) in runs.items():
        seconds = statistics.median(times[layout])
        q = statistics.quantiles(times[layout], n=4) if repeat >= 4 else [float("nan")] * 3
        out.append({"device": str(device), "batch": batch_size, "layout": layout, "new ids": new_ids,
                    "ms/step": f"{seconds * 1e3:.2f}",
                    "samples/s": f"{batch_size / seconds:,.0f}", "spread %": f"{(q[2] - q[0]) / seconds * 100:.0f}",
                    "table rows": sum(t.size() for t in model.embeddings.dynemb_tables()),
                    "_seconds": seconds, "_samples_per_s": batch_size / seconds})
    return out


def paired_trees(args, sizes: list[int], steps: int, repeat: int) -> list[dict]:
    """``--before``: one row per batch size, each tree's median ms a step on CPU and the ratios (see the module)."""
    trees = {"before": args.before, "after": args.after or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    rows = []
    for size in sizes:
        ms: dict[str, list[float]] = {"before": [], "after": []}
        for pair in range(args.pairs):
            for name in (("before", "after") if pair % 2 == 0 else ("after", "before")):
                ms[name].append(_tree_step_ms(trees[name], size, steps, repeat, args.threads, args.new_ids))
            print(f"batch {size}, pair {pair + 1}: before {ms['before'][-1]:.2f} ms, after {ms['after'][-1]:.2f} ms",
                  flush=True)
        rows.append(_ab_row(size, args.pairs, ms))
    return rows


def same_process_trees(args, sizes: list[int], steps: int, rounds: int) -> list[dict]:
    """``--before`` with ``--same-process``: the rows of :func:`paired_trees`, from both trees' models in this
    process, one round of steps of each in turn (the order flipping each round), each round timed by the CPU
    clock."""
    from train_step_impls import alternated_steps

    libs = {"before": load_tree_package(args.before), "after": sys.modules["dynemb"]}
    rows = []
    for size in sizes:
        n = max(2, steps * 512 // size)

        def stepper(lib, size=size, n=n):
            trainer, made = _job(lib, size, max(n, 4), args.new_ids, n * rounds)
            return lambda r: [trainer.train_step(made[(r * n + i) % len(made)]) for i in range(n)]

        seconds = alternated_steps([stepper(lib) for lib in libs.values()], list(range(rounds)), rounds)
        rows.append(_ab_row(size, rounds, {name: [t / n * 1e3 for t in times] for name, times in zip(libs, seconds)}))
    return rows


def _ab_row(size: int, count: int, ms: dict[str, list[float]]) -> dict:
    before, after = statistics.median(ms["before"]), statistics.median(ms["after"])
    ratios = [b / a for b, a in zip(ms["before"], ms["after"])]
    return {"batch": size, "pairs": count, "before ms": f"{before:.2f}", "after ms": f"{after:.2f}",
            "before/after": f"{before / after:.2f}", "paired": f"{statistics.median(ratios):.2f}",
            "pair range": f"{min(ratios):.2f}-{max(ratios):.2f}", "_before_ms": ms["before"], "_after_ms": ms["after"]}


def _tree_step_ms(tree: str, size: int, steps: int, repeat: int, threads: int, new_ids: float = 0.0) -> float:
    """The median CPU ms a step of ``tree``'s package at batch ``size``, from this script in a fresh process."""
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"), OMP_NUM_THREADS=str(threads))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        subprocess.run([sys.executable, os.path.abspath(__file__), "--devices", "cpu", "--batch-sizes", str(size),
                        "--steps", str(steps), "--repeat", str(repeat), "--threads", str(threads), "--clock", "cpu",
                        "--json", out] + (["--new-ids", str(new_ids)] if new_ids else []),
                       env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)["results"][0]["_seconds"] * 1e3


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="+", default=None, help="default: cpu, and cuda when there is one")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 512 4096 32768 (quick: 512)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed round at batch 512, fewer in proportion "
                   "at larger batches, at least 2 (default 20; quick 10)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--one-table", action="store_true", help="also time the model without execution groups and with "
                   "every feature in one shared table, interleaved (an upper bound on what grouping can save)")
    p.add_argument("--new-ids", type=float, default=0.0, metavar="FRACTION", help="share of never-seen ids in each "
                   "timed batch (default 0: every id already stored)")
    p.add_argument("--before", metavar="TREE", help="compare the source tree TREE with --after, fresh processes")
    p.add_argument("--after", metavar="TREE", help="with --before: the tree to compare (default this checkout)")
    p.add_argument("--pairs", type=int, default=None, help="with --before: pairs of processes, or of rounds with "
                   "--same-process (default 12, same process 40; quick 3)")
    p.add_argument("--same-process", action="store_true", help="with --before: both trees in this process (see above)")
    args = p.parse_args()
    if args.same_process and (not args.before or args.after or args.one_table or args.repeat
                              or (args.devices or ["cpu"]) != ["cpu"]):
        p.error("--same-process compares --before TREE with this checkout on CPU, by rounds of --steps steps "
                "(--pairs of them; no --after, --one-table, --devices or --repeat)")
    torch.set_num_threads(args.threads)
    devices = [torch.device(d) for d in (args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))]
    sizes = args.batch_sizes or ([512] if args.quick else [512, 4096, 32768])
    steps = args.steps or (10 if args.quick else 20)
    repeat = args.repeat or (5 if args.quick else 9)
    info = machine_info()
    if args.before:
        args.pairs = args.pairs or (3 if args.quick else 40 if args.same_process else 12)
        after = args.after or "this checkout"
        what = (f"{args.pairs} pairs of rounds in one process" if args.same_process else
                f"{args.pairs} pairs of processes, each the median of {repeat} rounds")
        print(f"{info['cpu_model']}, {args.threads} thread(s); before {args.before}, after {after}; {what}, CPU ms a "
              "step")
        rows = (same_process_trees(args, sizes, steps, args.pairs) if args.same_process
                else paired_trees(args, sizes, steps, repeat))
        print_table(rows, ["batch", "pairs", "before ms", "after ms", "before/after", "paired", "pair range"])
        if args.json:
            write_json(args.json, {"benchmark": "job_step", "machine": info,
                                   "mode": "before/after" + (", same process" if args.same_process else ""),
                                   "threads": args.threads, "steps": steps,
                                   "repeat": None if args.same_process else repeat, "results": rows})
        return
    state = f"{args.new_ids:.0%} new ids a batch" if args.new_ids else "steady state (every id already stored)"
    print(f"{info['cpu_model']}, {args.threads} thread(s); cuda: {info['cuda']}; medians of {repeat} rounds of "
          f"{steps} steps at batch 512 (fewer at larger batches), {state}")
    rows, columns = [], ["device", "batch", "layout", "new ids", "ms/step", "samples/s", "spread %", "table rows"]
    for size in sizes:
        n = max(2, steps * 512 // size)  # about the same samples a round at every batch size
        for device in devices:
            layouts = ["tables"] + (["tables, no groups", "one table"] if args.one_table else [])
            rows += measure(device, size, n, repeat, max(n, 4), layouts, CLOCKS[args.clock], args.new_ids)
            print_table(rows[-1:], columns)
    print()
    print_table(rows, columns)
    if args.json:
        write_json(args.json, {"benchmark": "job_step", "machine": info, "threads": args.threads, "steps": steps,
                               "repeat": repeat, "results": rows})


if __name__ == "__main__":
    main()
