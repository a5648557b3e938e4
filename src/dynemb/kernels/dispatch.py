"""Which implementation runs a hot operation: chosen from an explicit backend and the device, never from the
environment.

=========  ============================================================  ====================================
backend    runs                                                          where
=========  ============================================================  ====================================
``auto``   numba on CPU, triton on CUDA (each when importable), else     any device (the process default)
           torch
``torch``  the batched-torch reference                                   any device
``numba``  the numba kernels (``numba_*`` modules)                       CPU only, with numba installed
``triton`` the Triton kernels (``triton_*`` modules)                     CUDA; CPU only under Triton's
                                                                         interpreter (``TRITON_INTERPRET=1``)
=========  ============================================================  ====================================

Every backend gives identical results (the tests hold each kernel equal to the torch reference); they differ in
speed. Tables and indexes take ``backend=``; ``None`` (their default) means the process default, read at each
call. The process default is ``auto`` until it is set explicitly, with :func:`set_default_backend` or, for a
block of code (tests, benchmarks), :func:`use_backend`. Nothing in the library reads an environment variable for
this: the ``dynemb`` command alone maps ``DYNEMB_NUMBA=0`` to ``set_default_backend("torch")`` at startup.

The CUDA backend (``triton``) is one member of :class:`Backend`, one entry per family in ``_MODULES`` below and
one rule in :func:`resolve_backend`. Its modules implement the same contracts; ``triton_index`` adds the one-launch
``find_or_insert``, ``erase`` and ``find_gather`` a GPU step uses (documented there).

Operation families
------------------
Each family has one function here, ``<family>_kernels(backend, device)``, that returns the module implementing
the family for that call, or ``None`` for the torch reference (which lives beside the code it serves and stays the
fallback). A module implements every function of its family with exactly the tensor contract below; the tests
hold every module equal to the reference. Symbols: ``R`` rows of a table, ``D`` its dim, ``U`` unique rows of a
call, ``N`` ids, ``B`` bags. All tensors are on the call's device and contiguous; int tensors are int64 unless
said otherwise; ``values`` and slots are the table's own storage, updated in place. Callers route only float32
tables (and float32 weights and slots) to ``pool`` and ``optim`` kernels
(:func:`~dynemb.functional.grads.table_kernels`); other dtypes run the torch reference.

``index_kernels`` (:mod:`~dynemb.kernels.numba_index`): ``probe``, ``place`` of :class:`~dynemb.table.HashIndex`,
and optionally ``find(buckets, key_cols, overflow, keys [N], shift) -> (rows [N] int64, bool)``: ``probe``'s rows
as int64 (-1 where absent) and whether every key was found, in one pass (``HashIndex.find_all``); and optionally
``unique_by_hash(keys [N]) -> (keys [U], hashes [U], last [U], inverse [N])``: the four tensors of
:func:`~dynemb.table.hashing.unique_by_hash`'s stable torch sort, bit for bit.

``pool_kernels`` (:mod:`~dynemb.kernels.numba_pool`): dedup and pooled lookups straight from a table's rows.

- ``dedup(ids [N] int32/int64, inverse: bool = True) -> (unique [U] ids' dtype, inverse [N] | None, order [N],
  starts [U + 1])``: the call's one grouping of its ids (torch reference:
  :func:`~dynemb.functional.find.sort_ids`, a stable sort): ``unique[inverse] == ids`` (None when not asked
  for); ``order`` lists the ids grouped by unique id, in input order within one; unique id ``u``'s ids are
  ``order[starts[u]:starts[u + 1]]``. The order of ``unique`` is the module's choice.
- ``pool(values [R, D], rows [U], inverse [N] | None, offsets [B], weights [N] | None, denom [B] | None) -> [B,
  D]`` (dtype of ``values``): ``out[b] = sum(weights[j] * values[rows[inverse[j]]] for j in bag b) / denom[b]``
  (``inverse`` None: ``rows [N]`` holds each id's own row, ``values[rows[j]]``), the
  ids of bag ``b`` being ``offsets[b] <= j < offsets[b + 1]`` (``N`` for the last bag); ``offsets`` start at 0 and
  never decrease; a missing ``weights``/``denom`` is all ones (``denom`` holds the ``mean``/``sqrtn`` combiners'
  divisors, never 0); an empty bag is zeros. Every row in ``rows`` is ``>= 0``. Sums run in id order within a bag.
- ``gather(values [R, D], rows [N], out [N, D]) -> out`` (optional: a module without it leaves ``find`` to
  ``index_select``): ``out[i] = values[max(rows[i], 0)]`` (the caller overwrites the rows of ``rows[i] < 0``);
  what :meth:`~dynemb.table.KeyValueTable.find` reads its rows with.
- ``rows_current(row_keys [C] keys' dtype, size: int, keys [U], rows [U]) -> bool`` (optional: a module without
  it leaves the check to torch): whether every ``0 <= rows[u] < size`` and ``row_keys[rows[u]] == keys[u]``, the
  fast path of :func:`~dynemb.functional.grads.current_rows` (False sends it to the torch re-check).
- ``fill_rows(column [C] int, rows [N], value: int) -> bool`` (optional: a module without it leaves the stamps to
  ``index_fill_``): ``column[rows] = value`` and True when every ``0 <= rows[i] < C``, else False with nothing
  written; how :func:`~dynemb.table.ops.fill_rows` writes score and version stamps of large batches. The int64
  columns here and below may have any stride (a table's score and version columns are interleaved).
- ``fill_pair(first [C] int64, second [C] int64, rows [N], a: int, b: int) -> bool`` (optional: a module without
  it leaves it to two ``fill_rows``): ``first[rows] = a`` and ``second[rows] = b``, all or nothing as
  ``fill_rows``; how a lookup under ``lru`` or ``epoch_lru`` writes both stamps of its rows in one pass.
- ``mark_rows(marks [C] uint8, rows [N], tag: int) -> bool`` and ``settle_marks(marks [C] uint8, first [C] int64,
  second [C] int64, a [T] int64, b [T] int64) -> None`` (optional, together: a module without them leaves a lookup's
  stamps to ``fill_pair``): ``marks[rows] = tag`` (``1 <= tag <= 255``), all or nothing as ``fill_rows``; then, for
  every ``r`` with ``t = marks[r] > 0``, ``first[r] = a[t - 1]``, ``second[r] = max(second[r], b[t - 1])`` (a
  version written since is newer) and ``marks[r] = 0``. How a table defers its stamps
  (:meth:`~dynemb.table.rows.RowStore._defer_stamps`).
- ``touch_counts(column [C] int64, rows [N], counts [N] | None) -> (before [N], total [N], last [N] bool) | None``
  and ``write_last(column, rows, values [N] int64, last [N] bool) -> None`` (optional, together: a module without
  them leaves the counting policies' access to torch's ``index_*`` passes): ``before[j]`` is ``column[rows[j]]``
  before the call, ``last[j]`` whether ``j`` is the last occurrence of its row, and there ``total[j]`` is the sum
  of the row's ``counts`` (ones when None; elsewhere unspecified); None, with nothing written, when a row is out
  of range. ``touch_counts`` may leave scratch values in the rows; ``write_last`` then writes ``values[j]`` to
  ``column[rows[j]]`` at each last occurrence (``values=before`` restores the column). How
  :func:`~dynemb.table.policy.touch_scores` applies an ``lfu``, ``epoch_lfu`` or ``decayed_lfu`` access of a
  large batch.
- ``decayed_scores(old [N] int64, n [N] int64, now: int, constants) -> [N] int64`` (optional: a module without it
  leaves it to the torch ops of :func:`~dynemb.table.policy._decayed`): the ``decayed_lfu`` scores of rows scored
  ``old`` accessed ``n >= 1`` times at fixed-point time ``now``, with the arithmetic and the ``constants``
  (:data:`~dynemb.table.policy.DECAY_MATH`) of the torch ops, bit for bit.
- ``scatter(values [R, D] float32, rows [N], src [N, D]) -> bool`` (optional: a module without it leaves it to
  ``index_copy_``): ``values[rows[i]] = src[i]`` for unique ``rows`` and True when every ``0 <= rows[i] < R``,
  else False with nothing written; how :func:`~dynemb.table.ops.scatter_rows` fills rows reused after eviction.
- ``move_rows(dst [R, ...], dst_rows [N], src [S, ...], src_rows [N]) -> bool`` (optional: a module without it
  leaves it to ``index_select`` and ``index_copy_``): ``dst[dst_rows[i]] = src[src_rows[i]]`` for unique
  ``dst_rows`` (``src`` may be ``dst`` itself when the two row sets are disjoint, not another view of its
  storage), bit for bit, and True; or False with nothing written when a row is out of range or the tensors are not
  ones the module moves (any layout, dtype or index tensor; the caller then moves the rows itself). How
  :func:`~dynemb.table.ops.copy_rows` moves rows (compaction, tiers, reused rows).
- ``lowest_rows(scores [S] int64, k: int, pinned [P] | None) -> [min(k, free)] int64`` (optional: a module
  without it leaves it to the torch code of :func:`~dynemb.table.ops.lowest_rows`): the positions not in
  ``pinned`` lowest by ``(score, position)``, in that order; how eviction picks its victims.
- ``offsets_valid(offsets [B >= 1], n: int) -> bool`` (optional: a module without it leaves the check to torch):
  whether ``offsets`` start at 0, never decrease and end at most at ``n``; how
  :func:`~dynemb.functional.pooling.to_bags` validates bag offsets.
- ``bag_of(offsets [B], n: int) -> [n] int32/int64`` (optional: a module without it leaves it to
  :func:`~dynemb.functional.pooling.bag_of`): the bag of each of ``n`` ids, ``b`` for ``offsets[b] <= j <
  offsets[b + 1]`` (``n`` for the last bag); ``offsets`` as for ``pool``; the dtype is the module's choice.
  Backward passes build it once a call, and every ``bag`` argument below may be either dtype.
- ``spread(values [U] int32/int64, order [N], starts [U + 1]) -> [N]`` (values' dtype; optional: a lookup on a
  module without it keeps the sort's ``inverse``): ``out[order[k]] = values[u]`` for every ``k`` in
  ``starts[u]:starts[u + 1]`` (a grouping of ``dedup``); how a training lookup gives each id its key's row
  (reference: :func:`~dynemb.functional.find.spread_groups`).
- ``row_grad(grad [B, D] float32, order [N], starts [U + 1], bag [N] | None, weights [N] | None) -> [U, D]
  float32``: the gradient of a sum-pooling for each unique row, ``g[u] = sum(weights[j] * grad[bag[j]] for j in
  order[starts[u]:starts[u + 1]])``, summed in that order (``order`` lists the ids grouped by unique row, in input
  order within a row: the one stable sort of the call, :func:`~dynemb.functional.find.sort_ids`; ``bag[j]`` is
  id ``j``'s bag; None: ``bag[j] == j``, bags of one id each). The caller has already divided ``grad`` by the
  combiner's ``denom``.

``optim_kernels`` (:mod:`~dynemb.kernels.numba_optim`): sparse optimizer updates applied in place.

- ``sparse_update(kind: str, hparams: tuple[float, ...], values [R, D], slots: tuple[[R, d_i] float32, ...],
  rows [U], grad [G, D] float32, order [M] | None, starts [U + 1] | None, bag [M] | None, weights [M] | None)
  -> None``: updates ``values[rows[u]]`` and its slot rows with row ``u``'s gradient, in one pass,
  with no ``[U, D]`` temporary. Row ``u``'s gradient is ``grad[u]`` when ``order`` is None (then ``G == U``), else
  its ``row_grad`` sum (same arguments; ``bag`` None means ``bag[j] == j``). ``rows`` are unique and
  ``>= 0``. ``kind``, ``hparams`` and ``slots`` come from ``SparseOptimizer.kernel_args`` (one line per kind):

  ===================  ====================================================  ================================
  kind                 hparams                                               slots
  ===================  ====================================================  ================================
  ``sgd``              lr, momentum, weight_decay, nesterov (0.0 or 1.0)     (momentum_buffer [R, D]) or ()
  ``adagrad``          clr (lr after decay), weight_decay, eps               (sum [R, D],)
  ``rowwise_adagrad``  lr, weight_decay, eps                                 (sum [R, 1],)
  ``adam``             beta1, beta2, eps, step_size (bias-corrected lr)      (exp_avg, exp_avg_sq) [R, D]
  ``ftrl``             lr, power (= -learning_rate_power), l1, l2            (accumulator, linear) [R, D]
  ===================  ====================================================  ================================

  The math of each kind is its optimizer's torch ``_update`` in :mod:`dynemb.optim.algorithms`.

``init_kernels`` (:mod:`~dynemb.kernels.numba_init`): the built-in counter-based initializers.

- ``initial_rows(kind: str, params: tuple[float, ...], keys [M] int32/int64, seed: int, out [M, D]) -> None``:
  writes the rows ``Initializer(keys, D, out.dtype, seed)`` would return, bit for bit, into ``out`` (which may be
  a slice of the table's values). ``kind, params`` come from ``Initializer.kernel_spec()``: ``("uniform", (low,
  high))`` or ``("constant", (value,))``; an initializer without a spec always runs in torch.

``group_kernels`` (:mod:`~dynemb.kernels.triton_group`, :mod:`~dynemb.kernels.numba_group`; torch reference
:mod:`~dynemb.table.group_reference`, which :func:`~dynemb.table.group.group_ops` picks where no module serves):
the operations of a training step over a group of dynamic tables, one launch (or call) each for all of them. Every
function takes the ``group`` (a :class:`~dynemb.table.group.TableGroup`), which each backend reads its way: the
kernels read row ``t`` of its ``meta [G, len(GROUP_META)]`` (int64: addresses, ``data_ptr()`` of table ``t``'s own
tensors, and sizes; see :data:`GROUP_META`) and ``fmeta [G, len(GROUP_FMETA)]`` (float32); the torch reference,
which cannot follow an address, reads ``group.tables[t]`` and the slot names ``group.slots[t]``. Each work item
carries its table ``t``; a table's storage never moves into a shared buffer. ``G`` tables, ``N`` ids, ``B`` bags;
no kernel call reads anything back to the host, and every tensor is sized by ``N`` or ``B`` (the torch reference
reads a few ``[G]``-sized values back).

- ``max_ids_per_table() -> int | None``: the most ids a table passes to one grouped call (None: any), above which
  the table's own lookup costs no more (numba: 4,096; Triton and torch: any).

- ``find_or_insert(group, keys [N], seg [N] int64, seg_first [N] int64, sizes [G] int64, stamps [G, 2]
  int64) -> rows [N] int64``: key ``i`` belongs to table ``seg[i]`` (the tables' keys come in contiguous runs,
  ``seg_first[i]`` the first position of ``i``'s run); found, or inserted as the table's own ``find_or_insert``
  inserts it (rows ``sizes[t]`` on, numbered in the order of the keys' hashes, initial values of the table's
  initializer, slots at their initial values), duplicates sharing one row; every row read gets the score and
  version ``stamps[t]``; ``sizes`` advances by each table's new keys. The caller leaves room for every key to be
  new (rows, index load).
- ``pool(group, rows [N], offsets [B], bag_seg [B] int64, weights [N] | None, denom [B] | None, out [*] float32,
  out_at [B] int64, max_dim) -> out``: bag ``b`` (of table ``bag_seg[b]``, its ids ``offsets[b]`` up to the next
  offset or ``N``) summed in id order, weighted, divided by ``denom[b]``, into ``out[out_at[b]:][:dim]``.
- ``sparse_update(kind, group, hparams [G, 8] float64, versions [G] int64, keyed [N] int64, grad [*] float32,
  grad_at [B] int64, table_bags [G, 3] int64, bag [N] | None, weights [N] | None, max_dim) -> None``: ``keyed``
  are the ids' ``t << 32 | row``; each distinct one is updated once, as the ``sparse_update`` contract above, with
  the sum of ``weights[j] * grad[grad_at[bag[j]]:][:dim]`` over its ids ``j`` in input order (``bag`` None: id ``j``
  is bag ``j``; table ``t``'s bags are the ``table_bags[t, 1]`` from bag ``table_bags[t, 0]`` on, and its block of
  ``grad`` starts at ``table_bags[t, 2]``, bag after bag) and table ``t``'s
  ``hparams[t]``: the kind's hyper-parameters of the table above (``kernel_args``, as they are), weight decay at 4,
  and at 7 whether the table is updated (0: its rows moved since the lookup; it is updated apart); ``versions[t] >=
  0`` is a version stamp to write (the table's clock moved since the lookup stamped the rows).

Example:
    >>> resolve_backend("torch", "cuda")
    <Backend.TORCH: 'torch'>
    >>> with use_backend("torch"):
    ...     resolve_backend(None, "cpu")
    <Backend.TORCH: 'torch'>
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib.util
from types import ModuleType
from typing import Iterator, NamedTuple

import torch

__all__ = [
    "Backend",
    "Family",
    "FamilyKernels",
    "FAMILIES",
    "Kernels",
    "kernels_for",
    "GROUP_META",
    "GROUP_FMETA",
    "group_hparams",
    "resolve_backend",
    "get_default_backend",
    "set_default_backend",
    "use_backend",
    "numba_available",
    "triton_available",
    "index_kernels",
    "table_kernels",
    "pool_kernels",
    "optim_kernels",
    "init_kernels",
]


class Backend(str, enum.Enum):
    """A kernel backend, or ``AUTO`` to let :func:`resolve_backend` pick by device (see the module's table)."""

    AUTO = "auto"
    TORCH = "torch"
    NUMBA = "numba"
    TRITON = "triton"

    @classmethod
    def parse(cls, value: "Backend | str", name: str = "backend") -> "Backend":
        """``value`` as a Backend; a ``ValueError`` naming ``name`` and the choices if it is none of them."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(b.value) for b in cls)
            raise ValueError(f"{name} must be one of {choices} or a Backend, got {value!r}") from None


_default = Backend.AUTO


@functools.cache
def numba_available() -> bool:
    """Whether numba is installed (numba itself is imported only when a kernel first runs: it loads slowly)."""
    return importlib.util.find_spec("numba") is not None


@functools.cache
def triton_available() -> bool:
    """Whether triton is installed (imported only when a Triton kernel first runs)."""
    return importlib.util.find_spec("triton") is not None


def get_default_backend() -> Backend:
    """The process default: what ``backend=None`` means. ``Backend.AUTO`` unless set."""
    return _default


def set_default_backend(backend: Backend | str) -> Backend:
    """Make ``backend`` the process default for every table and index created with ``backend=None``, from their
    next call on. Returns the previous default.

    Raises:
        ValueError: ``backend`` is not a backend name, or it is ``numba`` and numba is not installed.
    """
    global _default
    previous, _default = _default, _available(Backend.parse(backend))
    return previous


@contextlib.contextmanager
def use_backend(backend: Backend | str) -> Iterator[Backend]:
    """``with use_backend("torch"): ...`` runs the block under that process default and then restores the previous
    one, also when the block raises."""
    previous = set_default_backend(backend)
    try:
        yield _default
    finally:
        set_default_backend(previous)


def resolve_backend(backend: Backend | str | None, device: torch.device | str | None = None) -> Backend:
    """The backend that runs an operation on ``device`` (default CPU): never ``AUTO``.

    ``None`` is the process default; ``auto`` picks numba on CPU when numba is installed, triton on CUDA when
    triton is installed, else torch. ``triton`` on a CPU device is allowed: its kernels then run only under
    Triton's interpreter (the tests' setting), which triton itself enables from ``TRITON_INTERPRET=1``.

    Raises:
        ValueError: ``backend`` is not a backend name; or it is ``numba`` and numba is not installed or ``device``
            is not a CPU; or it is ``triton`` and triton is not installed or ``device`` is neither CUDA nor CPU.
    """
    # Every lookup asks several times a table: the answer is remembered (a refusal is not), except whether Triton
    # interprets, which the user may switch at run time and is read whenever it matters.
    try:
        resolved = _resolved_backend(backend, device, _default, numba_available(), triton_available())
    except TypeError:  # an unhashable argument: the uncached path says what is wrong with it
        resolved = _resolve_backend(backend, device)
    if resolved is Backend.TRITON and _device_kind(device) == "cpu" and not _triton_interprets():
        raise ValueError("backend 'triton' runs on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1 "
                         "in the environment before triton is imported); on CPU use 'auto', 'numba' or 'torch'")
    return resolved


@functools.lru_cache(maxsize=256)
def _resolved_backend(backend, device, *state) -> Backend:
    # state: the process default and which packages are installed, only so that a change of them is a new entry
    return _resolve_backend(backend, device)


def _device_kind(device: torch.device | str | None) -> str:
    return device.type if isinstance(device, torch.device) else torch.device(device or "cpu").type


def _resolve_backend(backend: Backend | str | None, device: torch.device | str | None) -> Backend:
    requested = _default if backend is None else backend if isinstance(backend, Backend) else Backend.parse(backend)
    kind = _device_kind(device)
    on_cpu = kind == "cpu"
    if requested is Backend.AUTO:
        if on_cpu and numba_available():
            return Backend.NUMBA
        return Backend.TRITON if kind == "cuda" and triton_available() else Backend.TORCH
    if requested is Backend.TRITON and kind not in ("cuda", "cpu"):
        raise ValueError(f"backend 'triton' runs on CUDA (or CPU under Triton's interpreter), got device {device}")
    if requested is Backend.NUMBA and not on_cpu:
        raise ValueError(f"backend 'numba' runs on CPU only, got device {device}; use 'auto' or 'torch'")
    return _available(requested)


def _triton_interprets() -> bool:
    """Whether triton runs kernels in its interpreter (it reads ``TRITON_INTERPRET`` itself; dynemb does not)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


