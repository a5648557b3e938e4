"""Triton kernels over a group of tables: the ``group`` family of :mod:`dynemb.kernels.dispatch` (the contracts,
and the per-table rows of ``meta``, are written there).

Each launch serves every table of the group: a work item (a key, a bag, a row) carries its table, whose index,
rows, slots, seed and hyper-parameters the program reads from the table's row of ``meta`` (addresses and sizes, as
fbgemm's batched kernels take per-table offsets into their one weights buffer); the tables keep their own storage.
No launch reads anything back to the host, and every buffer is sized by the batch (``N`` ids, ``B`` bags), not by
what the batch turns out to hold, so that a step can be captured in a CUDA graph.

``find_or_insert`` is two launches around a few torch ops. The first finds each key or claims a slot for it with
compare-and-swap (on a GPU the winner among duplicates, and the order of claims, is a race), publishing a
placeholder row ``-(3 + p)`` that names the claiming position ``p``; torch then numbers each table's new keys in
the order of their hashes, as the table's torch path numbers them (``unique_by_hash``), whatever the race; the
second launch publishes the rows and writes the new rows' key, initial values, slot values and every found row's
stamps. Results are those of each table's own ``find_or_insert`` (rows, initial rows, stamps); only the slots the
index uses may differ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import GROUP_META, GROUP_FMETA
from .triton_common import check_device, mix64_tl, unit_uniform_tl
from .triton_index import _find, _ptrs
from .triton_optim import _pow

__all__ = ["find_or_insert", "pool", "sparse_update", "KINDS", "max_ids_per_table"]

KINDS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "ftrl")
#: A table passes any number of ids to a grouped call (None): on a GPU every call saved is launches and host time.
_MAX_IDS_PER_TABLE = None


def max_ids_per_table() -> int | None:
    """The most ids a table passes to one grouped call (None: any); above it the table runs its own lookup."""
    return _MAX_IDS_PER_TABLE
_M = len(GROUP_META)
_F = len(GROUP_FMETA)
_IDLE = -(2**31)  # a compare value no row word holds: placeholders stop at -(2**31 - 2) (N < 2**31 - 4)
(_BUCKETS, _OVERFLOW, _SHIFT, _NB, _VALUES, _DIM, _KEYS, _STAMPS, _SLOT0, _W0, _SLOT1, _W1, _SEED, _INIT,
 _CAPACITY) = range(_M)


def _blocks(device: torch.device) -> tuple[int, int]:
    """Work items a program: the interpreter runs programs one by one in Python, so it takes large blocks; a GPU
    wants many small programs."""
    return (256, 256) if device.type == "cpu" else (128, 32)


def _key_layout(key_dtype: torch.dtype) -> dict:
    key64 = key_dtype == torch.int64
    width = 5 if key64 else 8  # HashIndex.width_for
    return dict(C=16, KEY_COLS=width * (2 if key64 else 1), KEY64=key64, W=width)


def find_or_insert(group, keys: torch.Tensor, seg: torch.Tensor, seg_first: torch.Tensor, sizes: torch.Tensor,
                   stamps: torch.Tensor) -> torch.Tensor:
    """``rows [N]`` int64 of ``keys [N]`` (key ``i`` of table ``seg[i]``), the absent ones inserted: see the
    contract (``group.meta`` and ``group.fmeta`` say where each table's storage is). Advances ``sizes [G]`` by each
    table's new keys."""
    meta, fmeta = group.meta, group.fmeta
    check_device(meta, fmeta, keys, seg, seg_first, sizes, stamps)
    n, device = keys.numel(), keys.device
    rows = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return rows
    block, _ = _blocks(device)
    layout = _key_layout(keys.dtype)
    claimed = torch.empty(n, dtype=torch.int32, device=device)
    slots = torch.empty(n, dtype=torch.int64, device=device)
    hashes = torch.empty(n, dtype=torch.int64, device=device)
    _claim_kernel[(triton.cdiv(n, block),)](meta, keys, seg, claimed, slots, hashes, n, M=_M, BLOCK=block, **layout)
    # Each table's new keys in hash order, numbered from its size: the torch path's rows whatever the claims' race.
    positions, marks = _positions(n, device)
    new = claimed == marks
    by_hash = torch.sort(hashes, stable=True).indices
    # then by table, its new keys first: a stable sort keeps them in hash order
    tag = (seg * 2 + ~new).index_select(0, by_hash)
    order = by_hash.index_select(0, torch.sort(tag, stable=True).indices)
    rank = torch.empty_like(order).index_copy_(0, order, positions - seg_first.index_select(0, order))
    numbered = rank + sizes.index_select(0, seg)
    _publish_kernel[(triton.cdiv(n, block),)](meta, fmeta, keys, seg, claimed, slots, numbered, stamps, rows, n,
                                              M=_M, F=_F, BLOCK=block, BLOCK_D=16, enable_fp_fusion=False, **layout)
    sizes.index_add_(0, seg, new.to(torch.int64))
    return rows


def pool(group, rows: torch.Tensor, offsets: torch.Tensor, bag_seg: torch.Tensor,
         weights: torch.Tensor | None, denom: torch.Tensor | None, out: torch.Tensor, out_at: torch.Tensor,
         max_dim: int) -> torch.Tensor:
    """Bag ``b`` of table ``bag_seg[b]`` summed from its ids' ``rows`` into ``out`` (flat) at ``out_at[b]``: see
    the contract. Returns ``out``."""
    meta = group.meta
    check_device(meta, rows, offsets, bag_seg, weights, denom, out, out_at)
    nbags = offsets.numel()
    if nbags == 0:
        return out
    _, block = _blocks(rows.device)
    bd = triton.next_power_of_2(max(1, min(max_dim, 64)))
    _pool_kernel[(triton.cdiv(nbags, block), triton.cdiv(max_dim, bd))](
        meta, rows, offsets, bag_seg, offsets if weights is None else weights, offsets if denom is None else denom,
        out, out_at, rows.numel(), nbags, M=_M, HAS_W=weights is not None, HAS_DENOM=denom is not None,
        BLOCK=block, BLOCK_D=bd)
    return out


def sparse_update(kind: str, group, hparams: torch.Tensor, versions: torch.Tensor, keyed: torch.Tensor,
                  grad: torch.Tensor, grad_at: torch.Tensor, table_bags: torch.Tensor, bag: torch.Tensor | None,
                  weights: torch.Tensor | None, max_dim: int) -> None:
    """Each distinct ``(table, row)`` of ``keyed [N]`` (``table << 32 | row``) updated once with its summed
    gradient, by the table's hyper-parameters: see the contract. One stable sort groups the ids (each row sums them
    in input order); the launch's leaders are the first id of each group."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    meta = group.meta
    check_device(meta, hparams, versions, keyed, grad, grad_at, bag, weights)
    n = keyed.numel()
    if n == 0:
        return
    keyed, order = torch.sort(keyed, stable=True)
    _, block = _blocks(keyed.device)
    _update_kernel[(triton.cdiv(n, block),)](
        meta, hparams, versions, keyed, order, grad, grad_at, order if bag is None else bag,
        grad if weights is None else weights, n, M=_M, KIND=KINDS.index(kind), HAS_BAG=bag is not None,
        HAS_W=weights is not None, BLOCK=block, BLOCK_D=triton.next_power_of_2(max(1, max_dim)))


_POSITIONS: dict = {}


def _positions(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(arange(n), the claim placeholders -3 - arange(n) as int32)`` on ``device``, made once a size (a step's
    sizes repeat)."""
    key = (n, device)
    got = _POSITIONS.get(key)
    if got is None:
        if len(_POSITIONS) > 64:
            _POSITIONS.clear()
        positions = torch.arange(n, device=device)
        got = _POSITIONS[key] = (positions, (-3 - positions).to(torch.int32))
    return got


# --------------------------------------------------------------------------------------------------- device code
@triton.jit
def _field(meta, t, k, M: tl.constexpr):
    return tl.load(meta + t * M + k)


@triton.jit
def _claim_kernel(meta, keys, seg, claimed, slots_out, hashes_out, n, M: tl.constexpr, C: tl.constexpr,
                  KEY_COLS: tl.constexpr, KEY64: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(keys + offs, mask=live, other=0)
    t = tl.load(seg + offs, mask=live, other=0).to(tl.int64)
    words = _field(meta, t, 0, M).to(tl.pointer_type(tl.int32))  # each lane its own table's index
    overflow = _field(meta, t, 1, M).to(tl.pointer_type(tl.uint8))
    shift = _field(meta, t, 2, M)
    nb = tl.where(live, _field(meta, t, 3, M), 2)
    half = nb // 2
    hashed = mix64_tl(key.to(tl.int64))
    tl.store(hashes_out + offs, hashed, mask=live)
    # Keys stored before this launch: found along the flag chain (a placeholder is not a row: probed below).
    slot, row = _find(words[:, None], overflow, key, live, shift, half, nb, C, KEY_COLS, KEY64, W)
    # The rest walk from home to the first slot not held by another key and claim it (-1 -> -2 by CAS), write the
    # key and publish a placeholder naming this position; a copy of the key meets the slot claimed (waits) or
    # published (takes the placeholder).
    active = live & (row < 0)
    bucket = tl.where(active, (hashed >> shift) + half, 0)
    lowest = tl.zeros([BLOCK], tl.int32)
    steps = tl.zeros([BLOCK], tl.int64)
    j = tl.arange(0, 8)
    mine = (-3 - offs).to(tl.int32)
    while tl.max(active.to(tl.int32), axis=0) > 0:
        kps, rps = _ptrs(words[:, None], bucket[:, None], j[None, :], C, KEY_COLS, KEY64)
        m = active[:, None] & (j[None, :] < W)
        r = tl.load(rps, mask=m, other=0, volatile=True)
        k = tl.load(kps, mask=m, other=0, volatile=True)
        other = ((r >= 0) | (r <= -3)) & (k != key[:, None])
        target = tl.min(tl.where(~other & (j[None, :] >= lowest[:, None]) & (j[None, :] < W), j[None, :], 8), axis=1)
        full = active & (target == 8)
        tl.store(overflow + bucket, tl.full([BLOCK], 1, tl.uint8), mask=full)
        go = active & (target < 8)
        kp, rp = _ptrs(words, bucket, tl.where(go, target, 0), C, KEY_COLS, KEY64)
        old = tl.atomic_cas(rp, tl.where(go, -1, _IDLE), tl.full([BLOCK], -2, tl.int32), sem="acq_rel")
        won = go & (old == -1)
        tl.store(kp, key, mask=won)
        tl.atomic_xchg(rp, mine, mask=won, sem="release")
        held = go & ((old >= 0) | (old <= -3))
        hit = held & (tl.load(kp, mask=held, other=0, volatile=True) == key)
        done = won | hit
        row = tl.where(won, mine, tl.where(hit, old, row))
        slot = tl.where(done, bucket * 8 + target, slot)
        lowest = tl.where(held & ~hit, target + 1, lowest)  # old == -2 (claimed, unpublished): look again
        bucket = tl.where(full, (bucket + 1) & (nb - 1), bucket)
        lowest = tl.where(full, 0, lowest)
        steps += full.to(tl.int64)
        active = active & ~done & (steps < nb)
    tl.store(claimed + offs, row, mask=live)
    tl.store(slots_out + offs, slot, mask=live)


@triton.jit
def _publish_kernel(meta, fmeta, keys, seg, claimed, slots, numbered, stamps, rows_out, n, M: tl.constexpr,
                    F: tl.constexpr, C: tl.constexpr, KEY_COLS: tl.constexpr, KEY64: tl.constexpr, W: tl.constexpr,
                    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    key = tl.load(keys + offs, mask=live, other=0)
    t = tl.load(seg + offs, mask=live, other=0).to(tl.int64)
    r = tl.load(claimed + offs, mask=live, other=0)
    new = live & (r == (-3 - offs).to(tl.int32))
    claimer = tl.where(r >= 0, offs, (-3 - r).to(tl.int64))
    row = tl.where(r >= 0, r.to(tl.int64), tl.load(numbered + claimer, mask=live & (r < 0), other=0))
    tl.store(rows_out + offs, row, mask=live)
    # the index: the placeholder becomes the row
    words = _field(meta, t, 0, M).to(tl.pointer_type(tl.int32))
    slot = tl.load(slots + offs, mask=new, other=0)
    _, rp = _ptrs(words, slot >> 3, slot & 7, C, KEY_COLS, KEY64)
    tl.store(rp, row.to(tl.int32), mask=new)
    # the new row's key, values, slots
    if KEY64:
        key_col = _field(meta, t, 6, M).to(tl.pointer_type(tl.int64))
    else:
        key_col = _field(meta, t, 6, M).to(tl.pointer_type(tl.int32))
    tl.store(key_col + row, key, mask=new)
    dim = tl.where(live, _field(meta, t, 5, M), 0)
    values = _field(meta, t, 4, M).to(tl.pointer_type(tl.float32))
    seed = _field(meta, t, 12, M)
    uniform = _field(meta, t, 13, M) == 1
    low = tl.load(fmeta + t * F + 0, mask=live, other=0.0)
    width = tl.load(fmeta + t * F + 1, mask=live, other=0.0)
    most = tl.max(tl.where(new, dim, 0), axis=0)
    for c0 in range(0, most, BLOCK_D):
        cols = c0 + tl.arange(0, BLOCK_D)
        cm = new[:, None] & (cols[None, :] < dim[:, None])
        u = unit_uniform_tl(key, cols.to(tl.int64), seed)
        v = tl.where(uniform[:, None], low[:, None] + u * width[:, None], low[:, None] + u * 0.0)
        tl.store(values[:, None] + row[:, None] * dim[:, None] + cols[None, :], v, mask=cm)
    for s in tl.static_range(2):
        base = _field(meta, t, 8 + 2 * s, M).to(tl.pointer_type(tl.float32))
        w = tl.where(new, _field(meta, t, 9 + 2 * s, M), 0)
        init = tl.load(fmeta + t * F + 2 + s, mask=live, other=0.0)
        most_w = tl.max(w, axis=0)
        for c0 in range(0, most_w, BLOCK_D):
            cols = c0 + tl.arange(0, BLOCK_D)
            cm = (cols[None, :] < w[:, None])
            tl.store(base[:, None] + row[:, None] * w[:, None] + cols[None, :], init[:, None] + cols[None, :] * 0.0,
                     mask=cm)
    # every row read: the access's score and version stamps (interleaved: score, then version)
    pair = _field(meta, t, 7, M).to(tl.pointer_type(tl.int64))
    tl.store(pair + row * 2, tl.load(stamps + t * 2, mask=live, other=0), mask=live)
    tl.store(pair + row * 2 + 1, tl.load(stamps + t * 2 + 1, mask=live, other=0), mask=live)


@triton.jit
def _pool_kernel(meta, rows, offsets, bag_seg, weights, denom, out, out_at, n, nbags, M: tl.constexpr,
                 HAS_W: tl.constexpr, HAS_DENOM: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = b < nbags
    t = tl.load(bag_seg + b, mask=live, other=0).to(tl.int64)
    start = tl.load(offsets + b, mask=live, other=0)
    end = tl.load(offsets + b + 1, mask=live & (b + 1 < nbags), other=n)
    end = tl.where(live, end, start)
    dim = tl.where(live, _field(meta, t, 5, M), 0)
    values = _field(meta, t, 4, M).to(tl.pointer_type(tl.float32))
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = live[:, None] & (cols[None, :] < dim[:, None])
    acc = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    longest = tl.max(end - start, axis=0)
    for k in range(0, longest):  # ids in order within a bag, as the torch reference sums them
        j = start + k
        m = j < end
        row = tl.load(rows + j, mask=m, other=0)
        v = tl.load(values[:, None] + row[:, None] * dim[:, None] + cols[None, :], mask=m[:, None] & cm, other=0.0)
        if HAS_W:
            v = v * tl.load(weights + j, mask=m, other=0.0)[:, None]
        acc += v
    if HAS_DENOM:
        acc = acc / tl.load(denom + b, mask=live, other=1.0)[:, None]
    at = tl.load(out_at + b, mask=live, other=0)
    tl.store(out + at[:, None] + cols[None, :], acc, mask=cm)


@triton.jit
def _update_kernel(meta, hparams, versions, keyed, order, grad, grad_at, bag, weights, n, M: tl.constexpr,
                   KIND: tl.constexpr, HAS_BAG: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    ck = tl.load(keyed + i, mask=live, other=-1)
    prev = tl.load(keyed + i - 1, mask=live & (i > 0), other=-1)
    t = ck >> 32
    h = hparams + tl.where(live, t, 0) * 8  # lr-like hparams 0-3, weight decay 4, whether the table runs 7
    on = tl.load(h + 7, mask=live, other=0.0) != 0  # a table whose rows moved since the lookup is updated apart
    lead = live & ((i == 0) | (ck != prev)) & on
    row = ck & 0xFFFFFFFF
    dim = tl.where(lead, _field(meta, tl.where(live, t, 0), 5, M), 0)
    cols = tl.arange(0, BLOCK_D)
    cm = lead[:, None] & (cols[None, :] < dim[:, None])
    # the row's gradient: its ids' bag gradients (weighted) in input order
    g = tl.zeros([BLOCK, BLOCK_D], tl.float32)
    j = i
    active = lead
    while tl.max(active.to(tl.int32), axis=0) > 0:
        idx = tl.load(order + j, mask=active, other=0)
        if HAS_BAG:
            b = tl.load(bag + idx, mask=active, other=0).to(tl.int64)
        else:
            b = idx
        at = tl.load(grad_at + b, mask=active, other=0)
        gg = tl.load(grad + at[:, None] + cols[None, :], mask=active[:, None] & cm, other=0.0)
        if HAS_W:
            gg = gg * tl.load(weights + idx, mask=active, other=0.0)[:, None]
        g += gg
        j += 1
        nxt = tl.load(keyed + j, mask=active & (j < n), other=-1)
        active = active & (j < n) & (nxt == ck)
    # the table's kernel_args (float64, as given) rounded to float32 as torch rounds Python scalars; Adam's 1 - beta
    # in double first, as torch computes it; idle lanes get ones, so that their masked arithmetic divides by no 0
    r0 = tl.load(h + 0, mask=lead, other=0.0)
    r1 = tl.load(h + 1, mask=lead, other=0.0)
    if KIND == 3:
        r0 = 1.0 - r0
        r1 = 1.0 - r1
    h0 = tl.where(lead, r0, 1.0).to(tl.float32)
    h1 = tl.where(lead, r1, 1.0).to(tl.float32)
    h2 = tl.load(h + 2, mask=lead, other=1.0).to(tl.float32)
    h3 = tl.load(h + 3, mask=lead, other=1.0).to(tl.float32)
    decay = tl.load(h + 4, mask=lead, other=0.0).to(tl.float32)
    tt = tl.where(lead, t, 0)
    vp = _field(meta, tt, 4, M).to(tl.pointer_type(tl.float32))[:, None] + row[:, None] * dim[:, None] + cols[None, :]
    w = tl.load(vp, mask=cm, other=0.0)
    w0 = tl.where(lead, _field(meta, tt, 9, M), 0)
    s0 = _field(meta, tt, 8, M).to(tl.pointer_type(tl.float32))
    s1 = _field(meta, tt, 10, M).to(tl.pointer_type(tl.float32))
    sp0 = s0[:, None] + row[:, None] * dim[:, None] + cols[None, :]
    sp1 = s1[:, None] + row[:, None] * dim[:, None] + cols[None, :]
    if KIND != 3 and KIND != 4:  # weight decay (sgd, adagrad, rowwise_adagrad): only where the table has it
        g = tl.where(decay[:, None] != 0, g + w * decay[:, None], g)
    if KIND == 0:  # sgd: lr, momentum, -, nesterov (a momentum buffer where the table has momentum)
        mom = cm & (w0[:, None] > 0) & (h1[:, None] != 0)  # a buffer only with momentum, as torch's SGD
        buf = tl.load(sp0, mask=mom, other=0.0) * h1[:, None] + g
        tl.store(sp0, buf, mask=mom)
        g = tl.where(mom, tl.where(h3[:, None] != 0, g + buf * h1[:, None], buf), g)
        w = w + g * -h0[:, None]
    elif KIND == 1:  # adagrad: clr, -, eps
        state = tl.load(sp0, mask=cm, other=0.0) + g * g
        tl.store(sp0, state, mask=cm)
        w = w + (g / (tl.sqrt(state) + h2[:, None])) * -h0[:, None]
    elif KIND == 2:  # rowwise_adagrad: lr, -, eps; one accumulator per row
        sq = tl.sum(tl.where(cm, g * g, 0.0), axis=1) / tl.where(lead, dim, 1).to(tl.float32)
        state = tl.load(s0 + row, mask=lead, other=0.0) + sq
        tl.store(s0 + row, state, mask=lead)
        w = w + g * ((1.0 / (tl.sqrt(state) + h2)) * -h0)[:, None]
    elif KIND == 3:  # adam: 1 - beta1, 1 - beta2, eps, step_size
        m_old = tl.load(sp0, mask=cm, other=0.0)
        v_old = tl.load(sp1, mask=cm, other=0.0)
        m = (g - m_old) * h0[:, None] + m_old
        v = (g * g - v_old) * h1[:, None] + v_old
        tl.store(sp0, m, mask=cm)
        tl.store(sp1, v, mask=cm)
        w = w + (m / (tl.sqrt(v) + h2[:, None])) * -h3[:, None]
    else:  # ftrl: lr, power, l1, l2
        acc = tl.load(sp0, mask=cm, other=1.0)
        new_acc = acc + g * g
        sigma = (_pow(new_acc, h1[:, None]) - _pow(acc, h1[:, None])) / h0[:, None]
        linear = tl.load(sp1, mask=cm, other=0.0) + g - sigma * w
        quadratic = _pow(new_acc, h1[:, None]) / h0[:, None] + 2 * h3[:, None]
        sign = tl.where(linear > 0, 1.0, tl.where(linear < 0, -1.0, 0.0))
        w = tl.where(tl.abs(linear) > h2[:, None], (sign * h2[:, None] - linear) / quadratic, 0.0)
        tl.store(sp0, new_acc, mask=cm)
        tl.store(sp1, linear, mask=cm)
    tl.store(vp, w, mask=cm)
    # a version stamp where the table's clock moved since the lookup stamped the row (versions[t] >= 0: that clock)
    version = tl.load(versions + tt, mask=lead, other=-1)
    pair = _field(meta, tt, 7, M).to(tl.pointer_type(tl.int64))
    tl.store(pair + row * 2 + 1, version, mask=lead & (version >= 0))
