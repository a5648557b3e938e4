"""How rows move between the tiers of a :class:`~dynemb.table.tiered.TieredTable`: one exchange a call.

A call that needs ``U`` rows from the slow tier and has to free ``V`` fast rows for them pairs the two up: each
column is gathered once from each side and scattered once into the other, so the ``min(U, V)`` paired rows swap
places (a fast row's slot is refilled by an incoming row, a slow row's by an outgoing one) and no row is compacted.
Only the unpaired rest appends at the end of one tier and leaves holes, filled from the end, in the other.

The copies between the tiers go through a :class:`Link`: :class:`HostLink` when both tiers are host memory (a
RAM fast tier over row files: rows move in one pass, no staging), :class:`StagedLink` when the fast tier is device
memory. A staged link moves each direction as one batched copy through pinned staging buffers on a side stream;
the steps that need a device (pinning, the stream, its events) are the named methods :meth:`StagedLink.staging`,
:meth:`StagedLink.upload`, :meth:`StagedLink.download` and :meth:`StagedLink.fence`, and
``StagedLink(stand_in=True)`` replaces exactly those by host equivalents, so that CI runs every other line of it on
CPU.
"""

from __future__ import annotations

import contextlib

import torch

from ..kernels.dispatch import Backend, resolve_backend
from .index import HashIndex
from .ops import copy_rows, gather_rows, lowest_rows, scatter_rows

__all__ = ["DISK_BASE", "ROW_END", "SLOW_BASE", "HostLink", "Link", "SlowIndex", "StagedLink", "TieredIndex",
           "VictimQueue", "exchange", "link_for"]


class Link:
    """Moves rows between a fast and a slow tier's columns (see the module docstring)."""

    def move(self, fast: torch.Tensor, fast_dest: torch.Tensor, victims: torch.Tensor,
             slow: torch.Tensor, slow_dest: torch.Tensor, up_from: torch.Tensor) -> None:
        """One column: ``fast[fast_dest] <- slow[up_from]`` and ``slow[slow_dest] <- fast[victims]``, both sides read
        before either is written (``fast_dest`` starts with ``victims``' rows, ``slow_dest`` with ``up_from``'s)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Called after the last column of a call: whatever reads the fast tier next sees the moved rows."""


class HostLink(Link):
    """Both tiers in host memory (RAM over row files): each column moves in place, without staging; the paired
    rows swap in one pass of the numba kernel where the table's backend runs numba
    (:mod:`dynemb.kernels.numba_tiers`), else in three torch passes (the reference).

    Args:
        backend: the table's backend (see :mod:`dynemb.kernels.dispatch`).
    """

    def __init__(self, backend=None) -> None:
        self.backend = backend

    def move(self, fast, fast_dest, victims, slow, slow_dest, up_from) -> None:
        k = min(victims.numel(), up_from.numel())
        if k:
            swap = _swap_kernel(self.backend)
            if swap is None or not swap(fast, victims[:k], slow, up_from[:k]):
                down = gather_rows(fast, victims[:k])
                copy_rows(fast, victims[:k], slow, up_from[:k])
                scatter_rows(slow, up_from[:k], down)
        if victims.numel() > k:
            copy_rows(slow, slow_dest[k:], fast, victims[k:])
        if up_from.numel() > k:
            copy_rows(fast, fast_dest[k:], slow, up_from[k:])


def _swap_kernel(backend):
    """The numba kernel's ``swap_rows`` where ``backend`` runs numba on CPU, else None."""
    if resolve_backend(backend, torch.device("cpu")) is not Backend.NUMBA:
        return None
    from ..kernels import numba_tiers  # imported on first use: numba loads slowly
    return numba_tiers.swap_rows


