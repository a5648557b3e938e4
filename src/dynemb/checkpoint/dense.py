"""The dense part of a model: every state_dict entry that does not belong to a table.

``model.state_dict()`` would make each table export (copy) its rows, so the dense state is collected module by
module instead, skipping the tables (standalone Dynamic/StaticEmbeddings, and the tables of collections), with the
same names ``state_dict`` uses.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..collection import EmbeddingCollection
from ..embedding import DynamicEmbedding, StaticEmbedding
from .errors import CheckpointError

__all__ = ["dense_state", "check_dense", "load_dense", "unwrap", "wrapper_free"]

#: the child names a wrapper keeps its module under (DistributedDataParallel and DataParallel: ``module``;
#: ``torch.compile``'s OptimizedModule: ``_orig_mod``); a name saved through a wrapper by older versions has them
_WRAPPER_SEGMENTS = ("module", "_orig_mod")


def unwrap(module: nn.Module) -> nn.Module:
    """``module`` without its wrappers: DistributedDataParallel, DataParallel and ``torch.compile``'s
    OptimizedModule (matched by name: importing ``torch._dynamo`` to test the type costs a second). Wrapping is
    layout, so names in files and exports are the wrapped model's."""
    while True:
        if isinstance(module, (DistributedDataParallel, nn.DataParallel)):
            module = module.module
        elif type(module).__name__ == "OptimizedModule" and isinstance(module._modules.get("_orig_mod"), nn.Module):
            module = module._modules["_orig_mod"]
        else:
            return module


def wrapper_free(name: str, known) -> str:
    """``name`` (a table's or a dense entry's, as an older version saved it through a wrapper, such as
    ``_orig_mod.emb`` or ``top.module.0.weight``) as the model names it now, if ``known`` has it that way and not
    as it is; else ``name``."""
    if name in known:
        return name
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    bare = ".".join(parts)
    return bare if bare and bare in known else name


def _modules(module: nn.Module, prefix: str = ""):
    """``(name, module)`` as ``named_modules(remove_duplicate=False)``, but through wrappers (:func:`unwrap`) as
    if they were not there: wrapping is layout, and the names in a file are the user's model's."""
    module = unwrap(module)
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _modules(child, f"{prefix}.{name}" if prefix else name)


def dense_state(model: nn.Module, keep_vars: bool = False) -> dict:
    """Parameters, persistent buffers and extra state of every module except the tables (no copies), named as
    in the model without its wrappers (:func:`unwrap`: ``top.0.weight``, never ``top.module.0.weight``)."""
    state: dict = {}
    for prefix, module in _modules(model):
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
    # Files written before wrappers were skipped name the wrapper's ``module`` or ``_orig_mod``: read them too.
    state = {wrapper_free(k, expected): v for k, v in state.items()}
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


def load_dense(model: nn.Module, state: dict) -> None:
    """Load ``state`` (names as :func:`dense_state` gives them, checked by :func:`check_dense`) into ``model``'s
    modules other than the tables, through wrappers (:func:`unwrap`)."""
    errors: list = []
    for prefix, module in _modules(model):
        if isinstance(module, (DynamicEmbedding, StaticEmbedding)):
            continue
        load = nn.Module._load_from_state_dict if isinstance(module, EmbeddingCollection) \
            else type(module)._load_from_state_dict
        load(module, state, f"{prefix}." if prefix else "", {}, False, [], [], errors)
    if errors:
        raise CheckpointError("; ".join(errors))
