"""Run a function on W gloo processes on loopback; results come back as .npz files (no pickle)."""

import os
import traceback

import numpy as np

from dynemb.distributed.launch import spawn


def _collect(rank, world, fn, out_dir, args):
    try:
        result = fn(rank, world, *args)
        if result is not None:
            np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **{k: np.asarray(v) for k, v in result.items()})
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run(fn, world: int, out_dir, *args, join: bool = True):
    """Start ``fn(rank, world, *args)`` on ``world`` processes; returns rank 0's result dict (numpy arrays)."""
    ctx = spawn(_collect, world, fn, str(out_dir), args, join=join)
    if not join:
        return ctx
    path = os.path.join(out_dir, "rank0.npz")
    return dict(np.load(path)) if os.path.exists(path) else None
