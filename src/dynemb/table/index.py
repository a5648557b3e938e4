"""A vectorized hash index from integer keys to row ids, over plain torch tensors (CPU and CUDA alike).

Layout: ``B`` buckets of ``W = 8`` slots. A slot holds a key and a row id; row id ``-1`` marks a free slot, so no
key value is reserved and every int32/int64 value is a valid key. A key's home bucket is given by the top bits of
its (bijective) hash; when a bucket is full, keys spill to the next bucket (linear probing over buckets) and the
full bucket gets a sticky *overflow* flag. A lookup stops at the first bucket that holds the key or has no overflow
flag, so deleting a key simply frees its slot: there are no tombstones. Flags are cleared by a rehash, which the
table triggers when too many accumulate.

All operations are batched: one round handles every pending key with a few gathers, and only the rare keys that
spill to a neighbour bucket go round again. No Python loop runs over keys.
"""

from __future__ import annotations

import math

import torch

from .hashing import key_hash
from .ops import gather_rows

__all__ = ["HashIndex"]

# Free slots carry this key so that a plain key comparison rarely needs the row-id check; keys equal to it take a
# slower (still vectorized) path that also checks the row id.
_FILL = 0x5851F42D


class HashIndex:
    """Maps unique keys to int32 row ids.

    Args:
        key_dtype: ``torch.int32`` or ``torch.int64``.
        device: where the index lives.
        capacity: number of keys to size for without a rehash.

    Example:
        >>> idx = HashIndex(torch.int64, "cpu", capacity=16)
        >>> idx.insert(torch.tensor([7, -1]), torch.tensor([0, 1]))
        >>> idx.find(torch.tensor([-1, 5, 7])).tolist()
        [1, -1, 0]
    """

    WIDTH = 8
    MAX_LOAD = 0.5
    MAX_OVERFLOW_FRACTION = 0.25

    def __init__(self, key_dtype: torch.dtype, device: torch.device | str, capacity: int) -> None:
        self.key_dtype = key_dtype
        self.device = torch.device(device)
        self._alloc(self.buckets_for(capacity))

    # ---------------------------------------------------------------- sizing
    @classmethod
    def buckets_for(cls, capacity: int) -> int:
        """Smallest power-of-two bucket count that holds ``capacity`` keys under ``MAX_LOAD``."""
        need = max(2, math.ceil(max(capacity, 1) / (cls.WIDTH * cls.MAX_LOAD)))
        return 1 << (need - 1).bit_length()

    def _alloc(self, num_buckets: int) -> None:
        self.num_buckets = num_buckets
        self._shift = 64 - (num_buckets.bit_length() - 1)
        self.bucket_keys = torch.full((num_buckets, self.WIDTH), _FILL, dtype=self.key_dtype, device=self.device)
        self.bucket_rows = torch.full((num_buckets, self.WIDTH), -1, dtype=torch.int32, device=self.device)
        self.overflow = torch.zeros(num_buckets, dtype=torch.bool, device=self.device)

    @property
    def slots(self) -> int:
        return self.num_buckets * self.WIDTH

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.bucket_keys, self.bucket_rows, self.overflow))

    def needs_rehash(self, num_keys: int) -> bool:
        """True when ``num_keys`` would exceed the load limit, or stale overflow flags slow lookups down."""
        if num_keys > self.MAX_LOAD * self.slots:
            return True
        return int(self.overflow.sum()) > self.MAX_OVERFLOW_FRACTION * self.num_buckets

    def rehash(self, keys: torch.Tensor, rows: torch.Tensor, capacity: int) -> None:
        """Rebuild from scratch holding ``keys -> rows`` (unique keys), sized for ``capacity`` keys."""
        self._alloc(self.buckets_for(max(capacity, keys.numel())))
        self.insert(keys, rows)

    # ---------------------------------------------------------------- hashing
    def _home(self, hashes: torch.Tensor) -> torch.Tensor:
        # Arithmetic shift keeps bucket order equal to signed hash order: sorting hashes groups keys by bucket.
        return (hashes >> self._shift) + self.num_buckets // 2

    # ---------------------------------------------------------------- queries
    def find_slots(self, keys: torch.Tensor) -> torch.Tensor:
        """Flat slot position of each key, or -1 where absent. ``keys``: ``[N]`` -> ``[N]`` int64."""
        n = keys.numel()
        out = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        if n == 0:
            return out
        width, mask = self.WIDTH, self.num_buckets - 1
        bucket = self._home(key_hash(keys))
        pending = None  # positions into `out` still probing; None means all of them
        for _ in range(self.num_buckets):
            stored = gather_rows(self.bucket_keys, bucket)
            eq = stored == keys.unsqueeze(1)
            special = keys == _FILL
            if bool(special.any()):
                eq &= ~special.unsqueeze(1) | (gather_rows(self.bucket_rows, bucket) >= 0)
            pos = eq.view(torch.uint8).argmax(1)
            hit = eq.gather(1, pos.unsqueeze(1)).squeeze(1)
            slot = torch.where(hit, bucket * width + pos, -1)
            if pending is None:
                out = slot
            else:
                out.index_copy_(0, pending, slot)
            more = ~hit & self.overflow.index_select(0, bucket)
            if not bool(more.any()):
                break
            sel = more.nonzero().squeeze(1)
            pending = sel if pending is None else pending.index_select(0, sel)
            keys, bucket = keys.index_select(0, sel), (bucket.index_select(0, sel) + 1) & mask
        return out

    def rows_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Row id at each flat slot (``slots >= 0``), as int64."""
        return gather_rows(self.bucket_rows.view(-1), slots).to(torch.int64)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Row id of each key, or -1 where absent. ``keys``: ``[N]`` -> ``[N]`` int64."""
        slots = self.find_slots(keys)
        return torch.where(slots >= 0, self.rows_at(slots.clamp(min=0)), -1)

    # ---------------------------------------------------------------- updates
    def insert(self, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Add unique keys that are known to be absent. The caller guarantees room (see ``needs_rehash``)."""
        if keys.numel() == 0:
            return
        hashes, order = key_hash(keys).sort()
        self._place(self._home(hashes), keys.index_select(0, order), rows.index_select(0, order))

    def _place(self, bucket: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor) -> None:
        # `bucket` is sorted (up to one wrap-around), so keys sharing a bucket are contiguous; each takes the
        # rank-th free slot of its bucket, and keys beyond the free count spill to the next bucket together.
        width, mask = self.WIDTH, self.num_buckets - 1
        flat_keys, flat_rows = self.bucket_keys.view(-1), self.bucket_rows.view(-1)
        for _ in range(self.num_buckets + 1):
            n = bucket.numel()
            position = torch.arange(n, device=self.device)
            starts = torch.ones(n, dtype=torch.bool, device=self.device)
            starts[1:] = bucket[1:] != bucket[:-1]
            rank = position - torch.where(starts, position, 0).cummax(0).values
            free_so_far = (gather_rows(self.bucket_rows, bucket) < 0).cumsum(1)
            fits = rank < free_so_far[:, -1]
            pos = (free_so_far <= rank.unsqueeze(1)).sum(1)
            slot = (bucket * width + pos)[fits]
            flat_keys[slot] = keys[fits]
            flat_rows[slot] = rows[fits].to(torch.int32)
            if bool(fits.all()):
                return
            spill = ~fits
            self.overflow[bucket[spill]] = True
            bucket, keys, rows = (bucket[spill] + 1) & mask, keys[spill], rows[spill]
        raise RuntimeError("HashIndex is full; the table must rehash before inserting")  # unreachable by contract

    def remove(self, slots: torch.Tensor) -> None:
        """Free flat slots (``slots >= 0``, unique)."""
        self.bucket_keys.view(-1)[slots] = _FILL
        self.bucket_rows.view(-1)[slots] = -1

    def set_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Point flat slots at new row ids (rows moved by compaction)."""
        self.bucket_rows.view(-1)[slots] = rows.to(torch.int32)

    def clear(self) -> None:
        self.bucket_keys.fill_(_FILL)
        self.bucket_rows.fill_(-1)
        self.overflow.zero_()
