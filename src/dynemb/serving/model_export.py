"""``export_model``: a serving export of a user's own ``nn.Module`` holding ``EmbeddingCollection`` s or
standalone tables, trained in one process or sharded over N ranks.

The tables go through the table export (:func:`~dynemb.checkpoint.export_for_serving`: the same files, dtypes and
versions ``dynemb serve --watch`` follows); the rest through ``torch.export``, saved with ``torch.export.save``
(``program.pt2``, no pickle of code) in the same version directory, with the model's inputs and outputs described
in the manifest's ``program`` field. Each collection call is traced as one ``dynemb::served_features`` node (see
:mod:`.served_features`), which the served model binds to its parameter server: the graph holds no table rows.
A standalone ``DynamicEmbedding``/``StaticEmbedding`` called on ids (``emb(ids)``, as ``nn.Embedding``) is traced
the same way, as the one sequence feature of a one-table collection.

Under torchrun every rank calls :func:`export_model`: each writes its rows, and rank 0 alone traces the program,
from the collections' logical view (their configs, not their shards; DistributedDataParallel wrappers skipped),
so the program, and what it serves, is the one a single process exporting the same weights writes.
"""

from __future__ import annotations

import contextlib
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
from ..checkpoint.ranks import rank_context
from ..checkpoint.dense import unwrap
from ..checkpoint.tables import find_tables
from ..collection import EmbeddingCollection
from ..collection.config import FeatureConfig, TableConfig
from ..collection.features import Bags, Jagged, as_bags, prepare_features
from ..embedding import DynamicEmbedding, StaticEmbedding
from ..functional.pooling import to_bags
from ..serialization import dtype_name
from .served_features import bind, pooled_from_server, served_features_op

__all__ = ["export_model", "PROGRAM_FILE"]

PROGRAM_FILE = "program.pt2"
"""The exported program in a version directory of an ``export_model`` root."""


