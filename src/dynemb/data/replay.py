"""What a bounded table keeps: replay an id trace through a real :class:`KeyValueTable`, and Belady's optimum.

Hit rate counts each distinct key of a batch once (a training lookup deduplicates its ids, and a miss costs one
new row, or one fetch from a slower tier): a *hit* is a key already stored when its batch arrives.

:func:`replay` drives the table users get (``find_or_insert`` of each batch's unique ids with their counts, under
``max_capacity`` and a policy), so it measures the real eviction code. :func:`belady` is the offline ceiling on
the same accesses: with the whole future known, on a miss it drops the stored key whose next use is farthest, or
does not store the new key when that one's next use is the farthest (Belady's MIN, 1966). No online policy, with
or without admission, can beat it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import numpy as np
import torch

from ..checks import check_int
from ..table.kv import KeyValueTable
from ..table.policy import EvictionPolicy

__all__ = ["replay", "belady", "unique_accesses", "compare", "policies", "summarize"]


def policies(epoch_every: int) -> dict[str, dict]:
    """The online policies compared, as :func:`replay` keyword arguments by label. ``epoch_*`` move to a new
    epoch every ``epoch_every`` batches (as a job would each day); the last one adds admission on a 2nd sighting."""
    return {"lru": {"eviction": "lru"}, "lfu": {"eviction": "lfu"},
            "epoch_lru": {"eviction": "epoch_lru", "epoch_every": epoch_every},
            "epoch_lfu": {"eviction": "epoch_lfu", "epoch_every": epoch_every},
            "decayed_lfu": {"eviction": "decayed_lfu"},
            "decayed_lfu+admit2": {"eviction": "decayed_lfu", "admission": 2}}


def unique_accesses(batches: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(unique keys, counts)`` of each batch (tensors or lists of ints; int32 keys become int64): the accesses
    :func:`replay` and :func:`belady` score."""
    out = []
    for i, b in enumerate(batches):
        b = torch.as_tensor(b)
        if b.is_floating_point() or b.dtype == torch.bool:
            raise TypeError(f"batches[{i}] must hold integer ids, got {b.dtype}")
        out.append(torch.unique(b.reshape(-1).to(torch.int64), return_counts=True))
    return out


def _check_accesses(accesses) -> None:
    if not isinstance(accesses, (list, tuple)) or any(
            not (isinstance(a, tuple) and len(a) == 2 and all(isinstance(t, torch.Tensor) for t in a))
            for a in accesses):
        raise TypeError("accesses must be a list of (unique keys, counts) tensor pairs: pass your batches through "
                        "unique_accesses(batches) first")


def replay(accesses: list[tuple[torch.Tensor, torch.Tensor]], max_capacity: int, eviction=None, *,
           warmup: int = 0, epoch_every: int | None = None, **table_kw) -> dict:
    """Hit rate of a ``KeyValueTable(1, max_capacity=..., eviction=..., **table_kw)`` fed ``accesses``.

    Args:
        accesses: from :func:`unique_accesses`.
        max_capacity: rows the table may hold.
        eviction: policy (name or :class:`~dynemb.table.EvictionPolicy`); ``None`` is the table's default.
        warmup: leading batches that fill the table and are not scored.
        epoch_every: set ``table.epoch = i // epoch_every`` before batch ``i`` (for the ``epoch_*`` policies).
        table_kw: more table arguments (``half_life``, ``admission``, ...).

    Returns:
        ``{"hit_rate", "hits", "accesses", "evicted", "evicted_per_row"}``; ``evicted_per_row`` is evictions
        divided by ``max_capacity`` (how many times over the table's rows were replaced).
    """
    _check_accesses(accesses)
    check_int(max_capacity, "max_capacity", minimum=1)
    if EvictionPolicy.parse(eviction) is EvictionPolicy.CUSTOM:
        raise ValueError("replay cannot score eviction='custom': its scores come from the caller's calls")
    table = KeyValueTable(1, max_capacity=max_capacity, eviction=eviction, initializer="zeros",
                          init_capacity=min(max_capacity, 1 << 16), **table_kw)
    hits = total = 0
    for i, (keys, counts) in enumerate(accesses):
        table.epoch = i // epoch_every if epoch_every else 0
        _, found = table.find_or_insert(keys, counts=counts)
        if i >= warmup:
            hits += int(found.sum())
            total += keys.numel()
    return {"hit_rate": hits / max(total, 1), "hits": hits, "accesses": total, "evicted": table.evicted,
            "evicted_per_row": table.evicted / max_capacity}


