"""TableConfig and FeatureConfig: the user's model, validated when it is built.

A table's ``name`` is the name of everything the user sees: checkpoint entries, serving tables, ``state_dict``
keys and error messages. Any non-empty string without control characters works (``"items"``, ``"user.id"``,
``"stack:a+b"``, unicode), because no internal name shares the namespace.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from ..functional import COMBINERS
from ..optim.base import SparseOptimizer
from ..serialization import Serializable, parse_dtype, serializable
from ..table.admission import FrequencyAdmission
from ..checks import KEY_DTYPES, VALUE_DTYPES, check_positive_int
from ..table.initializers import InitializerSpec, resolve_initializer
from ..table.policy import DEFAULT_BOUNDED, EvictionPolicy
from ..table.tiered import Tiers
from ..table.budget import row_bytes, split_bytes

__all__ = ["TableConfig", "FeatureConfig", "check_name", "split_max_bytes"]

_MAX_NAME = 200  # bytes of UTF-8: names become parts of file names and JSON keys


def check_name(name, what: str) -> str:
    """A table or feature name: a non-empty str of printable characters, at most 200 bytes of UTF-8."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{what} must be a non-empty str, got {name!r}")
    if not name.isprintable():
        raise ValueError(f"{what} must not hold control characters (newline, tab, NUL, ...), got {name!r}")
    if len(name.encode("utf-8", "surrogatepass")) > _MAX_NAME:
        raise ValueError(f"{what} must be at most {_MAX_NAME} bytes of UTF-8, got {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be valid unicode (no lone surrogates), got {name!r}") from None
    return name