def export_model(path, model: nn.Module, example_inputs: tuple, *, example_kwargs: Optional[dict] = None,
                 dtype: torch.dtype = torch.float32, incremental: bool = False,
                 model_name: Optional[str] = None) -> Path:
    """Write a serving export of ``model`` (an ``nn.Module`` holding ``EmbeddingCollection`` s or standalone
    ``DynamicEmbedding``/``StaticEmbedding`` s).

    Writes ``path/version-<n>/`` (``n`` one above the newest there; ``latest`` then names it, so ``dynemb serve
    --export path --watch`` follows new versions) with every table as :func:`~dynemb.checkpoint.export_for_serving`
    writes it (in ``dtype``: float32/16, bfloat16, or 8-bit ``int8``/``float8_e4m3fn``/``float8_e5m2`` rows; a delta
    of the rows written since the last export with ``incremental``), and ``program.pt2``: ``model`` in eval mode
    traced by ``torch.export`` on ``example_inputs``, each collection call a ``dynemb::served_features`` node bound
    at serve time to the parameter server's lookup of its tables. Dim 0 of every input is dynamic (any batch size,
    1 included; a jagged input's length too). A jagged sequence (``combiner="none"`` on bags) comes to the model as
    the collection gives it, ``Jagged(values [N, D], offsets [B])``.

    A standalone ``DynamicEmbedding`` or ``StaticEmbedding`` (``emb(ids)``: ids of any shape ``S`` -> rows
    ``S + (D,)``, pooled if need be by the model's own code) is served as a one-table collection would be: its
    table (named by its module path, as ``export_for_serving`` names it) in the parameter server, each call a node.
    ``embedding_lookup(emb, ids, max_norm)`` is served the same way, and ``embedding_lookup_sparse(emb, ...)`` (the
    ``nn.EmbeddingBag`` forms) as a pooled feature with that call's options. A model that reads anything else of it
    in ``forward`` (``emb.table``, ``emb.find(ids)``) is refused, naming it.

    Sharded (a collection with a ``plan``, under torchrun): a collective; every rank calls it with the same
    arguments. Each rank writes the rows it holds (see ``export_for_serving``); rank 0 runs and traces the model
    on its ``example_inputs`` (the other ranks' are not read), with every collection by its logical configs and
    every ``DistributedDataParallel`` as the module it wraps: the export is the one a single process holding the
    same weights writes, and serves bit-equal outputs. When rank 0 refuses the inputs, every rank raises (the
    others naming rank 0) and nothing is written.

    The served inputs are the tensors of ``example_inputs`` (nested tuples, lists, dicts and pytree-registered
    classes such as TorchRec's ``KeyedJaggedTensor`` are flattened), named by ``forward``'s parameter and the path
    inside it joined by ``_``: ``dense``, ``features_values``, ``features_lengths``, ``batch_user_id``; a sparse COO
    input ``tags [B, M]`` (a collection feature's ids or weights) as ``tags`` (its values, dense ``[B, M]``) and
    ``tags_mask`` (bool ``[B, M]``: where its entries are), both dynamic in dims 0 and 1. Outputs:
    ``output`` for one tensor, else each by its path (``output_0``, a dict output's keys). The manifest's
    ``program`` field lists both with dtypes and shapes (``-1``: dynamic).

    Args:
        path: the export root (created if needed).
        model: the model: its collections (sharded or not) and standalone tables are served.
        example_inputs: positional arguments of ``model.forward`` (tensors, or containers of them).
        example_kwargs: keyword arguments of ``model.forward``.
        dtype: the tables' served dtype (see ``export_for_serving``).
        incremental: tables as a delta of the previous export to ``path``; the program is always whole.
        model_name: the model id of the root (see ``export_for_serving``).

    Returns:
        The version directory written.

    Raises:
        TypeError: ``model`` is no module, an input is no tensor, an output is no tensor; ``model`` in eval mode
            refuses ``example_inputs`` (ids of a float dtype, ...): its message, after ``example_inputs:``.
        RuntimeError: this torch lacks what the trace needs (torch 2.7 or newer).
        ValueError: ``model`` holds no table; its ``forward`` reads a standalone table other than by calling it;
            a sparse COO input that is not 2-D, or that the model reads other than as a collection's feature;
            ``model`` in eval mode refuses ``example_inputs`` (as for TypeError).
        On ranks other than 0, rank 0's TypeError/ValueError (RuntimeError for others) as ``export_model failed
        on rank 0 ...``.

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
    ctx = rank_context(model)
    attach = failure = None
    if ctx.rank == 0:  # the program is the same on every rank: rank 0 traces it, the others export their rows
        try:
            attach = _program(model, example_inputs, example_kwargs)
        except Exception as e:  # noqa: BLE001  (every rank must learn of it, or the others wait in the export)
            failure = e
    _agree(ctx, failure)
    return export_for_serving(path, model, dtype=dtype, incremental=incremental, model_name=model_name,
                              attach=attach)


def _agree(ctx, failure: Optional[BaseException]) -> None:
    """Raise ``failure`` (rank 0's, the only rank that traces) on every rank, before any rank writes a file."""
    # by its base class: the other ranks raise a TypeError or ValueError (whatever subclass rank 0 raised), else a
    # RuntimeError; the kind travels as its place in _KINDS
    kind = next((i for i, k in enumerate(_KINDS) if isinstance(failure, k)), len(_KINDS) - 1)
    told = ctx.gather(None if failure is None else [kind, str(failure)])[0] if ctx.distributed else None
    if failure is not None:
        raise failure
    if told is not None:
        raise _KINDS[told[0]](f"export_model failed on rank 0 (which traces the model); nothing was written: "
                              f"{told[1]}")


_KINDS = (TypeError, ValueError, RuntimeError)


def _program(model: nn.Module, example_inputs, example_kwargs: Optional[dict]) -> dict:
    """``export_for_serving``'s ``attach`` of ``model``: ``program.pt2`` and the manifest's ``program`` field."""
    if isinstance(example_inputs, (torch.Tensor, dict)) or not isinstance(example_inputs, (tuple, list)):
        raise TypeError(f"example_inputs must be a tuple of model.forward's positional arguments, got "
                        f"{type(example_inputs).__name__} (one tensor x: pass (x,))")
    kwargs = dict(example_kwargs or {})
    _check_torch()
    _check_tables(model)
    leaves, in_spec = pytree.tree_flatten_with_path((tuple(example_inputs), kwargs))
    names = _input_names(model, tuple(example_inputs), kwargs, [p for p, _ in leaves])
    for name, (_, value) in zip(names, leaves):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"input {name!r} must be a tensor (or a container of tensors registered with "
                            f"torch.utils._pytree), got {type(value).__name__}")
    flat, served, sparse = [], [], set()
    for leaf, (name, (_, value)) in enumerate(zip(names, leaves)):
        if value.layout == torch.sparse_coo:  # served as two dense inputs (see _SparseInput)
            flat += _coo_inputs(name, value)
            served += [name, f"{name}_mask"]
            sparse.add(leaf)
        else:
            flat.append(value)
            served.append(name)
    served = _unique(served)
    wrapper = _Flat(model, in_spec, names, served, sparse)
    # each module's own mode, restored as it was: model.train(mode) would also flip a submodule the user keeps in
    # eval mode (a frozen BatchNorm) in a model being trained
    modes = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with _stand_ins(wrapper, find_tables(model)) as records:
            _check_runs(wrapper, flat, records)
            program = _trace(wrapper, flat)
    finally:
        for m, mode in modes:
            m.training = mode
    # without them the archive is the graph (JSON) and raw weight bytes: torch.export.save writes example inputs
    # with torch.save (a pickle, of the user's example ids), and torch.export.load may unpickle them
    program.example_inputs = None
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    meta = _describe(program, served, wrapper.output_names)
    meta.update(file=PROGRAM_FILE, torch=torch.__version__,
                collections={path: _record(features, tables) for path, (features, tables, _) in records.items()})
    return {"files": {PROGRAM_FILE: buffer.getvalue()}, "fields": {"program": meta}}


