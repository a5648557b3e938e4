"""A vectorized hash index from integer keys to row ids, over plain torch tensors (CPU and CUDA alike).

Layout: ``B`` buckets of ``W`` slots. A slot holds a key and a row id; row id ``-1`` marks a free slot, so no
key value is reserved and every int32/int64 value is a valid key. A key's home bucket is given by the top bits of
its (bijective) hash; when a bucket is full, keys spill to the next bucket (linear probing over buckets) and the
full bucket gets a sticky *overflow* flag. A lookup stops at the first bucket that holds the key or has no overflow
flag, so deleting a key simply frees its slot: there are no tombstones. Flags are cleared by a rehash, which the
table triggers when too many accumulate.

A bucket is one 64-byte cache line: a row of 16 int32 words holding its ``W`` keys, then their ``W`` int32 row ids
(``W = 8`` for int32 keys; ``W = 5`` for int64 keys, whose 60 bytes leave one word unused). A lookup that finds its
key in the home bucket thus reads one cache line, the unit memory moves in: with 8 int64 slots the bucket took 96
bytes, two lines, and a cold probe on CPU took 1.15-1.4x the time. Slot ``s`` is
position ``s & 7`` of bucket ``s >> 3`` (slots are numbered as if every bucket had 8, so that addressing is shifts;
positions from ``W`` on are never used).

All operations are batched: one round handles every pending key with a few gathers, and only the rare keys that
spill to a neighbour bucket go round again. No Python loop runs over keys. This torch code is the one
implementation for every device (the reference). Lookups and placement of new keys may run the equivalent kernels
of :mod:`dynemb.kernels.numba_index` instead on CPU (identical results and layout, fewer passes over memory, 2-3x
faster): the ``backend`` of the index decides, through :mod:`dynemb.kernels.dispatch`, once per call.
"""

from __future__ import annotations

import math

import torch

from ..kernels.dispatch import Backend, kernels_for, resolve_backend
from .hashing import key_hash
from .huge_pages import empty_storage
from .ops import all_nonnegative, gather_rows

__all__ = ["HashIndex"]

_BYTES = 0x0101010101010101  # one in every byte: multiplying by it sums bytes into the higher bytes
_HIGH_BITS = -0x7F7F7F7F7F7F7F80  # 0x8080808080808080: the top bit of every byte

# Free slots carry this key so that a plain key comparison rarely needs the row-id check; keys equal to it take a
# slower (still vectorized) path that also checks the row id.
_FILL = 0x5851F42D
_FULL = "HashIndex is full; the table must rehash before inserting"  # unreachable when callers keep the contract
_WALK = 8  # buckets a torch-path lookup walks past its home in one round


