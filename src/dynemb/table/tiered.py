"""TieredTable: a fast tier (device memory or RAM) caching a slow tier (host memory or row files on disk).

The fast tier is the table's own rows, index and columns (a :class:`KeyValueTable` with no row bound); the slow
tier is a :class:`~dynemb.table.slow.SlowStore`. Before each operation the keys it names are made resident: keys
found in the slow tier move up with their values, optimizer slots, score and version stamp (never re-initialized),
and when the fast tier would pass its budget the lowest-score rows not named by the call move down. Then the
ordinary operation runs on the fast tier. Moving rows between tiers changes no value, slot, score, counter or the
clock, so results equal those of one untiered table, bit for bit; only ``export``'s row order differs.

The fast tier's budget is soft in one way: the rows of a single call all stay resident (an optimizer updates them
in place afterwards), so a call with more distinct keys than the budget leaves the fast tier over it until the next
call. A full fast tier frees exactly the rows a call needs, and the rows coming up take their places (one exchange
a call, :mod:`dynemb.table.tier_moves`): no row is compacted on either side. The rows to free come from a queue
that one scan of the scores fills for many calls (:class:`~dynemb.table.tier_moves.VictimQueue`).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Iterable, Optional, Union

import torch

from ..serialization import Serializable, serializable
from . import budget, fused
from ..checks import check_int, check_keys, check_rows_like, check_scores
from .kv import KeyValueTable
from .ops import all_nonnegative, lowest_rows
from .rows import Rows
from .slow import LogStore, SlowStore, swap_rows
from .tier_moves import DISK_BASE, ROW_END, SLOW_BASE, HostLink, SlowIndex, TieredIndex, VictimQueue, exchange, \
    link_for

__all__ = ["Tiers", "TieredTable", "tier_traffic"]

#: the most rows a three-level table's host level may be given: half its row ids (a call may pass the budget)
HOST_ROWS = (DISK_BASE - SLOW_BASE) // 2

#: row files written as a log (:class:`~dynemb.table.slow.LogStore`: rows going down appended with ``pwrite`` on a
#: writer thread, the mapping only read), which removes the page faults after each of the kernel's write-backs (the
#: train step 2-4x slower for ~50 steps); False (set before a table is made): rows written in place through the
#: mapping, the earlier way, kept as a fallback (BENCHMARKS.md, "Tiered tables")
ROW_FILES_AS_LOG = True

#: fraction of the fast tier one scan of its scores picks to move down over the next calls (:class:`VictimQueue`)
QUEUE = 1 / 4


@serializable("tiers")
@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiers(Serializable):
    """Where a tiered table keeps its rows: a fast tier of bounded size over an unbounded slow tier.

    Attributes:
        fast_capacity: rows kept in the fast tier (the table's device); exclusive with ``fast_bytes``.
        fast_bytes: the fast tier's budget in bytes instead: its rows (values, slots, scores, version stamps) and
            an index sized for them (see :mod:`dynemb.table.budget`). The table keeps one index of both tiers' keys
            on the fast tier's device; the slow keys' entries, 26-52 bytes a key, come on top (``stats()``:
            ``tiers.index``).
        slow: ``"host"``: host memory (pinned when the fast tier is on CUDA); or a directory where the slow tier
            keeps memory-mapped row files (a private subdirectory, removed with the table). A path is saved as its
            ``str`` (``to_dict``).
        host_capacity: three levels: rows kept in host memory (pinned on CUDA) between the fast tier and the row
            files under ``slow`` (then a directory), for a table larger than host memory; exclusive with
            ``host_bytes``. The rows of a call pass through the host on their way up; the lowest-score host rows
            go down to the files when the host passes its budget. At most ``2**27`` rows (the row files:
            ``3 * 2**28``).
        host_bytes: the host level's budget in bytes instead: its rows, every column interleaved (the index stays
            with the fast tier).

    Example:
        >>> Tiers(fast_capacity=1000, slow="host").slow
        'host'
        >>> Tiers(fast_capacity=1000, host_capacity=10_000, slow="/mnt/ssd/rows").host_capacity  # three levels
        10000
        >>> Tiers(fast_capacity=1000, host_capacity=10_000)
        Traceback (most recent call last):
        ...
        ValueError: Tiers.host_capacity puts host memory over row files: slow must be their directory, got 'host'
        >>> Tiers(slow="host")
        Traceback (most recent call last):
        ...
        ValueError: Tiers needs fast_capacity (rows) or fast_bytes, got neither
    """

    fast_capacity: Optional[int] = None
    fast_bytes: Optional[int] = None
    slow: Union[str, os.PathLike] = "host"
    host_capacity: Optional[int] = None
    host_bytes: Optional[int] = None

    def __post_init__(self):
        check_int(self.fast_capacity, "Tiers.fast_capacity", minimum=1, maximum=2**31 - 1, allow_none=True)
        check_int(self.fast_bytes, "Tiers.fast_bytes", minimum=1, allow_none=True)
        if (self.fast_capacity is None) == (self.fast_bytes is None):
            got = "both" if self.fast_capacity is not None else "neither"
            raise ValueError(f"Tiers needs fast_capacity (rows) or fast_bytes, got {got}")
        if not isinstance(self.slow, (str, os.PathLike)) or self.slow == "":
            raise ValueError(f"Tiers.slow must be 'host' or a directory path, got {self.slow!r}")
        if isinstance(self.slow, str) and self.slow != "host" and os.sep not in self.slow \
                and not os.path.isdir(self.slow):
            # a bare word ("disk", "gpu", "ssd") is far likelier a guessed option than a directory meant to be made
            raise ValueError(f"Tiers.slow must be 'host' or a directory path, got {self.slow!r}; for a directory "
                             f"of that name here, pass './{self.slow}' or a pathlib.Path")
        check_int(self.host_capacity, "Tiers.host_capacity", minimum=1, maximum=HOST_ROWS, allow_none=True)
        check_int(self.host_bytes, "Tiers.host_bytes", minimum=1, allow_none=True)
        if self.host_capacity is not None and self.host_bytes is not None:
            raise ValueError("Tiers needs host_capacity (rows) or host_bytes for a host level, got both")
        if self.three_levels and self.slow == "host":
            what = "host_capacity" if self.host_bytes is None else "host_bytes"
            raise ValueError(f"Tiers.{what} puts host memory over row files: slow must be their directory, got "
                             f"'host'")

    @property
    def three_levels(self) -> bool:
        """Whether host memory sits between the fast tier and row files (``host_capacity`` or ``host_bytes``)."""
        return self.host_capacity is not None or self.host_bytes is not None


class TieredTable(KeyValueTable):
    """A :class:`KeyValueTable` whose rows beyond a fast-tier budget live in a slow tier, invisibly.

    Every operation (find, find_or_insert, insert_or_assign, accum, erase, export, replace) sees one table of
    ``size()`` rows; the row ids it returns are fast-tier rows, valid until the next call. Unlike a bounded table
    it drops nothing: ``max_capacity`` is ``None`` and only ``erase``/``clear``/``evict``/``restrict`` remove rows.

    Three levels (``Tiers(host_capacity=...)``): the slow tier is host memory over row files, moved between as the
    fast tier and the host are (one index of every level's keys, one exchange a call between two levels; the same
    code moves both pairs): a call's keys found in the files come up to the host, then with the host's to the fast
    tier; a host over its budget sends its lowest-score rows down to the files.

    Args:
        dim: as for :class:`KeyValueTable`, like every other keyword except ``max_capacity``/``max_bytes`` (not
            allowed) and ``init_capacity`` (the fast tier is allocated at its budget).
        tiers: a :class:`Tiers`: the fast tier's budget and where the slow tier lives.

    Attributes:
        slow: the level below the fast tier (a :class:`~dynemb.table.slow.SlowStore`: host memory or row files).
        disk: a three-level table's row files below the host (``slow``), else None.
        levels: ``(slow,)`` or ``(slow, disk)``.

    Example:
        >>> t = TieredTable(2, tiers=Tiers(fast_capacity=2), initializer="zeros")
        >>> t.insert_or_assign(torch.tensor([0, 1]), torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
        >>> t.insert_or_assign(torch.tensor([2, 3]), torch.ones(2, 2))  # 0 and 1 move down to make room
        >>> t.stats()["tiers"]["fast"]["rows"], t.stats()["tiers"]["slow"]["rows"], t.size()
        (2, 2, 4)
        >>> t.find(torch.tensor([0, 9]))[0].tolist()  # key 0 comes back from the slow tier
        [[0.0, 1.0], [0.0, 0.0]]

        Three levels, 1 row on the fast tier (the device, on CUDA), 1 in host memory, the rest in row files:

        >>> import tempfile
        >>> t = TieredTable(2, tiers=Tiers(fast_capacity=1, host_capacity=1, slow=tempfile.mkdtemp()),
        ...                 initializer="zeros")
        >>> t.insert_or_assign(torch.tensor([0, 1, 2]), torch.ones(3, 2))
        >>> [t.stats()["tiers"][level]["rows"] for level in ("fast", "slow", "disk")]
        [3, 0, 0]
        >>> t.find(torch.tensor([5]))[0].tolist()  # a call of one key: two rows go down, one to each level
        [[0.0, 0.0]]
        >>> [t.stats()["tiers"][level]["rows"] for level in ("fast", "slow", "disk")]
        [1, 1, 1]
    """

    _DEFERS_STAMPS = False  # every lookup reads scores to pick the rows to move down: nothing to gain

    def __init__(self, dim: int, *, tiers: Tiers, **kwargs) -> None:
        if not isinstance(tiers, Tiers):
            raise TypeError(f"tiers must be a dynemb.table.Tiers, got {tiers!r}")
        for bound in ("max_capacity", "max_bytes"):
            if kwargs.get(bound) is not None:
                raise ValueError(f"a tiered table keeps every row: give the fast tier's budget in tiers, not "
                                 f"{bound}={kwargs[bound]}")
        self.tiers = tiers
        self.fast_capacity = tiers.fast_capacity or 1
        # The fast tier is allocated at its budget once (doubling growth would overshoot a byte budget).
        super().__init__(dim, **{**kwargs, "init_capacity": self.fast_capacity})
        self.link = link_for(self.device, self.backend)
        self._queue = VictimQueue(self.fast_capacity * QUEUE)
        self.index = self._tiered_index(self.device)
        self._fit_fast()
        three = tiers.three_levels
        if three or tiers.slow == "host":
            self.slow = SlowStore(self, "host", pin=self.device.type == "cuda")
        else:
            self.slow = (LogStore if ROW_FILES_AS_LOG else SlowStore)(self, tiers.slow)
        self.slow.index = SlowIndex(self.index, self.slow, SLOW_BASE, DISK_BASE if three else ROW_END,
                                    "host level" if three else "slow tier")
        self.levels = (self.slow,)
        self.hits = {"fast": 0, "slow": 0, "miss": 0}
        #: rows and bytes (every column) moved up to the fast tier and down to the slow one, since construction
        self.moved = {"rows_up": 0, "rows_down": 0, "bytes_up": 0, "bytes_down": 0}
        self.disk = self.host_capacity = None
        if three:  # the host over row files: the same store, index view and exchange as the fast tier over the host
            self.disk = (LogStore if ROW_FILES_AS_LOG else SlowStore)(self, tiers.slow)
            self.disk.index = SlowIndex(self.index, self.disk, DISK_BASE, ROW_END, "row files")
            self.levels = (self.slow, self.disk)
            self.disk_link = HostLink(self.slow.backend)  # host rows both sides: the host's kernels
            self._host_queue = VictimQueue(1)
            self.hits["disk"] = 0
            #: as ``moved``, between the host and the row files
            self.moved_disk = {"rows_up": 0, "rows_down": 0, "bytes_up": 0, "bytes_down": 0}
            self._fit_host()

    def rows_unmoved_since(self, moves: int) -> bool:
        """Never assumed: rows move between the tiers on their own, so a backward always re-checks them."""
        return False

    # ------------------------------------------------------------------ one table
    def size(self) -> int:
        """Rows in every level."""
        return self._size + sum(level.size() for level in self.levels)

    def __len__(self) -> int:
        return self.size()

    def find_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """As :meth:`KeyValueTable.find_rows`, after bringing ``keys`` found in the slow tier up."""
        self._resident(keys, new_ok=False)
        return super().find_rows(keys)

    def find(self, keys, *, out=None, update_scores=False):
        """As :meth:`KeyValueTable.find` (a miss reads the initializer's row); stored rows come up first."""
        self._resident(keys, new_ok=False)
        return super().find(keys, out=out, update_scores=update_scores)

    def find_or_insert(self, keys, scores=None, counts=None):
        """As :meth:`KeyValueTable.find_or_insert`: ``found`` is True for keys stored in either tier, whose rows
        come up with their slots and scores (never re-initialized); the rows returned are fast-tier rows."""
        rows = self._resident(keys)
        if rows is not None and scores is None and counts is None and fused.kernels(self) is None:
            # every key was found and its row is known: what KeyValueTable does then, without probing them again
            self.clock += 1
            self._touch(rows)
            return rows.view(keys.shape), torch.ones(keys.shape, dtype=torch.bool, device=self.device)
        return super().find_or_insert(keys, scores, counts)

    #: every occurrence of a key would count as a hit and move rows down for it: lookups pass distinct keys
    keys_may_repeat = False

    def lookup_rows(self, keys, *, insert, counts=None):
        """As :meth:`KeyValueTable.lookup_rows`, through this table's :meth:`find_or_insert` and :meth:`find_rows`
        (which bring rows up from the slow tier first)."""
        rows = self.find_or_insert(keys, counts=counts)[0] if insert else self.find_rows(keys)
        return rows, all_nonnegative(rows)

    def insert_or_assign(self, keys, values, scores=None) -> None:
        """As :meth:`KeyValueTable.insert_or_assign` (a key stored in the slow tier is a hit: its slots stay)."""
        self._resident(keys)
        super().insert_or_assign(keys, values, scores)

    def accum(self, keys, old_values, new_values, exists) -> None:
        """As :meth:`KeyValueTable.accum`; a key stored in either tier counts as present."""
        self._resident(keys)
        super().accum(keys, old_values, new_values, exists)

    def erase(self, keys: torch.Tensor) -> int:
        """Remove keys from both tiers; returns the number removed (as one table: one clock tick if any)."""
        check_keys(keys, self.key_dtype, self.device)
        # first: they leave the one index
        gone = [level.erase(keys.to(level.device)).to(self.device) for level in self.levels]
        gone = gone[0] if len(gone) == 1 else torch.cat(gone)
        n_fast = super().erase(keys)
        if gone.numel():
            if n_fast == 0:
                self.clock += 1
            self._log_deleted(gone)
            self.removed += gone.numel()
        return n_fast + gone.numel()

    def evict(self, n: int) -> Rows:
        """Evict the ``n`` lowest-score rows of the whole table (both tiers); reported to ``on_evict``."""
        check_int(n, "n", minimum=0)
        n = min(n, self.size())
        if n and self.size() > self._size:  # the n lowest of all levels come up (pinned there); then the fast n go
            at = [level.stored_rows() for level in self.levels]
            scores = torch.cat([self.scores[: self._size]] + [level.scores.index_select(0, r).to(self.device)
                                                              for level, r in zip(self.levels, at)])
            keys = torch.cat([self.row_keys[: self._size]] + [level.row_keys.index_select(0, r).to(self.device)
                                                              for level, r in zip(self.levels, at)])
            self._resident(keys.index_select(0, lowest_rows(scores, n, backend=self.backend)), new_ok=False)
        return super().evict(n)

    def clear(self) -> None:
        super().clear()
        for level in self.levels:
            n = level.size()
            self._log_deleted(level.stored()[0].to(self.device, copy=True))
            self.removed += n
            level.clear()

    def export(self) -> Rows:
        """Copies of every row: the fast tier's, then each level's below it (see :meth:`changes_since`)."""
        rows = super().export()
        for level in self.levels:
            rows = _concat(rows, level.export()[0])
        return rows

    def changes_since(self, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`KeyValueTable.changes_since`, rows counted in :meth:`export`'s order (fast, then each level)."""
        rows, deleted = super().changes_since(version)
        parts, start = [rows], self._size
        for level in self.levels:
            n = level.size()
            versions = level._cols["version"].index_select(0, level.stored_rows())  # in export's order
            parts.append((versions > version).nonzero().squeeze(1).to(rows.device) + start)
            start += n
        return torch.cat(parts), deleted

    def replace(self, rows: Rows) -> None:
        """Hold exactly ``rows``; the lowest-score ones past the fast tier's budget then move to the slow tier.
        (All of them pass through the fast tier's memory once.)"""
        super().replace(rows)  # checks every argument's form before anything changes
        for level in self.levels:
            level.clear()
        self._fit_fast()

    def replace_chunks(self, chunks: Iterable[Rows], total: Optional[int] = None) -> None:
        """Hold exactly the rows of ``chunks`` (an iterable of :class:`Rows`, keys unique across all of them),
        one chunk in memory at a time: the first fills the fast tier as :meth:`replace` does, the others go
        straight to the slow tier. ``total``, the rows in all when known, is reserved in the slow tier up front.

        A chunk that fails its checks (a ValueError/TypeError naming the argument) leaves the table holding the
        chunks before it: check the source first (a checkpoint load verifies every file before it streams it).

        Example:
            >>> t = TieredTable(1, tiers=Tiers(fast_capacity=2), initializer="zeros")
            >>> t.replace_chunks([Rows(torch.tensor([k, k + 1]), torch.ones(2, 1), None, {}) for k in (0, 2, 4)])
            >>> t.size(), t.stats()["tiers"]["slow"]["rows"]
            (6, 4)
        """
        it = iter(chunks)
        first = next(it, None)
        if first is None:
            first = Rows(torch.empty(0, dtype=self.key_dtype), torch.empty(0, self.dim, dtype=self.dtype), None, {})
        # The fast tier takes what fits of the first chunk (it never grows past its budget); the rest goes down.
        fast, rest = (_sliced(first, slice(0, self.fast_capacity), self.device),
                      _sliced(first, slice(self.fast_capacity, None), None))
        self.replace(fast)
        if total is not None and total > self.size():
            below = total - self._size
            if self.disk is not None and below > self.host_capacity:
                self.disk._reserve(below - self.host_capacity)
            self.slow._reserve(below if self.disk is None else min(below, self.host_capacity))
        for rows in itertools.chain([rest] if rest.keys.numel() else [], it):
            rows = self._checked(rows)
            if rows.keys.numel() and bool((self.index.find(rows.keys.to(self.device)) >= 0).any()):  # both tiers
                raise ValueError("keys must be unique to load a table (a key of this chunk was loaded by an earlier "
                                 "chunk)")
            self._store_slow(rows)

    def load_chunk(self, rows: Optional[Rows] = None, deleted: Optional[torch.Tensor] = None) -> None:
        """Apply a chunk of a checkpoint delta after :meth:`replace_chunks`: remove the keys ``deleted [K]``, then
        hold ``rows`` (a stored key's row is replaced, with every column). Rows are stamped with the current clock;
        no counter but ``inserted`` changes and nothing is logged (a load sets counters and lineage afterwards).

        Raises:
            TypeError/ValueError: a malformed argument (named); the table is then unchanged.
        """
        checked = None if rows is None else self._checked(rows)
        gone = [] if deleted is None else [check_keys(deleted, self.key_dtype, deleted.device, "deleted")]
        for keys in gone + ([] if checked is None else [checked.keys]):
            keys = torch.unique(keys.to(self.device))
            at = self.index.find(keys)
            fast = at[(at >= 0) & (at < SLOW_BASE)]
            if fast.numel():
                swap_rows(self, fast, None, None)
            for level in self.levels:
                level.erase(keys.to(level.device))
        if checked is not None:
            self._store_slow(checked)

    def _checked(self, rows: Rows) -> Rows:
        """``rows`` checked (forms, keys unique) and on the slow tier's device, every slot given."""
        cpu = self.slow.device
        keys = check_keys(rows.keys, self.key_dtype, getattr(rows.keys, "device", cpu), "keys").to(cpu)
        m = keys.numel()
        values = check_rows_like(rows.values, m, self.dim, self.dtype, getattr(rows.values, "device", cpu), "values",
                                 keys.shape)
        scores = torch.zeros(m, dtype=torch.int64) if rows.scores is None else check_scores(rows.scores, (m,))
        unknown = set(rows.slots) - set(self._slot_init)
        if unknown:
            raise ValueError(f"slots {sorted(unknown)} are not defined on this table (has {self.slot_names})")
        slots = {}
        for name, init in self._slot_init.items():
            slot = self.slot(name)
            given = rows.slots.get(name)
            slots[name] = (torch.full((m, slot.shape[1]), init, dtype=slot.dtype) if given is None else
                           check_rows_like(given, m, slot.shape[1], slot.dtype, given.device, f"slot {name!r}", (m,)))
        if m and torch.unique(keys).numel() != m:
            raise ValueError("keys must be unique to load a table")
        return Rows(keys, values.to(cpu), scores.to(cpu), {n: v.to(cpu) for n, v in slots.items()})

    def _store_slow(self, rows: Rows) -> None:
        """Store checked ``rows`` (keys absent from every level) in the slow tier (a three-level table's host while
        it has room, then its row files), stamped with the current clock."""
        m = rows.keys.numel()
        room = m if self.disk is None else max(0, min(m, self.host_capacity - self.slow._size))
        for level, part in ((self.slow, slice(0, room)), (self.disk, slice(room, m))):
            if part.stop > part.start:
                n = part.stop - part.start
                level.put(_sliced(rows, part, None), torch.full((n,), self.clock, dtype=torch.int64))
        self.inserted += m

    def prefetch(self, keys: torch.Tensor) -> None:
        """Bring the rows of ``keys`` (the next batch's, say) up from the slow tier now, making room for the keys
        stored in neither tier as well, so that the call that names them next finds them in the fast tier. Changes
        no row, score, counter or the clock, and is not counted in the hit rates.

        Shape: ``keys`` any shape, dtype ``key_dtype``.
        """
        self._resident(keys, count=False)

    def _tiered_index(self, device) -> TieredIndex:
        index = TieredIndex(self.key_dtype, device, self.fast_capacity, backend=self.backend)
        index.table = self
        return index

    def _load(self, keys, values, scores, slots) -> None:
        for level in self.levels:
            level._size = 0  # the levels' keys leave with the index's clear (replace then clears them)
        self._queue.clear()
        if self.disk is not None:
            self._host_queue.clear()
        super()._load(keys, values, scores, slots)

    # ------------------------------------------------------------------ layout changes reach both tiers
    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        super().add_slot(name, dim, init, dtype)
        if getattr(self, "slow", None) is not None:
            for level in self.levels:
                level.add_slot(name, dim, init, dtype)
            self._fit_fast()

    def cast(self, dtype: torch.dtype) -> None:
        super().cast(dtype)
        for level in self.levels:
            level.cast(dtype)
        self._fit_fast()

    def to(self, device):
        before = self.device
        super().to(device)  # a plain index of the fast keys: the one index of both tiers is rebuilt below
        if self.device != before:
            self.index = self._tiered_index(self.device)
            self.index.rehash(self.row_keys[: self._size], torch.arange(self._size, device=self.device), self._size)
            for level in self.levels:
                view = level.index
                level.index = SlowIndex(self.index, level, view.base, view.end, view.name)
                level.backend = self.backend if self.device.type == "cpu" else None
            if self.disk is not None:
                self.disk_link = HostLink(self.slow.backend)
            self.link = link_for(self.device, self.backend)
            self._queue.clear()
        if self.slow.directory is None and self.slow.pin != (self.device.type == "cuda"):
            self.slow.pin = self.device.type == "cuda"
            self.slow._resize_columns(self.slow.capacity, self.slow._size)  # placed again: pinned or not
        return self

    # ------------------------------------------------------------------ stats
    def nbytes(self) -> int:
        """Bytes of both tiers (see ``stats()["tiers"]`` for each)."""
        return super().nbytes() + sum(level.nbytes() for level in self.levels)

    def stats(self) -> dict:
        """As :meth:`KeyValueTable.stats` (``size`` counts both tiers), plus ``tiers``: per tier ``rows``,
        ``bytes`` (its columns), ``hit_rate`` (the share of the keys calls looked up that were found there; lookups
        pass each id once per batch) and ``where``; ``index``: the ``bytes`` and ``where`` of the one index of both
        tiers' keys (kept with the fast tier); ``miss_rate``: keys stored in neither tier; ``looked_up``: the counts
        behind the rates (``fast``, ``slow``, ``miss``); ``moved``: ``rows_up``, ``rows_down``, ``bytes_up`` and
        ``bytes_down`` (every column of a row) moved between the tiers. All counts run since construction: the
        change between two calls is one step's traffic (see :func:`tier_traffic`). A three-level table's ``slow``
        is its host level (with its ``capacity``), and ``disk`` its row files: ``rows``, ``bytes``, ``hit_rate``
        (keys found there), ``where``, and ``moved`` between the host and the files (``rows_up`` came up to the
        host)."""
        stats = super().stats()
        looked = max(1, sum(self.hits.values()))
        index_bytes = self.index.nbytes()
        fast_bytes = super().nbytes() - index_bytes
        stats.update(size=self.size(), bytes=self.nbytes(), index_load=self.size() / self.index.slots, tiers={
            "fast": {"rows": self._size, "bytes": fast_bytes, "capacity": self.fast_capacity,
                     "hit_rate": self.hits["fast"] / looked, "where": str(self.device)},
            "slow": {"rows": self.slow.size(), "bytes": self.slow.nbytes(), "hit_rate": self.hits["slow"] / looked,
                     "where": "host" if self.slow.directory is None else self.slow.directory},
            "index": {"bytes": index_bytes, "where": str(self.device)},
            "miss_rate": self.hits["miss"] / looked, "looked_up": dict(self.hits), "moved": dict(self.moved)})
        if self.disk is not None:
            stats["tiers"]["slow"]["capacity"] = self.host_capacity
            stats["tiers"]["disk"] = {"rows": self.disk.size(), "bytes": self.disk.nbytes(),
                                      "hit_rate": self.hits["disk"] / looked, "where": self.disk.directory,
                                      "moved": dict(self.moved_disk)}
        return stats

    # ------------------------------------------------------------------ moving rows
    def _fit_fast(self) -> None:
        """Derive the fast tier's row budget (from ``Tiers.fast_bytes`` and the columns it has now, if given in
        bytes), move rows past it down, and size the columns to it exactly (a call larger than the budget or a
        checkpoint load grows them past it; the one index of both tiers grows with the table)."""
        if self.tiers.fast_bytes is not None:
            slots = {n: (self.slot(n).shape[1], self.slot(n).dtype) for n in self.slot_names}
            per_row = budget.row_bytes(self.dim, self.dtype, self.key_dtype, slots)
            self.fast_capacity = budget.rows_for_bytes(self.tiers.fast_bytes, per_row, self.key_dtype,
                                                       "Tiers.fast_bytes")
        cap = self.fast_capacity
        self._queue.refill = max(1, int(cap * QUEUE))
        if getattr(self, "slow", None) is not None and self._size > cap:
            self._demote(self._size - cap, torch.empty(0, dtype=torch.int64, device=self.device))
        n = self._size
        if self.capacity != max(cap, n):
            self._resize_columns(max(cap, n), n)
        if getattr(self, "disk", None) is not None:
            self._fit_host()

    def _fit_host(self) -> None:
        """A three-level table's host budget (from ``Tiers.host_bytes`` and the row width now, if given in bytes);
        the lowest-score host rows past it move down to the row files."""
        host = self.slow
        if self.tiers.host_bytes is not None:
            width = host.row_nbytes()
            if self.tiers.host_bytes < width:
                raise ValueError(f"Tiers.host_bytes={self.tiers.host_bytes} is too small for one row: a row of this "
                                 f"table takes {width} bytes in host memory")
            self.host_capacity = min(HOST_ROWS, self.tiers.host_bytes // width)
        else:
            self.host_capacity = self.tiers.host_capacity
        self._host_queue.refill = max(1, int(self.host_capacity * QUEUE))
        over = host._size - self.host_capacity
        if over > 0:
            victims = self._host_queue.take(host, over, torch.empty(0, dtype=torch.int64))
            none = torch.empty(0, dtype=torch.int64)
            exchange(host, self.disk, self.disk_link, victims, none.to(self.key_dtype), none, none, self.moved_disk)

    def _resident(self, keys: torch.Tensor, new_ok: bool = True, count: bool = True) -> Optional[torch.Tensor]:
        """Bring the rows of ``keys`` found in the slow tier up, moving other rows down if the fast tier would pass
        its budget (``new_ok``: counting room for the keys stored in neither tier, which the call may insert).
        Returns the fast row of each key ``[N]`` where every key is stored and each one's row is known (no fast
        row moved but those exchanged), else None."""
        flat = check_keys(keys, self.key_dtype, self.device)
        if flat.numel() == 0:
            return None
        slots, rows = self.index.lookup(flat)  # one probe for every level; duplicates are harmless
        fast = (rows >= 0) & (rows < SLOW_BASE)
        from_disk = 0
        if self.disk is not None and bool((rows >= DISK_BASE).any()):
            from_disk = self._up_from_disk(flat, slots, rows)
            slots, rows = self.index.lookup(flat)  # the fast rows are as they were; the files' are host rows now
        up, up_slots, up_at = self._in_level(flat, slots, rows, self.slow)
        n_fast = int(fast.sum())
        new = flat.numel() - n_fast - up.numel()  # an upper bound when keys repeat: at worst more room is made
        if count:
            self.hits["fast"] += n_fast
            self.hits["slow"] += up.numel() - from_disk
            self.hits["miss"] += new
            if from_disk:
                self.hits["disk"] += from_disk
        over = self._size + up.numel() + (new if new_ok else 0) - self.fast_capacity
        victims = self._queue.take(self, over, rows[fast]) if over > 0 else rows[:0]
        dest = exchange(self, self.slow, self.link, victims, up, up_slots, up_at) \
            if up.numel() or victims.numel() else up
        if self.capacity > self.fast_capacity >= self._size:  # grown by an earlier call larger than the budget
            self._fit_fast()
        elif self.disk is not None and self.slow._size > self.host_capacity:
            self._fit_host()
        if new or dest is None or (up.numel() and up.numel() != int((rows >= SLOW_BASE).sum())):
            return None
        if up.numel():
            rows = rows.index_copy(0, (rows >= SLOW_BASE).nonzero().squeeze(1), dest)
        return rows

    def _in_level(self, keys: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, level
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, slots, rows)`` of the distinct ``keys`` whose index ``rows`` (at ``slots``) are in ``level`` (one
        of :attr:`levels`): the key, its index slot, its row there (on the level's device), each ``[U]``."""
        base, end = level.index.base, level.index.end
        at = ((rows >= base) & (rows < end)).nonzero().squeeze(1)
        keys, slots, rows = keys.index_select(0, at), slots.index_select(0, at), rows.index_select(0, at)
        # a lookup passes its keys sorted and distinct: checking that costs one pass, deduplicating a sort
        if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
            keys, first = _first_occurrences(keys)
            slots, rows = slots.index_select(0, first), rows.index_select(0, first)
        return keys, slots, (rows - base).to(level.device)

    def _up_from_disk(self, keys: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> int:
        """Bring the rows of ``keys`` (index ``slots``, ``rows``) found in the row files up to the host, each paired
        with a host row going down where the host is full (none of the call's own host rows, which go up next, and
        never more than come up: no host row of the call moves). Returns the distinct keys brought up."""
        host = self.slow
        keys, key_slots, at = self._in_level(keys, slots, rows, self.disk)
        over = min(keys.numel(), host._size + keys.numel() - self.host_capacity)
        victims = torch.empty(0, dtype=torch.int64)
        if over > 0:
            mine = rows[(rows >= SLOW_BASE) & (rows < DISK_BASE)]
            victims = self._host_queue.take(host, over, (mine - SLOW_BASE).to(host.device))
        exchange(host, self.disk, self.disk_link, victims, keys, key_slots, at, self.moved_disk)
        return keys.numel()

    def _demote(self, n: int, pinned: torch.Tensor) -> None:
        """Move the ``n`` lowest-score fast rows not in ``pinned`` to the slow tier."""
        victims = self._queue.take(self, n, pinned)
        none = torch.empty(0, dtype=torch.int64, device=self.device)
        exchange(self, self.slow, self.link, victims, none.to(self.key_dtype), none, none.cpu())


def _first_occurrences(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique keys, position of each one's first occurrence in keys)``."""
    unique, inverse = torch.unique(keys, return_inverse=True)
    position = torch.arange(keys.numel(), device=keys.device)
    first = torch.full_like(unique, keys.numel(), dtype=torch.int64).scatter_reduce_(0, inverse, position, "amin")
    return unique, first


def tier_traffic(tables, since: Optional[dict] = None) -> dict:
    """The tiers' traffic of ``tables`` (any tables; the tiered ones count) since the snapshot ``since`` (a
    previous return value; None: since construction): ``tier_bytes_moved`` (both directions, every column),
    ``tier_rows_up``/``tier_rows_down``, the fast and slow tiers' hit rates over the keys looked up
    (``tier_fast_hit_rate``, ``tier_slow_hit_rate``; 0 when none was), and ``counts``, the snapshot to pass next
    time. With a three-level table, ``tier_bytes_moved`` counts the host's traffic with its row files as well, and
    ``tier_disk_hit_rate`` the keys found in the files (``tier_slow_hit_rate``: in host memory).

    Example:
        >>> t = TieredTable(2, tiers=Tiers(fast_capacity=2), initializer="zeros")
        >>> before = tier_traffic([t])["counts"]
        >>> rows, found = t.find_or_insert(torch.tensor([0, 1]))
        >>> rows, found = t.find_or_insert(torch.tensor([2, 3]))  # 0 and 1 move down: 32 bytes a row
        >>> step = tier_traffic([t], before)
        >>> step["tier_rows_down"], step["tier_bytes_moved"], step["tier_fast_hit_rate"]
        (2, 64, 0.0)
    """
    counts = {"fast": 0, "slow": 0, "miss": 0, "rows_up": 0, "rows_down": 0, "bytes_up": 0, "bytes_down": 0}
    for table in tables:
        if isinstance(table, TieredTable):
            for name, n in {**table.hits, **table.moved}.items():
                counts[name] = counts.get(name, 0) + n
            if table.disk is not None:  # the host's traffic with the row files counts too
                for name in ("bytes_up", "bytes_down"):
                    counts[name] += table.moved_disk[name]
    d = {k: v - (since or {}).get(k, 0) for k, v in counts.items()}
    looked = d["fast"] + d["slow"] + d["miss"] + d.get("disk", 0)
    out = {"tier_bytes_moved": d["bytes_up"] + d["bytes_down"], "tier_rows_up": d["rows_up"],
           "tier_rows_down": d["rows_down"], "tier_fast_hit_rate": d["fast"] / looked if looked else 0.0,
           "tier_slow_hit_rate": d["slow"] / looked if looked else 0.0, "counts": counts}
    if "disk" in counts:
        out["tier_disk_hit_rate"] = d["disk"] / looked if looked else 0.0
    return out


def _sliced(rows: Rows, part: slice, device) -> Rows:
    """Rows ``part`` of ``rows`` (keys ``[N]``; what is not a tensor is left for the checks to name), moved to
    ``device`` unless None."""
    def cut(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t[part] if device is None else t[part].to(device)
    return Rows(cut(rows.keys), cut(rows.values), cut(rows.scores), {n: cut(s) for n, s in rows.slots.items()})


def _concat(a: Rows, b: Rows) -> Rows:
    dev = a.keys.device
    return Rows(torch.cat([a.keys, b.keys.to(dev)]), torch.cat([a.values, b.values.to(dev)]),
                torch.cat([a.scores, b.scores.to(dev)]), {n: torch.cat([a.slots[n], b.slots[n].to(dev)])
                                                          for n in a.slots})
