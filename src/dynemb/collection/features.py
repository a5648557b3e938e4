"""Feature inputs, validated and normalized before any table changes: one :class:`PreparedFeature` per feature.

Both executors (local and sharded) take the same prepared features and finish their outputs the same way, so
they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..functional import BagSet, clip_rows, pool_many, to_bags
from ..functional.pooling import one_id_bags
from ..checks import check_keys, fit_keys
from .config import FeatureConfig, TableConfig

__all__ = ["Bags", "Jagged", "PreparedFeature", "prepare_features", "as_feature_dict", "as_bags", "finish"]


@dataclasses.dataclass(frozen=True)
class Bags:
    """One feature's bags of ids, in any of the jagged forms: ``ids [N]`` with ``offsets [B]`` (bag starts, as
    ``nn.EmbeddingBag``), ``offsets [B+1]`` with ``include_last_offset=True`` (as TorchRec), or ``lengths [B]``;
    optional per-id ``weights [N]``.

    A plain ``(ids, offsets)`` or ``(ids, offsets, weights)`` tuple, or a dict with these field names, means the
    same; so does a TorchRec ``JaggedTensor`` (lengths, weights).

    Example:
        >>> Bags(torch.tensor([3, 4, 5]), lengths=torch.tensor([2, 1])).lengths.tolist()
        [2, 1]
    """

    ids: torch.Tensor
    offsets: Optional[torch.Tensor] = None
    lengths: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    include_last_offset: bool = False


class Jagged(tuple):
    """Sequence output for ``(ids, offsets)`` inputs: ``(values [N, D], offsets [B])``."""

    def __new__(cls, values, offsets):
        return super().__new__(cls, (values, offsets))

    values = property(lambda self: self[0])
    offsets = property(lambda self: self[1])


@dataclasses.dataclass
class PreparedFeature:
    """One feature's ids ``[N]`` (flat, the table's key dtype) and how its rows become the output.

    Exactly one of ``bags`` (pooled), ``jagged_offsets`` (a jagged sequence) and ``shape`` (a dense sequence of
    ids of that shape) says what the output is.
    """

    name: str
    table: str
    ids: torch.Tensor
    max_norm: Optional[float] = None
    bags: Optional[BagSet] = None
    jagged_offsets: Optional[torch.Tensor] = None
    shape: Optional[tuple] = None
    positions: Optional[torch.Tensor] = None  # dense sequences with padding: where in ``shape`` the ids sit

    @property
    def plain(self) -> bool:
        """Pooled without ``max_norm``: poolable straight from the table with other plain features."""
        return self.bags is not None and self.max_norm is None


def prepare_features(features: dict, weights: dict, feature_configs: dict[str, FeatureConfig],
                     table_configs: dict[str, TableConfig], device, *,
                     check_ranges: bool = True) -> dict[str, list[PreparedFeature]]:
    """Validate every feature of a batch and group them by table name (tables in config order).

    Dtypes, devices and shapes are always checked. int64 ids of an int32 table (TorchRec's ``KeyedJaggedTensor``
    carries int64) are cast to int32 when they fit. ``check_ranges`` checks that they fit, and that a static
    table's ids are in ``[0, V)``: both read the ids' min and max (a device sync on CUDA). Without it an id that
    does not fit in int32 fails a device-side assert (see :func:`dynemb.checks.fit_keys`): it is never
    wrapped onto another id.

    Raises:
        ValueError/TypeError: naming the feature and its table; nothing has been looked up yet.
    """
    if not isinstance(features, dict):
        raise TypeError(f"features must be a dict {{feature name: ids}} or a TorchRec KeyedJaggedTensor, got "
                        f"{type(features).__name__}")
    unknown = sorted(set(features) - set(feature_configs), key=str)
    if unknown:
        raise ValueError(f"features {unknown} are not configured; known: {sorted(feature_configs)}")
    extra = sorted(set(weights) - set(features), key=str)
    if extra:
        raise ValueError(f"weights given for features {extra}, which are not in this batch")
    by_table: dict[str, list[PreparedFeature]] = {name: [] for name in table_configs}
    for fname, value in features.items():
        fcfg = feature_configs[fname]
        tcfg = table_configs[fcfg.table_name]
        try:
            prepared = _prepare(fname, fcfg, tcfg, value, weights.get(fname), device, check_ranges)
        except (TypeError, ValueError) as e:
            raise type(e)(f"feature {fname!r} (table {tcfg.name!r}): {e}") from None
        by_table[tcfg.name].append(prepared)
    _check_batch_sizes([p for parts in by_table.values() for p in parts])
    return {name: parts for name, parts in by_table.items() if parts}


def _check_batch_sizes(prepared: list[PreparedFeature]) -> None:
    """Pooled features of one batch give one row per sample: their bag counts must agree."""
    sizes = {p.name: p.bags.num_bags for p in prepared if p.bags is not None}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"pooled features must have one bag per sample, but their bag counts differ: {sizes}. "
                         "Offsets with B+1 entries (TorchRec style) need Bags(ids, offsets, include_last_offset=True), "
                         "or pass lengths: Bags(ids, lengths=...)")


def as_feature_dict(features):
    """A TorchRec KeyedJaggedTensor as ``{feature: Bags}`` (torchrec itself stays optional); anything else as is."""
    if isinstance(features, dict) or not (callable(getattr(features, "to_dict", None))
                                          and callable(getattr(features, "keys", None))):
        return features
    return {key: _from_jagged(jt) for key, jt in features.to_dict().items()}


def _from_jagged(value):
    """A TorchRec JaggedTensor (values, lengths, weights) as Bags; anything else unchanged."""
    if callable(getattr(value, "lengths", None)) and callable(getattr(value, "values", None)) \
            and callable(getattr(value, "weights_or_none", None)):
        return Bags(value.values(), lengths=value.lengths(), weights=value.weights_or_none())
    return value


_FORMS = ("ids [B] (one per sample), dense [B, M], sparse COO [B, M], (ids, offsets), (ids, offsets, weights), "
          "Bags(ids, offsets=/lengths=, weights=), or a TorchRec JaggedTensor")


def as_bags(value):
    """The feature's value as Bags when it is a jagged form, else the tensor; errors say which forms work."""
    value = _from_jagged(value)
    if isinstance(value, (Bags, torch.Tensor)):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(Bags)})
        if unknown or "ids" not in value:
            raise ValueError(f"a dict input needs 'ids' and any of offsets/lengths/weights/include_last_offset, got "
                             f"keys {sorted(value)}")
        return Bags(**value)
    if isinstance(value, (tuple, list)) and len(value) in (2, 3) and all(isinstance(v, torch.Tensor) or v is None
                                                                         for v in value):
        return Bags(value[0], offsets=value[1], weights=value[2] if len(value) == 3 else None)
    what = f"a {type(value).__name__} of {len(value)} {type(value[0]).__name__}" if isinstance(
        value, (tuple, list)) and value else type(value).__name__
    raise TypeError(f"must be one of {_FORMS}; got {what}")


