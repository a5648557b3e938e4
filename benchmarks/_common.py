"""Shared benchmark helpers: argument parsing, median timing, machine info, table printing and JSON output.

Timings are medians of repeats. Implementations that are compared with each other are timed *interleaved*
(one repeat of each in turn), so that noise from other processes on a shared machine hits them alike and their
ratio is meaningful even when absolute numbers drift.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Iterator, NamedTuple

import torch

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}

__all__ = [
    "CLOCKS",
    "Case",
    "parser",
    "median_times",
    "thread_settings",
    "using_threads",
    "machine_info",
    "rss_bytes",
    "print_table",
    "write_json",
    "fmt_rate",
]


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark shares: ``--quick``, ``--json PATH``, ``--repeat``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (well under a minute)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--repeat", type=int, default=None, help="timed repeats per measurement (median reported)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: elapsed time; cpu: CPU time of this process, which ignores time spent descheduled on a busy "
        "machine (only meaningful with one thread)",
    )
    return p


class Case(NamedTuple):
    """A timed call with untimed preparation, e.g. removing keys before timing their insertion."""

    run: Callable[[], object]
    setup: Callable[[], object] | None = None  # before every run
    teardown: Callable[[], object] | None = None  # after every run


def median_times(
    cases: dict[str, Callable[[], object] | Case],
    *,
    repeat: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds per call of each case (a callable or a :class:`Case`), timed round-robin.

    Warm-up rounds are not timed: they fault in memory and fill allocator caches.
    """
    cases = {name: c if isinstance(c, Case) else Case(c) for name, c in cases.items()}
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + repeat):
        for name, case in cases.items():
            if case.setup is not None:
                case.setup()
            start = clock()
            case.run()
            elapsed = clock() - start
            if case.teardown is not None:
                case.teardown()
            if i >= warmup:
                samples[name].append(elapsed)
    return {name: statistics.median(s) for name, s in samples.items()}


def thread_settings() -> list[int]:
    """``[1, default]`` torch thread counts (just ``[1]`` on a one-core machine)."""
    default = torch.get_num_threads()
    return [1] if default == 1 else [1, default]


@contextlib.contextmanager
def using_threads(n: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _cpu_model() -> str:
    """The CPU's name, with its family, model and widest vector unit where ``/proc/cpuinfo`` has them: a KVM guest
    often names only the vendor ("AMD EPYC"), and ratios to TorchRec move with the CPU generation (measured: a
    RowWiseAdagrad step at 0.8x TorchRec on a Zen 5 guest with AVX-512, 1.6-2.2x on a Zen 3 one without)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "flags") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:  # the first processor's block is enough
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    flags = set(fields.get("flags", "").split())
    isa = next((f for f in ("avx512f", "avx2", "avx", "sse4_2") if f in flags), None)
    has_model = {"cpu family", "model"} <= fields.keys()
    detail = [f"family {fields['cpu family']} model {fields['model']}"] if has_model else []
    detail += [isa] if isa else []
    return f"{name} ({', '.join(detail)})" if detail else name


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


_ALLOCATOR_ENV = ("MALLOC_", "THP_", "LD_PRELOAD")  # settings that change large-tensor allocation costs


def machine_info() -> dict:
    """What the numbers depend on: CPU, core count, memory, versions, allocator settings, GPU if any."""
    info = {
        "date": datetime.date.today().isoformat(),
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "torch_threads_default": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "allocator_env": {k: v for k, v in os.environ.items() if k.startswith(_ALLOCATOR_ENV)},
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    with contextlib.suppress(ImportError):
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    return info


def rss_bytes() -> int:
    """Resident set size of this process (needs psutil)."""
    import psutil

    return psutil.Process().memory_info().rss


def fmt_rate(keys_per_s: float | None) -> str:
    """Keys/s as ``12.3M``; ``n/a`` for None."""
    if keys_per_s is None:
        return "n/a"
    return f"{keys_per_s / 1e6:.2f}M" if keys_per_s >= 1e5 else f"{keys_per_s / 1e3:.1f}K"


def print_table(rows: list[dict], columns: list[str], file=sys.stdout) -> None:
    """Print dicts as an aligned text table (missing cells print as ``n/a``)."""
    cells = [[str(r.get(c, "n/a")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)), file=file)
    for row in cells:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths)), file=file)


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (temp file, fsync, rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_tree_package(tree: str, name: str = "dynemb_before"):
    """The ``dynemb`` package of the source tree ``tree`` imported as ``name`` beside this process's own ``dynemb``
    (a copy in a temporary folder, its absolute imports of dynemb renamed): how an A/B benchmark runs two trees in
    one process, where a shared machine's slow and fast phases hit both alike."""
    import atexit
    import importlib
    import re
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix=f"{name}-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    shutil.copytree(os.path.join(os.path.abspath(tree), "src", "dynemb"), os.path.join(root, name),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for folder, _, files in os.walk(os.path.join(root, name)):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(re.sub(r"\b(from|import) dynemb\b", rf"\1 {name}", text))
    sys.path.insert(0, root)
    return importlib.import_module(name)