class _ZeroRows:
    """The served lookups with every row zero: what :func:`_check_runs` binds the stand-ins to. The features are
    prepared (checked) and pooled by the served code, without a table, a collective or a parameter server."""

    def __init__(self, records: dict) -> None:
        self.records = records

    def lookup(self, collection: str, features: dict, weights: dict) -> dict:
        feature_configs, table_configs, device = self.records[collection]
        return pooled_from_server(self, "", prepare_features(features, weights, feature_configs, table_configs,
                                                             device))

    def lookup_many(self, model: str, keys: dict) -> dict:
        return {t: torch.zeros(ids.numel(), self._dims[t][0], dtype=self._dims[t][1], device=ids.device)
                for t, ids in keys.items()}

    @property
    def _dims(self) -> dict:
        return {t.name: (t.dim, t.dtype) for _, tables, _ in self.records.values() for t in tables.values()}


def _check_runs(wrapper: nn.Module, flat: list, records: dict) -> None:
    """One run of the model in eval mode, with its stand-ins in place, on the example inputs, each lookup reading
    zero rows (:class:`_ZeroRows`): the served code checks the features, and nothing reads or changes a table
    (which, sharded, would be a collective). The trace checks no ids, so without this an input the served model
    refuses (float ids, lengths that do not sum to the ids) would be exported and then refused by every request;
    here it is refused at once, with the collection's message."""
    try:
        with torch.no_grad(), bind(_ZeroRows(records)):
            wrapper(*flat)
    except _NotServed as e:
        raise ValueError(str(e)) from None
    except (TypeError, ValueError) as e:
        if type(e) not in (TypeError, ValueError):
            raise
        raise type(e)(f"example_inputs: {e}") from e  # (its traceback: where, in forward or in the collection)