class HashIndex:
    """Maps unique keys to int32 row ids.

    Args:
        key_dtype: ``torch.int32`` or ``torch.int64``.
        device: where the index lives.
        capacity: number of keys to size for without a rehash.
        backend: which implementation probes and places keys (see :mod:`dynemb.kernels.dispatch`); ``None``
            follows the process default at each call.

    Example:
        >>> idx = HashIndex(torch.int64, "cpu", capacity=16)
        >>> idx.insert(torch.tensor([7, -1]), torch.tensor([0, 1]))
        >>> idx.find(torch.tensor([-1, 5, 7])).tolist()
        [1, -1, 0]
    """

    BUCKET_WORDS = 16  # int32 words a bucket: 64 bytes, one cache line
    MAX_LOAD = 0.5
    MAX_OVERFLOW_FRACTION = 0.25

    def __init__(
        self, key_dtype: torch.dtype, device: torch.device | str, capacity: int, *, backend: Backend | str | None = None
    ) -> None:
        self.key_dtype = key_dtype
        self.device = torch.device(device)
        if backend is not None:
            backend = Backend.parse(backend)
            resolve_backend(backend, self.device)  # a backend this device cannot run fails here, not at a call
        self.backend = backend
        self.width = self.width_for(key_dtype)
        # int32 columns per bucket taken by the keys; the row ids follow them.
        self._key_cols = self.width * torch.iinfo(key_dtype).bits // 32
        self._alloc(self.buckets_for(capacity, key_dtype))

    @classmethod
    def load_kernels(cls, key_dtype: torch.dtype = torch.int64) -> None:
        """Load the CPU kernels that placing and finding ``key_dtype`` keys run (from numba's cache, or compiled),
        by placing and finding one key in a one-key index. numba's first use in a process costs ~0.4-0.6 s (its
        typing and lowering registries) before the first kernel loads: a scorer pays it in a thread beside its
        model's load (``dynemb predict``'s reading thread), not in the model's first index. A no-op cost (a few
        torch ops) where the process default backend is torch.

        Example:
            >>> HashIndex.load_kernels()
        """
        index = cls(key_dtype, "cpu", capacity=1)
        keys = torch.zeros(1, dtype=key_dtype)
        index.insert(keys, torch.zeros(1, dtype=torch.int64))
        index.find_all(keys)

    # ---------------------------------------------------------------- sizing
    @classmethod
    def width_for(cls, key_dtype: torch.dtype) -> int:
        """Slots a bucket: the (key, int32 row id) pairs that fit in its 64 bytes, at most 8 (8 for int32 keys, 5
        for int64)."""
        return min(8, cls.BUCKET_WORDS * 4 // (torch.iinfo(key_dtype).bits // 8 + 4))

    @classmethod
    def buckets_for(cls, capacity: int, key_dtype: torch.dtype) -> int:
        """Smallest power-of-two bucket count that holds ``capacity`` keys of ``key_dtype`` under ``MAX_LOAD``."""
        need = max(2, math.ceil(max(capacity, 1) / (cls.width_for(key_dtype) * cls.MAX_LOAD)))
        return 1 << (need - 1).bit_length()

    #: advances whenever the buckets are reallocated (a group's kernels hold their address)
    generation = 0

    def _alloc(self, num_buckets: int) -> None:
        self.generation += 1
        self.num_buckets = num_buckets
        self._shift = 64 - (num_buckets.bit_length() - 1)
        self._buckets = empty_storage((num_buckets, self.BUCKET_WORDS), torch.int32, self.device)
        self.overflow = torch.zeros(num_buckets, dtype=torch.bool, device=self.device)
        self.clear()

    @property
    def bucket_keys(self) -> torch.Tensor:
        """``[B, W]`` view of the keys (free slots hold the fill key)."""
        return self._buckets[:, : self._key_cols].view(self.key_dtype)

    @property
    def bucket_rows(self) -> torch.Tensor:
        """``[B, W]`` int32 view of the row ids (``-1``: free slot)."""
        return self._buckets[:, self._key_cols : self._key_cols + self.width]

    @property
    def slots(self) -> int:
        return self.num_buckets * self.width

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self._buckets, self.overflow))

    def needs_rehash(self, num_keys: int) -> bool:
        """True when ``num_keys`` would exceed the load limit, or stale overflow flags slow lookups down."""
        if num_keys > self.MAX_LOAD * self.slots:
            return True
        return int(self.overflow.count_nonzero()) > self.MAX_OVERFLOW_FRACTION * self.num_buckets

    def rehash(self, keys: torch.Tensor, rows: torch.Tensor, capacity: int) -> None:
        """Rebuild from scratch holding ``keys -> rows`` (unique keys), sized for ``capacity`` keys."""
        self._alloc(self.buckets_for(max(capacity, keys.numel()), self.key_dtype))
        self.insert(keys, rows)

    def _kernels(self):
        """The index family serving this call (:func:`~dynemb.kernels.dispatch.kernels_for`); false (no module) for
        the torch code below."""
        return kernels_for(self.backend, self.device).index

    # ---------------------------------------------------------------- addressing
    def _home(self, hashes: torch.Tensor) -> torch.Tensor:
        # Arithmetic shift keeps bucket order equal to signed hash order: sorting hashes groups keys by bucket.
        return (hashes >> self._shift) + self.num_buckets // 2

    def _key_pos(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat positions of slots' keys in ``_buckets`` viewed as a 1-D key tensor."""
        stride = self._buckets.shape[1] * 32 // torch.iinfo(self.key_dtype).bits
        return (slots >> 3) * stride + (slots & 7)  # slots count 8 a bucket: shifts, as integer division is slow

    def _row_pos(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat positions of slots' row ids in ``_buckets`` viewed as 1-D."""
        return (slots >> 3) * self._buckets.shape[1] + ((slots & 7) + self._key_cols)

    def _flat_keys(self) -> torch.Tensor:
        return self._buckets.view(-1).view(self.key_dtype)

    # ---------------------------------------------------------------- queries
    def find_slots(self, keys: torch.Tensor, hashes: torch.Tensor | None = None) -> torch.Tensor:
        """Flat slot position of each key, or -1 where absent. ``keys``: ``[N]`` -> ``[N]`` int64.

        ``hashes`` (``key_hash(keys)``) may be passed when the caller has them already.
        """
        return self._probe(keys, hashes)[0]

    def find(self, keys: torch.Tensor, hashes: torch.Tensor | None = None) -> torch.Tensor:
        """Row id of each key, or -1 where absent. ``keys``: ``[N]`` -> ``[N]`` int64."""
        return self._probe(keys, hashes)[1].to(torch.int64)

    def find_all(self, keys: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """``(find(keys), whether every key is present)``: on CPU one kernel pass does both (no int32 copy and no
        second pass over the rows to count the absent ones)."""
        fast = self._kernels().find  # optional in the index family
        if fast is None:
            rows = self.find(keys)
            return rows, all_nonnegative(rows)
        return fast(*self._kernel_args(keys))

    def lookup(self, keys: torch.Tensor, hashes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, rows)`` of each key, both ``[N]`` int64 and -1 where absent: ``find_slots`` and ``find`` in one
        pass.

        Example:
            >>> idx = HashIndex(torch.int32, "cpu", capacity=16)
            >>> idx.insert(torch.tensor([4], dtype=torch.int32), torch.tensor([9]))
            >>> slots, rows = idx.lookup(torch.tensor([4, 5], dtype=torch.int32))
            >>> (slots >= 0).tolist(), rows.tolist()
            ([True, False], [9, -1])
        """
        slots, rows = self._probe(keys, hashes)
        return slots, rows.to(torch.int64)

    def rows_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Row id at each flat slot (``slots >= 0``), as int64."""
        return gather_rows(self._buckets.view(-1), self._row_pos(slots)).to(torch.int64)

    def _kernel_args(self, keys: torch.Tensor) -> tuple:
        """What the index kernels' ``probe`` and ``find`` take: the buckets in the key dtype, their key columns, the
        overflow flags, ``keys`` and the hash shift."""
        return self._buckets.view(self.key_dtype), self._key_cols, self.overflow, keys, self._shift

    def _probe(self, keys: torch.Tensor, hashes: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots int64, rows int32)`` of ``[N]`` keys, -1 where absent."""
        if keys.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device), torch.empty_like(keys, dtype=torch.int32)
        kernels = self._kernels()
        if kernels:
            return kernels.probe(*self._kernel_args(keys))
        bucket = self._home(key_hash(keys) if hashes is None else hashes)
        # Only a key equal to the fill value can match a free slot; one check per call keeps the common case lean.
        check_rows = bool((keys == _FILL).any())
        slots, rows = self._match(keys, bucket, check_rows)
        # Keys not at home walk the following buckets, up to _WALK of them a round: a round costs a host sync on
        # CUDA, and with 5 int64 slots a bucket a chain of 10 buckets occurs in an index of millions of keys.
        nb = self.num_buckets
        walk = min(_WALK, nb - 1)  # nb >= 2
        steps = torch.arange(1, walk + 1, device=self.device)
        more = self.overflow.index_select(0, bucket) & slots.lt(0)
        pending = None  # positions into the outputs of keys still probing
        for _ in range(-(-(nb - 1) // walk)):
            if not bool(more.any()):
                break
            sel = more.nonzero().squeeze(1)
            pending = sel if pending is None else pending.index_select(0, sel)
            keys, bucket = keys.index_select(0, sel), bucket.index_select(0, sel)
            ahead = (bucket.unsqueeze(1) + steps) & (nb - 1)  # [P, walk]
            slot, row = (t.view(-1, walk) for t in self._match(keys.repeat_interleave(walk), ahead.view(-1),
                                                                check_rows))
            # The walk ends at the first bucket that holds the key or has no overflow flag.
            stop = slot.ge(0) | ~self.overflow[ahead]
            first = stop.to(torch.int8).argmax(1, keepdim=True)  # the first stop; 0 where none
            more = ~stop.any(1)
            slots.index_copy_(0, pending, slot.gather(1, first).squeeze(1) | -more.long())
            rows.index_copy_(0, pending, row.gather(1, first).squeeze(1) | -more.int())
            bucket = ahead[:, -1]
        return slots, rows

    def _match(self, keys: torch.Tensor, bucket: torch.Tensor, check_rows: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slot, row)`` of each key within its current bucket, ``-1`` where it is not there."""
        tile = gather_rows(self._buckets, bucket)  # [N, 16]: one random access (a cache line) per key
        rows = tile[:, self._key_cols : self._key_cols + self.width]
        eq = tile[:, : self._key_cols].view(self.key_dtype) == keys.unsqueeze(1)
        if check_rows:
            eq &= rows >= 0
        # The W <= 8 match flags of a key are the bytes of one int64 word, so word ops replace reductions over a
        # tiny dimension (slow on CPU). The lowest set byte is read off the float exponent of its isolated bit:
        # 2**(8 * p) has exponent field 127 + 8 * p, so ``field >> 3 == 15 + p``; a zero word gives 0.
        word = _byte_word(eq)
        pos = ((word & -word).to(torch.float32).view(torch.int32) >> 26) - 15
        miss = pos >> 31  # -1 where no slot matched, else 0
        # A miss's position, -15, reads column 1 (< W), masked by ``miss``.
        row = rows.gather(1, (pos & 7).unsqueeze(1).long()).squeeze(1) | miss
        return ((bucket << 3) + pos) | miss, row

    # ---------------------------------------------------------------- updates
    def insert(self, keys: torch.Tensor, rows: torch.Tensor, hashes: torch.Tensor | None = None) -> None:
        """Add unique keys that are known to be absent. The caller guarantees room (see ``needs_rehash``).

        ``hashes`` (``key_hash(keys)``) may be passed; keys already in hash order skip the sort.
        """
        if keys.numel() == 0:
            return
        hashes = key_hash(keys) if hashes is None else hashes
        if not bool((hashes[1:] >= hashes[:-1]).all()):
            hashes, order = hashes.sort()
            keys, rows = keys.index_select(0, order), rows.index_select(0, order)
        self._place(self._home(hashes), keys, rows)

    def _place(self, bucket: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor) -> None:
        kernels = self._kernels()
        if kernels:
            if not kernels.place(self._buckets.view(self.key_dtype), self._key_cols, self.overflow, bucket, keys, rows):
                raise RuntimeError(_FULL)
            return
        # `bucket` is sorted (up to one wrap-around), so keys sharing a bucket are contiguous; each takes the
        # rank-th free slot of its bucket, and keys beyond the free count spill to the next bucket together.
        for _ in range(self.num_buckets + 1):
            tile = gather_rows(self._buckets, bucket)
            free = _byte_word(tile[:, self._key_cols : self._key_cols + self.width] < 0)
            pos, fits = _nth_set_byte(free, _rank_in_run(bucket))
            take = fits.nonzero().squeeze(1)
            slot = (bucket.index_select(0, take) << 3) + pos.index_select(0, take)
            self._flat_keys().index_copy_(0, self._key_pos(slot), keys.index_select(0, take))
            self._buckets.view(-1).index_copy_(0, self._row_pos(slot), rows.index_select(0, take).to(torch.int32))
            if take.numel() == bucket.numel():
                return
            spill = (~fits).nonzero().squeeze(1)
            bucket, keys, rows = bucket.index_select(0, spill), keys.index_select(0, spill), rows.index_select(0, spill)
            self.overflow.index_fill_(0, bucket, True)
            bucket = (bucket + 1) & (self.num_buckets - 1)
        raise RuntimeError(_FULL)

    def remove(self, slots: torch.Tensor) -> None:
        """Free flat slots (``slots >= 0``, unique)."""
        self._flat_keys().index_fill_(0, self._key_pos(slots), _FILL)
        self._buckets.view(-1).index_fill_(0, self._row_pos(slots), -1)

    def set_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Point flat slots at new row ids (rows moved by compaction)."""
        self._buckets.view(-1).index_copy_(0, self._row_pos(slots), rows.to(torch.int32))

    def clear(self) -> None:
        self.bucket_keys.fill_(_FILL)
        self.bucket_rows.fill_(-1)
        self._buckets[:, self._key_cols + self.width :].zero_()  # the unused word of int64 buckets
        self.overflow.zero_()


def _byte_word(flags: torch.Tensor) -> torch.Tensor:
    """``[N, W]`` bool flags (``W <= 8``) as one int64 word each, flag ``p`` in byte ``p`` (missing bytes 0)."""
    flags = flags.contiguous().view(torch.uint8)
    if flags.shape[1] < 8:
        flags = torch.nn.functional.pad(flags, (0, 8 - flags.shape[1]))
    return flags.view(torch.int64).squeeze(1)


def _rank_in_run(sorted_values: torch.Tensor) -> torch.Tensor:
    """Position of each element within its run of equal neighbours (``[3, 3, 5, 5, 5] -> [0, 1, 0, 1, 2]``)."""
    position = torch.arange(sorted_values.numel(), device=sorted_values.device)
    starts = torch.ones_like(sorted_values, dtype=torch.bool)
    starts[1:] = sorted_values[1:] != sorted_values[:-1]
    return position - torch.where(starts, position, 0).cummax(0).values


def _nth_set_byte(flags: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte position of the ``n``-th (0-based) nonzero byte of each word, and whether it exists.

    ``flags`` holds 0/1 bytes. Multiplying by ``_BYTES`` turns them into running counts (each <= 8, so no byte
    carries into the next); the position is then the number of running counts <= n, counted with one add per word.
    """
    n = n.clamp(max=8)  # keeps 0x7F - n a positive byte; n >= 8 never fits anyway
    counts = flags * _BYTES
    total = (counts >> 56) & 0xFF
    above = ((counts + (0x7F - n) * _BYTES) & _HIGH_BITS) >> 7 & _BYTES  # 1 in each byte whose count > n
    pos = 8 - ((above * _BYTES) >> 56 & 0xFF)
    return pos, n < total