class Family(NamedTuple):
    """A kernel family's declared interface (the contracts are in the module docstring): the functions every
    implementation of the family has (``required``), and those an implementation may leave to the torch reference
    (``optional``: ``None`` on the backend object). ``rows``: whether the family reads or writes a table's value
    rows, which the kernels serve for float32 tables only (:meth:`Kernels.for_rows`)."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    rows: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return self.required + self.optional


#: Every kernel family and the functions it declares. A backend module implements all ``required`` functions of its
#: family and any of the ``optional`` ones, and nothing else under a declared name; ``tests/kernels/test_dispatch.py``
#: holds each module to this list.
FAMILIES: dict[str, Family] = {
    # find_or_insert, erase and find_gather: Triton's one-launch table operations (table/fused.py)
    "index": Family(("probe", "place"), ("find", "unique_by_hash", "find_or_insert", "erase", "find_gather")),
    "pool": Family(("dedup", "pool", "row_grad"),
                   ("gather", "rows_current", "spread", "fill_rows", "fill_pair", "mark_rows", "settle_marks",
                    "touch_counts", "write_last", "decayed_scores", "scatter", "move_rows", "lowest_rows",
                    "offsets_valid", "bag_of"), rows=True),
    "optim": Family(("sparse_update",), rows=True),
    "init": Family(("initial_rows",)),
    "group": Family(("find_or_insert", "pool", "sparse_update", "max_ids_per_table"), rows=True),
}

#: The columns of a group's ``meta`` (``group`` family): addresses of a table's index buckets (int32 words),
#: overflow flags (uint8), values (float32 ``[capacity, dim]``), row keys, score/version pairs (int64, interleaved),
#: two optimizer slots (float32 ``[capacity, width]``, 0 when absent); the index's hash shift and bucket count, the
#: row width, the slots' widths, the initializer's mixed seed and kind (1 uniform, 2 constant) and the capacity.
GROUP_META = ("buckets", "overflow", "shift", "num_buckets", "values", "dim", "row_keys", "stamps", "slot0",
              "slot0_width", "slot1", "slot1_width", "seed", "init", "capacity")
def group_hparams(kind: str, hparams: tuple[float, ...], runs: bool = True) -> list[float]:
    """A table's row of the group ``sparse_update``'s ``hparams [G, 8]`` (float64) from its optimizer's
    ``kernel_args`` (``kind, hparams``; see the ``sparse_update`` table above): the hyper-parameters as they are,
    the weight decay at 4, and at 7 whether the table runs."""
    h = [float(x) for x in hparams] + [0.0] * (4 - len(hparams))
    decay = {"sgd": h[2], "adagrad": h[1], "rowwise_adagrad": h[1]}.get(kind, 0.0)
    return h + [decay, 0.0, 0.0, 1.0 if runs else 0.0]


#: The columns of a group's ``fmeta`` (float32): the initializer's low and width (uniform; a constant's value is the
#: low), and each slot's initial value.
GROUP_FMETA = ("init_low", "init_width", "slot0_init", "slot1_init")


class FamilyKernels:
    """One family's functions on one backend: each declared name of :data:`FAMILIES` is an attribute, the kernel
    or ``None`` where the torch reference serves (every name ``None`` on the torch backend). A name the family does
    not declare is an ``AttributeError``: a call site cannot probe for a function nobody promised.

    Example:
        >>> kernels_for("torch", "cpu").pool.spread is None
        True
    """

    def __init__(self, family: str, module: ModuleType | None) -> None:
        self.family, self.module = family, module
        self._names = frozenset(FAMILIES[family].names)

    def __getattr__(self, name: str):
        # read from the module at each call (a test may patch it), and only for the names the family declares
        if name not in self.__dict__.get("_names", ()):
            raise AttributeError(f"kernel family {self.__dict__.get('family')!r} declares no function {name!r}")
        return getattr(self.module, name, None)

    def __bool__(self) -> bool:
        """Whether a kernel module serves the family (False: the torch reference runs all of it)."""
        return self.module is not None


class Kernels:
    """The backend object: what runs each kernel family for one resolved backend on one device kind, chosen once
    (:func:`kernels_for`) and asked by the operations that own the invariants (``kernels.pool.fill_rows``). The
    families are attributes (:class:`FamilyKernels`), imported on first use: numba and triton load slowly."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._families: dict[str, FamilyKernels] = {}

    def __getattr__(self, family: str) -> FamilyKernels:
        if family not in FAMILIES:
            raise AttributeError(family)
        got = self._families.get(family)
        if got is None:
            name = _MODULES.get((family, self.backend))
            got = self._families[family] = FamilyKernels(family, None if name is None else _module(name))
        return got

    def for_rows(self, dtype: torch.dtype) -> "Kernels":
        """The kernels that work on value rows of ``dtype``: these for float32 rows, the torch reference for any
        other dtype (the row families, ``pool`` and ``optim``, serve float32 only). Ask it for row work only."""
        return self if dtype == torch.float32 else _TORCH

    def __repr__(self) -> str:
        return f"Kernels({self.backend.value})"


