"""The local executor: every table whole on this process; one dedup, one find and one pooling op per table, and one
autograd node for the pooling of all tables whose features are plain pooled ones."""

from __future__ import annotations

import dataclasses

import torch

from ..functional import pool_many, unique_rows
from ..functional.lookup import clip_rows, id_rows, pooled_lookups
from ..functional.pooling import split_combine
from .features import PreparedFeature, finish
from .plan import ExecutionPlan

__all__ = ["LocalExecutor"]


class LocalExecutor:
    """Runs lookups of prepared features against the plan's whole tables."""

    def __init__(self, plan: ExecutionPlan) -> None:
        self.plan = plan

    def forward(self, prepared: dict[str, list[PreparedFeature]], training: bool) -> dict:
        plain = [name for name, parts in prepared.items() if all(p.plain for p in parts)]
        pooled = self._grouped(prepared, plain) if training and torch.is_grad_enabled() else {}
        rest = [name for name in plain if name not in pooled]
        lookups = [(self.plan[name].module, _ids(prepared[name]), [p.bags for p in prepared[name]]) for name in rest]
        pooled.update(zip(rest, pooled_lookups(lookups, training=training, checked=True)))
        out = {}
        for name, parts in prepared.items():
            if name in pooled:
                out.update(zip([p.name for p in parts], pooled[name]))
            else:
                out.update(_mixed_lookup(self.plan[name].module, parts, training))
        return out


    def _grouped(self, prepared: dict[str, list[PreparedFeature]], plain: list[str]) -> dict:
        """The plain features' outputs of the tables the plan's execution groups run this call (one grouped call a
        group), by table name; the other tables are left to their own lookups."""
        if torch.compiler.is_compiling() or not self.plan.groups:
            return {}
        wanted, pooled = set(plain), {}
        for group in self.plan.groups:
            members = [(i, name) for i, name in enumerate(group.names) if name in wanted]
            if not members:
                continue
            got = group.lookup.pooled([(i, _ids(prepared[name]), [p.bags for p in prepared[name]])
                                       for i, name in members])
            pooled.update((name, got[i]) for i, name in members if i in got)
        return pooled


def _ids(parts: list[PreparedFeature]) -> torch.Tensor:
    return parts[0].ids if len(parts) == 1 else torch.cat([p.ids for p in parts])


def _mixed_lookup(module, parts: list[PreparedFeature], training: bool) -> dict:
    """Outputs of the features ``parts`` of one table with a sequence or ``max_norm`` feature (tables of plain pooled
    features only go to ``pooled_lookups``): one dedup and one find for all, one pooling op for the plain ones."""
    ids = _ids(parts)
    plain = [p for p in parts if p.plain]
    if torch.compiler.is_compiling():
        return _compiled_lookup_table(module, ids, parts, training)
    values, inverse = unique_rows(module, ids, training=training, checked=True)
    inverses = dict(zip([p.name for p in parts], inverse.split([p.ids.numel() for p in parts])))
    plain_inverse = torch.cat([inverses[p.name] for p in plain]) if plain else inverse[:0]
    out = {p.name: pooled for p, pooled in zip(plain, pool_many(values, plain_inverse, [p.bags for p in plain]))}
    for p in parts:
        if p.name not in out:
            out[p.name] = finish(p, values, inverses[p.name])
    return out



def _compiled_lookup_table(module, ids: torch.Tensor, parts: list[PreparedFeature], training: bool) -> dict:
    """What compiled code runs for a table with sequence or ``max_norm`` features: each id's row from the one
    opaque lookup op, then clipping, pooling and shaping in plain torch ops the compiler can trace."""
    out = {}
    for p, rows in zip(parts, id_rows(module, ids, training).split([p.ids.numel() for p in parts])):
        if p.max_norm is not None:
            rows = clip_rows(rows, p.max_norm)
        each = torch.arange(rows.shape[0], device=rows.device)
        if p.bags is None:
            out[p.name] = finish(dataclasses.replace(p, max_norm=None), rows, each)
        else:
            offsets, weights = p.bags.offsets, p.bags.weights
            summed = torch.nn.functional.embedding_bag(each, rows, offsets, mode="sum", per_sample_weights=weights)
            out[p.name] = split_combine(summed, [p.bags])[0]
    return out
