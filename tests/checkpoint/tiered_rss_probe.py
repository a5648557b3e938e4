"""Run as a script: peak extra anonymous memory (RssAnon) of a save and a load of a tiered table whose slow tier
is on disk, and of a whole-table export as the control. Prints one JSON line (bytes)."""

from __future__ import annotations

import gc
import json
import sys
import threading

import torch

import dynemb
from dynemb.checkpoint import load, save
from dynemb.checkpoint import tiered_stream
from dynemb.table import Tiers


def anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class Peak:
    """The largest RssAnon above the level at entry, sampled every millisecond by a thread."""

    def __enter__(self):
        self.base = self.peak = anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, anon())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon())
        self.extra = self.peak - self.base


def build(rows: int, where: str) -> dynemb.DynamicEmbedding:
    emb = dynemb.DynamicEmbedding(64, seed=0, tiers=Tiers(fast_capacity=rows // 20, slow=where))
    emb.table.add_slot("m", 64)
    return emb


def round_trip(rows: int, where: str) -> dict:
    emb = build(rows, f"{where}/slow")
    for start in range(0, rows, 10_000):
        keys = torch.arange(start, min(rows, start + 10_000)) * 7 - rows
        emb.table.insert_or_assign(keys, torch.randn(keys.numel(), 64))
    gc.collect()
    with Peak() as saving:
        save(f"{where}/ckpt", emb, step=1)
    del emb
    gc.collect()
    fresh = build(rows, f"{where}/slow2")
    with Peak() as loading:
        load(f"{where}/ckpt", fresh)
    assert fresh.table.size() == rows
    with Peak() as control:
        whole = fresh.table.export()
    row_bytes = whole.values[:1].nbytes + whole.slots["m"][:1].nbytes + 16
    return {"rows": rows, "row_bytes": row_bytes, "save": saving.extra, "load": loading.extra,
            "export": control.extra, "slow_index": fresh.table.slow.index.nbytes()}


def main(rows: int, where: str) -> None:
    torch.set_num_threads(1)
    tiered_stream.CHUNK_ROWS = 4096
    round_trip(2000, f"{where}/warm")  # compiles the kernels first: JIT memory is not the save's or the load's
    print(json.dumps(round_trip(rows, where)))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
