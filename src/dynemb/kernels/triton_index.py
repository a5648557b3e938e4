"""Triton kernels for the hash index (the ``index`` family of :mod:`dynemb.kernels.dispatch`), plus the index
operations a GPU step runs in one launch: ``find_or_insert``, ``erase`` and ``find_gather``.

The layout is :class:`~dynemb.table.HashIndex`'s: ``B`` buckets of ``W`` slots (8 for int32 keys, 5 for int64), one
row of 16 int32 words (64 bytes) per bucket holding the ``W`` keys (int64 ones as word pairs) then the ``W`` int32
row ids; row ``-1`` marks a free slot, so every key value is valid; a full bucket gets a sticky overflow flag and
keys spill to the next bucket; a lookup stops at the first bucket that holds the key or has no flag. Slot ``s`` is
position ``s & 7`` of bucket ``s >> 3``. One program handles :data:`KEY_BLOCK` keys as a ``[K, 8]`` tile per probed
bucket (lanes from ``W`` on masked): one 64-byte access per key and bucket, no host round trip between probe
rounds.

Placement (``place``, ``find_or_insert``) claims slots with atomic compare-and-swap on the slot's row word, so
programs running at once never take the same slot, and duplicates of one key within a batch resolve to one row.
``place`` first aims each key at the ``rank``-th free slot of its bucket (its rank among the block's keys of that
bucket, as the torch path does), which gives the torch path's exact layout whenever no two programs contend for a
bucket (always under the interpreter, which runs programs one after another); on a GPU, keys of one bucket split
across two programs, or spilling into a bucket another program fills, may take its slots in another order. Which
keys are found, every bucket's key count and the overflow flags are the same either way (linear probing fills the
same buckets whatever the order), and these are the index's semantics.

Host syncs: ``place`` returns a Python bool (the contract), one read of a failure flag; ``find_or_insert`` returns
its new-row count as a tensor and never syncs. ``probe``, ``erase`` and ``find_gather`` do not sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import KEY_BLOCK, block_d, check_device, init_args, init_values_tl, mix64_tl, round_to, seed_mix

__all__ = ["probe", "place", "find_or_insert", "erase", "find_gather"]

_FILL = tl.constexpr(0x5851F42D)  # HashIndex's key of a free slot (any value would do: the row word decides)


def _layout(table: torch.Tensor, key_cols: int) -> dict:
    words = table.view(torch.int32)
    # W: slots a bucket, as many keys as its key words hold (HashIndex.width; numba_index._width alike)
    return dict(C=words.shape[1], KEY_COLS=key_cols, KEY64=table.dtype == torch.int64,
                W=key_cols * 4 // table.element_size())


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, KEY_BLOCK),)


def probe(table: torch.Tensor, key_cols: int, overflow: torch.Tensor, keys: torch.Tensor, shift: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slots int64, rows int32)`` of ``[N]`` keys, -1 where absent: the contract of ``HashIndex._probe``.

    ``table``: the index's buckets viewed in the key dtype, ``[B, 8]`` (int64) or ``[B, 16]`` (int32);
    ``key_cols``: int32 words of keys per bucket. ``keys`` must have the index's key dtype.
    """
    return _probe(table, key_cols, overflow, keys, shift, erase=False)


def place(table: torch.Tensor, key_cols: int, overflow: torch.Tensor, bucket: torch.Tensor, keys: torch.Tensor,
          rows: torch.Tensor) -> bool:
    """``HashIndex._place``: write unique absent ``keys -> rows`` (``bucket``: their home buckets, sorted, as
    ``HashIndex.insert`` passes them); False if the index is full (one host read of a flag)."""
    keys, bucket, rows = keys.contiguous(), bucket.contiguous(), rows.contiguous()
    check_device(table, overflow, bucket, keys, rows)
    n = keys.numel()
    failed = torch.zeros(1, dtype=torch.int32, device=keys.device)
    if n:
        _place_kernel[_grid(n)](table.view(torch.int32), overflow.view(torch.uint8), bucket, keys, rows, failed, n,
                                table.shape[0], BLOCK=KEY_BLOCK, **_layout(table, key_cols))
    return not bool(failed.item())


