"""The main job's training step: the model ``dynemb train`` builds with its defaults (a DLRM over the 26
categorical and 13 dense columns of ``SyntheticClickLog``, one dynamic table of dim 16 a column, fused Adagrad,
Adam for the MLPs), timed per batch size and device.

Each step is what ``Trainer.fit`` runs (forward, BCE loss, backward, the combined optimizer's step and
``zero_grad``), without its logging. Batches are made ahead and placed on the device; one untimed pass over them
inserts their ids, so the timed rounds measure the steady state, in which every id is already in its table.
Rounds of ``--steps`` steps at batch 512 (in proportion fewer at larger batches) are timed (CUDA: with a device synchronize at the end of each); medians of
``--repeat`` rounds. Devices are timed one after the other, not interleaved: compare them within one run.

Run: ``python benchmarks/job_step.py [--devices cpu cuda] [--batch-sizes 512 4096] [--quick] [--json PATH]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

from dynemb.data import SyntheticClickLog  # noqa: E402
from dynemb.train import Trainer, TrainConfig, build_dlrm  # noqa: E402


def measure(device: torch.device, batch_size: int, steps: int, repeat: int, batches: int) -> dict:
    data = SyntheticClickLog(batch_size=batch_size, seed=0)
    cfg = TrainConfig()  # the job's defaults: dim 16, adagrad, lr 0.05
    torch.manual_seed(0)
    model = build_dlrm(data.num_dense, data.categorical_names, cfg).to(device)
    trainer = Trainer(model, cfg)
    made = [data.batch(i).to(device) for i in range(batches)]

    def step(batch) -> None:
        trainer.loss_fn(model(batch), batch.labels).backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for batch in made:  # inserts every id of the timed batches, compiles kernels
        step(batch)
    times = []
    for r in range(repeat):
        sync()
        start = time.perf_counter()
        for i in range(steps):
            step(made[(r * steps + i) % len(made)])
        sync()
        times.append((time.perf_counter() - start) / steps)
    seconds = statistics.median(times)
    spread = (statistics.quantiles(times, n=4)[2] - statistics.quantiles(times, n=4)[0]) / seconds if repeat >= 4 \
        else float("nan")
    rows = sum(t.size() for t in model.embeddings.dynemb_tables())
    return {"device": str(device), "batch": batch_size, "ms/step": f"{seconds * 1e3:.2f}",
            "samples/s": f"{batch_size / seconds:,.0f}", "spread %": f"{spread * 100:.0f}", "table rows": rows,
            "_seconds": seconds, "_samples_per_s": batch_size / seconds}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--devices", nargs="+", default=None, help="default: cpu, and cuda when there is one")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 512 4096 32768 (quick: 512)")
    p.add_argument("--steps", type=int, default=None, help="steps per timed round at batch 512, fewer in proportion "
                   "at larger batches, at least 2 (default 20; quick 10)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    devices = [torch.device(d) for d in (args.devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))]
    sizes = args.batch_sizes or ([512] if args.quick else [512, 4096, 32768])
    steps = args.steps or (10 if args.quick else 20)
    repeat = args.repeat or (5 if args.quick else 9)
    info = machine_info()
    print(f"{info['cpu_model']}, {args.threads} thread(s); cuda: {info['cuda']}; medians of {repeat} rounds of "
          f"{steps} steps at batch 512 (fewer at larger batches), steady state (every id already stored)")
    rows = []
    for size in sizes:
        n = max(2, steps * 512 // size)  # about the same samples a round at every batch size
        for device in devices:
            rows.append(measure(device, size, n, repeat, batches=max(n, 4)))
            print_table(rows[-1:], ["device", "batch", "ms/step", "samples/s", "spread %", "table rows"])
    print()
    print_table(rows, ["device", "batch", "ms/step", "samples/s", "spread %", "table rows"])
    if args.json:
        write_json(args.json, {"benchmark": "job_step", "machine": info, "threads": args.threads, "steps": steps,
                               "repeat": repeat, "results": rows})


if __name__ == "__main__":
    main()
