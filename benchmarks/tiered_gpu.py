"""Tiered tables on a GPU: device memory over pinned host memory against the same tables all in device memory.

Issue 47's GPU target: ``T`` tables of ``V`` rows x dim ``D`` (default 4 x 25M x 64) with 10% of the rows in HBM,
zipf ids (s = 1.05), a batch of ``B`` ids per table (65,536), RowWiseAdagrad fused, a linear head. Reports steps/s
of both (interleaved, medians), the bytes the tiers moved a step, the time inside the row moves
(``tier_moves.exchange``), their quotient, and the pinned host-to-device copy bandwidth measured on the same
machine: the target is steps/s >= 0.5x all in HBM and moved bytes / move time >= 0.7x that bandwidth.

Tables are filled with ``replace``/``replace_chunks`` (every row stored, the slow tier's straight into pinned
memory), so no step inserts. ``--device cpu`` with small sizes runs every line but the device's (CI checks it).

``--host-share F`` runs the three-level table instead: ``F`` of the rows in (pinned) host memory, the rest in row
files under ``--rows-dir`` (a temporary directory by default); bytes moved and the move time then count the host's
traffic with the row files too.

Run: ``python benchmarks/tiered_gpu.py [--device cuda] [--rows 25000000] [--host-share 0.3] [--json PATH]``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, parser, print_table, write_json  # noqa: E402

import dynemb  # noqa: E402
from dynemb.table import Rows, Tiers, tier_traffic  # noqa: E402
from dynemb.table import tier_moves  # noqa: E402

LR = 0.01


def zipf_ids(vocab: int, n: int, alpha: float, g: torch.Generator, device) -> torch.Tensor:
    """``n`` ids in ``[0, vocab)``: zipf ranks (inverse CDF of a sampled grid) through a fixed scramble."""
    grid = min(vocab, 1 << 20)  # the CDF over the top ranks, exact; beyond it ranks spread evenly in their bucket
    ranks = torch.arange(1, grid + 1, dtype=torch.float64)
    cdf = ranks.pow(-alpha).cumsum(0)
    cdf /= cdf[-1].clone()
    r = torch.searchsorted(cdf, torch.rand(n, dtype=torch.float64, generator=g)).clamp_(max=grid - 1)
    spread = (r * (vocab // grid) + torch.randint(0, max(1, vocab // grid), (n,), generator=g)).clamp_(max=vocab - 1)
    return ((spread * 0x9E3779B1 + 7) % vocab).to(device)  # hot ids scattered over the id space


def filled(rows: int, dim: int, device, tiers, seed: int):
    """A DynamicEmbedding of ``rows`` keys ``0..rows-1`` (every row stored), RowWiseAdagrad fused."""
    emb = dynemb.DynamicEmbedding(dim, seed=seed, device=device, tiers=tiers, init_capacity=rows if tiers is None
                                  else 8192)
    opt = dynemb.optim.RowWiseAdagrad([emb], lr=LR, fused=True)
    table, chunk = emb.table, 1 << 22

    def values(keys: torch.Tensor) -> torch.Tensor:  # cheap to make (memory bandwidth only); any values do
        return ((keys % 1009).to(torch.float32) * 1e-5 + seed * 1e-3).unsqueeze(1).expand(keys.numel(), dim)

    if tiers is None:
        keys = torch.arange(rows, device=device)
        table.replace(Rows(keys, values(keys).contiguous(), None, {}))
    else:
        table.replace_chunks((Rows(k, values(k), None, {}) for k in torch.arange(rows).split(chunk)), total=rows)
    return emb, opt


class Model:
    def __init__(self, args, device, tiered: bool) -> None:
        fast = max(1, int(args.rows * args.fast_share))
        if not tiered:
            tiers = None
        elif args.host_share > 0:  # three levels: device over host over row files
            tiers = Tiers(fast_capacity=fast, host_capacity=max(1, int(args.rows * args.host_share)),
                          slow=args.rows_dir or tempfile.mkdtemp(prefix="tiered-gpu-"))
        else:
            tiers = Tiers(fast_capacity=fast, slow="host")
        self.tables = [filled(args.rows, args.dim, device, tiers, seed=t) for t in range(args.tables)]
        torch.manual_seed(0)
        self.head = torch.nn.Linear(args.tables * args.dim, 1, device=device)
        self.opt = torch.optim.SGD(self.head.parameters(), lr=LR)
        self.device = device

    def step(self, batch: list[torch.Tensor]) -> None:
        out = torch.cat([emb(ids) for (emb, _), ids in zip(self.tables, batch)], dim=1)
        self.head(out).sum().backward()
        self.opt.step()
        self.opt.zero_grad()

    def prefetch(self, batch: list[torch.Tensor]) -> None:
        for (emb, _), ids in zip(self.tables, batch):
            emb.table.prefetch(ids)


def pinned_h2d_gbps(device, nbytes: int) -> float:
    """Pinned host-to-device copy bandwidth (GB/s, median of 5), or 0.0 off CUDA."""
    if torch.device(device).type != "cuda":
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


class MoveTimer:
    """Seconds spent inside ``tier_moves.exchange`` (the row-move phase; the staged link fences its copies)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._exchange = tier_moves.exchange

    def __enter__(self):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return self._exchange(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
        import dynemb.table.tiered as tiered_module
        self._module = tiered_module
        tiered_module.exchange = timed
        return self

    def __exit__(self, *exc):
        self._module.exchange = self._exchange


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=25_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=65_536, help="ids per table a step")
    p.add_argument("--fast-share", type=float, default=0.1)
    p.add_argument("--alpha", type=float, default=1.05)
    p.add_argument("--steps", type=int, default=20, help="timed steps of each (after 5 warm-up)")
    p.add_argument("--prefetch", action="store_true", help="prefetch the next batch after each tiered step")
    p.add_argument("--host-share", type=float, default=0.0,
                   help="three levels: this share of the rows in host memory, the rest in row files (0: two levels)")
    p.add_argument("--rows-dir", default=None, help="the row files' directory (three levels; default: a temp dir)")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.batch, args.steps = min(args.rows, 200_000), min(args.batch, 8192), min(args.steps, 8)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    warmup = 5
    batches = [[zipf_ids(args.rows, args.batch, args.alpha, g, device) for _ in range(args.tables)]
               for _ in range(warmup + args.steps + 1)]
    t0 = time.perf_counter()
    models = {"all-in-device": Model(args, device, False), "tiered": Model(args, device, True)}
    build_s = time.perf_counter() - t0
    tiered_tables = [emb.table for emb, _ in models["tiered"].tables]
    times = {name: [] for name in models}
    moved, move_s = 0, 0.0
    for i in range(warmup + args.steps):
        for name, model in models.items():
            before = tier_traffic(tiered_tables)["counts"]
            with MoveTimer() as timer:
                sync(device)
                t = time.perf_counter()
                model.step(batches[i])
                if args.prefetch and name == "tiered":
                    model.prefetch(batches[i + 1])
                sync(device)
                elapsed = time.perf_counter() - t
            if i >= warmup:
                times[name].append(elapsed)
                if name == "tiered":
                    moved += tier_traffic(tiered_tables, before)["tier_bytes_moved"]
                    move_s += timer.seconds
    step = {name: statistics.median(t) for name, t in times.items()}
    rate = {name: 1.0 / s for name, s in step.items()}
    h2d = pinned_h2d_gbps(device, 1 << 30)
    move_gbps = moved / move_s / 1e9 if move_s else 0.0
    levels = tiered_tables[0].stats()["tiers"]
    hit = levels["fast"]["hit_rate"]
    disk_hit = levels["disk"]["hit_rate"] if "disk" in levels else None
    base = rate["all-in-device"]
    rows = [{"implementation": n, "steps/s": f"{rate[n]:.2f}", "x all-in-device": f"{rate[n] / base:.2f}"}
            for n in models]
    print_table(rows, ["implementation", "steps/s", "x all-in-device"])
    result = {"benchmark": "tiered_gpu", "device": str(device), "machine": machine_info(), "args": vars(args),
              "build_s": build_s, "steps_per_s": rate, "ratio": rate["tiered"] / rate["all-in-device"],
              "bytes_moved_per_step": moved / max(1, args.steps), "move_s_per_step": move_s / max(1, args.steps),
              "move_gbps": move_gbps, "pinned_h2d_gbps": h2d,
              "move_vs_h2d": move_gbps / h2d if h2d else None, "fast_hit_rate": hit,
              "levels": 3 if disk_hit is not None else 2, "disk_hit_rate": disk_hit}
    print(f"ratio {result['ratio']:.3f} (target >= 0.5); bytes moved/step {result['bytes_moved_per_step'] / 2**20:.1f} "
          f"MiB in {result['move_s_per_step'] * 1e3:.1f} ms: {move_gbps:.1f} GB/s; pinned H2D {h2d:.1f} GB/s"
          + (f" ({move_gbps / h2d:.2f}x, target >= 0.7)" if h2d else "") + f"; fast hit rate {hit:.3f}"
          + (f"; row-file hit rate {disk_hit:.3f}" if disk_hit is not None else ""))
    if args.json:
        write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
