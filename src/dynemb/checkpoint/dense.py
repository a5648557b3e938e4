"""The dense part of a model: every state_dict entry that does not belong to a table.

``model.state_dict()`` would make each table export (copy) its rows, so the dense state is collected module by
module instead, skipping the tables (standalone Dynamic/StaticEmbeddings, and the tables of collections), with the
same names ``state_dict`` uses.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..collection import EmbeddingCollection
from ..embedding import DynamicEmbedding, StaticEmbedding
from .errors import CheckpointError

__all__ = ["dense_state", "check_dense"]


def dense_state(model: nn.Module, keep_vars: bool = False) -> dict:
    """Parameters, persistent buffers and extra state of every module except the tables (no copies)."""
    state: dict = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, (DynamicEmbedding, StaticEmbedding)):
            continue
        # A collection's own _save_to_state_dict adds its tables: take only what nn.Module itself would.
        save = nn.Module._save_to_state_dict if isinstance(module, EmbeddingCollection) \
            else type(module)._save_to_state_dict
        save(module, state, f"{prefix}." if prefix else "", keep_vars)
    return state


def check_dense(model: nn.Module, state: dict, strict: bool, source: Path) -> dict:
    """The entries of ``state`` to load into ``model``, after checking names (when ``strict``) and shapes.

    Raises:
        CheckpointError: names differ under ``strict``, or a tensor's shape differs; the message names ``source``.
    """
    expected = dense_state(model, keep_vars=True)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if strict and (missing or unexpected):
        raise CheckpointError(f"{source}: dense state does not match the model (strict=True): missing {missing}, "
                              f"unexpected {unexpected}")
    for name, value in state.items():
        mine = expected.get(name)
        if hasattr(mine, "shape") and hasattr(value, "shape") and tuple(mine.shape) != tuple(value.shape):
            raise CheckpointError(f"{source}: {name!r} has shape {tuple(value.shape)} in the checkpoint but "
                                  f"{tuple(mine.shape)} in the model")
    return {k: v for k, v in state.items() if k in expected}