@serializable("table", nested=("initializer", "optimizer", "admission", "tiers"))
@dataclasses.dataclass(frozen=True, kw_only=True)
class TableConfig(Serializable):
    """One embedding table.

    Attributes:
        name: unique table name (see the module docstring).
        dim: embedding width ``D``.
        vocabulary_size: ``None`` for a dynamic (hash) table; an int ``V`` for a static dense table of ids
            ``[0, V)``.
        initializer: as for :class:`~dynemb.DynamicEmbedding`.
        optimizer: an unbound sparse optimizer spec, e.g. ``dynemb.optim.Adagrad(lr=0.1)``; each table gets its
            own bound copy, with its own step count.
        combiner: default pooling of the table's features: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
        dtype: value dtype (float32, float16, bfloat16), or its name (``"bfloat16"``).
        key_dtype: id dtype (int32 or int64), or its name; every value of the dtype is a valid id of a dynamic
            table.
        max_capacity: dynamic tables: most rows kept (per rank for row-sharded tables); ``None``: unbounded.
        max_bytes: dynamic tables: the bound in bytes instead (values, slots, scores and index, per rank); see
            :mod:`dynemb.table.budget`, and :func:`split_max_bytes` to share one budget among a collection's tables.
        tiers: dynamic tables: a :class:`dynemb.table.Tiers` (fast-tier budget and where the slow tier lives);
            rows past the budget move to host memory or disk instead of being evicted. Not with the two above.
        eviction: dynamic tables with a bound (``max_capacity``, ``max_bytes`` or ``tiers``): an
            :class:`~dynemb.EvictionPolicy` or its name; without a bound it is an error (nothing is evicted).
            ``None``: ``decayed_lfu`` when the table is bounded (``max_capacity`` or ``max_bytes``;
            :data:`~dynemb.table.policy.DEFAULT_BOUNDED`, chosen by measurement: see docs/tables.md), else lru
            (the scores then only order ``restrict`` and which rows a tiered table moves down).
        half_life: ``decayed_lfu`` tables: clock ticks (about one per training step) in which an access's weight
            halves (default 16, measured: see docs/tables.md).
        admission: dynamic tables: a threshold (int >= 1) or :class:`~dynemb.table.FrequencyAdmission`.
        init_capacity: rows allocated up front (dynamic tables).
        seed: initializer seed (int >= 0); ``None`` draws one from torch's RNG when the collection is built.

    ``to_dict()`` / ``TableConfig.from_dict()`` (:mod:`dynemb.serialization`) save and rebuild a config made of
    data; a callable initializer or an ``OptimizerWrapper`` (a torch class) is refused, naming the field.

    Example:
        >>> TableConfig(name="user", dim=8, eviction="lfu", max_capacity=1000).eviction
        <EvictionPolicy.LFU: 'lfu'>
        >>> TableConfig(name="user", dim=8, max_capacity=1000).eviction  # the measured default
        <EvictionPolicy.DECAYED_LFU: 'decayed_lfu'>
        >>> TableConfig(name="user", dim=0)
        Traceback (most recent call last):
        ...
        ValueError: TableConfig('user').dim must be an int >= 1, got 0
    """

    name: str
    dim: int
    vocabulary_size: Optional[int] = None
    initializer: InitializerSpec = "uniform"
    optimizer: Optional[SparseOptimizer] = None
    combiner: str = "mean"
    dtype: torch.dtype = torch.float32
    key_dtype: torch.dtype = torch.int64
    max_capacity: Optional[int] = None
    eviction: Optional[Union[EvictionPolicy, str]] = None
    admission: Optional[Union[int, FrequencyAdmission]] = None
    init_capacity: int = 8192
    seed: Optional[int] = None
    max_bytes: Optional[int] = None
    tiers: Optional[Tiers] = None
    half_life: Optional[int] = None

    def __post_init__(self):
        check_name(self.name, "TableConfig.name")
        where = f"TableConfig({self.name!r})"
        check_positive_int(self.dim, f"{where}.dim")
        check_positive_int(self.vocabulary_size, f"{where}.vocabulary_size", allow_none=True)
        check_positive_int(self.max_capacity, f"{where}.max_capacity", allow_none=True)
        check_positive_int(self.init_capacity, f"{where}.init_capacity")
        check_positive_int(self.max_bytes, f"{where}.max_bytes", allow_none=True)
        check_positive_int(self.half_life, f"{where}.half_life", allow_none=True)
        for field in ("dtype", "key_dtype"):  # a name, as from_dict gives it, becomes the dtype
            if isinstance(getattr(self, field), str):
                object.__setattr__(self, field, parse_dtype(getattr(self, field), f"{where}.{field}"))
        if self.tiers is not None and not isinstance(self.tiers, Tiers):
            raise TypeError(f"{where}.tiers must be None or a dynemb.table.Tiers, got {self.tiers!r}")
        bounds = {k: v for k, v in (("max_capacity", self.max_capacity), ("max_bytes", self.max_bytes),
                                    ("tiers", self.tiers)) if v is not None}
        if len(bounds) > 1:
            raise ValueError(f"{where}: give at most one of max_capacity, max_bytes and tiers, got {bounds}")
        check_positive_int(self.seed, f"{where}.seed", allow_none=True, minimum=0)
        if self.combiner not in COMBINERS:
            raise ValueError(f"{where}.combiner must be one of {COMBINERS}, got {self.combiner!r}")
        if self.dtype not in VALUE_DTYPES:
            raise TypeError(f"{where}.dtype must be one of {VALUE_DTYPES}, got {self.dtype!r}")
        if self.key_dtype not in KEY_DTYPES:
            raise TypeError(f"{where}.key_dtype must be int32 or int64, got {self.key_dtype!r}")
        if self.optimizer is not None and not isinstance(self.optimizer, SparseOptimizer):
            raise TypeError(f"{where}.optimizer must be a dynemb.optim optimizer spec, got {self.optimizer!r}")
        if self.optimizer is not None and self.optimizer.tables:
            raise ValueError(f"{where}.optimizer must be unbound (built without tables)")
        bounded = self.max_capacity is not None or self.max_bytes is not None
        if self.eviction is None and bounded and not self.is_static:
            object.__setattr__(self, "eviction", DEFAULT_BOUNDED)
        if self.eviction is not None:
            try:
                object.__setattr__(self, "eviction", EvictionPolicy(self.eviction))
            except ValueError:
                raise ValueError(f"{where}.eviction must be None or one of "
                                 f"{[p.value for p in EvictionPolicy]}, got {self.eviction!r}") from None
        if self.half_life is not None and self.eviction is not EvictionPolicy.DECAYED_LFU:
            policy = None if self.eviction is None else self.eviction.value
            raise ValueError(f"{where}.half_life applies to eviction='decayed_lfu' only (the default of a bounded "
                             f"table), got half_life={self.half_life!r} with eviction={policy!r}")
        if self.admission is not None and not isinstance(self.admission, FrequencyAdmission):
            check_positive_int(self.admission, f"{where}.admission (a threshold)")
        if self.is_static and (self.max_capacity, self.eviction, self.admission, self.max_bytes,
                               self.tiers) != (None,) * 5:
            raise ValueError(f"{where}: max_capacity/max_bytes/tiers/eviction/admission apply to dynamic tables only "
                             "(vocabulary_size=None)")
        if self.eviction is not None and not bounded and self.tiers is None:
            # as the CLI's "--eviction needs --max-capacity": a policy on an unbounded table would never evict
            raise ValueError(f"{where}.eviction={self.eviction.value!r} needs a bound: give max_capacity or max_bytes "
                             "(or tiers); only a bounded table evicts, and an unbounded one keeps every key")
        resolve_initializer(self.initializer, f"{where}.initializer")

    @property
    def is_static(self) -> bool:
        return self.vocabulary_size is not None

    @property
    def counts_occurrences(self) -> bool:
        """Whether inserts need each key's number of occurrences (lfu scores and admission count them)."""
        policy = self.eviction or EvictionPolicy.LRU
        return not self.is_static and (self.admission is not None or policy.value.endswith("lfu"))


