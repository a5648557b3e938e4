"""The main job's training step: the model ``dynemb train`` builds with its defaults (a DLRM over the 26
categorical and 13 dense columns of ``SyntheticClickLog``, one dynamic table of dim 16 a column, fused Adagrad,
Adam for the MLPs), timed per batch size and device.

Each step is ``Trainer.train_step``, what ``Trainer.fit`` runs for each batch (forward, BCE loss, backward, the
combined optimizer's step and ``zero_grad``), without its logging. Batches are made ahead and placed on the device; one untimed pass over them
inserts their ids, so the timed rounds measure the steady state, in which every id is already in its table.
Rounds of ``--steps`` steps at batch 512 (in proportion fewer at larger batches) are timed (CUDA: with a device synchronize at the end of each); medians of
``--repeat`` rounds. Devices are timed one after the other, not interleaved: compare them within one run.

``--one-table`` also times the same model with every feature in one shared table, in interleaved rounds: one
dedup, find, pool and update a step for all features, about what a lookup grouped across tables would cost.

Run: ``python benchmarks/job_step.py [--devices cpu cuda] [--batch-sizes 512 4096] [--one-table] [--quick]
[--json PATH]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

from dynemb import EmbeddingCollection, FeatureConfig, TableConfig  # noqa: E402
from dynemb.data import SyntheticClickLog  # noqa: E402
from dynemb.models import DLRM  # noqa: E402
from dynemb.train import SPARSE_OPTIMIZERS, Trainer, TrainConfig, build_dlrm  # noqa: E402


def _model(data: SyntheticClickLog, cfg: TrainConfig, one_table: bool):
    """The job's DLRM; ``one_table``: its features share one table (one dedup, find, pool and update a step for
    all of them: about what a lookup grouped across tables would cost, an upper bound on its gain)."""
    torch.manual_seed(0)
    if not one_table:
        return build_dlrm(data.num_dense, data.categorical_names, cfg)
    spec = SPARSE_OPTIMIZERS[cfg.optimizer](lr=cfg.lr, fused=True)
    tables = [TableConfig(name="shared", dim=cfg.dim, optimizer=spec)]
    features = [FeatureConfig(name=f, table="shared") for f in data.categorical_names]
    return DLRM(data.num_dense, EmbeddingCollection(tables, features), cfg.dim)


def measure(device: torch.device, batch_size: int, steps: int, repeat: int, batches: int,
            layouts: list[str]) -> list[dict]:
    """One row per layout (``tables``: the job's; ``one table``: see :func:`_model`), timed in interleaved rounds."""
    data = SyntheticClickLog(batch_size=batch_size, seed=0)
    cfg = TrainConfig()  # the job's defaults: dim 16, adagrad, lr 0.05
    made = [data.batch(i).to(device) for i in range(batches)]
    runs = {}
    for layout in layouts:
        model = _model(data, cfg, layout == "one table").to(device)
        runs[layout] = (model, Trainer(model, cfg))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _, trainer in runs.values():
        for batch in made:  # inserts every id of the timed batches, compiles kernels
            trainer.train_step(batch)
    times = {layout: [] for layout in runs}
    for r in range(repeat):
        for layout, (_, trainer) in runs.items():
            sync()
            start = time.perf_counter()
            for i in range(steps):
                trainer.train_step(made[(r * steps + i) % len(made)])
            sync()
            times[layout].append((time.perf_counter() - start) / steps)
    out = []
    for layout, (model, _) in runs.items():
        seconds = statistics.median(times[layout])
        q = statistics.quantiles(times[layout], n=4) if repeat >= 4 else [float("nan")] * 3
        out.append({"device": str(device), "batch": batch_size, "layout": layout, "ms/step": f"{seconds * 1e3:.2f}",
                    "samples/s": f"{batch_size / seconds:,.0f}", "spread %": f"{(q[2] - q[0]) / seconds * 100:.0f}",
                    "table rows": sum(t.size() for t in model.embeddings.dynemb_tables()),
                    "_seconds": seconds, "_samples_per_s": batch_size / seconds})
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="+", default=None, help="default: cpu, and cuda when there is one")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 512 4096 32768 (quick: 512)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed round at batch 512, fewer in proportion "
                   "at larger batches, at least 2 (default 20; quick 10)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--one-table", action="store_true", help="also time the model with every feature in one shared "
                   "table, interleaved: an upper bound on what a lookup grouped across tables would save")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    devices = [torch.device(d) for d in (args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))]
    sizes = args.batch_sizes or ([512] if args.quick else [512, 4096, 32768])
    steps = args.steps or (10 if args.quick else 20)
    repeat = args.repeat or (5 if args.quick else 9)
    info = machine_info()
    print(f"{info['cpu_model']}, {args.threads} thread(s); cuda: {info['cuda']}; medians of {repeat} rounds of "
          f"{steps} steps at batch 512 (fewer at larger batches), steady state (every id already stored)")
    rows, columns = [], ["device", "batch", "layout", "ms/step", "samples/s", "spread %", "table rows"]
    for size in sizes:
        n = max(2, steps * 512 // size)  # about the same samples a round at every batch size
        for device in devices:
            rows += measure(device, size, n, repeat, max(n, 4), ["tables"] + (["one table"] if args.one_table else []))
            print_table(rows[-1:], columns)
    print()
    print_table(rows, columns)
    if args.json:
        write_json(args.json, {"benchmark": "job_step", "machine": info, "threads": args.threads, "steps": steps,
                               "repeat": repeat, "results": rows})


if __name__ == "__main__":
    main()
