"""Nested state (an optimizer's ``state_dict()``, a module's extra state) as one safetensors file, without pickle.

Tensors go to the file's tensor section, named by their path in the structure; everything else becomes a JSON tree
in the header metadata, where ``{"__tensor__": name}`` stands for a tensor, ``{"__tuple__": [...]}`` for a tuple
and ``{"__items__": [[key, value], ...]}`` for a dict whose keys are not all plain strings (torch.optim keys its
state by int). Only tensors, numbers, strings, None, lists, tuples and dicts are accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import CheckpointError
from .tensorfile import FileRecord, OnBytes, read_tensors

__all__ = ["encode", "decode", "read_state", "TREE_KEY"]

TREE_KEY = "dynemb.tree"
_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"


def encode(obj, what: str) -> tuple[dict, dict]:
    """Split ``obj`` into ``(tensors, metadata)`` ready for :func:`~dynemb.checkpoint.tensorfile.write_tensors`.

    Raises:
        TypeError: ``obj`` holds something other than the accepted types; the message names ``what`` and the path.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(x, path: str):
        if isinstance(x, torch.Tensor):
            name = path or "tensor"
            while name in tensors:
                name += "'"
            tensors[name] = x.detach()
            return {_TENSOR: name}
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(x)]
            return {_TUPLE: items} if isinstance(x, tuple) else items
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: walk(v, f"{path}/{k}" if path else k) for k, v in x.items()}
            pairs = enumerate(x.items())
            return {_ITEMS: [[walk(k, f"{path}/{i}/key"), walk(v, f"{path}/{i}")] for i, (k, v) in pairs]}
        raise TypeError(f"{what}: cannot save a {type(x).__name__} at {path or 'the top level'}; only tensors, "
                        "numbers, strings, None, lists, tuples and dicts are saved (no pickle)")

    tree = walk(obj, "")
    return tensors, {TREE_KEY: json.dumps(tree)}


def decode(metadata: dict, tensors: dict, source: Path):
    """Rebuild the structure :func:`encode` split. ``source`` names the file in errors."""
    try:
        tree = json.loads(metadata[TREE_KEY])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{source}: no readable '{TREE_KEY}' metadata ({e})") from None

    def walk(x):
        if isinstance(x, list):
            return [walk(v) for v in x]
        if not isinstance(x, dict):
            return x
        if _TENSOR in x:
            if x[_TENSOR] not in tensors:
                raise CheckpointError(f"{source}: tensor {x[_TENSOR]!r} named in the metadata is not in the file")
            return tensors[x[_TENSOR]]
        if _TUPLE in x:
            return tuple(walk(v) for v in x[_TUPLE])
        if _ITEMS in x:
            return {walk(k): walk(v) for k, v in x[_ITEMS]}
        return {k: walk(v) for k, v in x.items()}

    return walk(tree)


def read_state(path: Path, expected: FileRecord, on_bytes: OnBytes | None = None):
    """Read and decode a file written from :func:`encode`'s output, verifying its checksum."""
    tensors, metadata = read_tensors(path, expected, on_bytes)
    return decode(metadata, tensors, path)