def _check_torch() -> None:
    """The trace's torch.export features (``Dim.AUTO``; ``backed_size_oblivious``, so that a batch of 1 is a size
    like any other: torch 2.7) are there, or a clear error names the one missing (not torch's own AttributeError
    from the middle of the trace)."""
    needed = {"torch.export.Dim.AUTO": hasattr(getattr(torch.export, "Dim", None), "AUTO"),
              "torch.fx.experimental._config.backed_size_oblivious": hasattr(fx_config, "backed_size_oblivious")}
    missing = [name for name, there in needed.items() if not there]
    if missing:
        raise RuntimeError(f"export_model needs torch 2.7 or newer: it traces with {missing[0]}, which torch "
                           f"{torch.__version__} lacks")


def _check_tables(model: nn.Module) -> None:
    if not any(isinstance(m, (EmbeddingCollection, DynamicEmbedding, StaticEmbedding)) for m in model.modules()):
        raise ValueError("model holds no table (an EmbeddingCollection, DynamicEmbedding or StaticEmbedding); "
                         "export_model serves a model's tables")


def _modules(module: nn.Module, path: str = ""):
    """``(path, parent, name, child, inner)`` of ``module``'s submodules (``inner``: ``child`` without its
    DistributedDataParallel wrappers), as ``named_modules`` but through those wrappers as if they were not there
    (wrapping is layout: the paths are the model's), and not into tables."""
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        inner = unwrap(child)
        where = f"{path}.{name}" if path else name
        yield where, module, name, child, inner
        if not isinstance(inner, (EmbeddingCollection, DynamicEmbedding, StaticEmbedding)):
            yield from _modules(inner, where)


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
    try:  # the wrapped model's forward (a compiled or DataParallel model's forward takes *args: layout)
        params = [p.name for p in inspect.signature(unwrap(model).forward).parameters.values()
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

    def __init__(self, model: nn.Module, in_spec, leaf_names: list, names: list, sparse: set) -> None:
        super().__init__()
        self.model, self.in_spec = model, in_spec
        named: list = []  # the outputs' names, known once traced
        # the program's placeholders carry the inputs' names, so its shape checks name them too
        params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
        # each leaf in ``sparse`` (a sparse COO tensor) is two inputs, values and mask, whose dim 1 is dynamic too
        self.sparse, self.wide, i = sparse, set(), 0
        for leaf in range(len(leaf_names)):
            if leaf in sparse:
                self.wide |= {i, i + 1}
            i += 2 if leaf in sparse else 1

        def forward(*flat):
            tensors, leaves = iter(flat), []
            for leaf, name in enumerate(leaf_names):
                leaves.append(_SparseInput(next(tensors), next(tensors), name) if leaf in self.sparse
                              else next(tensors))
            args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
            leaves, _ = pytree.tree_flatten_with_path(self.model(*args, **kwargs))
            bad = [(pytree.keystr(p), type(v).__name__) for p, v in leaves if not isinstance(v, torch.Tensor)]
            if bad:
                raise _BadOutput(f"model outputs must be tensors (or containers of them); output{bad[0][0]} is "
                                 f"{bad[0][1]}")
            named[:] = _output_names([p for p, _ in leaves])
            return tuple(v for _, v in leaves)

        forward.__signature__ = inspect.Signature(params)
        forward.output_names = named  # on the function: export restores the module's own attributes after tracing
        self.forward = forward

    @property
    def output_names(self) -> list:
        return list(self.forward.output_names)


class _BadOutput(TypeError):
    """The model's output is not a tree of tensors: the model's fault, not its example inputs' (raised as is)."""


class _NotServed(AttributeError):
    """A stand-in's attribute read that serving cannot answer (the model reads a table other than by calling it)."""


def _coo_inputs(name: str, value: torch.Tensor) -> list:
    """A sparse COO input ``[B, M]`` as served: its values, dense ``[B, M]`` (duplicates summed, as coalescing
    sums them), and ``{name}_mask [B, M]`` (bool: where it has an entry, an entry of value 0 included)."""
    if value.dim() != 2 or value.dense_dim() != 0:
        raise ValueError(f"input {name!r}: a sparse COO input must be 2-D [B, M] (ids, or their weights), got "
                         f"shape {list(value.shape)} with {value.dense_dim()} dense dims")
    value = value.coalesce()
    mask = torch.zeros(value.shape, dtype=torch.bool, device=value.device)
    mask[tuple(value.indices())] = True
    return [value.to_dense(), mask]


class _SparseInput:
    """A sparse COO input inside the trace, as its request carries it: ``values [B, M]`` and ``mask [B, M]``. A
    collection takes it as a feature's ids or weights (rebuilt as the COO tensor when served); nothing else of the
    model may read it (a tensor op on it is a clear error)."""

    def __init__(self, values: torch.Tensor, mask: torch.Tensor, name: str) -> None:
        self.values, self.mask, self.name = values, mask, name

    def __getattr__(self, attr: str):
        raise _NotServed(f"input {self.name!r} is a sparse COO tensor, read as .{attr} in the model's forward: "
                         "export_model serves a sparse input only as a collection feature's ids or weights (its "
                         f"requests carry {self.name} [B, M] and {self.name}_mask [B, M])")


class _StandIn(nn.Module):
    """A table or collection while its model is checked and traced: its calls become ``dynemb::served_features``
    nodes, and anything else the model reads of it is a clear error."""

    what = "collection"
    calls = "ec(features) -> outputs"

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        path = self.__dict__.get("path") or "model"  # (never an attribute read: it could recurse here)
        raise _NotServed(f"{self.what} {path!r} is read as .{name} in the model's forward: "
                         f"export_model serves its calls ({self.calls}), each bound to the parameter server, and "
                         "nothing else of it")


class _CollectionNode(_StandIn):
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
                if isinstance(value, _SparseInput):  # ids, and weights when they are one too
                    fields, w = {"ids": value.values, "mask": value.mask}, (weights or {}).get(name)
                    fields.update({"weight": w.values, "weight_mask": w.mask} if isinstance(w, _SparseInput)
                                  else {"weight": w} if w is not None else {})
                    tensors += fields.values()
                    described.append({"name": name, "form": "coo", "fields": list(fields)})
                    continue
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
            # a sequence of bags: Jagged(values [N, D], offsets [B]), as the collection gives it
            jagged = not pooled and (spec["kind"] == "kjt" or spec["features"][names.index(n)]["form"] != "tensor")
            outputs.append({"name": n, "dim": tcfg.dim, "dtype": dtype_name(tcfg.dtype), "pooled": pooled,
                            **({"jagged": True} if jagged else {})})
        spec = {"collection": self.path, **spec, "outputs": outputs}
        out = iter(served_features_op(tensors, json.dumps(spec, sort_keys=True)))
        return {o["name"]: Jagged(next(out), next(out)) if o.get("jagged") else next(out) for o in outputs}


class _TableNode(_StandIn):
    """Stands in for a standalone Dynamic/StaticEmbedding: each lookup of it becomes one ``dynemb::served_features``
    node of a one-table collection named by the module's path (its table as ``export_for_serving`` names it):
    ``emb(ids)`` and ``embedding_lookup(emb, ids, max_norm)`` a sequence feature (``combiner="none"``, dense ids),
    ``embedding_lookup_sparse(emb, ...)`` a pooled one with that call's combiner, ``max_norm`` and padding."""

    calls = "emb(ids), embedding_lookup(emb, ...), embedding_lookup_sparse(emb, ...)"

    def __init__(self, path: str, table: TableConfig, module: nn.Module, features: dict) -> None:
        super().__init__()
        self.path, self.config, self.what = path, table, f"module ({type(module).__name__})"
        self.features = features  # the record's: each call's feature config, added as the model calls

    dim = property(lambda self: self.config.dim)  # what a forward may read of a table besides its rows
    dtype = property(lambda self: self.config.dtype)
    key_dtype = property(lambda self: self.config.key_dtype)

    def forward(self, ids) -> torch.Tensor:
        return self.served_lookup(ids)

    def served_lookup(self, ids, max_norm: Optional[float] = None) -> torch.Tensor:
        """``embedding_lookup(emb, ids, max_norm)``: ids of any shape ``S`` -> rows ``S + (D,)``."""
        return self._node({"ids": self._dense(ids)}, "tensor", "none", max_norm=max_norm)

    def served_lookup_sparse(self, ids, offsets, weights, combiner: str, max_norm, padding_value,
                             include_last_offset: bool) -> torch.Tensor:
        """``embedding_lookup_sparse(emb, ...)``: one pooled row per bag, ``[B, D]``."""
        ids = self._dense(ids)
        if ids.dim() not in (1, 2) or (ids.dim() == 1) != (offsets is not None):
            to_bags(ids, offsets)  # raises the eager lookup's error (a shape rule: no value is read)
        if ids.dim() == 2:
            fields = {"ids": ids, **({"weight": weights} if weights is not None else {})}
            return self._node(fields, "tensor", combiner, max_norm, padding_value)
        fields = {"ids": ids, "offsets": offsets, **({"weights": weights} if weights is not None else {})}
        return self._node(fields, "bags", combiner, max_norm, include_last_offset=include_last_offset)

    def _dense(self, ids) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.is_sparse:
            got = "a sparse COO tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"{self.what} {self.path or 'model'!r}: ids must be a dense tensor, got {got}")
        return ids

    def _node(self, fields: dict, form: str, combiner: str, max_norm=None, padding_value=None,
              include_last_offset: bool = False) -> torch.Tensor:
        t = self.config
        options = {"combiner": combiner if combiner != "none" else None, "max_norm": max_norm,
                   "padding_value": padding_value}
        name = "|".join([t.name, *(f"{k}={v}" for k, v in options.items() if v is not None)])
        # a plain emb(ids) reads the feature named as its table; other calls one named by their options
        self.features.setdefault(name, FeatureConfig(name=name, table=t.name, combiner=combiner,
                                                     max_norm=max_norm, padding_value=padding_value))
        spec = {"collection": self.path, "kind": "dict",
                "features": [{"name": name, "form": form, "fields": list(fields),
                              "include_last_offset": include_last_offset}],
                "outputs": [{"name": name, "dim": t.dim, "dtype": dtype_name(t.dtype), "pooled": combiner != "none"}]}
        return served_features_op(list(fields.values()), json.dumps(spec, sort_keys=True))[0]


@contextlib.contextmanager
def _stand_ins(wrapper: _Flat, tables: dict):
    """``wrapper``'s model with its DistributedDataParallel wrappers removed, each collection a
    :class:`_CollectionNode` and each standalone table a :class:`_TableNode`, inside the block, which gets
    ``{module path: (feature configs, table configs, device)}`` of each (the user's, logical: no layout)."""
    names = {id(shard.module): name for name, shard in tables.items() if shard.module is not None}
    swapped, records = [], {}
    try:
        for path, parent, name, child, inner in _modules(wrapper):
            user_path = path.removeprefix("model").removeprefix(".")
            if isinstance(inner, EmbeddingCollection):
                node = _CollectionNode(user_path, inner)
                records[user_path] = (inner.feature_configs, inner.table_configs, inner._device)
            elif isinstance(inner, (DynamicEmbedding, StaticEmbedding)):
                config = tables[names[id(inner)]].config
                features: dict = {}
                node = _TableNode(user_path, config, inner, features)
                records[user_path] = (features, {config.name: config}, inner.table.device)
            elif inner is not child:
                node = inner
            else:
                continue
            swapped.append((parent, name, child))
            parent._modules[name] = node
        yield records
    finally:
        for parent, name, child in reversed(swapped):
            parent._modules[name] = child


def _trace(wrapper: _Flat, flat: list):
    """``torch.export`` of ``wrapper`` (its model in eval mode, its stand-ins in place)."""
    auto = torch.export.Dim.AUTO
    dynamic = tuple(({0: auto, 1: auto} if i in wrapper.wide else {0: auto}) if t.dim() else None
                    for i, t in enumerate(flat))
    try:
        # sizes 0 and 1 are sizes like any other (a batch of 1 is served by the same program)
        with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
            return torch.export.export(wrapper, tuple(flat), dynamic_shapes=dynamic, strict=False)
    except _NotServed as e:
        raise ValueError(str(e)) from None


def _shape(value) -> list:
    return [d if isinstance(d, int) else -1 for d in value.shape]


def _describe(program, names: list, output_names: list) -> dict:
    """The program's inputs and outputs (names, dtypes, shapes) and how a request's rows (the outputs' dim 0) follow
    from its inputs (:func:`batch_rule`)."""
    ins, outs = _values(program)
    batch_input, divisor = batch_rule(program, names)
    return {"inputs": [{"name": n, "dtype": dtype_name(v.dtype), "shape": _shape(v)} for n, v in zip(names, ins)],
            "outputs": [{"name": n, "dtype": dtype_name(v.dtype), "shape": _shape(v)}
                        for n, v in zip(output_names, outs)],
            "batch_input": batch_input, "batch_divisor": divisor}


def _values(program) -> tuple[list, list]:
    """The traced values (fake tensors, symbolic sizes) of ``program``'s user inputs and of its outputs."""
    nodes = {n.name: n for n in program.graph.nodes}
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    return ([nodes[n].meta["val"] for n in program.graph_signature.user_inputs],
            [a.meta["val"] for a in out_node.args[0]])


def batch_rule(program, names: list) -> tuple[Optional[str], int]:
    """``(input, k)``: a request's rows (the first output's dim 0) are input ``input``'s dim 0 divided by ``k``,
    read off the symbolic sizes of ``program`` (an ``ExportedProgram``, as traced or as loaded; ``names``: its user
    inputs' names); ``(None, 1)`` where no input's dim 0 gives them (a fixed or scalar output).
    ``k`` is 1 for an input with a row per sample (``dense [B, 13]``) and the number of keys for a
    ``KeyedJaggedTensor``'s lengths (``[F * B]``, key-major: its stride), the batch size of a model fed only by one.

    Example:
        >>> # a model of forward(kjt) with 3 keys: batch_rule(program, ["sparse_values", "sparse_lengths"])
        >>> # ("sparse_lengths", 3)
    """
    inputs, outputs = _values(program)
    rows = outputs[0].shape[0] if outputs and outputs[0].dim() else None
    if not isinstance(rows, torch.SymInt):
        return None, 1
    expr = rows.node.expr
    for n, v in zip(names, inputs):
        size = v.shape[0] if v.dim() else None
        if not isinstance(size, torch.SymInt):
            continue
        symbol = size.node.expr
        if expr == symbol:
            return n, 1
        # a KeyedJaggedTensor's stride: lengths.shape[0] // keys, which the trace keeps as FloorDiv(s, keys)
        if type(expr).__name__ == "FloorDiv" and expr.args[0] == symbol and expr.args[1].is_Integer \
                and int(expr.args[1]) >= 1:
            return n, int(expr.args[1])
    return None, 1


def _record(features: dict, tables: dict) -> dict:
    """What serving needs of a collection (or a standalone table) to prepare and finish its features: its feature
    configs and the fields of its tables that shape a lookup (no optimizer, no initializer callable)."""
    return {"features": [{**f.to_dict(), "table": f.table_name} for f in features.values()],
            "tables": [{"name": t.name, "dim": t.dim, "vocabulary_size": t.vocabulary_size, "combiner": t.combiner,
                        "dtype": dtype_name(t.dtype), "key_dtype": dtype_name(t.key_dtype)}
                       for t in tables.values()]}
