"""``dynemb predict`` from a fresh process, with its timeline: source trees side by side, in alternating processes.

Each run is a new ``python -m dynemb predict --threads T`` process (what a user runs), timed from its creation to
its exit; the trees (``--src LABEL=PATH``, a ``src`` directory each: this checkout's and, say, an exported copy of
``main``'s) take turns, one process each in a rotating order, so that the load of a shared machine hits them alike.
Inside each process a few marks are taken (seconds since the process was created, read from ``/proc``): Python
ready, ``dynemb``'s command imported (torch with it), the model loaded, the first block read, the first block
scored and written, the last one written. Reported per tree: the medians of wall time, CPU time (user + system,
all threads) and rows/s a fresh process (rows / wall time), each mark, and the load average over the runs. Each
tree's runs must write the same probabilities, bit for bit; the trees are compared with the first one (bit-equal, or
their largest difference: trees of other versions may round differently).

Give each tree its bytecode (``python -m compileall -q PATH``) when the machine sets ``PYTHONDONTWRITEBYTECODE``:
otherwise every process compiles the package's modules again, which an installed package never does.

    OMP_NUM_THREADS=1 python benchmarks/predict_fresh.py --model demo-report/run \\
        --data demo-report/data/train.parquet --src branch=src --src main=/tmp/main/src --runs 7
    python benchmarks/predict_fresh.py --model RUN --data FILE --quick     # two runs of this checkout's src
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

# Run in the child instead of ``python -m dynemb``: the same command, with marks around the functions every
# version of predict has (``load_model`` as score.py imports it, the file reader's iteration, the Parquet writer).
CHILD = r"""
import os, sys, threading, time
def _since_start():
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - start
_t0, _base = time.perf_counter(), _since_start()
marks = {}
def mark(name):
    marks.setdefault(name, round(_base + time.perf_counter() - _t0, 3))
mark("python_ready")
import dynemb.cli as cli
mark("imported")
import dynemb.job.score as score
import dynemb.data as data
import pyarrow.parquet as pq
_load = score.load_model
def load_model(*a, **k):
    out = _load(*a, **k)
    mark("model_loaded")
    return out
score.load_model = load_model
_iter = data.FileReader.__iter__
def _reading(self):
    for batch in _iter(self):
        mark("first_block_read")
        yield batch
data.FileReader.__iter__ = _reading
_write = pq.ParquetWriter.write_batch
def write_batch(self, *a, **k):
    out = _write(self, *a, **k)
    mark("first_block_written")
    marks["last_block_written"] = round(_base + time.perf_counter() - _t0, 3)
    return out
pq.ParquetWriter.write_batch = write_batch
def _report():
    mark("done")
    print("MARKS " + __import__("json").dumps(marks), flush=True)
_exit = os._exit
def _ending(code):  # a command may end the process itself once its file is written
    _report()
    _exit(code)
os._exit = _ending
code = cli.main()  # as the command: argv from sys.argv
_report()
sys.exit(code)
"""

MARKS = ["python_ready", "imported", "model_loaded", "first_block_read", "first_block_written", "last_block_written",
         "done"]


def run_once(src: str, args, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-c", CHILD, "predict", "--model", args.model, "--data", args.data, "--out", str(out),
               "--threads", str(args.threads)]
    load = os.getloadavg()[0]
    before = os.times()
    started = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = os.times()
    if proc.returncode != 0:
        raise SystemExit(f"{src}: predict failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = proc.stdout.splitlines()
    marks = json.loads(next(line for line in lines if line.startswith("MARKS "))[6:])
    result = json.loads(next(line for line in lines if line.startswith("{")))
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return {"wall_s": wall, "cpu_s": cpu, "rows": result["rows"], "inside_rows_per_s": result["rows_per_s"],
            "load": load, **marks}


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the run directory (dynemb train --out)")
    p.add_argument("--data", required=True, help="the file to score")
    p.add_argument("--src", action="append", metavar="LABEL=PATH", help="a source tree to run (repeatable; "
                   "default: this checkout's src)")
    p.add_argument("--runs", type=int, default=5, help="fresh processes per tree")
    p.add_argument("--threads", type=int, default=1, help="dynemb predict --threads")
    args = p.parse_args()
    trees = dict(s.split("=", 1) for s in (args.src or [f"this={HERE.parent / 'src'}"]))
    runs = 2 if args.quick else args.runs
    samples: dict[str, list] = {label: [] for label in trees}
    first: dict[str, bytes] = {}  # each tree's first output: its other runs must write the same bits
    reference: dict[str, np.ndarray] = {}  # the first tree's first probabilities
    across: dict[str, float] = {}  # each tree's largest difference from the first tree's probabilities
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            labels = list(trees)
            labels = labels[i % len(labels):] + labels[:i % len(labels)]  # rotate who goes first
            for label in labels:
                out = Path(tmp) / f"{label}-{i}.parquet"
                samples[label].append(run_once(trees[label], args, out))
                p = pq.read_table(out).column("probability").to_numpy()
                if p.tobytes() != first.setdefault(label, p.tobytes()):
                    raise SystemExit(f"{label}: run {i} wrote other probabilities than its first run")
                if label not in across:  # trees of other versions may round (or write float32) differently
                    base = reference.setdefault("first tree", p)
                    if len(p) != len(base):
                        raise SystemExit(f"{label}: wrote {len(p)} probabilities, the first tree {len(base)}")
                    same = p.dtype == base.dtype and p.tobytes() == base.tobytes()
                    across[label] = 0.0 if same else float(np.abs(p.astype(np.float64) - base).max())
                out.unlink()
                print(f"{label} run {i}: {samples[label][-1]['wall_s']:.2f} s wall, load "
                      f"{samples[label][-1]['load']:.1f}", file=sys.stderr)
    rows = []
    for label, runs_ in samples.items():
        med = lambda key, runs_=runs_: statistics.median(r[key] for r in runs_)  # noqa: E731
        n = runs_[0]["rows"]
        rows.append({"tree": label, "runs": len(runs_), "wall_s": round(med("wall_s"), 2),
                     "cpu_s": round(med("cpu_s"), 2), "rows_per_s": round(n / med("wall_s")),
                     "inside_rows_per_s": round(med("inside_rows_per_s")),
                     **{m: round(med(m), 2) for m in MARKS if all(m in r for r in runs_)},
                     "load": f"{min(r['load'] for r in runs_):.1f}-{max(r['load'] for r in runs_):.1f}"})
    print_table(rows, list(rows[0]))
    apart = max(across.values(), default=0.0)
    agree = "bit-equal" if apart == 0 else f"up to {apart:.1e} from the first tree's (largest difference)"
    print(f"outputs: each tree's runs bit-equal; across trees {agree}; {machine_info()['cpu_model']}, "
          f"{os.cpu_count()} CPUs, --threads {args.threads}")
    if args.json:
        write_json(args.json, {"machine": machine_info(), "rows": rows, "samples": samples,
                               "largest_difference_across_trees": apart})


if __name__ == "__main__":
    main()