@serializable("feature", nested=("table",))
@dataclasses.dataclass(frozen=True, kw_only=True)
class FeatureConfig(Serializable):
    """One input feature looked up in ``table`` (a table name or its TableConfig).

    Attributes:
        name: the feature's key in the input dict.
        table: the table it reads.
        combiner: ``None`` pools with the table's combiner; ``"sum"``/``"mean"``/``"sqrtn"`` override it;
            ``"none"`` returns the sequence of rows without pooling.
        padding_value: for dense ``[B, M]`` inputs, entries equal to it are skipped.
        max_norm: clip each row's L2 norm before combining (float > 0).

    ``to_dict()`` / ``FeatureConfig.from_dict()`` save and rebuild it, its TableConfig nested (or the table's
    name).

    Example:
        >>> FeatureConfig(name="clicked", table="item", combiner="sum").to_dict()  # doctest: +NORMALIZE_WHITESPACE
        {'type': 'feature', 'name': 'clicked', 'table': 'item', 'combiner': 'sum', 'padding_value': None,
         'max_norm': None}
    """

    name: str
    table: Union[str, TableConfig]
    combiner: Optional[str] = None
    padding_value: Optional[int] = None
    max_norm: Optional[float] = None

    def __post_init__(self):
        check_name(self.name, "FeatureConfig.name")
        where = f"FeatureConfig({self.name!r})"
        if not isinstance(self.table, (str, TableConfig)):
            raise TypeError(f"{where}.table must be a table name or a TableConfig, got {self.table!r}")
        if self.combiner is not None and self.combiner not in COMBINERS + ("none",):
            raise ValueError(f"{where}.combiner must be None, 'none' or one of {COMBINERS}, got {self.combiner!r}")
        if self.padding_value is not None and (isinstance(self.padding_value, bool)
                                               or not isinstance(self.padding_value, int)):
            raise TypeError(f"{where}.padding_value must be None or an int id, got {self.padding_value!r}")
        if self.max_norm is not None and (isinstance(self.max_norm, bool)
                                          or not isinstance(self.max_norm, (int, float)) or not self.max_norm > 0):
            raise ValueError(f"{where}.max_norm must be None or a float > 0, got {self.max_norm!r}")

    @property
    def table_name(self) -> str:
        return self.table if isinstance(self.table, str) else self.table.name


def split_max_bytes(tables: list[TableConfig], max_bytes: int) -> list[TableConfig]:
    """One byte budget for a collection: the dynamic tables with no bound of their own (no ``max_capacity``,
    ``max_bytes`` or ``tiers``) share ``max_bytes`` so that each can hold the same number of rows, counting values,
    their optimizer's slots, scores and index (see :func:`dynemb.table.budget.split_bytes`). The others are
    returned unchanged.

    Raises:
        ValueError: ``max_bytes`` is not a positive int, no table is left to share it, or it does not hold one row
            of each.

    Example:
        >>> a, b = TableConfig(name="a", dim=4), TableConfig(name="b", dim=12)
        >>> [t.max_bytes for t in split_max_bytes([a, b], 1 << 20)]
        [412525, 636050]
    """
    check_positive_int(max_bytes, "max_bytes")
    if isinstance(tables, (str, bytes, dict)) or not all(isinstance(t, TableConfig) for t in tables):
        raise TypeError(f"split_max_bytes: tables must be a list of TableConfig, got {tables!r}")
    if not tables:
        raise ValueError("split_max_bytes: tables is empty; give the collection's TableConfigs")
    free = [t for t in tables if not t.is_static and (t.max_capacity, t.max_bytes, t.tiers) == (None,) * 3]
    if not free:
        raise ValueError("split_max_bytes: every table is static or has its own bound; none is left to share "
                         f"max_bytes={max_bytes}")
    slots = lambda t: {} if t.optimizer is None else {  # noqa: E731
        k: (w, torch.float32) for k, (w, _) in t.optimizer.slot_widths(t.dim).items()}
    shares = split_bytes(max_bytes, {t.name: (row_bytes(t.dim, t.dtype, t.key_dtype, slots(t)), t.key_dtype)
                                     for t in free})
    return [dataclasses.replace(t, max_bytes=shares[t.name]) if t.name in shares else t for t in tables]