class StagedLink(Link):
    """A device fast tier over a host slow tier: rows cross in batched copies through pinned staging buffers, on
    a side stream, fenced against the default stream by events.

    Per column a call makes one host gather into staging, one upload, one device scatter (rows coming up) and one
    device gather, one download, one host scatter (rows going down). The device-specific steps are methods of
    their own; ``stand_in=True`` runs them on host memory (no pinning, no stream: copies are synchronous), so the
    rest of this class is tested on CPU.

    Args:
        device: the fast tier's device.
        stand_in: host stand-ins for pinning, the stream and its events.
    """

    def __init__(self, device: torch.device, *, stand_in: bool = False) -> None:
        self.device = torch.device(device)
        self.stand_in = bool(stand_in) or self.device.type != "cuda"
        self._stream = None if self.stand_in else torch.cuda.Stream(self.device)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._done = None  # event: the side stream's last moves are complete

    # ---------------------------------------------------------------- device-specific steps
    def staging(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of ``shape`` for column ``name``'s rows in flight: pinned memory on CUDA (copies from it
        run asynchronously), reused while large enough."""
        key = (name, dtype, tuple(shape[1:]))
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < shape[0]:
            rows = max(shape[0], 0 if buf is None else buf.shape[0] * 2)
            buf = torch.empty((rows,) + tuple(shape[1:]), dtype=dtype, pin_memory=not self.stand_in)
            self._buffers[key] = buf
        return buf[: shape[0]]

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (staging) on the fast tier's device, copied on the side stream."""
        if self.stand_in:
            return host.clone()
        return host.to(self.device, non_blocking=True)

    def download(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``rows`` (on the device) copied into ``out`` (staging) on the side stream; the host may read ``out`` once
        :meth:`fence` has waited for it."""
        out.copy_(rows, non_blocking=not self.stand_in)
        return out

    def fence(self, wait_for_device: bool) -> contextlib.AbstractContextManager:
        """The context the moves run in: on CUDA the side stream, which first waits for the work already queued on
        the default stream (it may still read the victims' rows). ``wait_for_device``: on exit, block the host
        until the side stream is done (a download must land before the host scatters it)."""
        if self.stand_in:
            return contextlib.nullcontext()
        return _side_stream(self, wait_for_device)

    def finish(self) -> None:
        """Make the default stream wait for the moves (the call that reads the rows next queues after them)."""
        if not self.stand_in and self._done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._done)
            self._done = None

    # ---------------------------------------------------------------- the logic CI tests
    def move(self, fast: torch.Tensor, fast_dest: torch.Tensor, victims: torch.Tensor,
             slow: torch.Tensor, slow_dest: torch.Tensor, up_from: torch.Tensor) -> None:
        """As :meth:`HostLink.move`, across the link: ``fast`` on the device, ``slow`` on the host; the index
        tensors on their tier's device."""
        # one buffer each way per row shape: a column's copies are fenced before the next column reuses them
        with self.fence(wait_for_device=True):
            shape = (victims.numel(),) + tuple(fast.shape[1:])
            down = self.download(gather_rows(fast, victims), self.staging("down", shape, fast.dtype))
            staged = self.staging("up", (up_from.numel(),) + tuple(slow.shape[1:]), slow.dtype)
            gather_rows(slow, up_from, out=staged)
            up = self.upload(staged)
            _put(fast, fast_dest, up)
        # the download has landed (fenced): the host scatters it
        _put(slow, slow_dest, down)


@contextlib.contextmanager
def _side_stream(link: StagedLink, wait_for_device: bool):
    stream = link._stream
    stream.wait_stream(torch.cuda.current_stream(link.device))
    with torch.cuda.stream(stream):
        yield
    done = torch.cuda.Event()
    done.record(stream)
    if wait_for_device:
        done.synchronize()
    link._done = done


def link_for(device: torch.device, backend=None) -> Link:
    """The link a tiered table on ``device`` (with kernel ``backend``) moves rows through: staged on CUDA, in place
    on the host."""
    return StagedLink(device) if torch.device(device).type == "cuda" else HostLink(backend)


def _put(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows] = src`` (rows unique)."""
    if rows.numel():
        scatter_rows(dst, rows, src)


def _row_bytes(col: torch.Tensor) -> int:
    return (col.numel() // max(1, col.shape[0])) * col.element_size()


def exchange(fast, slow, link, victims: torch.Tensor, up_keys: torch.Tensor, up_slots: torch.Tensor,
             up_at: torch.Tensor, moved: dict | None = None) -> torch.Tensor | None:
    """Move the ``fast`` level's rows ``victims [V]`` (unique, live) down and the ``slow`` level's rows ``up_at
    [U]`` of keys ``up_keys`` (unique; ``up_slots``: their slots in the table's :class:`TieredIndex`) up, every
    column with them (keys, values, scores, version stamps, optimizer slots). The first ``min(U, V)`` of each swap
    places; the rest append at the end of the other level, whose holes then fill from its end. Every key keeps its
    index slot: only the row ids there change. Changes no value, score, stamp or counter. Returns the fast rows
    ``[U]`` the keys came up to, or None where fast rows were compacted (more went down than came up: rows of the
    call may have moved).

    Any two adjacent levels of a table: its fast tier over the host (``fast.index`` the :class:`TieredIndex`), or,
    in a three-level table, the host over the row files (``fast.index`` a :class:`SlowIndex`); ``moved``: the
    traffic counts to add to (default ``fast.moved``).
    """
    log = hasattr(slow, "raw_rows")  # row files written as a log (LogStore)
    if log and isinstance(link, HostLink):
        return _exchange_into_log(fast, slow, link, victims, up_keys, up_slots, up_at, moved)
    v, u = victims.numel(), up_keys.numel()
    k = min(u, v)
    index = fast.index
    # The keys stay as many (the index keeps its size and flags): only a level's columns may have to grow, and with
    # them (sized for the larger level) the index, whose slots found before are then stale.
    rebuilds, rewrites = index.rebuilds, getattr(slow, "rewrites", 0)
    if fast._size + u - k > fast.capacity:
        fast._reserve(fast._size + u - k)
    if log or slow._size + v - k > slow.capacity:
        slow._reserve(slow._size + v - k)
    if index.rebuilds != rebuilds:
        up_slots = index.find_slots(up_keys)
    if log and slow.rewrites != rewrites:  # packed into a new file: the rows coming up moved
        up_at = slow.index.find(up_keys)
    fast_cols, slow_cols = fast._cols, slow._cols
    down_slots = index.find_slots(gather_rows(fast_cols["key"], victims))
    fast_dest = torch.cat([victims[:k], torch.arange(fast._size, fast._size + u - k, device=fast.device)])
    if log:  # a staged link writes through the mapping: the rows it appends are claimed at the ring's head
        tail, stale = slow.claim(v - k)
        if stale:
            up_at = slow.index.find(up_keys)
    else:
        tail = torch.arange(slow._size, slow._size + v - k, device=slow.device)
    slow_dest = torch.cat([up_at[:k], tail])
    for name, col in fast_cols.items():
        link.move(col, fast_dest, victims, slow_cols[name], slow_dest, up_at)
    link.finish()
    _count_moves(fast.moved if moved is None else moved, fast_cols, u, v)
    index.set_rows(up_slots, fast_dest)
    slow.index.set_rows(down_slots, slow_dest)
    fast._size += u - k
    slow._size += v - k
    fast.row_moves += 1
    if u > k:
        slow._compact(up_at[k:])
    if v > k:
        fast._compact(victims[k:])
        return None
    return fast_dest


def _count_moves(moved: dict, cols: dict, up: int, down: int) -> None:
    """Add a call's rows moved up and down, and their bytes (every column of a row), to the ``moved`` counts."""
    row = sum(_row_bytes(col) for col in cols.values())
    moved["rows_up"] += up
    moved["rows_down"] += down
    moved["bytes_up"] += up * row
    moved["bytes_down"] += down * row


def _exchange_into_log(fast, slow, link, victims, up_keys, up_slots, up_at, moved):
    """:func:`exchange` where ``slow`` is a :class:`~dynemb.table.slow.LogStore` (row files written as a log): the
    rows going down are appended to it in one sequential write, the rows coming up leave holes there (no slow row
    is written in place), and the fast side is as in :func:`exchange` (the rows coming up take the victims' rows,
    the rest append; fast holes fill from the end)."""
    v, u = victims.numel(), up_keys.numel()
    k = min(u, v)
    index = fast.index
    rebuilds, rewrites = index.rebuilds, slow.rewrites
    if fast._size + u - k > fast.capacity:
        fast._reserve(fast._size + u - k)
    if slow.ring_rows(slow._size + v) > slow.capacity:  # the ring's room for the rows coming down
        slow._reserve(slow._size + v)  # (the index keeps its keys: an exchange moves them between levels)
    if index.rebuilds != rebuilds:
        up_slots = index.find_slots(up_keys)
    if slow.rewrites != rewrites:  # packed into a new file: the rows coming up moved
        up_at = slow.index.find(up_keys)
    fast_cols = fast._cols
    down_keys = gather_rows(fast_cols["key"], victims)
    down_slots = index.find_slots(down_keys)
    kernels = _raw_kernels(link.backend)
    layout, width = slow._file_layout
    pads = _pads(layout, width)
    # the rows going down, in the file's layout (padding zeroed: the files hold nothing but rows)
    down = torch.empty((v, width), dtype=torch.uint8)
    fast_dest = torch.cat([victims[:k], torch.arange(fast._size, fast._size + u - k, device=fast.device)])
    moves = _file_columns(fast_cols, layout)
    # every column of a row in one pass, the file's rows read straight into the columns
    if kernels is None or not kernels.exchange_with_file([col for col, _ in moves], [at for _, at in moves],
                                                         victims, down, slow._buf, up_at, fast_dest, pads):
        _exchange_by_column(kernels, fast_cols, layout, slow, victims, fast_dest, up_at, down, k, u, pads)
    if u:
        slow._compact(up_at)  # holes in the ring
    slow_dest = slow._append(down) if v else up_at[:0]
    _count_moves(fast.moved if moved is None else moved, fast_cols, u, v)
    index.set_rows(up_slots, fast_dest)
    slow.index.set_rows(down_slots, slow_dest)
    fast._size += u - k
    slow._size += v
    fast.row_moves += 1
    slow.row_moves += 1
    if v > k:
        fast._compact(victims[k:])
        return None
    return fast_dest


def _exchange_by_column(kernels, fast_cols, layout, slow, victims, fast_dest, up_at, down, k, u, pads) -> None:
    """The column moves of :func:`_exchange_into_log` a column at a time (where the one-pass kernel does not take
    the columns, or without numba): the file's rows coming up gathered first, read once each."""
    for a, b in pads:
        down[:, a:b] = 0
    up = None
    if u:
        up = kernels.gather_raw(slow._buf, up_at) if kernels is not None else None
        if up is None:
            up = slow._buf.index_select(0, up_at)
    for name, col in fast_cols.items():
        start, nbytes, shape = layout[name]
        # the k paired rows swap in one pass over the victims' rows; the rest go one way
        if kernels is not None and kernels.swap_with_raw(col, victims[:k], down, up if k else down, start) \
                and kernels.rows_to_raw(down[k:], start, col, victims[k:]) \
                and (u == k or kernels.rows_from_raw(col, fast_dest[k:], up, torch.arange(k, u), start)):
            continue
        _raw_view(down, start, nbytes, shape, col.dtype).copy_(col.index_select(0, victims))
        if u:
            col.index_copy_(0, fast_dest, _raw_view(up, start, nbytes, shape, col.dtype))


def _file_columns(cols: dict, layout: dict) -> list:
    """``[(column, byte offset in a file row)]`` for the one-pass kernel: a table's paired stamps (score and
    version side by side in one ``[N, 2]`` tensor, as in the file's rows) as one column, moved in one pass."""
    score, version = cols.get("score"), cols.get("version")
    paired = score is not None and version is not None and score.dim() == version.dim() == 1 \
        and score.dtype == version.dtype and score.stride(0) == version.stride(0) == 2 \
        and version.data_ptr() == score.data_ptr() + score.element_size() \
        and layout["version"][0] == layout["score"][0] + score.element_size()
    out = []
    for name, col in cols.items():
        if paired and name == "version":
            continue
        if paired and name == "score":
            col = torch.as_strided(col, (col.shape[0], 2), (2, 1))
        out.append((col, layout[name][0]))
    return out


def _pads(layout: dict, width: int) -> list:
    """Byte ranges ``[(start, end)]`` of a file row that no column covers (written as zeros)."""
    pads, at = [], 0
    for start, nbytes, _ in sorted(layout.values()):
        if start > at:
            pads.append((at, start))
        at = max(at, start + nbytes)
    if width > at:
        pads.append((at, width))
    return pads


def _raw_view(raw: torch.Tensor, start: int, nbytes: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A column's view ``[N, *shape]`` of raw rows ``[N, width]`` (uint8) at byte ``start``."""
    view = raw[:, start:start + nbytes].view(dtype)
    return view[:, 0] if not shape else view.view(raw.shape[0], *shape)


def _raw_kernels(backend):
    """:mod:`dynemb.kernels.numba_tiers` where ``backend`` runs numba on CPU (rows to and from a file's raw rows in
    one pass a column), else None (torch: a gather, then a strided copy)."""
    if resolve_backend(backend, torch.device("cpu")) is not Backend.NUMBA:
        return None
    from ..kernels import numba_tiers
    return numba_tiers


#: row ids from which a :class:`TieredIndex` points into the levels below the fast tier (row ``SLOW_BASE + r`` is
#: row ``r`` of the host, or of the row files of a two-level table)
SLOW_BASE = 1 << 30
#: where a three-level table's row files start (row ``DISK_BASE + r`` is file row ``r``); its host has the ids below
DISK_BASE = SLOW_BASE + (1 << 28)
#: the end of the row ids (the index stores int32)
ROW_END = 1 << 31


class TieredIndex(HashIndex):
    """One hash index over every level of a tiered table: fast row ``r`` is stored as ``r``, a lower level's row
    ``r`` as its base plus ``r`` (``SLOW_BASE``; in a three-level table the row files from ``DISK_BASE``). One probe
    tells where a key is, and a key moving between the levels keeps its slot: an exchange rewrites row ids in place,
    and never hashes, places or removes a key. (Two indexes, one a tier, took two inserts, two removals and a probe
    of the slow one per call: about a third of the time a call spent moving rows.) Sizing and rehashing count the
    keys of every level; a lower level reaches this index through a :class:`SlowIndex`.

    ``table``: the tiered table (its ``_size``, ``row_keys`` and ``levels``), set by it.
    """

    table = None
    rebuilds = 0  # counts reallocations: slots found before one are stale

    def _alloc(self, num_buckets: int) -> None:
        super()._alloc(num_buckets)
        self.rebuilds += 1

    def _levels(self) -> tuple:
        return getattr(self.table, "levels", ())

    def _slow_size(self) -> int:
        return sum(level._size for level in self._levels())

    def needs_rehash(self, num_keys: int) -> bool:
        """As :meth:`HashIndex.needs_rehash` for ``num_keys`` fast keys beside the lower levels' keys."""
        return super().needs_rehash(num_keys + self._slow_size())

    def rehash(self, keys: torch.Tensor, rows: torch.Tensor, capacity: int) -> None:
        """Rebuild holding the fast tier's ``keys -> rows`` and every lower level's keys, sized for ``capacity`` fast
        keys beside them."""
        self._rebuild(None, keys, rows, capacity)

    def rehash_level(self, level, keys: torch.Tensor, rows: torch.Tensor, capacity: int) -> None:
        """:meth:`rehash` called by a lower ``level``: ``keys -> rows`` are its own, ``capacity`` its keys."""
        self._rebuild(level, keys, rows, capacity)

    def _rebuild(self, caller, keys: torch.Tensor, rows: torch.Tensor, capacity: int) -> None:
        table, device = self.table, self.device
        if caller is None:
            all_keys, all_rows = [keys], [rows]
        else:
            n = table._size
            all_keys, all_rows = [table.row_keys[:n]], [torch.arange(n, device=device)]
            capacity += n
        for level in self._levels():
            base = level.index.base
            if level is caller:
                all_keys.append(keys.to(device))
                all_rows.append(rows.to(device) + base)
            elif level._size:
                level_keys, level_rows = level.stored()
                all_keys.append(level_keys.to(device))
                all_rows.append(level_rows.to(device) + base)
                capacity += level._size
        keys, rows = (all_keys[0], all_rows[0]) if len(all_keys) == 1 else (torch.cat(all_keys), torch.cat(all_rows))
        HashIndex.rehash(self, keys, rows, capacity)


class SlowIndex:
    """A lower level's view of its table's :class:`TieredIndex`: the :class:`HashIndex` methods a row store calls,
    on the level's own row ids (``base .. end`` in the one index) and on its device. Clearing and counting bytes
    are the table's.

    Args:
        index: the table's index.
        slow: the level (a :class:`~dynemb.table.slow.SlowStore`).
        base, end: the level's row ids in ``index``.
        name: the level, in errors.
    """

    def __init__(self, index: TieredIndex, slow, base: int = SLOW_BASE, end: int = ROW_END,
                 name: str = "slow tier") -> None:
        self.index, self.slow = index, slow
        self.base, self.end, self.name = base, end, name
        self.key_dtype = index.key_dtype

    @property
    def rebuilds(self) -> int:
        return self.index.rebuilds

    @property
    def device(self) -> torch.device:
        return self.index.device

    def _there(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.index.device)

    def _mine(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows >= self.base) & (rows < self.end)

    def find(self, keys: torch.Tensor, hashes: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.index.find(self._there(keys))
        return torch.where(self._mine(rows), rows - self.base, -1).to(self.slow.device)

    def lookup(self, keys: torch.Tensor, hashes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        slots, rows = self.index.lookup(self._there(keys))
        mine = self._mine(rows)
        return (torch.where(mine, slots, -1).to(self.slow.device),
                torch.where(mine, rows - self.base, -1).to(self.slow.device))

    def find_slots(self, keys: torch.Tensor, hashes: torch.Tensor | None = None) -> torch.Tensor:
        return self.index.find_slots(self._there(keys))

    def insert(self, keys: torch.Tensor, rows: torch.Tensor, hashes: torch.Tensor | None = None) -> None:
        self.index.insert(self._there(keys), self._there(rows) + self.base)

    def remove(self, slots: torch.Tensor) -> None:
        self.index.remove(self._there(slots))

    def set_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.index.set_rows(self._there(slots), self._there(rows) + self.base)

    def needs_rehash(self, num_keys: int) -> bool:
        if num_keys > self.end - self.base:
            raise ValueError(f"a tiered table holds at most {self.end - self.base} rows in its {self.name}, asked "
                             f"for {num_keys}")
        others = self.index.table._size + sum(level._size for level in self.index._levels() if level is not self.slow)
        return HashIndex.needs_rehash(self.index, num_keys + others)

    def rehash(self, keys: torch.Tensor, rows: torch.Tensor, capacity: int) -> None:
        self.index.rehash_level(self.slow, keys, rows, capacity)

    def clear(self) -> None:
        """Nothing: the table clears the one index (its ``clear`` and ``replace`` do)."""

    def nbytes(self) -> int:
        return 0  # the table counts the one index


class VictimQueue:
    """Fast rows to move down next, lowest score first: one scan of the scores picks many calls' worth, and a call
    takes those still valid (the same key, not touched since: the same version stamp; not used by the call).

    Args:
        refill: rows a scan picks beyond what the call needs.
    """

    def __init__(self, refill: int) -> None:
        self.refill = max(1, int(refill))
        self.clear()

    def clear(self) -> None:
        self._rows = self._keys = self._versions = None

    def take(self, table, n: int, pinned: torch.Tensor) -> torch.Tensor:
        """``min(n, rows not pinned)`` fast rows of ``table`` to move down, none of ``pinned [P]`` (rows the call
        uses); ``[n']`` int64, unique."""
        size = table._size
        if n <= 0 or size == 0:
            return torch.empty(0, dtype=torch.int64, device=table.device)
        used = torch.zeros(size, dtype=torch.bool, device=table.device)
        used[pinned] = True
        if self._rows is not None:
            # the head first: most entries are still valid, and a call needs a few of many
            for end in (min(self._rows.numel(), 2 * n + 64), self._rows.numel()):
                good = self._valid(table, used, end).nonzero().squeeze(1)
                if good.numel() >= n:
                    taken = self._rows.index_select(0, good[:n])
                    start = int(good[n - 1]) + 1  # what precedes was taken or is no longer valid
                    self._keep(self._rows[start:], self._keys[start:], self._versions[start:])
                    return taken
        picked = _low_rows(table.scores[:size], n + self.refill, used, pinned)
        rest = picked[n:]
        self._keep(rest, gather_rows(table.row_keys, rest), gather_rows(table._cols["version"], rest))
        return picked[:n]

    def _valid(self, table, used: torch.Tensor, end: int) -> torch.Tensor:
        """Which of the first ``end`` entries may still move down: live, the same key and version, not used."""
        rows = self._rows[:end]
        ok = rows < table._size
        at = torch.where(ok, rows, 0)
        ok &= gather_rows(table.row_keys, at) == self._keys[:end]
        ok &= gather_rows(table._cols["version"], at) == self._versions[:end]
        return ok & ~used.index_select(0, at)

    def _keep(self, rows, keys, versions) -> None:
        self._rows, self._keys, self._versions = rows, keys, versions


_SAMPLE = 1024  # scores read to place the threshold of a scan


def _low_rows(scores: torch.Tensor, k: int, used: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
    """``min(k, unused)`` unused positions of ``scores [S]`` among the lowest: those below a threshold read off an
    even sample of the scores, in position order, then those tied with it; where that leaves too few, the exact
    ``k`` lowest (:func:`~dynemb.table.ops.lowest_rows`). One pass over the scores, where an exact pick of many
    rows sorts them (30,000 of 200,000: 5.3 ms against about 0.5)."""
    size = scores.numel()
    if size > 4 * _SAMPLE and k < size // 2:
        sample = scores[:: size // _SAMPLE].sort().values
        threshold = sample[min(sample.numel() - 1, (5 * k * sample.numel()) // (4 * size))]  # a margin for the estimate
        free = ~used
        below = ((scores < threshold) & free).nonzero().squeeze(1)
        if below.numel() < k:  # rows tied at the threshold (a batch stamps its rows alike) make up the rest
            below = torch.cat([below, ((scores == threshold) & free).nonzero().squeeze(1)])
        if below.numel() >= k:
            return below[:k]
    return lowest_rows(scores, k, pinned)
