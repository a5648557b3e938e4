"""Feature inputs, validated and normalized before any table changes: one :class:`PreparedFeature` per feature.

Both executors (local and sharded) take the same prepared features and finish their outputs the same way, so
they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..functional import BagSet, clip_rows, pool_many, to_bags
from ..table.checks import check_keys
from .config import FeatureConfig, TableConfig

__all__ = ["Jagged", "PreparedFeature", "prepare_features", "finish"]


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

    @property
    def plain(self) -> bool:
        """Pooled without ``max_norm``: poolable straight from the table with other plain features."""
        return self.bags is not None and self.max_norm is None


def prepare_features(features: dict, weights: dict, feature_configs: dict[str, FeatureConfig],
                     table_configs: dict[str, TableConfig], device, *,
                     check_ranges: bool = True) -> dict[str, list[PreparedFeature]]:
    """Validate every feature of a batch and group them by table name (tables in config order).

    Dtypes, devices and shapes are always checked. ``check_ranges`` also checks that a static table's ids are in
    ``[0, V)``, which reads the ids' min and max (a device sync on CUDA).

    Raises:
        ValueError/TypeError: naming the feature and its table; nothing has been looked up yet.
    """
    if not isinstance(features, dict):
        raise TypeError(f"features must be a dict {{feature name: ids}}, got {type(features).__name__}")
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
    return {name: parts for name, parts in by_table.items() if parts}


def _prepare(fname: str, fcfg: FeatureConfig, tcfg: TableConfig, value, weight, device,
             check_ranges: bool) -> PreparedFeature:
    combiner = fcfg.combiner or tcfg.combiner
    if combiner == "none":
        if isinstance(value, (tuple, list)):
            ids, offsets = value
            out = PreparedFeature(fname, tcfg.name, _check_ids(ids, tcfg, device, check_ranges), fcfg.max_norm,
                                  jagged_offsets=offsets)
        else:
            out = PreparedFeature(fname, tcfg.name, _check_ids(value, tcfg, device, check_ranges), fcfg.max_norm,
                                  shape=tuple(value.shape))
        return out
    if isinstance(value, (tuple, list)):
        ids, offsets = value
    elif isinstance(value, torch.Tensor) and not value.is_sparse and value.dim() == 1:
        ids, offsets = value, torch.arange(value.numel(), device=value.device)  # one id per sample
    else:
        ids, offsets = value, None
    flat, offsets, w, num_bags = to_bags(ids, offsets, weight, padding_value=fcfg.padding_value)
    flat = _check_ids(flat, tcfg, device, check_ranges)
    return PreparedFeature(fname, tcfg.name, flat, fcfg.max_norm,
                           bags=BagSet(flat.numel(), offsets, w, num_bags, combiner))


def _check_ids(ids, tcfg: TableConfig, device, check_ranges: bool) -> torch.Tensor:
    flat = check_keys(ids, tcfg.key_dtype, device, "ids")
    if check_ranges and tcfg.is_static and flat.numel():
        low, high = torch.aminmax(flat)  # one device sync per static feature
        if int(low) < 0 or int(high) >= tcfg.vocabulary_size:
            bad = int(low) if int(low) < 0 else int(high)
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
    return rows.view(*p.shape, values.shape[1])
