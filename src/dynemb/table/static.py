"""StaticTable: a dense ``[V, D]`` table for ids in ``[0, V)``, with the row interface of KeyValueTable.

Id ``i`` is row ``i``: no hashing and no insertion, so lookups are plain gathers. Optimizers, lookups and exports
use the same code as for dynamic tables. Initial rows come from the same counter-based initializers, so a static
and a dynamic table with the same seed start with identical rows for the same ids.
"""

from __future__ import annotations

import torch

from ..kernels.dispatch import Backend
from ..checks import KEY_DTYPES, VALUE_DTYPES, check_dtype, check_int, check_keys, check_rows_like, resolve_device
from .columns import RowColumns
from .initializers import CallableInitializer, InitializerSpec, initial_rows, resolve_initializer
from .huge_pages import empty_storage, to_storage
from .rows import Rows

__all__ = ["StaticTable"]


class StaticTable(RowColumns):
    """Dense rows for ids ``0 .. num_rows-1``.

    ``backend``: the kernels of its lookups (see :mod:`dynemb.kernels.dispatch`); None follows the process default.

    Example:
        >>> t = StaticTable(3, 2, initializer="zeros")
        >>> t.find_or_insert(torch.tensor([2, 0]))[0].tolist()
        [2, 0]
    """

    def __init__(self, num_rows: int, dim: int, *, key_dtype: torch.dtype = torch.int64,
                 dtype: torch.dtype = torch.float32, device=None, initializer: InitializerSpec = "uniform",
                 seed: int = 0, backend: Backend | str | None = None) -> None:
        self.num_rows = check_int(num_rows, "vocabulary_size", minimum=1)
        self.dim = check_int(dim, "dim", minimum=1)
        self.key_dtype = check_dtype(key_dtype, KEY_DTYPES, "key_dtype")
        self.dtype = check_dtype(dtype, VALUE_DTYPES, "dtype")
        self.device = resolve_device(device)
        self.initializer = resolve_initializer(initializer)
        self.seed = seed
        self.backend = None if backend is None else Backend.parse(backend)
        self.max_capacity = num_rows
        self.clock = 0
        self.save_ticks = 0
        self._ids = torch.arange(num_rows, dtype=self.key_dtype, device=self.device)
        self._slot_init: dict[str, float] = {}
        self._cols = {"value": self.initial_rows(self._ids, empty_storage((num_rows, dim), self.dtype, self.device)),
                      "score": empty_storage((num_rows,), torch.int64, self.device).zero_()}

    #: id ``i`` is row ``i`` (see :class:`~dynemb.table.protocol.EmbeddingTable`)
    ids_are_rows = True
    counts_occurrences = False
    keys_may_repeat = True
    #: rows never move
    row_moves = 0

    # ------------------------------------------------------------------ row interface
    def rows_unmoved_since(self, moves: int) -> bool:
        return True

    def live_rows(self) -> int:
        return self.num_rows

    def lookup_rows(self, keys: torch.Tensor, *, insert: bool, counts: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, bool]:
        """``(rows [N], True)``: each id is its row (range-checked); an inserting lookup advances the clock, as
        :meth:`find_or_insert` does."""
        rows = self.find_rows(keys)
        if insert:
            self.clock += 1
        return rows, True

    @property
    def row_keys(self) -> torch.Tensor:
        return self._ids

    def add_slot(self, name: str, dim: int, init: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        if f"slot:{name}" not in self._cols:
            self._cols[f"slot:{name}"] = empty_storage((self.num_rows, dim), dtype, self.device).fill_(init)
            self._slot_init[name] = init

    def size(self) -> int:
        return self.num_rows

    def __len__(self) -> int:
        return self.num_rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._cols.values())

    def check_ids(self, ids: torch.Tensor, name: str = "ids") -> torch.Tensor:
        """Validate ids (dtype, device, range ``[0, V)``); returns them flattened."""
        flat = check_keys(ids, self.key_dtype, self.device, name)
        if flat.numel():
            low, high = int(flat.min()), int(flat.max())
            if low < 0 or high >= self.num_rows:
                bad = low if low < 0 else high
                raise ValueError(f"{name} must be in [0, {self.num_rows}) for this static table, got {bad}")
        return flat

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.to(torch.int64)

    def find_rows(self, keys: torch.Tensor) -> torch.Tensor:
        # a copy: the rows are the ids, and a caller writing to the rows must not change its keys
        return self.check_ids(keys).to(torch.int64, copy=True).view(keys.shape)

    def find_or_insert(self, keys: torch.Tensor, scores=None):
        rows = self.find_rows(keys)
        self.clock += 1
        return rows, torch.ones_like(rows, dtype=torch.bool)

    def mark_updated(self, rows: torch.Tensor) -> None:
        pass

    def track_deletions(self, enabled: bool = True) -> None:
        pass  # rows of a static table are never deleted

    def forget_deletions(self, version: int) -> None:
        pass

    def changes_since(self, version: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row (a static table keeps no version stamps), and no deleted keys: deltas carry it whole."""
        return torch.arange(self.num_rows, device=self.device), self._ids[:0]

    def initial_rows(self, keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The initializer's rows ``[N, D]`` for ``keys [N]`` (into ``out`` when given; a callable initializer's
        own tensor, called once for all of them)."""
        if isinstance(self.initializer, CallableInitializer):
            return self.initializer(keys, self.dim, self.dtype, self.seed)
        return initial_rows(self.initializer, keys, self.dim, self.dtype, self.seed, self.backend, out=out)

    def export(self) -> Rows:
        slots = {n: self.slot(n).clone() for n in self._slot_init}
        return Rows(self._ids.clone(), self.values.clone(), self.scores.clone(), slots)

    def replace(self, rows: Rows) -> None:
        keys = self.check_ids(rows.keys, "keys")
        values = check_rows_like(rows.values, keys.numel(), self.dim, self.dtype, self.device, "values",
                                 rows.keys.shape)
        self.values[keys.long()] = values
        for name, tensor in rows.slots.items():
            self.slot(name)[keys.long()] = tensor.to(self.device)

    def to(self, device) -> "StaticTable":
        self.device = resolve_device(device)
        self._cols = {k: v if v.device == self.device else to_storage(v, self.device) for k, v in self._cols.items()}
        self._ids = self._ids.to(self.device)
        return self