def kernels_for(backend: Backend | str | None, device: torch.device | str | None = None) -> Kernels:
    """The backend object for ``backend`` (``None``: the process default) on ``device``: see
    :func:`resolve_backend` for the rules and errors.

    Example:
        >>> kernels_for("torch").backend
        <Backend.TORCH: 'torch'>
    """
    return _KERNELS[resolve_backend(backend, device)]


def table_kernels(family, table) -> ModuleType | None:
    """The kernel module of ``family`` (one of the functions below, such as :func:`pool_kernels`) for ``table``'s
    backend and device, or None for torch: the kernels serve float32 tables only."""
    if table.dtype != torch.float32:
        return None
    return family(getattr(table, "backend", None), table.device)


def index_kernels(backend: Backend | str | None, device: torch.device | str | None) -> ModuleType | None:
    """The kernels that run :class:`~dynemb.table.HashIndex`'s probe and placement for one call on ``device``: a
    module with ``probe`` and ``place`` (:mod:`dynemb.kernels.numba_index`), or None for the index's own torch
    reference."""
    return _kernels("index", backend, device)


def pool_kernels(backend: Backend | str | None, device: torch.device | str | None) -> ModuleType | None:
    """The module with ``pool`` and ``row_grad`` (see the module's contract) for one call, or None for torch."""
    return _kernels("pool", backend, device)


