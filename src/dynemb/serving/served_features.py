"""A collection's lookups in an exported graph: the ``dynemb::served_features`` custom op, and its binding to a
parameter server at serve time.

:func:`dynemb.serving.export_model` traces a user's model with each :class:`~dynemb.EmbeddingCollection` call
replaced by one ``dynemb::served_features(tensors, spec)`` node. ``tensors`` are the call's input tensors (a
``KeyedJaggedTensor``'s values, lengths and weights; or each feature's ids, offsets/lengths and weights; a sparse
COO input's dense values and mask of entries), ``spec``
a JSON string naming the collection (its module path in the user's model) and, per feature, the form its input came
in and the output it gives. The graph holds no table row and no table: only these names.

At serve time the node runs :func:`lookup_features` against the model bound by :func:`bind` (the served export,
:class:`~dynemb.serving.exported_model.ExportedModel`): the features are rebuilt from the tensors, prepared by the
collection's own code (:func:`~dynemb.collection.features.prepare_features`), their rows read from the parameter
server for all tables at once, and each output finished by :func:`~dynemb.collection.features.finish`, as the
collection's executors finish theirs. Outputs therefore equal the collection's in eval mode on the same rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import json

import torch

from ..collection.features import Bags, finish, prepare_features
from ..functional.pooling import one_id_bags
from ..serialization import parse_dtype

__all__ = ["served_features_op", "bind", "lookup_features", "pooled_from_server", "feature_dict"]

_BOUND: contextvars.ContextVar = contextvars.ContextVar("dynemb_served_model", default=None)


@contextlib.contextmanager
def bind(model):
    """Run the ``dynemb::served_features`` nodes of a graph against ``model`` (anything with a
    ``lookup(collection, features, weights) -> {feature: output}`` method) inside the block."""
    token = _BOUND.set(model)
    try:
        yield model
    finally:
        _BOUND.reset(token)


def feature_dict(tensors: list, spec: dict) -> tuple[dict, dict]:
    """``(features, weights)`` of one collection call, rebuilt from its op's ``tensors`` and ``spec`` in the forms
    :meth:`EmbeddingCollection.forward <dynemb.EmbeddingCollection.forward>` takes."""
    if spec["kind"] == "kjt":  # TorchRec's layout: values and lengths key-major, lengths [F * B]
        keys = spec["keys"]
        values, lengths = tensors[0], tensors[1]
        weights = tensors[2] if spec.get("weighted") else None
        if lengths.dim() != 1 or (keys and lengths.numel() % len(keys)):
            raise ValueError(f"collection {spec['collection']!r}: a KeyedJaggedTensor of {len(keys)} keys needs "
                             f"lengths [keys x batch], got shape {list(lengths.shape)}")
        per_key = lengths.view(len(keys), -1)
        sizes = per_key.sum(1).tolist()
        if sum(sizes) != values.numel() or min(per_key.min().item() if per_key.numel() else 0, 0) < 0:
            raise ValueError(f"collection {spec['collection']!r}: the KeyedJaggedTensor's lengths must be >= 0 and "
                             f"sum to its {values.numel()} values, got a sum of {sum(sizes)}")
        parts = torch.split(values, sizes)
        wparts = torch.split(weights, sizes) if weights is not None else [None] * len(keys)
        return {k: Bags(v, lengths=n, weights=w) for k, v, n, w in zip(keys, parts, per_key, wparts)}, {}
    features, weights, i = {}, {}, 0
    for f in spec["features"]:
        got = dict(zip(f["fields"], tensors[i:i + len(f["fields"])]))
        i += len(f["fields"])
        if "weight" in got:
            weight = got.pop("weight")
            weights[f["name"]] = _coo(spec, f, weight, got.pop("weight_mask")) if "weight_mask" in got else weight
        if f["form"] == "coo":
            features[f["name"]] = _coo(spec, f, got["ids"], got["mask"])
            continue
        features[f["name"]] = got["ids"] if f["form"] == "tensor" else Bags(
            got["ids"], offsets=got.get("offsets"), lengths=got.get("lengths"), weights=got.get("weights"),
            include_last_offset=f.get("include_last_offset", False))
    return features, weights


def _coo(spec: dict, feature: dict, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sparse COO tensor ``[B, M]`` a request carries as its dense ``values`` and the ``mask`` of its entries."""
    if mask.dtype != torch.bool or values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(f"collection {spec['collection']!r}: feature {feature['name']!r}: a sparse input's values "
                         f"and mask must be [B, M] of one shape, the mask bool; got values {list(values.shape)}, "
                         f"mask {list(mask.shape)} {mask.dtype}")
    # the mask's nonzero() is in row-major order and unique: the indices of a valid, coalesced tensor
    return torch.sparse_coo_tensor(mask.nonzero().T, values[mask], tuple(values.shape), check_invariants=False,
                                   is_coalesced=True)


