"""TableGroup: dynamic tables whose lookups run as one call of the ``group`` kernels for all of them.

Grouping is an execution detail. Every table keeps its own index, rows, slots, seed, clock, scores, counters,
capacity and bound; the kernels read each table's storage at its own addresses (a row of ``meta`` a table, see
:data:`~dynemb.kernels.dispatch.GROUP_META`) and write what the table's own ``find_or_insert`` would write: the same
rows, in the same order (new keys numbered by hash), the same initial rows and stamps. Nothing of the group is ever
saved, exported or named in an error.

A grouped lookup asks the host nothing. The tables' sizes live on the device while grouped lookups run (``sizes``),
and each table's ``size()``, ``inserted`` and anything else that needs its count read them back, once for the whole
group (:meth:`TableGroup.settle`). Before a call the group checks, on Python numbers only, that every key of the
batch could be new without passing a table's capacity, bound or index load (``bound``: the size at the last
settle plus every key passed since); only when that check fails does it settle (the one read) and, where the table
must grow, grow it before the call, so that room never runs out inside a kernel. A bounded table that would have to
evict runs its own lookup that call (:meth:`TableGroup.admit` says which).

Which tables a group holds (:func:`refusal`): plain :class:`~dynemb.table.KeyValueTable` s of float32 values with a
built-in initializer (uniform or constant), an ``lru`` or ``epoch_lru`` policy (their stamps are one value a call),
no admission filter and no byte budget. The others run their own lookups, with the same results.

Every backend runs groups: numba and Triton with their ``group`` kernels, which follow ``meta``'s addresses; torch
with the family's torch reference (:mod:`~dynemb.table.group_reference`, chosen by :func:`group_ops`), which reads
the group's tables instead. The family's functions take the group itself, and each implementation reads it its way.
"""

from __future__ import annotations

import torch

from ..kernels.dispatch import GROUP_META, FamilyKernels, kernels_for, resolve_backend
from . import group_reference
from .hashing import mix64
from .initializers import CallableInitializer
from .kv import KeyValueTable
from .policy import EvictionPolicy, fill_score

__all__ = ["TableGroup", "HostValues", "refusal", "group_key", "group_ops"]

_STAMPED = (EvictionPolicy.LRU, EvictionPolicy.EPOCH_LRU)


def refusal(table) -> str | None:
    """Why ``table`` cannot join a kernel group, or None when it can (see the module). Its backend does not matter:
    every backend runs groups (torch through :mod:`~dynemb.table.group_reference`)."""
    if type(table) is not KeyValueTable:
        return f"a {type(table).__name__} runs its own lookups"
    if table.dtype != torch.float32:
        return f"values of {table.dtype} (the group kernels serve float32)"
    if table.admission is not None:
        return "an admission filter decides which keys get rows"
    if table.max_bytes is not None:
        return "a byte budget sizes the table"
    if table.policy not in _STAMPED:
        return f"eviction {table.policy.value!r} counts accesses"
    if isinstance(table.initializer, CallableInitializer) or table.initializer.kernel_spec() is None:
        return "its initializer has no kernel"
    return None


def group_ops(backend, device) -> FamilyKernels:
    """The ``group`` family that runs a group's operations on ``backend`` and ``device``: the kernels (numba, Triton)
    where a module serves the family, else its torch reference (:mod:`~dynemb.table.group_reference`), which lives
    here beside the group it serves, as every family's torch reference does, and reads the group's tables rather than
    the addresses of ``meta``. Both implement the family's declared functions, and only those."""
    kernels = kernels_for(backend, device).group
    return kernels if kernels else _REFERENCE


_REFERENCE = FamilyKernels("group", group_reference)


def group_key(table) -> tuple:
    """What tables must share to run in one group: the device, the key dtype and the resolved backend (value
    dtypes are float32 for all; dims may differ)."""
    return table.device, table.key_dtype, resolve_backend(table.backend, table.device)