def belady(accesses: list[tuple[torch.Tensor, torch.Tensor]], max_capacity: int, *, warmup: int = 0) -> dict:
    """Belady's offline optimum on the same accesses as :func:`replay`: ``{"hit_rate", "hits", "accesses"}``.

    Runs compiled by numba when it is installed, else in Python (the same code).

    Example:
        >>> acc = unique_accesses([torch.tensor([1, 2]), torch.tensor([3, 1]), torch.tensor([2, 1])])
        >>> belady(acc, 2)["hits"]  # keeps 1 and 2 and does not store 3: 1 hits twice, 2 once
        3
    """
    _check_accesses(accesses)
    check_int(max_capacity, "max_capacity", minimum=1)
    sizes = [keys.numel() for keys, _ in accesses]
    flat = torch.cat([keys for keys, _ in accesses]).numpy() if accesses else np.zeros(0, np.int64)
    _, ids = np.unique(flat, return_inverse=True)
    ids = ids.astype(np.int64).reshape(-1)
    hit = np.zeros(ids.size, dtype=np.bool_)
    _kernel()(ids, _next_use(ids), max_capacity, hit)
    scored = hit[sum(sizes[:warmup]):]
    return {"hit_rate": float(scored.mean()) if scored.size else 0.0, "hits": int(scored.sum()),
            "accesses": int(scored.size)}


def _next_use(ids: np.ndarray) -> np.ndarray:
    """Position of the next access to the same id, or ``len(ids)`` for none (vectorized: one stable sort)."""
    n = ids.size
    order = np.argsort(ids, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    same = ids[order[1:]] == ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def _belady_python(ids, next_use, capacity, hit) -> None:
    """Belady's MIN with a lazy max-heap of (next use, id): a popped entry is stale if its id's next use moved."""
    n = ids.size
    stored_next = np.full(int(ids.max()) + 1 if n else 0, -1, dtype=np.int64)  # -1: not stored
    heap = [(np.int64(0), np.int64(0))]  # typed for numba, then emptied
    heapq.heappop(heap)
    size = 0
    for i in range(n):
        key, nxt = ids[i], next_use[i]
        if stored_next[key] >= 0:
            hit[i] = True
        elif size < capacity:
            size += 1
        else:
            while -heap[0][0] != stored_next[heap[0][1]]:  # drop stale entries
                heapq.heappop(heap)
            if -heap[0][0] <= nxt:  # the new key is needed last: do not store it
                continue
            stored_next[heapq.heappop(heap)[1]] = -1
        stored_next[key] = nxt
        heapq.heappush(heap, (-nxt, key))


def _kernel():
    """:func:`_belady_python` compiled by numba when available (same code, same results)."""
    global _COMPILED
    if _COMPILED is None:
        try:
            import numba
        except ImportError:
            _COMPILED = _belady_python
        else:
            _COMPILED = numba.njit(cache=False)(_belady_python)
    return _COMPILED


_COMPILED = None


def compare(accesses: list[tuple[torch.Tensor, torch.Tensor]], fractions=(0.1, 0.3),
            candidates: dict[str, dict] | None = None, warmup: int = 0) -> list[dict]:
    """Belady and each candidate policy at capacities of ``fractions`` of the trace's distinct keys.

    Returns one row per (fraction, policy): ``fraction``, ``capacity``, ``policy``, ``hit_rate``,
    ``gap_to_belady`` (points of hit rate, >= 0) and ``evicted_per_row`` (absent for Belady).
    """
    _check_accesses(accesses)
    if any(isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1 for f in fractions):
        raise ValueError(f"fractions must be numbers in (0, 1] (shares of the trace's distinct keys), "
                         f"got {fractions!r}")
    candidates = policies(max(1, len(accesses) // 8)) if candidates is None else candidates
    distinct = torch.unique(torch.cat([keys for keys, _ in accesses])).numel()
    rows = []
    for fraction in fractions:
        capacity = max(1, round(fraction * distinct))
        ceiling = belady(accesses, capacity, warmup=warmup)["hit_rate"]
        rows.append({"fraction": fraction, "capacity": capacity, "policy": "belady", "hit_rate": ceiling,
                     "gap_to_belady": 0.0})
        for label, kw in candidates.items():
            got = replay(accesses, capacity, warmup=warmup, **kw)
            rows.append({"fraction": fraction, "capacity": capacity, "policy": label, "hit_rate": got["hit_rate"],
                         "gap_to_belady": 100 * (ceiling - got["hit_rate"]),
                         "evicted_per_row": got["evicted_per_row"]})
    return rows


def summarize(rows: list[dict], default: str) -> list[dict]:
    """Per group of :func:`compare` rows (same ``fraction`` and ``trace`` if any): the best online policy, and
    how many points of hit rate ``default`` is below it and below Belady."""
    out = []
    for key in dict.fromkeys((r.get("trace"), r["fraction"]) for r in rows):
        group = [r for r in rows if (r.get("trace"), r["fraction"]) == key]
        best = max((r for r in group if r["policy"] != "belady"), key=lambda r: r["hit_rate"])
        mine = next(r for r in group if r["policy"] == default)
        out.append({**({"trace": key[0]} if key[0] is not None else {}), "fraction": key[1],
                    "best_online": best["policy"], "best_hit_rate": round(best["hit_rate"], 4), "default": default,
                    "default_hit_rate": round(mine["hit_rate"], 4),
                    "default_below_best_points": round(100 * (best["hit_rate"] - mine["hit_rate"]), 2),
                    "default_below_belady_points": round(mine["gap_to_belady"], 2)})
    return out