def find_or_insert(table: torch.Tensor, key_cols: int, overflow: torch.Tensor, keys: torch.Tensor, shift: int,
                   next_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Find ``[N]`` keys (duplicates allowed) and insert the absent ones, in one launch and no host sync.

    A new key takes row id ``next_row[0]`` (an int32 counter on the device, advanced atomically): all duplicates of
    it in the batch get that one row. Returns ``(slots int64 [N], rows int32 [N], inserted bool [N])``,
    ``inserted`` true at the one position per new key that created it; a key that found no room (the index is
    full: the caller keeps the load under ``HashIndex.MAX_LOAD``) gets slot and row -1. New rows are
    ``[old next_row, next_row)``, in no particular key order.

    Example (interpreter or GPU)::

        counter = torch.zeros(1, dtype=torch.int32)
        slots, rows, new = find_or_insert(idx._buckets.view(torch.int64), idx._key_cols, idx.overflow,
                                          torch.tensor([5, 5, 9]), idx._shift, counter)
        # rows == [0, 0, 1] (or [1, 1, 0] on a GPU), new.sum() == 2, counter == [2]
    """
    keys = keys.contiguous()
    check_device(table, overflow, keys, next_row)
    n = keys.numel()
    slots = torch.empty(n, dtype=torch.int64, device=keys.device)
    rows = torch.empty(n, dtype=torch.int32, device=keys.device)
    inserted = torch.zeros(n, dtype=torch.int8, device=keys.device)
    if n:
        nb = table.shape[0]
        _find_or_insert_kernel[_grid(n)](table.view(torch.int32), overflow.view(torch.uint8), keys, slots, rows,
                                         inserted, next_row, n, shift, nb // 2, nb, BLOCK=KEY_BLOCK,
                                         **_layout(table, key_cols))
    return slots, rows, inserted.view(torch.bool)


def erase(table: torch.Tensor, key_cols: int, overflow: torch.Tensor, keys: torch.Tensor, shift: int,
          with_rows: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Free the slots of ``[N]`` keys (absent keys are ignored; flags stay, as in ``HashIndex.remove``). Returns
    the freed slots (int64, -1 where absent), taken before the erase, and with ``with_rows`` their row ids too
    (``(slots, rows int32)``, what the table compacts). Repeated keys in one program all report their slot; give
    unique keys on a GPU, where another program may see the slot already freed."""
    slots, rows = _probe(table, key_cols, overflow, keys, shift, erase=True)
    return (slots, rows) if with_rows else slots


def _probe(table, key_cols: int, overflow, keys, shift: int, erase: bool) -> tuple[torch.Tensor, torch.Tensor]:
    keys = keys.contiguous()
    check_device(table, overflow, keys)
    n = keys.numel()
    slots = torch.empty(n, dtype=torch.int64, device=keys.device)
    rows = torch.empty(n, dtype=torch.int32, device=keys.device)
    if n:
        nb = table.shape[0]
        _probe_kernel[_grid(n)](table.view(torch.int32), overflow.view(torch.uint8), keys, slots, rows, n, shift,
                                nb // 2, nb, BLOCK=KEY_BLOCK, ERASE=erase, **_layout(table, key_cols))
    return slots, rows


def find_gather(table: torch.Tensor, key_cols: int, overflow: torch.Tensor, keys: torch.Tensor, shift: int,
                values: torch.Tensor, init: tuple[str, tuple] | None = None, seed: int = 0,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Find ``[N]`` keys and read their rows of ``values [R, D]`` in one launch: ``(rows int32 [N], out [N, D])``.

    An absent key gets row -1 and, in ``out``, its initializer row (``init``: an ``Initializer.kernel_spec()``,
    ``("uniform", (low, high))`` or ``("constant", (value,))``, with the table's ``seed``: the row a training
    lookup would create) or zeros when ``init`` is None. ``out``: an optional contiguous ``[N, D]`` tensor of
    ``values``' dtype to write into.
    """
    keys = keys.contiguous()
    n, dim = keys.numel(), values.shape[1]
    if out is None:
        out = torch.empty(n, dim, dtype=values.dtype, device=keys.device)
    elif out.shape != (n, dim) or out.dtype != values.dtype:
        raise ValueError(f"out must be [{n}, {dim}] {values.dtype}, got {tuple(out.shape)} {out.dtype}")
    check_device(table, overflow, keys, values, out)
    rows = torch.empty(n, dtype=torch.int32, device=keys.device)
    kind, p0, p1 = init_args(init, values.dtype, "init")
    if n:
        nb = table.shape[0]
        _find_gather_kernel[(triton.cdiv(n, 32),)](
            table.view(torch.int32), overflow.view(torch.uint8), keys, rows, values, out, n, dim, shift, nb // 2,
            nb, seed_mix(seed), p0, p1, INIT=kind, BLOCK=32, BLOCK_D=block_d(dim),
            enable_fp_fusion=False, **_layout(table, key_cols))
    return rows, out


# --------------------------------------------------------------------------------------------------- device code
@triton.jit
def _ptrs(words, bucket, slot, C: tl.constexpr, KEY_COLS: tl.constexpr, KEY64: tl.constexpr):
    """Pointers to the key and the row word of ``slot`` (any shape broadcasting with ``bucket``) of ``bucket``."""
    if KEY64:
        kp = words.to(tl.pointer_type(tl.int64)) + bucket * (C // 2) + slot
    else:
        kp = words + bucket * C + slot
    return kp, words + bucket * C + KEY_COLS + slot


@triton.jit
def _match(words, bucket, key, live, C: tl.constexpr, KEY_COLS: tl.constexpr, KEY64: tl.constexpr,
           W: tl.constexpr):
    """``(slot, row)`` of each live key in its ``bucket``, -1 where it is not there."""
    j = tl.arange(0, 8)
    kp, rp = _ptrs(words, bucket[:, None], j[None, :], C, KEY_COLS, KEY64)
    m = live[:, None] & (j[None, :] < W)
    k = tl.load(kp, mask=m, other=0)
    r = tl.load(rp, mask=m, other=-1)
    eq = (k == key[:, None]) & (r >= 0)
    pos = tl.min(tl.where(eq, j[None, :], 8), axis=1)
    row = tl.max(tl.where(eq, r, -1), axis=1)
    return tl.where(pos < 8, bucket * 8 + pos, -1), row


@triton.jit
def _find(words, overflow, key, live, shift, half, nb, C: tl.constexpr, KEY_COLS: tl.constexpr,
          KEY64: tl.constexpr, W: tl.constexpr):
    """Probe: home bucket, then the next ones while the last probed has its overflow flag (at most ``nb - 1``)."""
    bucket = tl.where(live, (mix64_tl(key.to(tl.int64)) >> shift) + half, 0)
    slot, row = _match(words, bucket, key, live, C, KEY_COLS, KEY64, W)
    pending = live & (slot < 0) & (tl.load(overflow + bucket, mask=live, other=0) != 0)
    steps = tl.zeros_like(bucket) + 1  # a tensor: a Python int would change type inside the loop
    while tl.max(pending.to(tl.int32), axis=0) > 0:
        bucket = tl.where(pending, (bucket + 1) & (nb - 1), bucket)
        s2, r2 = _match(words, bucket, key, pending, C, KEY_COLS, KEY64, W)
        slot = tl.where(pending, s2, slot)
        row = tl.where(pending, r2, row)
        pending = pending & (s2 < 0) & (tl.load(overflow + bucket, mask=pending, other=0) != 0) & (steps < nb - 1)
        steps += 1
    return slot, row


@triton.jit
def _probe_kernel(words, overflow, keys, slots_out, rows_out, n, shift, half, nb, C: tl.constexpr,
                  KEY_COLS: tl.constexpr, KEY64: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
                  ERASE: tl.constexpr = False):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(keys + offs, mask=live, other=0)
    slot, row = _find(words, overflow, key, live, shift, half, nb, C, KEY_COLS, KEY64, W)
    tl.store(slots_out + offs, slot, mask=live)
    tl.store(rows_out + offs, row, mask=live)
    if ERASE:
        hit = live & (slot >= 0)
        kp, rp = _ptrs(words, slot >> 3, slot & 7, C, KEY_COLS, KEY64)
        tl.store(kp, key * 0 + _FILL, mask=hit)
        tl.store(rp, row * 0 - 1, mask=hit)


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _place_kernel(words, overflow, bucket_in, keys, rows, failed, n, nb, C: tl.constexpr, KEY_COLS: tl.constexpr,
                  KEY64: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + i
    active = offs < n
    key = tl.load(keys + offs, mask=active, other=0)
    row = tl.load(rows + offs, mask=active, other=0).to(tl.int32)
    bucket = tl.load(bucket_in + offs, mask=active, other=0)
    # rank among this block's keys of the same bucket (they are contiguous): aim at the rank-th free slot
    prev = tl.load(bucket_in + offs - 1, mask=active & (i > 0), other=-1)
    start = (i == 0) | (bucket != prev)
    rank = (i - tl.associative_scan(tl.where(start, i, 0), 0, _max2)).to(tl.int32)
    j = tl.arange(0, 8)
    steps = tl.zeros([BLOCK], tl.int32)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        _, rp = _ptrs(words, bucket[:, None], j[None, :], C, KEY_COLS, KEY64)
        free = tl.load(rp, mask=active[:, None] & (j[None, :] < W), other=0, volatile=True) < 0
        nth = tl.cumsum(free.to(tl.int32), axis=1) == rank[:, None] + 1
        target = tl.min(tl.where(free & nth, j[None, :], 8), axis=1)
        spill = active & (target == 8)  # no free slot left for this key: flag the bucket, go to the next one
        tl.store(overflow + bucket, tl.full([BLOCK], 1, tl.uint8), mask=spill)
        go = active & (target < 8)
        kp, rp1 = _ptrs(words, bucket, tl.where(go, target, 0), C, KEY_COLS, KEY64)
        old = tl.atomic_cas(rp1, tl.where(go, -1, -3), row)  # -3 never matches: a no-op for idle lanes
        won = go & (old == -1)
        tl.store(kp, key, mask=won)
        active = active & ~won
        rank = tl.zeros([BLOCK], tl.int32)  # later rounds (lost race or spilled) take the first free slot
        bucket = tl.where(spill, (bucket + 1) & (nb - 1), bucket)
        steps += spill.to(tl.int32)
        stuck = active & (steps >= nb)
        tl.store(failed + i * 0, tl.full([BLOCK], 1, tl.int32), mask=stuck)
        active = active & ~stuck


@triton.jit
def _find_or_insert_kernel(words, overflow, keys, slots_out, rows_out, inserted, next_row, n, shift, half, nb,
                           C: tl.constexpr, KEY_COLS: tl.constexpr, KEY64: tl.constexpr, W: tl.constexpr,
                           BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + i
    live = offs < n
    key = tl.load(keys + offs, mask=live, other=0)
    # Phase 1: keys already present (possibly past a slot freed by an erase) are found along the flag chain.
    slot, row = _find(words, overflow, key, live, shift, half, nb, C, KEY_COLS, KEY64, W)
    # A slot being filled by another program shows the free-slot key until its key store is visible, so a hit for
    # that key value is confirmed after an acquiring read of the row word, and probed again if it was not real.
    unsure = live & (row >= 0) & (key == _FILL)
    while tl.max(unsure.to(tl.int32), axis=0) > 0:
        kp, rp = _ptrs(words, slot >> 3, slot & 7, C, KEY_COLS, KEY64)
        seen = tl.atomic_add(rp, tl.zeros_like(row), mask=unsure, sem="acquire")
        real = (seen == row) & (tl.load(kp, mask=unsure, other=0, volatile=True) == key)
        unsure = unsure & ~real
        s2, r2 = _find(words, overflow, key, unsure, shift, half, nb, C, KEY_COLS, KEY64, W)
        slot = tl.where(unsure, s2, slot)
        row = tl.where(unsure, r2, row)
        unsure = unsure & (r2 >= 0)
    # Phase 2: the rest walk from home and claim the first slot not held by another key: row word -1 -> -2 by
    # CAS, write the key, publish the row id. Slot states only move free -> claimed -> published here, so all
    # copies of one key stop at the same slot: one claims it, the others wait for the row and see their key.
    active = live & (row < 0)
    bucket = tl.where(active, (mix64_tl(key.to(tl.int64)) >> shift) + half, 0)
    lowest = tl.zeros([BLOCK], tl.int32)  # slots below this in the bucket hold other keys
    steps = tl.zeros([BLOCK], tl.int32)
    j = tl.arange(0, 8)
    new = tl.zeros([BLOCK], tl.int8)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        kps, rps = _ptrs(words, bucket[:, None], j[None, :], C, KEY_COLS, KEY64)
        m = active[:, None] & (j[None, :] < W)
        r = tl.load(rps, mask=m, other=0, volatile=True)
        k = tl.load(kps, mask=m, other=0, volatile=True)
        other = (r >= 0) & (k != key[:, None])  # a published slot of another key stays so: skip it
        target = tl.min(tl.where(~other & (j[None, :] >= lowest[:, None]) & (j[None, :] < W), j[None, :], 8), axis=1)
        full = active & (target == 8)
        tl.store(overflow + bucket, tl.full([BLOCK], 1, tl.uint8), mask=full)
        go = active & (target < 8)
        kp, rp = _ptrs(words, bucket, tl.where(go, target, 0), C, KEY_COLS, KEY64)
        old = tl.atomic_cas(rp, tl.where(go, -1, -3), tl.full([BLOCK], -2, tl.int32), sem="acq_rel")
        won = go & (old == -1)
        fresh = tl.atomic_add(next_row + i * 0, tl.full([BLOCK], 1, tl.int32), mask=won)
        tl.store(kp, key, mask=won)
        tl.atomic_xchg(rp, fresh, mask=won, sem="release")
        held = go & (old >= 0)
        hit = held & (tl.load(kp, mask=held, other=0, volatile=True) == key)
        done = won | hit
        row = tl.where(won, fresh, tl.where(hit, old, row))
        slot = tl.where(done, bucket * 8 + target, slot)
        new = tl.where(won, 1, new).to(tl.int8)
        lowest = tl.where(held & ~hit, target + 1, lowest)  # old == -2 (claimed, unpublished): look again
        bucket = tl.where(full, (bucket + 1) & (nb - 1), bucket)
        lowest = tl.where(full, 0, lowest)
        steps += full.to(tl.int32)
        active = active & ~done & (steps < nb)
    tl.store(slots_out + offs, slot, mask=live)
    tl.store(rows_out + offs, row, mask=live)
    tl.store(inserted + offs, new, mask=live)


@triton.jit
def _find_gather_kernel(words, overflow, keys, rows_out, values, out, n, dim, shift, half, nb, seed_mixed, p0, p1,
                        C: tl.constexpr, KEY_COLS: tl.constexpr, KEY64: tl.constexpr, W: tl.constexpr,
                        INIT: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(keys + offs, mask=live, other=0)
    _, row = _find(words, overflow, key, live, shift, half, nb, C, KEY_COLS, KEY64, W)
    tl.store(rows_out + offs, row, mask=live)
    hit = row >= 0
    for d0 in range(0, dim, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cm = cols[None, :] < dim
        v = tl.load(values + row.to(tl.int64)[:, None] * dim + cols[None, :], mask=(live & hit)[:, None] & cm,
                    other=0.0)
        if INIT != 0:
            miss = init_values_tl(key, cols.to(tl.int64), seed_mixed, p0, p1, INIT)
            v = tl.where(hit[:, None], v, round_to(miss, v.dtype))
        tl.store(out + offs[:, None] * dim + cols[None, :], v, mask=live[:, None] & cm)
