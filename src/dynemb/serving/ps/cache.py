"""The parameter server's state per served table: the device cache and its locks, statistics and default rows."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import warnings
from typing import Optional, Union

import torch

from ...checkpoint.row_codec import decode_rows, encode_rows
from ...serialization import NotSerializableError, parse_dtype
from ...table.initializers import Initializer
from ..server_config import ModelConfig
from .group_cache import TableCache
from .lineage import Lineage
from .writeback import PendingRows, batch_rows

__all__ = ["TableState", "new_table", "cache_capacity"]

_SMALL_TABLE_ROWS = 4096


@dataclasses.dataclass
class TableState:
    """One served table. Its cache is read and written under ``cache_lock``; ``stats`` and ``pending`` are guarded
    by ``stats_lock``, so that counting a lookup never waits for an insert into the cache."""

    name: str
    dim: int
    dtype: torch.dtype
    store_name: str  # the table's name in the stores: "<model>@<model id>.<table>" (store_name)
    cache: TableCache  # the table's view of its group's cache (see .group_cache)
    default: Union[float, Initializer]
    seed: int
    pending: PendingRows  # rows waiting for a background write-back into the cache
    stats: dict = dataclasses.field(default_factory=lambda: {"lookups": 0, "cache": 0, "volatile": 0,
                                                             "persistent": 0, "default": 0})
    stats_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    epoch: int = 0  # moved on by each update, under both locks; write-backs of rows read before are dropped
    lineage: Optional[Lineage] = None  # the export the table holds; replaced by each update, under the model's lock
    key_dtype: torch.dtype = torch.int64  # the trained table's key dtype: an int32 one serves only int32-range ids
    codec: Optional[str] = None  # 8-bit rows (checkpoint.row_codec): stored packed, `dim` 16-bit words a row
    row_dim: int = 0  # values a row as the lookup answers it (`dim` unless packed)
    namespace: str = ""  # "<model>@<model id>" of the export root it is served from: its marker's (see .tiers)

    def __post_init__(self) -> None:
        self.row_dim = self.row_dim or self.dim

    def stored(self, values: torch.Tensor, kind: Optional[str]) -> torch.Tensor:
        """Rows of an export whose dtype is ``kind`` (a packed 8-bit kind, or None for float rows) as this table
        stores them: float rows in its dtype, or packed rows as 16-bit words."""
        if kind != self.codec:  # an export of another precision: through float32
            values = decode_rows(values, kind, self.row_dim) if kind else values
            values = encode_rows(values, self.codec) if self.codec else values
        return values.contiguous().view(torch.float16) if self.codec else values.to(self.dtype)

    def answer(self, values: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[N, dim]`` -> the rows a lookup answers, ``[N, row_dim]`` (8-bit rows dequantized)."""
        return decode_rows(values, self.codec, self.row_dim) if self.codec else values

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Float rows ``[N, row_dim]`` as stored."""
        return encode_rows(rows, self.codec).view(torch.float16) if self.codec else rows.to(self.dtype)

    @property
    def cache_lock(self) -> threading.Lock:
        """The lock of the group cache the table's rows are in (shared by the tables of the group)."""
        return self.cache.group.lock

    @property
    def filling(self) -> bool:
        """A background write-back is inserting into the (group) cache, or about to."""
        return self.cache.group.filling

    @filling.setter
    def filling(self, value: bool) -> None:
        self.cache.group.filling = value

    def default_rows(self, keys: torch.Tensor) -> torch.Tensor:
        """Default rows of ``keys`` as stored (8-bit rows: the initializer's rows, quantized as the export's are)."""
        dtype = torch.float32 if self.codec else self.dtype
        if isinstance(self.default, Initializer):
            return self.encode(self.default(keys, self.row_dim, dtype, self.seed))
        return self.encode(torch.full((keys.numel(), self.row_dim), float(self.default), dtype=dtype))

    @property
    def hit_rate(self) -> float:
        return self.stats["cache"] / max(self.stats["lookups"], 1)

    def insert_if_current(self, keys: torch.Tensor, rows: torch.Tensor, epoch: int) -> None:
        """Insert rows read at ``epoch`` into the cache, unless an update came since (they may be stale then)."""
        with self.cache_lock:
            if epoch == self.epoch:
                self.cache.insert_or_assign(keys.to(self.cache.device), rows.to(self.cache.device))


def cache_capacity(cfg: ModelConfig, rows: int) -> int:
    """Rows of the cache for a table of ``rows`` rows: ``cache_fraction`` of them; a small table whole (a fraction
    of a 10-row table would only cost misses)."""
    return max(1, int(rows * cfg.cache_fraction), min(rows, _SMALL_TABLE_ROWS))


def new_table(cfg: ModelConfig, i: int, name: str, dim: int, dtype: torch.dtype, entry: dict, cache: TableCache,
              jitter: random.Random, model_id: Optional[str] = None) -> TableState:
    """The state of table ``i`` of ``cfg``, ``name``, from its export manifest ``entry`` of the export root whose
    model id is ``model_id``, cached in ``cache``."""
    default = cfg.default_for(i)
    if default == "initializer":
        default = _initializer(name, entry, explicit=bool(cfg.default_value_for_each_table))
    return TableState(name, dim, dtype, store_name(cfg.model, name, model_id), cache, default,
                      int(entry.get("seed") or 0), PendingRows(batch_rows(cache.capacity), jitter),
                      key_dtype=parse_dtype(entry.get("key_dtype", "int64"), f"table {name!r}: key_dtype"),
                      namespace=namespace(cfg.model, model_id))


def _initializer(name: str, entry: dict, explicit: bool) -> Union[float, Initializer]:
    """The initializer of the export ``entry``, rebuilt for default rows (``Initializer.from_dict``). One that
    cannot be rebuilt (a Python callable, or a type this dynemb does not know) is an error when ``"initializer"``
    was asked for, and zero rows with a warning by default."""
    record = entry["initializer"]
    try:
        return Initializer.from_dict(record, f"table {name!r}: initializer")
    except (NotSerializableError, ValueError) as e:
        if explicit:
            raise ValueError(f"{e}; it cannot be rebuilt for default rows") from None
        warnings.warn(f"{e}; it cannot be rebuilt for default rows; unseen ids get zero rows (set "
                      "default_value_for_each_table to choose)", stacklevel=5)
    return 0.0


def namespace(model: str, model_id: Optional[str] = None) -> str:
    """The stores' namespace of a model served from the export root of ``model_id`` (``model.json``, shared by
    every export of one training run): ``<model>@<model id>`` (just ``<model>`` for an export without an id), so
    two runs served under one name never share rows, and replicas of one run do."""
    return model if model_id is None else f"{model}@{_escaped(model_id)}"


def _escaped(name: str) -> str:
    return name.replace('%', '%25').replace('{', '%7B').replace('}', '%7D').replace('~', '%7E')


def store_name(model: str, table: str, model_id: Optional[str] = None) -> str:
    """The table's name in the stores: ``<model>@<model id>.<table>`` (see :func:`namespace`), with the characters
    stores cannot hold in a name (Redis hash-tag braces) percent-encoded, so every table name the user can give is
    served. A name too long for the stores' 255 bytes becomes a digest of itself."""
    space = namespace(model, model_id)
    name = f"{space}.{_escaped(table)}"
    if len(name.encode()) > 255:
        name = f"{model[:180]}.~{hashlib.sha256(f'{space}.{table}'.encode()).hexdigest()[:40]}"
    return name