def lookup_features(tensors: list, spec: dict) -> list:
    """The outputs of one collection call (in ``spec``'s feature order) from the bound model's parameter server."""
    model = _BOUND.get()
    if model is None:
        raise RuntimeError("dynemb::served_features ran outside a served model: load the export with "
                           "dynemb.serving.ExportedModel (or dynemb serve --export), which binds its lookups to "
                           "the parameter server")
    features, weights = feature_dict(tensors, spec)
    out = model.lookup(spec["collection"], features, weights)
    result = []
    for o in spec["outputs"]:  # a jagged sequence (combiner="none" on bags) as its two tensors (offsets copied:
        # they may be the input's own, and an op's output must not alias its inputs)
        value = out[o["name"]]
        result += [value.values.to(parse_dtype(o["dtype"])), value.offsets.clone()] if o.get("jagged") else \
            [value.to(parse_dtype(o["dtype"]))]
    return result


def pooled_from_server(ps, model: str, prepared: dict) -> dict:
    """``{feature: output}`` of prepared features (``prepare_features``' result) with their rows from
    parameter server ``ps``'s ``model``: one ``lookup_many`` call for every table, each output finished by the
    collection's :func:`~dynemb.collection.features.finish`."""
    keys, inverses = {}, {}
    for table, parts in prepared.items():
        ids = parts[0].ids if len(parts) == 1 else torch.cat([p.ids for p in parts])
        if len(parts) == 1 and parts[0].bags is not None and parts[0].bags.one_id:
            keys[table], inverse = ids, one_id_bags(ids.numel(), ids.device)  # the server takes repeats
        else:
            keys[table], inverse = torch.unique(ids, return_inverse=True)
        inverses[table] = inverse.split([p.ids.numel() for p in parts])
    found = ps.lookup_many(model, keys)
    return {p.name: finish(p, found[table], inverse)
            for table, parts in prepared.items() for p, inverse in zip(parts, inverses[table])}


def prepared_lookup(ps, model: str, features: dict, weights: dict, feature_configs: dict, table_configs: dict,
                    device) -> dict:
    """:func:`pooled_from_server` of ``features`` as the collection prepares them (ids checked, bags formed)."""
    return pooled_from_server(ps, model, prepare_features(features, weights, feature_configs, table_configs, device))


@torch.library.custom_op("dynemb::served_features", mutates_args=())
def served_features_op(tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """The outputs of one ``EmbeddingCollection`` call whose inputs are ``tensors`` (see the module docstring)."""
    return [t.contiguous() for t in lookup_features(list(tensors), json.loads(spec))]


@served_features_op.register_fake
def _(tensors, spec):
    spec = json.loads(spec)
    out = []
    for o, shape in zip(spec["outputs"], output_shapes(list(tensors), spec)):
        if o.get("jagged"):  # values [N, D] and bag starts [B] (int64, as the collection gives them)
            out += [tensors[0].new_empty(shape[0], dtype=parse_dtype(o["dtype"])),
                    tensors[0].new_empty(shape[1], dtype=torch.int64)]
        else:
            out.append(tensors[0].new_empty(shape, dtype=parse_dtype(o["dtype"])))
    return out


def output_shapes(tensors: list, spec: dict) -> list:
    """Each output's shape from its input tensors' shapes alone (symbolic sizes while tracing); a jagged
    sequence's is ``((N, D), (B,))``, its values' and its offsets'."""
    if spec["kind"] == "kjt":
        rows = tensors[1].shape[0] // max(len(spec["keys"]), 1)
        # a key's share of the values is data (its lengths' sum): a size known only when served
        return [((torch.library.get_ctx().new_dynamic_size(), o["dim"]), (rows,)) if o.get("jagged")
                else (rows, o["dim"]) for o in spec["outputs"]]
    shapes, i = [], 0
    for f, o in zip(spec["features"], spec["outputs"]):
        got = dict(zip(f["fields"], tensors[i:i + len(f["fields"])]))
        i += len(f["fields"])
        ids = got["ids"]
        if o.get("jagged"):
            bags = got["lengths"].shape[0] if "lengths" in got else \
                got["offsets"].shape[0] - int(f.get("include_last_offset", False))
            shapes.append(((ids.shape[0], o["dim"]), (bags,)))
        elif f["form"] == "tensor":
            shapes.append((ids.shape[0], o["dim"]) if o["pooled"] else (*ids.shape, o["dim"]))
        elif "lengths" in got:
            shapes.append((got["lengths"].shape[0], o["dim"]))
        elif "offsets" in got:
            shapes.append((got["offsets"].shape[0] - int(f.get("include_last_offset", False)), o["dim"]))
        else:  # Bags of ids [B, M] without offsets
            shapes.append((ids.shape[0], o["dim"]))
    return shapes