def _prepare(fname: str, fcfg: FeatureConfig, tcfg: TableConfig, value, weight, device,
             check_ranges: bool) -> PreparedFeature:
    value = as_bags(value)
    combiner = fcfg.combiner or tcfg.combiner
    if combiner == "none":
        if weight is not None or (isinstance(value, Bags) and value.weights is not None):
            raise ValueError("weights are for pooled features; this is a sequence feature (combiner='none')")
        if isinstance(value, Bags):
            ids, offsets, _, _ = to_bags(value.ids, value.offsets, lengths=value.lengths,
                                         include_last_offset=value.include_last_offset)
            return PreparedFeature(fname, tcfg.name, _check_ids(fname, ids, tcfg, device, check_ranges), fcfg.max_norm,
                                   jagged_offsets=offsets)
        if fcfg.padding_value is not None and not value.is_sparse:
            kept = (value.reshape(-1) != fcfg.padding_value).nonzero().squeeze(1)
            ids = value.reshape(-1).index_select(0, kept)  # checked (and cast) once, without the padding
            return PreparedFeature(fname, tcfg.name, _check_ids(fname, ids, tcfg, device, check_ranges), fcfg.max_norm,
                                   shape=tuple(value.shape), positions=kept)
        return PreparedFeature(fname, tcfg.name, _check_ids(fname, value, tcfg, device, check_ranges), fcfg.max_norm,
                               shape=tuple(value.shape))
    if isinstance(value, Bags):
        if weight is not None and value.weights is not None:
            raise ValueError("weights are given twice: in the weights dict and in the feature's input")
        flat, offsets, w, num_bags = to_bags(value.ids, value.offsets, value.weights if weight is None else weight,
                                             lengths=value.lengths, include_last_offset=value.include_last_offset,
                                             shared_offsets=True)
    elif not value.is_sparse and value.dim() == 1 and weight is None and value.device.type == "cpu" \
            and not torch.compiler.is_compiling():
        # one id per sample, unweighted: its ids as they are and the shared offsets (see one_id_bags), without the
        # reshapes of the [B, 1] form below (two ops a feature and step)
        flat, offsets, w, num_bags = value, one_id_bags(value.numel(), value.device), None, value.numel()
    elif not value.is_sparse and value.dim() == 1:  # one id per sample
        column = weight.reshape(-1, 1) if isinstance(weight, torch.Tensor) and weight.dim() == 1 else weight
        # [B, 1]: offsets need no check, and are shared (see one_id_bags)
        flat, offsets, w, num_bags = to_bags(value.reshape(-1, 1), None, column, shared_offsets=True)
    else:
        flat, offsets, w, num_bags = to_bags(value, None, weight, padding_value=fcfg.padding_value,
                                             shared_offsets=True)
    if w is None and not isinstance(value, Bags) and not value.is_sparse \
            and (value.dim() == 1 or (value.dim() == 2 and value.shape[1] <= 1)):
        # Bags of at most one unweighted id: mean and sqrtn divide by 1 (an empty bag's too), the same values as a
        # sum (the same bits but for a NaN's sign and payload), which spares each lookup its divisors and the
        # backward its division (a CTR model's usual feature).
        combiner = "sum"
    flat = _check_ids(fname, flat, tcfg, device, check_ranges)
    one_id = not isinstance(value, Bags) and not value.is_sparse and fcfg.padding_value is None \
        and (value.dim() == 1 or (value.dim() == 2 and value.shape[1] == 1))
    return PreparedFeature(fname, tcfg.name, flat, fcfg.max_norm,
                           bags=BagSet(flat.numel(), offsets, w, num_bags, combiner, one_id))


