"""Start a function on several local processes with an initialized process group (tests, benchmarks, laptops).

On a cluster use ``torchrun``; this is for running a world of N processes on one machine without it.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "free_port"]


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, threads: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # Leave together: a rank that tears its group down while a peer still reads from it can abort that peer.
        dist.barrier()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # the group may already be broken when a peer died
            pass


def spawn(fn, world: int, *args, backend: str = "gloo", threads: int = 1, join: bool = True):
    """Run ``fn(rank, world, *args)`` on ``world`` processes (spawned) on 127.0.0.1.

    ``fn`` must be importable (a module-level function). Returns the ``ProcessContext`` when ``join=False``.
    """
    return mp.start_processes(_entry, args=(world, free_port(), backend, threads, fn, args), nprocs=world,
                              join=join, start_method="spawn")