class TableGroup:
    """Tables (all accepted by :func:`refusal`, one :func:`group_key`) whose find-or-insert runs as one kernel call.

    Args:
        tables: the tables, in a fixed order: table ``t`` is row ``t`` of the kernels' ``meta``.
        slots: for each table, the slot names its optimizer's kernel reads, in the kernel's order (at most two;
            ``()`` without an optimizer). New rows get every one of them at its initial value; a table with a slot
            not named here runs its own lookups (:meth:`admit`), whose inserts initialize all of them.

    Raises:
        ValueError: a table the group cannot hold, or tables of different group keys.
    """

    def __init__(self, tables: list, slots: list[tuple[str, ...]] | None = None) -> None:
        if not tables:
            raise ValueError("a TableGroup needs at least one table")
        for table in tables:
            why = refusal(table)
            if why is not None:
                raise ValueError(f"table {getattr(table, 'name', None)!r} cannot join a kernel group: {why}")
        keys = {group_key(t) for t in tables}
        if len(keys) > 1:
            raise ValueError(f"tables of one group share device, key dtype and backend, got {sorted(map(str, keys))}")
        self.tables = list(tables)
        self.slots = [tuple(s) for s in slots] if slots is not None else [()] * len(tables)
        if len(self.slots) != len(self.tables) or any(len(s) > 2 for s in self.slots):
            raise ValueError(f"slots must name at most two slots for each of the {len(tables)} tables")
        self.device, self.key_dtype, self.backend = group_key(tables[0])
        self.kernels = group_ops(self.backend, self.device)
        self.pending = False  # the device sizes are ahead of the tables' own counts
        self.stale = True  # the tables' own counts are ahead of the device sizes
        self.sizes: torch.Tensor | None = None
        self._bound = [0] * len(tables)
        self._signature: tuple | None = None
        self.meta = self.fmeta = None
        self._headroom: list[int] = []
        self._covered: list[bool] = []
        self.staging = HostValues(self.device)

    def __len__(self) -> int:
        return len(self.tables)

    # ------------------------------------------------------------------ the device counters
    def settle(self) -> None:
        """Read the device sizes back into every table (the one read of the group), and count their inserts."""
        if not self.pending:
            return
        self.pending = False
        sizes = self.sizes.tolist()
        for table, size in zip(self.tables, sizes):
            table._inserted += size - table._live
            table._live = size
        self._bound = sizes

    def _attach(self) -> None:
        """Be every table's ledger: settle another group that held one, and upload the tables' counts when they
        moved on the host (a lookup of the table's own, a load) since the last call."""
        for table in self.tables:
            ledger = table._ledger
            if ledger is not self:
                if ledger is not None:
                    ledger.settle()
                table._ledger = self
                self.stale = True
        if self.stale:
            self.settle()
            self.sizes = torch.tensor([t._live for t in self.tables], dtype=torch.int64, device=self.device)
            self._bound = [t._live for t in self.tables]
            self.stale = False

    # ------------------------------------------------------------------ one call
    def admit(self, counts: dict[int, int]) -> list[int]:
        """Make room for a call that passes ``counts[t]`` keys to table ``t`` and return the tables that can run in
        it (every key of theirs could be new: rows, bound and index load hold them); the others must run their own
        lookup this call (a bounded table that would evict, a table with a slot the group does not fill, a table
        with more keys than the backend's ``max_ids_per_table()``). Settles
        (one read) and grows tables only when the bound says a table might run out."""
        self._attach()
        self._refresh()
        limit = self.kernels.max_ids_per_table()  # the backend's: above it a table's own lookup costs no more
        counts = {t: n for t, n in counts.items() if self._covered[t] and (limit is None or n <= limit)}
        short = [t for t, n in counts.items() if self._bound[t] + n > self._headroom[t]]
        if not short:
            return list(counts)
        self.settle()
        refused = []
        for t in short:
            table, need = self.tables[t], self.tables[t]._live + counts[t]
            if need <= self._headroom[t]:
                continue
            if table.max_capacity is not None and need > table.max_capacity:
                refused.append(t)  # it may have to evict: its own lookup decides
                continue
            table._reserve(need)  # grows the columns and the index now, on the host, before any kernel runs
        self._refresh()
        return [t for t in counts if t not in refused]

    def fits(self, counts: dict[int, int]) -> bool:
        """Whether a call passing ``counts[t]`` keys to table ``t`` runs with no read, growth or eviction: the
        check :meth:`admit` makes first, on Python numbers only (a CUDA-graph replay asks it before it replays)."""
        return (not self.stale and all(t._ledger is self for t in self.tables)
                and self._signature == tuple((t.storage_generation, t.index, t.index.generation) for t in self.tables)
                and all(self._covered[t] and self._bound[t] + n <= self._headroom[t] for t, n in counts.items()))

    def stamp_values(self, counts: dict[int, int]) -> list[tuple[int, int]]:
        """Advance the clock of each table of a call (``counts``: its tables) and return every table's
        ``(score, version)`` stamp of it, as :meth:`find_or_insert` writes them."""
        stamps = []
        for t, table in enumerate(self.tables):
            if t in counts:
                table.clock += 1
            # lru / epoch_lru: one score for every row an access touches, and the version
            stamps.append((fill_score(table.policy, clock=table.access_clock, epoch=table.epoch), table.clock))
            if table._pending:  # deferred stamps of the table's own lookups land first
                table._settle_stamps()
        return stamps

    def replayed(self, counts: dict[int, int]) -> None:
        """The host's part of a call replayed in a CUDA graph (:mod:`dynemb.collection.step_graph`): what
        :meth:`admit` and :meth:`find_or_insert` do on the host, the stamps written to the staging the graph reads.
        The caller checked :meth:`fits`."""
        self.staging.fill("stamps", self.stamp_values(counts))
        for t, n in counts.items():
            self._bound[t] += n
        self.pending = True

    def find_or_insert(self, keys: torch.Tensor, seg: torch.Tensor, seg_first: torch.Tensor,
                       counts: dict[int, int]) -> torch.Tensor:
        """``rows [N]`` int64 of ``keys [N]`` (key ``i`` of table ``seg[i]``, runs of a table contiguous,
        ``seg_first[i]`` the start of ``i``'s run), inserting the absent ones, for the tables :meth:`admit` let
        run (``counts``: their keys in this call). Each table's clock advances and every row read is stamped, as
        its own ``find_or_insert`` does."""
        stamps = self.staging.put("stamps", self.stamp_values(counts), torch.int64)
        rows = self.kernels.find_or_insert(self, keys, seg, seg_first, self.sizes, stamps)
        for t, n in counts.items():
            self._bound[t] += n
        self.pending = True
        return rows

    # ------------------------------------------------------------------ the tables' storage
    def _refresh(self) -> None:
        """Rebuild ``meta`` when a table's storage moved (growth, a rehash, a new slot, a cast, a move)."""
        signature = tuple((t.storage_generation, t.index, t.index.generation) for t in self.tables)
        if signature == self._signature:
            return
        rows, frows, headroom = [], [], []
        self._covered = [set(table.slot_names) <= set(slots) for table, slots in zip(self.tables, self.slots)]
        for table, slots in zip(self.tables, self.slots):
            row, frow = _meta_row(table, slots)
            rows.append(row)
            frows.append(frow)
            index, capacity = table.index, table.capacity
            headroom.append(min(capacity, table.max_capacity or capacity, int(index.MAX_LOAD * index.slots)))
        self.meta = torch.tensor(rows, dtype=torch.int64, device=self.device)
        self.fmeta = torch.tensor(frows, dtype=torch.float32, device=self.device)
        self._headroom = headroom
        self._signature = signature


