"""``export_model``: a serving export of a user's own ``nn.Module`` holding ``EmbeddingCollection`` s.

The tables go through the table export (:func:`~dynemb.checkpoint.export_for_serving`: the same files, dtypes and
versions ``dynemb serve --watch`` follows); the rest through ``torch.export``, saved with ``torch.export.save``
(``program.pt2``, no pickle of code) in the same version directory, with the model's inputs and outputs described
in the manifest's ``program`` field. Each collection call is traced as one ``dynemb::served_features`` node (see
:mod:`.served_features`), which the served model binds to its parameter server: the graph holds no table rows.
"""

from __future__ import annotations

import inspect
import io
import json
import re
from pathlib import Path
from typing import Optional

import torch
import torch.fx.experimental._config as fx_config
import torch.utils._pytree as pytree
from torch import nn

from ..checkpoint.export_format import export_for_serving
from ..collection import EmbeddingCollection
from ..collection.features import Bags, as_bags
from ..embedding import DynamicEmbedding, StaticEmbedding
from ..serialization import dtype_name
from .served_features import served_features_op

__all__ = ["export_model", "PROGRAM_FILE"]

PROGRAM_FILE = "program.pt2"
"""The exported program in a version directory of an ``export_model`` root."""


def export_model(path, model: nn.Module, example_inputs: tuple, *, example_kwargs: Optional[dict] = None,
                 dtype: torch.dtype = torch.float32, incremental: bool = False,
                 model_name: Optional[str] = None) -> Path:
    """Write a serving export of ``model`` (an ``nn.Module`` holding one or more ``EmbeddingCollection`` s).

    Writes ``path/version-<n>/`` (``n`` one above the newest there; ``latest`` then names it, so ``dynemb serve
    --export path --watch`` follows new versions) with every table as :func:`~dynemb.checkpoint.export_for_serving`
    writes it (in ``dtype``: float32/16, bfloat16, or 8-bit ``int8``/``float8_e4m3fn``/``float8_e5m2`` rows; a delta
    of the rows written since the last export with ``incremental``), and ``program.pt2``: ``model`` in eval mode
    traced by ``torch.export`` on ``example_inputs``, each collection call a ``dynemb::served_features`` node bound
    at serve time to the parameter server's lookup of its tables. Dim 0 of every input is dynamic (any batch size,
    1 included; a jagged input's length too).

    The served inputs are the tensors of ``example_inputs`` (nested tuples, lists, dicts and pytree-registered
    classes such as TorchRec's ``KeyedJaggedTensor`` are flattened), named by ``forward``'s parameter and the path
    inside it joined by ``_``: ``dense``, ``features_values``, ``features_lengths``, ``batch_user_id``. Outputs:
    ``output`` for one tensor, else each by its path (``output_0``, a dict output's keys). The manifest's
    ``program`` field lists both with dtypes and shapes (``-1``: dynamic).

    Args:
        path: the export root (created if needed).
        model: the model; its collections must be unsharded, and its tables live in collections.
        example_inputs: positional arguments of ``model.forward`` (tensors, or containers of them).
        example_kwargs: keyword arguments of ``model.forward``.
        dtype: the tables' served dtype (see ``export_for_serving``).
        incremental: tables as a delta of the previous export to ``path``; the program is always whole.
        model_name: the model id of the root (see ``export_for_serving``).

    Returns:
        The version directory written.

    Raises:
        TypeError: ``model`` is no module, an input is no tensor; ``model`` in eval mode refuses
            ``example_inputs`` (ids of a float dtype, ...): its message, after ``example_inputs:``.
        ValueError: ``model`` holds no collection, a sharded one, or a table outside a collection; a feature input
            the export does not support (a sparse COO tensor; a jagged sequence of ``combiner="none"``); ``model``
            in eval mode refuses ``example_inputs`` (as for TypeError).

    Example:
        >>> import tempfile, torch, dynemb
        >>> from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
        >>> class Tower(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.ec = EmbeddingCollection([TableConfig(name="user", dim=4)],
        ...                                       [FeatureConfig(name="user_id", table="user")])
        ...         self.head = torch.nn.Linear(4, 1)
        ...     def forward(self, user_id):
        ...         return self.head(self.ec({"user_id": user_id})["user_id"]).squeeze(1)
        >>> model = Tower()
        >>> _ = model(torch.tensor([1, 2, 3]))  # training inserts the rows
        >>> root = tempfile.mkdtemp()
        >>> out = export_model(root, model, (torch.tensor([1, 2]),))
        >>> out.name, sorted(p.name for p in out.iterdir() if p.suffix == ".pt2")
        ('version-00000001', ['program.pt2'])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(example_inputs, (torch.Tensor, dict)) or not isinstance(example_inputs, (tuple, list)):
        raise TypeError(f"example_inputs must be a tuple of model.forward's positional arguments, got "
                        f"{type(example_inputs).__name__} (one tensor x: pass (x,))")
    kwargs = dict(example_kwargs or {})
    _check_tables(model)
    leaves, in_spec = pytree.tree_flatten_with_path((tuple(example_inputs), kwargs))
    names = _input_names(model, tuple(example_inputs), kwargs, [p for p, _ in leaves])
    for name, (_, value) in zip(names, leaves):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"input {name!r} must be a tensor (or a container of tensors registered with "
                            f"torch.utils._pytree), got {type(value).__name__}")
    _check_runs(model, tuple(example_inputs), kwargs)
    flat = [v for _, v in leaves]
    wrapper = _Flat(model, in_spec, names)
    program = _trace(wrapper, flat)
    # without them the archive is the graph (JSON) and raw weight bytes: torch.export.save writes example inputs
    # with torch.save (a pickle, of the user's example ids), and torch.export.load may unpickle them
    program.example_inputs = None
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    meta = _describe(program, names, wrapper.output_names)
    meta.update(file=PROGRAM_FILE, torch=torch.__version__, collections={
        path: _collection_record(ec) for path, ec in model.named_modules() if isinstance(ec, EmbeddingCollection)})
    return export_for_serving(path, model, dtype=dtype, incremental=incremental, model_name=model_name,
                              attach={"files": {PROGRAM_FILE: buffer.getvalue()}, "fields": {"program": meta}})


def _check_runs(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """One eager forward of ``model`` in eval mode on the example inputs (tables read-only: nothing inserted or
    counted). The trace replaces each collection by a stand-in that checks no ids, so without this an input the
    collection refuses (float ids, lengths that do not sum to the ids) would be exported and then refused by every
    request; here it is refused at once, with the collection's message."""
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(*args, **kwargs)
    except (TypeError, ValueError) as e:
        if type(e) not in (TypeError, ValueError):
            raise
        raise type(e)(f"example_inputs: {e}") from None
    finally:
        model.train(training)