def optim_kernels(backend: Backend | str | None, device: torch.device | str | None) -> ModuleType | None:
    """The module with ``sparse_update`` (see the module's contract) for one call, or None for torch."""
    return _kernels("optim", backend, device)


def init_kernels(backend: Backend | str | None, device: torch.device | str | None) -> ModuleType | None:
    """The module with ``initial_rows`` (see the module's contract) for one call, or None for torch."""
    return _kernels("init", backend, device)


#: (family, backend) -> the module implementing it, relative to this package; absent pairs run in torch.
_MODULES = {
    ("index", Backend.NUMBA): "numba_index",
    ("pool", Backend.NUMBA): "numba_pool",
    ("optim", Backend.NUMBA): "numba_optim",
    ("init", Backend.NUMBA): "numba_init",
    ("index", Backend.TRITON): "triton_index",
    ("pool", Backend.TRITON): "triton_pool",
    ("optim", Backend.TRITON): "triton_optim",
    ("init", Backend.TRITON): "triton_init",
    ("group", Backend.TRITON): "triton_group",
    ("group", Backend.NUMBA): "numba_group",
}


def _kernels(family: str, backend: Backend | str | None, device: torch.device | str | None) -> ModuleType | None:
    return getattr(kernels_for(backend, device), family).module


_KERNELS = {b: Kernels(b) for b in Backend if b is not Backend.AUTO}
_TORCH = _KERNELS[Backend.TORCH]


@functools.cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{__package__}.{name}")  # on first use: numba (and triton) load slowly


def _available(backend: Backend) -> Backend:
    if backend is Backend.NUMBA and not numba_available():
        raise ValueError("backend 'numba' needs the numba package, which is not installed; use 'auto' or 'torch'")
    if backend is Backend.TRITON and not triton_available():
        raise ValueError("backend 'triton' needs the triton package (extra 'gpu'), which is not installed; use "
                         "'auto' or 'torch'")
    return backend