def _check_ids(fname: str, ids, tcfg: TableConfig, device, check_ranges: bool) -> torch.Tensor:
    # A ValueError of the checked cast is prefixed with the feature and table by prepare_features; the device-side
    # assert of the unchecked one (also the one compiled code runs) names them itself.
    checked = check_ranges and not torch.compiler.is_compiling()
    name = "ids" if checked else f"ids of feature {fname!r} (table {tcfg.name!r})"
    flat = check_keys(fit_keys(ids, tcfg.key_dtype, device, name, check=check_ranges), tcfg.key_dtype, device,
                      "ids")
    if check_ranges and tcfg.is_static and not torch.compiler.is_compiling() and flat.numel():
        low, high = torch.stack(torch.aminmax(flat)).tolist()  # one device sync per static feature
        if low < 0 or high >= tcfg.vocabulary_size:
            bad = low if low < 0 else high
            raise ValueError(f"ids must be in [0, {tcfg.vocabulary_size}) for static table {tcfg.name!r}, got {bad}")
    return flat


def finish(p: PreparedFeature, values: torch.Tensor, inverse: torch.Tensor):
    """The output of feature ``p`` from the unique rows ``values [U, D]`` it reads through ``inverse [N]``."""
    if p.max_norm is not None:
        used, local = torch.unique(inverse, return_inverse=True)
        values, inverse = clip_rows(values.index_select(0, used), p.max_norm), local
    if p.bags is not None:
        return pool_many(values, inverse, [p.bags])[0]
    rows = torch.nn.functional.embedding(inverse, values)
    if p.jagged_offsets is not None:
        return Jagged(rows, p.jagged_offsets)
    if p.positions is not None:  # padded positions read zeros and train nothing, as nn.Embedding's padding_idx
        total = 1
        for size in p.shape:
            total *= size
        rows = values.new_zeros(total, values.shape[1]).index_copy(0, p.positions, rows)
    return rows.view(*p.shape, values.shape[1])
