"""Start a function on several local processes with an initialized process group (tests, benchmarks, laptops).

On a cluster use ``torchrun``; this is for running a world of N processes on one machine without it.
"""

from __future__ import annotations

import collections
import os
import random
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "free_port"]

_HANDED_OUT: collections.deque = collections.deque(maxlen=256)  # free_port's recent answers


def free_port() -> int:
    """A free TCP port on the loopback interface, below the kernel's ephemeral range when it can be.

    A port the kernel picks for ``bind(("", 0))`` is an ephemeral one: once released, any outgoing connection on
    the machine (gloo opens one per pair of ranks) may take it as its source port before the caller listens on it,
    and a rendezvous store that then cannot bind aborts its rank. Ports below the range are never handed out that
    way. A port handed out is not handed out again by this process for its next 256 calls: two calls in a row (a
    server's HTTP and gRPC ports, bound later) could otherwise get the same free port.
    """
    low = _ephemeral_low()
    for _ in range(64):
        port = random.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.append(port)
            return port
    with socket.socket() as s:  # every try was taken: let the kernel pick one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; other systems: a range that is rarely ephemeral


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
