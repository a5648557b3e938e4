"""Run a function on W gloo processes on loopback; results come back as .npz files (no pickle)."""

import os
import socket
import traceback

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, out_dir, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if result is not None:
            np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **{k: np.asarray(v) for k, v in result.items()})
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run(fn, world: int, out_dir, *args, join: bool = True):
    """Start ``fn(rank, world, *args)`` on ``world`` processes; returns rank 0's result dict (numpy arrays)."""
    ctx = mp.start_processes(_entry, args=(world, free_port(), fn, str(out_dir), args), nprocs=world,
                             join=join, start_method="spawn")
    if not join:
        return ctx
    path = os.path.join(out_dir, "rank0.npz")
    return dict(np.load(path)) if os.path.exists(path) else None