def _check_tables(model: nn.Module) -> None:
    collections = [p for p, m in model.named_modules() if isinstance(m, EmbeddingCollection)]
    if not collections:
        raise ValueError("model holds no EmbeddingCollection; export_model serves the tables of collections")
    for path, m in model.named_modules():
        inside = any(path == c or path.startswith(c + ".") for c in collections) if path else False
        if isinstance(m, EmbeddingCollection) and m.sharded:
            raise ValueError(f"collection {path or 'model'!r} is sharded: export_model traces one process's model; "
                             "export the tables with export_for_serving and the model from an unsharded copy")
        if isinstance(m, (DynamicEmbedding, StaticEmbedding)) and not inside:
            raise ValueError(f"module {path or 'model'!r} is a standalone {type(m).__name__}: export_model serves "
                             "the tables of EmbeddingCollections; hold it in a collection")


def _key(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _safe(parts: list) -> str:
    return re.sub(r"\W", "_", "_".join(parts)) or "input"


def _unique(names: list) -> list:
    out, seen = [], set()
    for n in names:
        m, k = n, 2
        while m in seen:
            m, k = f"{n}_{k}", k + 1
        seen.add(m)
        out.append(m)
    return out


def _input_names(model: nn.Module, args: tuple, kwargs: dict, paths: list) -> list:
    """Each input leaf's name: ``forward``'s parameter, then its path inside that argument, joined by ``_``."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = []
    for path in paths:  # ((args, kwargs), ...): path[0] picks args (0) or kwargs (1), path[1] the argument
        where, arg = path[0].idx, path[1]
        head = _key(arg) if where == 1 else (params[arg.idx] if arg.idx < len(params) else f"input{arg.idx}")
        names.append(_safe([head, *(_key(k) for k in path[2:])]))
    return _unique(names)


def _output_names(paths: list) -> list:
    if len(paths) == 1 and not paths[0]:
        return ["output"]
    return _unique([_safe([_key(k) for k in p]) if p and hasattr(p[0], "key") else _safe(["output"] + [
        _key(k) for k in p]) for p in paths])


class _Flat(nn.Module):
    """The user's model with flat tensor inputs and outputs, so the program's interface needs none of the user's
    classes (a ``KeyedJaggedTensor`` is rebuilt inside the trace, and gone from the graph)."""

    def __init__(self, model: nn.Module, in_spec, names: list) -> None:
        super().__init__()
        self.model, self.in_spec = model, in_spec
        named: list = []  # the outputs' names, known once traced
        # the program's placeholders carry the inputs' names, so its shape checks name them too
        params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]

        def forward(*flat):
            args, kwargs = pytree.tree_unflatten(list(flat), self.in_spec)
            leaves, _ = pytree.tree_flatten_with_path(self.model(*args, **kwargs))
            bad = [pytree.keystr(p) for p, v in leaves if not isinstance(v, torch.Tensor)]
            if bad:
                raise TypeError(f"model outputs must be tensors (or containers of them); output{bad[0]} is not")
            named[:] = _output_names([p for p, _ in leaves])
            return tuple(v for _, v in leaves)

        forward.__signature__ = inspect.Signature(params)
        forward.output_names = named  # on the function: export restores the module's own attributes after tracing
        self.forward = forward

    @property
    def output_names(self) -> list:
        return list(self.forward.output_names)


class _CollectionNode(nn.Module):
    """Stands in for a collection while its model is traced: its call becomes one ``dynemb::served_features``
    node taking the call's input tensors (module :mod:`.served_features`)."""

    def __init__(self, path: str, ec: EmbeddingCollection) -> None:
        super().__init__()
        self.path, self.feature_configs, self.table_configs = path, ec.feature_configs, ec.table_configs

    def forward(self, features, weights: Optional[dict] = None) -> dict:
        where = f"collection {self.path or 'model'!r}"
        if not isinstance(features, dict) and callable(getattr(features, "keys", None)) \
                and callable(getattr(features, "values", None)) and callable(getattr(features, "lengths", None)):
            if weights:
                raise ValueError(f"{where}: weights are given beside a KeyedJaggedTensor; put them in it")
            keys = list(features.keys())
            w = features.weights_or_none() if callable(getattr(features, "weights_or_none", None)) else None
            tensors = [features.values(), features.lengths(), *([w] if w is not None else [])]
            spec = {"kind": "kjt", "keys": keys, "weighted": w is not None}
            names = keys
        elif isinstance(features, dict):
            tensors, described, names = [], [], list(features)
            for name, value in features.items():
                fields, value = {}, as_bags(value)
                if isinstance(value, Bags):
                    fields = {k: getattr(value, k) for k in ("ids", "offsets", "lengths", "weights")
                              if getattr(value, k) is not None}
                elif isinstance(value, torch.Tensor) and not value.is_sparse:
                    fields = {"ids": value}
                else:
                    raise ValueError(f"{where}: feature {name!r}: a sparse COO input cannot be exported; pass "
                                     "Bags(ids, lengths=...) or (ids, offsets)")
                if weights and weights.get(name) is not None:
                    fields["weight"] = weights[name]
                tensors += fields.values()
                described.append({"name": name, "form": "tensor" if not isinstance(value, Bags) else "bags",
                                  "fields": list(fields), "include_last_offset": isinstance(value, Bags)
                                  and value.include_last_offset})
            spec = {"kind": "dict", "features": described}
        else:
            raise TypeError(f"{where}: features must be a dict or a KeyedJaggedTensor, got {type(features).__name__}")
        unknown = [n for n in names if n not in self.feature_configs]
        if unknown:
            raise ValueError(f"{where}: features {unknown} are not configured; known: {sorted(self.feature_configs)}")
        outputs = []
        for n in names:
            fcfg = self.feature_configs[n]
            tcfg = self.table_configs[fcfg.table_name]
            pooled = (fcfg.combiner or tcfg.combiner) != "none"
            if not pooled and (spec["kind"] == "kjt" or spec["features"][names.index(n)]["form"] != "tensor"):
                raise ValueError(f"{where}: feature {n!r} is a jagged sequence (combiner='none'), which "
                                 "export_model does not serve; pass its ids as a dense [B, M] tensor")
            outputs.append({"name": n, "dim": tcfg.dim, "dtype": dtype_name(tcfg.dtype), "pooled": pooled})
        spec = {"collection": self.path, **spec, "outputs": outputs}
        out = served_features_op(tensors, json.dumps(spec, sort_keys=True))
        return dict(zip(names, out))


def _trace(wrapper: _Flat, flat: list):
    """``torch.export`` of ``wrapper`` in eval mode with each collection a :class:`_CollectionNode`."""
    swapped = []
    for path, module in list(wrapper.named_modules()):
        if isinstance(module, EmbeddingCollection):
            parent_path, _, child = path.rpartition(".")
            parent = wrapper.get_submodule(parent_path)
            user_path = path.removeprefix("model").removeprefix(".")
            parent._modules[child] = _CollectionNode(user_path, module)
            swapped.append((parent, child, module))
    training = wrapper.model.training
    try:
        wrapper.model.eval()
        dynamic = tuple({0: torch.export.Dim.AUTO} if t.dim() else None for t in flat)
        # sizes 0 and 1 are sizes like any other (a batch of 1 is served by the same program)
        with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
            return torch.export.export(wrapper, tuple(flat), dynamic_shapes=dynamic, strict=False)
    finally:
        wrapper.model.train(training)
        for parent, child, module in swapped:
            parent._modules[child] = module


def _shape(value) -> list:
    return [d if isinstance(d, int) else -1 for d in value.shape]


def _describe(program, names: list, output_names: list) -> dict:
    """The program's inputs and outputs (names, dtypes, shapes) and which input's dim 0 is the outputs' rows."""
    nodes = {n.name: n for n in program.graph.nodes}
    ins = [nodes[n].meta["val"] for n in program.graph_signature.user_inputs]
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    outs = [a.meta["val"] for a in out_node.args[0]]
    rows = outs[0].shape[0] if outs and outs[0].dim() else None
    batch_input = None
    if isinstance(rows, torch.SymInt):
        batch_input = next((n for n, v in zip(names, ins) if v.dim() and isinstance(v.shape[0], torch.SymInt)
                            and str(v.shape[0].node.expr) == str(rows.node.expr)), None)
    return {"inputs": [{"name": n, "dtype": dtype_name(v.dtype), "shape": _shape(v)} for n, v in zip(names, ins)],
            "outputs": [{"name": n, "dtype": dtype_name(v.dtype), "shape": _shape(v)}
                        for n, v in zip(output_names, outs)],
            "batch_input": batch_input}


def _collection_record(ec: EmbeddingCollection) -> dict:
    """What serving needs of a collection to prepare and finish its features: its feature configs and the fields
    of its tables that shape a lookup (no optimizer, no initializer callable)."""
    return {"features": [{**f.to_dict(), "table": f.table_name} for f in ec.feature_configs.values()],
            "tables": [{"name": t.name, "dim": t.dim, "vocabulary_size": t.vocabulary_size, "combiner": t.combiner,
                        "dtype": dtype_name(t.dtype), "key_dtype": dtype_name(t.key_dtype)}
                       for t in ec.table_configs.values()]}