def _meta_row(table: KeyValueTable, slots: tuple[str, ...]) -> tuple[list[int], list[float]]:
    """A table's row of ``meta`` (:data:`~dynemb.kernels.dispatch.GROUP_META`) and of ``fmeta``."""
    index, columns = table.index, table._columns
    kind, params = table.initializer.kernel_spec()
    low, width = (params[0], params[1] - params[0]) if kind == "uniform" else (
        float(torch.tensor(params[0], dtype=table.dtype).float()), 0.0)
    slot_cols = [table.slot(name) for name in slots] + [None] * (2 - len(slots))
    fields = {
        "buckets": index._buckets.data_ptr(), "overflow": index.overflow.data_ptr(), "shift": index._shift,
        "num_buckets": index.num_buckets, "values": columns["value"].data_ptr(), "dim": table.dim,
        "row_keys": columns["key"].data_ptr(), "stamps": columns["score"].data_ptr(),
        "slot0": 0 if slot_cols[0] is None else slot_cols[0].data_ptr(),
        "slot0_width": 0 if slot_cols[0] is None else slot_cols[0].shape[1],
        "slot1": 0 if slot_cols[1] is None else slot_cols[1].data_ptr(),
        "slot1_width": 0 if slot_cols[1] is None else slot_cols[1].shape[1],
        "seed": int(mix64(torch.tensor(table.seed, dtype=torch.int64))), "init": 1 if kind == "uniform" else 2,
        "capacity": table.capacity,
    }
    inits = [float(table._slot_init[name]) for name in slots] + [0.0] * (2 - len(slots))
    return [fields[name] for name in GROUP_META], [float(low), float(width), *inits]



class HostValues:
    """Small per-call values the host computes (stamps, hyper-parameters) on their way to the device.

    Eagerly, :meth:`put` makes a new device tensor of them. While a CUDA graph is being captured it instead writes
    them into a pinned host tensor kept under ``name`` and copies that into a device tensor kept beside it: the
    graph records the copy from the pinned memory, so that before each replay :meth:`fill` writes the next step's
    values there and the replay carries them over.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, name: str, values: list, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            return torch.tensor(values, dtype=dtype, device=self.device)
        host = torch.tensor(values, dtype=dtype).pin_memory()
        device = torch.empty(host.shape, dtype=dtype, device=self.device)
        device.copy_(host, non_blocking=True)
        self.kept[name] = (host, device)
        return device

    def fill(self, name: str, values: list) -> None:
        """The next replay's ``values`` for ``name`` (kept by a capture)."""
        host, _ = self.kept[name]
        host.copy_(torch.tensor(values, dtype=host.dtype))
