"""The store interface (:class:`Store`) shared by every storage tier of the serving parameter server.

A *store* maps ``(table, key)`` to one row of ``D`` values of the table's dtype. Keys are int64 and every
value is a valid key. Rows travel as raw little-endian bytes, so a row written by one store type reads back
bit-exact from any other. All operations are batched: one call moves ``N`` keys with a bounded number of round
trips, never one per key.

Errors. Bad arguments raise ``TypeError``/``ValueError`` before anything changes. Failures of the backend raise a
:class:`StoreError`; the parameter server catches it to fall through to the next tier:

=========================  ==================================================================================
error                      meaning
=========================  ==================================================================================
StoreError                 base class: any failure of the backend (catch this to fall through)
StoreUnavailableError      the server cannot be reached or timed out; also a ``ConnectionError``
StoreFullError             a put would exceed ``max_rows_per_table`` under ``overflow="refuse"``; nothing written
StoreReadOnlyError         a write on a store opened ``read_only``; also a ``PermissionError``
StoreCorruptError          a stored row has the wrong byte length for its table's schema
=========================  ==================================================================================
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import threading
from typing import Mapping, Sequence

import torch

from dynemb.serialization import dtype_name, parse_dtype
from dynemb.table.ops import last_occurrence
from dynemb.checks import VALUE_DTYPES, check_dtype, check_keys, check_positive_int, check_rows_like

__all__ = [
    "Store",
    "TableSchema",
    "StoreConfig",
    "OverflowPolicy",
    "StoreError",
    "StoreUnavailableError",
    "StoreFullError",
    "StoreReadOnlyError",
    "StoreCorruptError",
    "StoreRowsLostError",
]

_CPU = torch.device("cpu")


class StoreError(Exception):
    """A storage backend failed; the caller may fall through to the next tier."""


class StoreUnavailableError(StoreError, ConnectionError):
    """The backend server cannot be reached (at construction or during a call) or did not answer in time."""


class StoreFullError(StoreError):
    """A put would exceed the store's row bound under ``overflow="refuse"``. Nothing was written."""


class StoreReadOnlyError(StoreError, PermissionError):
    """A write was attempted on a store opened read-only. Nothing was written."""


class StoreCorruptError(StoreError):
    """A stored row does not have the byte length of its table's schema."""


class StoreRowsLostError(StoreError):
    """A shared store no longer holds the rows a reader needs: their marker key is gone (the server restarted
    empty, was flushed, or evicted it: ``lost`` True), or holds another version of the model (another server
    wrote its rows: ``lost`` False). What was read is not to be used."""

    def __init__(self, message: str, lost: bool) -> None:
        super().__init__(message)
        self.lost = lost


class OverflowPolicy(str, enum.Enum):
    """What a bounded store does when a put brings more rows than ``max_rows_per_table`` allows.

    ``evict``: the put succeeds and the lowest-score rows are dropped (memory: the ``eviction`` policy, lru or
    lfu; Redis: oldest write first). ``refuse``: the put raises :class:`StoreFullError` and writes nothing.
    """

    EVICT = "evict"
    REFUSE = "refuse"

    @classmethod
    def parse(cls, value, name: str = "overflow") -> "OverflowPolicy":
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(p.value) for p in cls)
            raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class TableSchema:
    """Shape of one table's rows.

    Args:
        dim: values per row (``D``), >= 1.
        dtype: value dtype: float32, float16 or bfloat16.
    """

    dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        check_positive_int(self.dim, "dim")
        check_dtype(self.dtype, VALUE_DTYPES, "dtype")

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored row."""
        return self.dim * self.dtype.itemsize

    def to_dict(self) -> dict:
        """JSON-ready form, as stored by the out-of-process stores."""
        return {"dim": self.dim, "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_dict(cls, record: Mapping) -> "TableSchema":
        """Inverse of :meth:`to_dict`; other fields of ``record`` are ignored."""
        return cls(dim=record["dim"], dtype=parse_dtype(record["dtype"], "table schema dtype"))


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Base of the per-store config dataclasses; adds construction from a JSON-style dict."""

    @classmethod
    def from_dict(cls, config: Mapping, where: str = "store config") -> "StoreConfig":
        """Build the config from ``config``. Unknown or missing fields raise ``ValueError`` naming them; bad values
        raise the field's own TypeError/ValueError, prefixed with ``where``."""
        if not isinstance(config, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(config).__name__}")
        fields = dataclasses.fields(cls)
        allowed = [f.name for f in fields]
        unknown = sorted(set(config) - set(allowed))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields are {allowed}")
        missing = [f.name for f in fields if f.default is dataclasses.MISSING and f.name not in config]
        if missing:
            raise ValueError(f"{where}: missing required field(s) {missing}")
        try:
            return cls(**config)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{where}: {error}") from None


