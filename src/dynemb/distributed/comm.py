"""Collectives used by the sharded modules: variable-size all-to-all and all-gather, and config agreement.

Everything goes through ``torch.distributed`` (gloo on CPU, NCCL on CUDA), never a home-made transport. A
failure in a collective (a peer rank died, or the group's timeout passed) is re-raised as
:class:`DistributedError` naming the step that failed, so a job fails loudly instead of hanging.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

__all__ = ["DistributedError", "all_to_all_known", "all_gather", "all_gather_varsize", "check_agreement"]


class DistributedError(RuntimeError):
    """A collective failed: a peer rank died, timed out, or ranks disagree."""


def _run(what: str, fn):
    try:
        return fn()
    except DistributedError:
        raise
    except RuntimeError as e:  # gloo/NCCL report peer death and timeouts as RuntimeError
        raise DistributedError(f"{what} failed on rank {dist.get_rank()}: a peer rank died or the collective "
                               f"timed out; a rank that skipped a step's forward or backward, or ran it in eval "
                               f"mode or under no_grad while its peers trained, ends here too "
                               f"({type(e).__name__}: {e})") from e


def all_to_all_known(send: torch.Tensor, send_counts: list, recv_counts: list, group=None, what="all-to-all"):
    """All-to-all when both sides already know the sizes (rows back after keys, gradients back after rows)."""
    recv = send.new_empty((sum(recv_counts),) + tuple(send.shape[1:]))
    _run(what, lambda: dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group))
    return recv


def all_gather(parts: list, tensor: torch.Tensor, group=None, what: str = "all-gather") -> None:
    """``dist.all_gather`` into ``parts`` (same shapes on every rank), a failure named as :func:`_run` does."""
    _run(what, lambda: dist.all_gather(parts, tensor, group=group))


def all_gather_varsize(tensor: torch.Tensor, group=None, what: str = "all-gather") -> list[torch.Tensor]:
    """All-gather tensors whose first dimension differs by rank; returns one tensor per rank."""
    world = dist.get_world_size(group)
    size = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    _run(f"{what} (sizes)", lambda: dist.all_gather(sizes, size, group=group))
    sizes = [int(s) for s in sizes]
    longest = max(sizes)
    padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    _run(what, lambda: dist.all_gather(parts, padded, group=group))
    return [p[:n] for p, n in zip(parts, sizes)]


def check_agreement(config: dict, group=None, what: str = "configuration") -> None:
    """Raise :class:`DistributedError` on every rank unless all ranks pass the same JSON-able ``config``.

    The message names the first differing field and the ranks' values. Uses JSON bytes, never pickle.
    """
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    parts = all_gather_varsize(torch.tensor(list(blob), dtype=torch.uint8, device=device), group, what)
    configs = [json.loads(bytes(p.cpu().tolist()).decode()) for p in parts]
    mine = configs[dist.get_rank(group)]
    for rank, other in enumerate(configs):
        if other != mine:
            field = _first_difference(mine, other, order=list(config))
            raise DistributedError(f"{what} differs across ranks at {field}: rank {dist.get_rank(group)} has "
                                   f"{_at(mine, field)!r}, rank {rank} has {_at(other, field)!r}")


def _first_difference(a, b, path: str = "", order: tuple | list = ()) -> str:
    """The path of the first field where ``a`` and ``b`` differ; a dict's keys in ``order`` first (the caller's own
    order, cause before effect: a table renamed on one rank is ``tables[1].name``, not the ``features`` naming it),
    then sorted."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) | set(b)
        for key in [k for k in order if k in keys] + sorted(keys - set(order)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(x, y, f"{path}[{i}]")
    return path or "<root>"


def _at(obj, path: str):
    import re

    for part in re.findall(r"[^.\[\]]+", path):
        if isinstance(obj, list):
            obj = obj[int(part)] if part.isdigit() and int(part) < len(obj) else None
        elif isinstance(obj, dict):
            obj = obj.get(part)
    return obj