def _no_rows(schema: TableSchema) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(0, schema.dim, dtype=schema.dtype), torch.empty(0, dtype=torch.bool)


def check_table_name(table) -> str:
    """Table names are non-empty strings without NUL or braces, at most 255 UTF-8 bytes: they form Redis hash tags
    and key prefixes (LMDB keys are at most 511 bytes)."""
    if not isinstance(table, str):
        raise TypeError(f"table must be a str, got {type(table).__name__}")
    if not table or any(c in table for c in "\x00{}") or len(table.encode()) > 255:
        raise ValueError(f"table must be a non-empty str of <= 255 bytes without NUL, '{{' or '}}', got {table!r}")
    return table


class Store(abc.ABC):
    """A batched key -> row store holding several named tables. Subclasses implement the ``_`` hooks.

    The public methods own the invariants: argument checks, the empty batch, read-only and closed stores, and
    de-duplication of written keys (the last occurrence wins). Hooks see CPU int64 keys ``[N]`` (unique for
    ``_put``/``_delete``), and values already checked against the table's schema.

    Example:
        >>> from dynemb.serving.stores import make_store
        >>> store = make_store({"type": "memory"})
        >>> store.create_table("user", dim=2)
        TableSchema(dim=2, dtype=torch.float32)
        >>> store.put("user", torch.tensor([-1, 7]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        >>> values, found = store.get("user", torch.tensor([7, 5]))
        >>> values.tolist(), found.tolist()
        ([[3.0, 4.0], [0.0, 0.0]], [True, False])
        >>> store.delete("user", torch.tensor([7, 7, 8])), store.size("user")
        (1, 1)
    """

    def __init__(self, *, read_only: bool = False) -> None:
        self.read_only = read_only
        self._schemas: dict[str, TableSchema] = {}
        self._concat_schemas: dict[tuple, TableSchema] = {}  # tables of get_concat -> their one schema
        self._schema_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ public API
    def create_table(self, table: str, dim: int, dtype: torch.dtype = torch.float32) -> TableSchema:
        """Declare ``table`` with rows of ``dim`` values of ``dtype``. Idempotent for the same schema.

        Returns:
            The table's :class:`TableSchema`.

        Raises:
            ValueError: the table exists with another schema. StoreReadOnlyError: a new table on a read-only store.
        """
        check_table_name(table)
        wanted = TableSchema(dim=dim, dtype=dtype)
        self._check_open()
        existing = self._find_schema(table)
        if existing is None:
            if self.read_only:
                raise StoreReadOnlyError(f"cannot create table {table!r}: {self} is read-only")
            with self._schema_lock:
                existing = self._create(table, wanted)
                self._schemas[table] = existing
        if existing != wanted:
            raise ValueError(f"table {table!r} already exists with {existing}, asked for {wanted}")
        return existing

    def drop_table(self, table: str) -> bool:
        """Remove ``table``: its rows, then its schema, so that a table of another schema may be created under its
        name (an export whose rows changed dtype). Whether it existed.

        Raises:
            StoreReadOnlyError: a read-only store.

        Example:
            >>> # store.drop_table("ctr.user"); store.create_table("ctr.user", 64, torch.int8)
        """
        check_table_name(table)
        self._check_open()
        self._check_writable()
        schema = self._find_schema(table)
        if schema is None:
            return False
        keys = self._keys(table, schema)
        if keys.numel():
            self._delete(table, schema, keys)
        with self._schema_lock:
            self._drop(table)
            self._schemas.pop(table, None)
            self._concat_schemas.clear()
        return True

    def schema(self, table: str) -> TableSchema:
        """The schema of ``table``. Raises ValueError if it was never created."""
        check_table_name(table)
        self._check_open()
        schema = self._find_schema(table)
        if schema is None:
            raise ValueError(f"table {table!r} does not exist in {self}; create it with create_table(table, dim)")
        return schema

    def get(self, table: str, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read rows. Hit: the stored row. Miss: a zero row and ``found`` False. Duplicates are allowed.

        Args:
            table: a created table.
            keys: ``[N]`` int64 CPU tensor.

        Returns:
            ``(values [N, D] of the table's dtype, found [N] bool)``.

        Raises:
            TypeError/ValueError: bad arguments. StoreError: the backend failed (see the module docstring).
        """
        schema = self.schema(table)
        keys = self._check_keys(keys)
        if keys.numel() == 0:
            return _no_rows(schema)
        return self._get(table, schema, keys)

    def get_many(self, keys_per_table: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`get` from several tables in one call; Redis answers all of them in one round trip.

        Args:
            keys_per_table: ``{table: keys [N_t] int64 CPU}``.

        Returns:
            ``{table: (values [N_t, D_t], found [N_t] bool)}``.

        Raises:
            TypeError/ValueError: bad arguments (nothing is read). StoreError: the backend failed.

        Example:
            >>> from dynemb.serving.stores import make_store
            >>> store = make_store({"type": "memory"})
            >>> for name in ("a", "b"):
            ...     _ = store.create_table(name, dim=1)
            >>> store.put("b", torch.tensor([4]), torch.ones(1, 1))
            >>> got = store.get_many({"a": torch.tensor([4]), "b": torch.tensor([4])})
            >>> got["a"][1].tolist(), got["b"][1].tolist()
            ([False], [True])
        """
        if not isinstance(keys_per_table, Mapping):
            raise TypeError(f"keys_per_table must be a dict {{table: keys}}, got {type(keys_per_table).__name__}")
        checked = [(table, self.schema(table), self._check_keys(keys)) for table, keys in keys_per_table.items()]
        got = self._get_many([request for request in checked if request[2].numel()])
        return {table: got[table] if keys.numel() else _no_rows(schema) for table, schema, keys in checked}

    def get_concat(self, tables: Sequence[str], keys: torch.Tensor,
                   sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`get_many` of tables that share one schema, their keys concatenated: what the parameter server
        asks a tier for the misses of a whole request (the in-process store reads them in one kernel call).

        Args:
            tables: distinct created tables of one ``dim`` and ``dtype``.
            keys: ``[N]`` int64 CPU, ``sizes[i]`` keys of ``tables[i]`` after those of the tables before it.
            sizes: ``[len(tables)]`` ints >= 0 summing to ``N``.

        Returns:
            ``(values [N, D], found [N] bool)``, in the order of ``keys``.

        Raises:
            TypeError/ValueError: bad arguments (nothing is read). StoreError: the backend failed.

        Example:
            >>> from dynemb.serving.stores import make_store
            >>> store = make_store({"type": "memory"})
            >>> for name in ("a", "b"):
            ...     _ = store.create_table(name, dim=1)
            >>> store.put("b", torch.tensor([4]), torch.ones(1, 1))
            >>> values, found = store.get_concat(["a", "b"], torch.tensor([4, 4, 5]), [1, 2])
            >>> values[:, 0].tolist(), found.tolist()
            ([0.0, 1.0, 0.0], [False, True, False])
        """
        tables = tuple(tables)
        schema = self._concat_schema(tables)
        keys = self._check_keys(keys)
        if len(sizes) != len(tables) or sum(sizes) != keys.numel() or min(sizes, default=0) < 0:
            raise ValueError(f"sizes must give the keys of each of the {len(tables)} tables (ints >= 0 summing to "
                             f"{keys.numel()}), got {list(sizes)}")
        if not keys.numel():
            return _no_rows(schema) if schema is not None else (torch.zeros(0, 0), torch.zeros(0, dtype=torch.bool))
        return self._get_concat(list(tables), schema, keys, list(sizes))

    def _concat_schema(self, tables: tuple) -> TableSchema | None:
        """The one schema of ``tables`` (distinct created tables; None for no table), checked once per list: a
        table's schema never changes."""
        schema = self._concat_schemas.get(tables)
        if schema is None:
            self._check_open()
            schemas = [self.schema(t) for t in tables]
            if len(set(tables)) != len(tables):
                raise ValueError(f"tables must be distinct, got {list(tables)}")
            schema = schemas[0] if schemas else None
            if any(s != schema for s in schemas):
                raise ValueError(f"tables must share one schema, got {dict(zip(tables, schemas))}")
            if schema is not None:
                if len(self._concat_schemas) > 256:
                    self._concat_schemas.clear()
                self._concat_schemas[tables] = schema
        return schema

    def put(self, table: str, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows. Hit: replaced. Miss: inserted. Duplicate keys: the last occurrence wins. Each row is
        replaced atomically (no reader sees a torn row). Bounded stores apply their overflow policy.

        Shape: ``keys`` ``[N]`` int64; ``values`` ``[N, D]`` of the table's dtype, on the CPU.

        Raises:
            TypeError/ValueError: bad arguments. StoreReadOnlyError, StoreFullError, StoreError.
        """
        schema = self.schema(table)
        keys = self._check_keys(keys)
        values = check_rows_like(values, keys.numel(), schema.dim, schema.dtype, _CPU, "values", tuple(keys.shape))
        self._check_writable()
        if keys.numel():
            # the last occurrence of each key wins; keys come out sorted, the order B-tree and LSM stores write fastest
            self._put(table, schema, *last_occurrence(keys, values.contiguous()))

    def delete(self, table: str, keys: torch.Tensor) -> int:
        """Remove keys. Hit: removed. Miss: ignored. Returns the number of rows removed."""
        schema = self.schema(table)
        keys = self._check_keys(keys)
        self._check_writable()
        return self._delete(table, schema, torch.unique(keys)) if keys.numel() else 0

    def size(self, table: str) -> int:
        """Number of rows stored in ``table``."""
        return self._size(table, self.schema(table))

    def keys(self, table: str) -> torch.Tensor:
        """Every key stored in ``table``: ``[N]`` int64 on the CPU, in no particular order.

        The parameter server reads them to delete the keys that a full export no longer has. Costs one scan of
        the table (a few round trips for Redis).
        """
        return self._keys(table, self.schema(table))

    def tables(self) -> list[str]:
        """Names of the created tables, sorted."""
        self._check_open()
        return sorted(self._tables())

    def close(self) -> None:
        """Release connections and files. Idempotent; any later call raises StoreError."""
        if not self._closed:
            self._closed = True
            self._close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ hooks
    @abc.abstractmethod
    def _create(self, table: str, schema: TableSchema) -> TableSchema:
        """Record ``schema`` for a new table; return the schema stored (another writer may have won a race)."""

    @abc.abstractmethod
    def _drop(self, table: str) -> None:
        """Forget ``table``'s schema (and any per-table record); its rows are deleted already."""

    @abc.abstractmethod
    def _load_schema(self, table: str) -> TableSchema | None:
        """The stored schema of ``table``, or None."""

    @abc.abstractmethod
    def _get(self, table: str, schema: TableSchema, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def _get_many(self, requests: list) -> dict:
        """``_get`` of each ``(table, schema, keys)``; stores with round trips override it to send one."""
        return {table: self._get(table, schema, keys) for table, schema, keys in requests}

    def _get_concat(self, tables: list, schema: TableSchema, keys: torch.Tensor, sizes: list) -> tuple:
        """:meth:`get_concat` of checked arguments (``N > 0``): by default ``_get_many``'s answers, concatenated."""
        got = self._get_many([(t, schema, k) for t, k in zip(tables, keys.split(sizes)) if k.numel()])
        parts = [got[t] for t, n in zip(tables, sizes) if n]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([v for v, _ in parts]), torch.cat([f for _, f in parts])

    @abc.abstractmethod
    def _put(self, table: str, schema: TableSchema, keys: torch.Tensor, values: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _delete(self, table: str, schema: TableSchema, keys: torch.Tensor) -> int: ...

    @abc.abstractmethod
    def _size(self, table: str, schema: TableSchema) -> int: ...

    @abc.abstractmethod
    def _keys(self, table: str, schema: TableSchema) -> torch.Tensor: ...

    @abc.abstractmethod
    def _tables(self) -> list[str]: ...

    @abc.abstractmethod
    def _close(self) -> None: ...

    # ------------------------------------------------------------------ helpers
    def _find_schema(self, table: str) -> TableSchema | None:
        schema = self._schemas.get(table)
        if schema is None:
            schema = self._load_schema(table)
            if schema is not None:
                self._schemas[table] = schema
        return schema

    def _check_keys(self, keys) -> torch.Tensor:
        self._check_open()
        if isinstance(keys, torch.Tensor) and keys.dim() != 1:
            raise ValueError(f"keys must be 1-D [N], got shape {tuple(keys.shape)}")
        return check_keys(keys, torch.int64, _CPU)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"{self} is closed")

    def _check_writable(self) -> None:
        if self.read_only:
            raise StoreReadOnlyError(f"{self} is read-only")
