"""Pooling of looked-up rows into bags: the input forms (``to_bags``), the combiners, and a sum-pooling whose
backward builds one ``[U, D]`` row gradient. Shared by training lookups and the serving layers."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from ..kernels.dispatch import kernels_for

__all__ = ["COMBINERS", "BagSet", "check_combiner", "to_bags", "pool", "pool_many", "bag_of", "bag_sum_grad",
           "BagSum", "concat_bags", "split_bags", "split_combine", "combine_denoms", "sorted_row_grad", "one_id_bags",
           "is_one_id_bags", "backward_bags"]

COMBINERS = ("sum", "mean", "sqrtn")


def one_id_bags(n: int, device: torch.device) -> torch.Tensor:
    """``[n]`` int64 offsets ``0, 1, ..., n - 1`` on ``device``: ``n`` bags of one id each (a CTR model's usual
    feature), as one tensor that every lookup of ``n`` such bags shares, so that :func:`is_one_id_bags` knows it by
    identity: the lookup then neither copies its offsets nor builds each id's bag for the backward (id ``j`` is bag
    ``j``). Read-only: only dynemb's own feature preparation hands it out (``to_bags(shared_offsets=True)``), and
    nothing in dynemb writes offsets; one written in place all the same (its version counter moved) is replaced and
    no longer recognized. Made outside inference mode, whose tensors keep no version counter.

    Example:
        >>> o = one_id_bags(3, torch.device("cpu"))
        >>> o.tolist(), is_one_id_bags(o, 3), is_one_id_bags(torch.arange(3), 3)
        ([0, 1, 2], True, False)
    """
    key = (n, device)
    shared = _ONE_ID_BAGS.get(key)
    if shared is None or shared._version:
        if len(_ONE_ID_BAGS) >= 64:  # batch sizes come and go (the last batch of an epoch): keep a few
            _ONE_ID_BAGS.clear()
        with torch.inference_mode(False):
            shared = _ONE_ID_BAGS[key] = torch.arange(n, device=device)
    return shared


def is_one_id_bags(offsets: torch.Tensor, n: int) -> bool:
    """Whether ``offsets`` are :func:`one_id_bags` ``(n)``, unwritten: ``n`` bags of one id each."""
    return _ONE_ID_BAGS.get((n, offsets.device)) is offsets and not offsets._version


_ONE_ID_BAGS: dict = {}



class BagSet(NamedTuple):
    """Bags of one feature over a slice of concatenated ids: ``num_ids`` ids in ``num_bags`` bags starting at
    ``offsets [B]`` (relative to the slice), optional ``weights [num_ids]``, pooled by ``combiner``; ``one_id``:
    known to be bags of one id each (``offsets`` is ``arange(B)``), which a grouped lookup needs no offsets for."""

    num_ids: int
    offsets: torch.Tensor
    weights: Optional[torch.Tensor]
    num_bags: int
    combiner: str
    one_id: bool = False



def check_combiner(combiner: str) -> str:
    if combiner not in COMBINERS:
        raise ValueError(f"combiner must be one of {COMBINERS}, got {combiner!r}")
    return combiner



def to_bags(ids, offsets=None, weights=None, *, lengths=None, padding_value=None, include_last_offset=False,
            shared_offsets=False, backend=None):
    """Validate bag inputs and normalize them to ``(ids [N], offsets [B] starts, weights [N] or None, B)``.

    Accepted forms:

    - 1-D ``ids [N]`` with ``offsets [B]``, the start of each bag (``nn.EmbeddingBag``); with
      ``include_last_offset=True``, ``offsets [B+1]`` ending with ``N`` (TorchRec's KeyedJaggedTensor offsets);
    - 1-D ``ids [N]`` with ``lengths [B]``, the size of each bag (TorchRec's lengths);
    - a 2-D sparse COO tensor ``[B, M]`` whose values are ids (``tf.SparseTensor``; ``weights`` a COO tensor of the
      same pattern or ``[N]``);
    - a dense ``[B, M]`` tensor, where entries equal to ``padding_value`` are skipped.

    Offsets must start at 0, never decrease and stay within ``[0, N]``; lengths must be >= 0 and sum to ``N``;
    weights are floating point, one per id, on the ids' device. Checking offsets and lengths reads their values
    (one device sync on CUDA): nothing is ever read out of bounds. ``shared_offsets``: CPU bags of one id each
    (dense ``[B, 1]`` ids, or lengths all 1) get the shared offsets of :func:`one_id_bags` (never write them), which
    spare a lookup work; CUDA tensors are not shared (streams would have to order their uses). ``backend``: the
    kernel backend of the table the bags are for (None: the process default), which may check offsets.

    Raises:
        TypeError/ValueError: naming the argument, the expected form and what came in.

    Example:
        >>> to_bags(torch.tensor([4, 5, 6]), lengths=torch.tensor([2, 0, 1]))[1].tolist()
        [0, 2, 2]
        >>> to_bags(torch.tensor([4, 5, 6]), torch.tensor([0, 2, 1]))
        Traceback (most recent call last):
        ...
        ValueError: offsets must start at 0 and never decrease (bag starts, nn.EmbeddingBag style), got [0, 2, 1]
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if not isinstance(include_last_offset, bool):
        raise TypeError(f"include_last_offset must be a bool, got {include_last_offset!r}")
    if offsets is not None and lengths is not None:
        raise ValueError("give offsets or lengths, not both")
    if ids.is_sparse:
        if ids.dim() != 2:
            raise ValueError(f"sparse ids must be a 2-D COO tensor [B, M], got {ids.dim()}-D")
        if offsets is not None or lengths is not None:
            raise ValueError("offsets and lengths must be None when ids is a sparse tensor")
        ids = ids.coalesce()
        bag = ids.indices()[0]
        b = ids.shape[0]
        if weights is not None and weights.is_sparse:
            weights = weights.coalesce()
            if not torch.equal(weights.indices(), ids.indices()):
                raise ValueError("sparse weights must have the same indices as sparse ids")
            weights = weights.values()
        counts = torch.bincount(bag, minlength=b)
        return ids.values(), counts.cumsum(0) - counts, _check_weights(weights, ids.values()), b
    if ids.dim() == 2:
        if offsets is not None or lengths is not None:
            raise ValueError(f"offsets and lengths must be None for 2-D ids {tuple(ids.shape)}; bags are rows")
        if weights is not None and tuple(getattr(weights, "shape", ())) != tuple(ids.shape):
            raise ValueError(f"weights must have the shape of ids {tuple(ids.shape)}, got "
                             f"{_describe(weights)}")
        weights = _check_weights(weights, ids)
        if padding_value is None:  # every entry is an id: no mask, so shapes stay static (compiled code)
            b, m = ids.shape
            if shared_offsets and m == 1 and ids.device.type == "cpu" and not torch.compiler.is_compiling():
                offsets = one_id_bags(b, ids.device)
            else:
                offsets = torch.arange(0, b * m, m, device=ids.device) if m else torch.zeros(b, dtype=torch.int64,
                                                                                            device=ids.device)
            return ids.reshape(-1), offsets, (weights.reshape(-1) if weights is not None else None), b
        mask = ids != padding_value
        counts = mask.sum(1)
        return ids[mask], counts.cumsum(0) - counts, (weights[mask] if weights is not None else None), ids.shape[0]
    if ids.dim() != 1 or (offsets is None and lengths is None):
        raise ValueError(f"ids must be 1-D with offsets or lengths, 2-D dense [B, M], or 2-D sparse; got shape "
                         f"{tuple(ids.shape)} with {'offsets' if offsets is not None else 'no offsets or lengths'}")
    n = ids.numel()
    # Value checks read the tensors (a sync). Compiled code cannot: there the lookup op checks offsets at run time.
    check_values = not torch.compiler.is_compiling()
    if lengths is not None:
        lengths = _check_index_tensor(lengths, "lengths", ids)
        if check_values and bool(((lengths < 0).any() | (lengths.sum() != n)).item()):
            raise ValueError(f"lengths must be >= 0 and sum to the number of ids ({n}), got "
                             f"{_preview(lengths)} (sum {int(lengths.sum())})")
        if shared_offsets and check_values and n == lengths.numel() and ids.device.type == "cpu" \
                and bool((lengths == 1).all()):  # one id a bag: a KeyedJaggedTensor's usual CTR feature
            offsets = one_id_bags(n, ids.device)
        else:
            offsets = lengths.cumsum(0) - lengths
    else:
        offsets = _check_index_tensor(offsets, "offsets", ids)
        if include_last_offset:
            if offsets.numel() == 0 or (check_values and bool((offsets[-1] != n).item())):
                raise ValueError(f"with include_last_offset=True, offsets [B+1] must end with the number of ids "
                                 f"({n}), got {_preview(offsets)}")
            offsets = offsets[:-1]
        # one read of the offsets for all three rules; the message then says which one failed
        if check_values and offsets.numel() and not _offsets_valid(offsets, n, backend):
            if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()):
                raise ValueError(f"offsets must start at 0 and never decrease (bag starts, nn.EmbeddingBag style), "
                                 f"got {_preview(offsets)}")
            raise ValueError(f"offsets must be <= the number of ids ({n}), got {_preview(offsets)}; lengths "
                             "passed as offsets? use lengths=")
    return ids, offsets, _check_weights(weights, ids), offsets.numel()


def _offsets_valid(offsets: torch.Tensor, n: int, backend=None) -> bool:
    """Whether int64 ``offsets [B >= 1]`` start at 0, never decrease and end at most at ``n``: one pass of the pool
    kernels' optional ``offsets_valid`` where ``backend`` (None: the process default) has it (a few microseconds on
    CPU), else one torch expression read back once."""
    check = kernels_for(backend, offsets.device).pool.offsets_valid
    if check is not None:
        return check(offsets, n)
    return not bool(((offsets[0] != 0) | (offsets[1:] < offsets[:-1]).any() | (offsets[-1] > n)).item())


def _check_index_tensor(t, name: str, ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be a 1-D int32/int64 tensor, got {_describe(t)}")
    if t.device != ids.device:
        raise ValueError(f"{name} must be on the ids' device {ids.device}, got {_describe(t)}")
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def _check_weights(weights, ids: torch.Tensor):
    if weights is None:
        return None
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
        raise TypeError(f"weights must be a floating-point tensor, one per id, got {_describe(weights)}")
    if tuple(weights.shape) != tuple(ids.shape) or weights.device != ids.device:
        raise ValueError(f"weights must have the shape {tuple(ids.shape)} and device {ids.device} of the ids, got "
                         f"{_describe(weights)}")
    return weights


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def _preview(t: torch.Tensor, most: int = 8) -> str:
    values = t[:most].tolist()
    return str(values) if t.numel() <= most else f"{str(values)[:-1]}, ...] ({t.numel()} entries)"


class BagSum(torch.autograd.Function):
    """``F.embedding_bag(inverse, values, offsets, mode="sum")`` with a faster backward for ``[U, D]`` rows.

    torch's dense embedding_bag backward accumulates into ``values`` one id at a time (tens of ms per 100k ids on
    CPU). Here the ids are ordered by row once and the row gradient is itself a sum-pooling of the output
    gradient: row ``u`` gets the sum of ``weight * grad[bag]`` over its ids.
    """

    @staticmethod
    def forward(ctx, values, inverse, offsets, weights):
        ctx.save_for_backward(values, inverse, offsets, weights)
        return F.embedding_bag(inverse, values, offsets, mode="sum", per_sample_weights=weights)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        values, inverse, offsets, weights = ctx.saved_tensors
        grad = grad.contiguous()
        grad_values = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_values = bag_sum_grad(grad, inverse, offsets, weights, values.shape[0])
        if ctx.needs_input_grad[3]:
            grad_weights = (grad.index_select(0, bag_of(offsets, inverse.numel())) * values.index_select(0, inverse)
                            ).sum(1)
        return grad_values, None, None, grad_weights



def bag_of(offsets: torch.Tensor, n: int, kernels=None) -> torch.Tensor:
    """``[n]`` int64: the bag of each of ``n`` ids, bag ``b`` holding ids ``offsets[b]`` up to the next offset (or
    ``n``). ``kernels``: a ``pool`` family (:func:`~dynemb.kernels.dispatch.kernels_for`) whose optional
    ``bag_of`` writes it in one pass instead (in the dtype that module chooses: int32 for numba).

    Example:
        >>> bag_of(torch.tensor([0, 2, 2]), 4).tolist()
        [0, 0, 2, 2]
    """
    fast = None if kernels is None else kernels.bag_of
    if fast is not None:
        return fast(offsets, n)
    counts = torch.diff(offsets, append=offsets.new_tensor([n]))
    return torch.repeat_interleave(torch.arange(offsets.numel(), device=offsets.device), counts, output_size=n)



def backward_bags(offsets: torch.Tensor, n: int, kernels=None) -> torch.Tensor | None:
    """Each of ``n`` ids' bag as a backward takes it: :func:`bag_of`, or None (id ``j`` is bag ``j``) for the
    shared offsets of bags of one id each (:func:`one_id_bags`), which need no ``[n]`` tensor."""
    return None if is_one_id_bags(offsets, n) else bag_of(offsets, n, kernels)


def bag_sum_grad(grad, inverse, offsets, weights, num_rows: int) -> torch.Tensor:
    """``[U, D]`` gradient of a sum-pooling of rows ``inverse`` by bags ``offsets``: row ``u`` gets the sum of
    ``weight * grad[bag]`` over its ids, itself computed as a sum-pooling with the ids ordered by row."""
    order = inverse.argsort(stable=True)
    per_row = torch.bincount(inverse, minlength=num_rows)
    starts = torch.cat([per_row.new_zeros(1), per_row.cumsum(0)])
    return sorted_row_grad(grad, order, starts, backward_bags(offsets, inverse.numel()), weights)


def sorted_row_grad(grad, order, starts, bag, weights) -> torch.Tensor:
    """The torch reference of the ``row_grad`` kernel (:mod:`dynemb.kernels.dispatch`): ``[U, D]``, row ``u``
    summing ``weights[j] * grad[bag[j]]`` over ``j in order[starts[u]:starts[u + 1]]`` (``bag`` int32 or int64;
    None: ``bag[j] == j``)."""
    ordered_weights = None if weights is None else weights.index_select(0, order)
    ordered_bags = order if bag is None else bag.index_select(0, order).to(torch.int64)
    return F.embedding_bag(ordered_bags, grad, starts[:-1], mode="sum", per_sample_weights=ordered_weights)



def pool(values, inverse, offsets, weights, num_bags: int, combiner: str) -> torch.Tensor:
    """Pool rows ``values[inverse]`` per bag: ``[B, D]``; empty bags give zeros."""
    return pool_many(values, inverse, [BagSet(inverse.numel(), offsets, weights, num_bags, combiner)])[0]



def pool_many(values, inverse, bag_sets: list[BagSet]) -> list[torch.Tensor]:
    """Pool several bag sets over the same rows ``values``: ``inverse`` is the concatenation of the sets' row
    indices.

    One sum-pooling op serves all the sets, so backward builds a single ``[U, D]`` gradient instead of one per set
    (features sharing a table would otherwise each produce, and sum, a gradient the size of all the rows).
    """
    if not bag_sets:
        return []
    offsets, weights = concat_bags(bag_sets, values.dtype, values.device)
    return split_combine(BagSum.apply(values, inverse, offsets, weights), bag_sets)



def concat_bags(bag_sets: list[BagSet], dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Offsets (shifted to the concatenated ids) and weights (ones for unweighted sets) of all the bag sets."""
    starts = [0]
    for s in bag_sets[:-1]:
        starts.append(starts[-1] + s.num_ids)
    if all(is_one_id_bags(s.offsets, s.num_ids) for s in bag_sets):  # shared, never written: nothing to copy
        offsets = bag_sets[0].offsets if len(bag_sets) == 1 else one_id_bags(starts[-1] + bag_sets[-1].num_ids,
                                                                             bag_sets[0].offsets.device)
    else:
        # new tensors (autograd keeps them; the caller may reuse its buffers); a clone costs half an add
        shifted = [s.offsets + start if start else s.offsets.clone() for s, start in zip(bag_sets, starts)]
        offsets = shifted[0] if len(shifted) == 1 else torch.cat(shifted)
    if all(s.weights is None for s in bag_sets):
        return offsets, None
    weights = torch.cat([s.weights.to(dtype) if s.weights is not None
                         else torch.ones(s.num_ids, dtype=dtype, device=device) for s in bag_sets])
    return offsets, weights



def split_bags(pooled: torch.Tensor, bag_sets: list[BagSet]) -> list[torch.Tensor]:
    """``pooled [sum of B, D]`` cut into each bag set's ``[B, D]`` (one set: the tensor itself, no view)."""
    return [pooled] if len(bag_sets) == 1 else list(pooled.split([s.num_bags for s in bag_sets]))


def split_combine(summed: torch.Tensor, bag_sets: list[BagSet]) -> list[torch.Tensor]:
    return [_combine(part, *s[:5]) for part, s in zip(split_bags(summed, bag_sets), bag_sets)]



def combine_denoms(bag_sets: list[BagSet], dtype: torch.dtype, device) -> torch.Tensor | None:
    """``[B]`` divisors of the concatenated bags (ones for ``sum`` sets), or None when every set sums."""
    if all(s.combiner == "sum" for s in bag_sets):
        return None
    return torch.cat([_denom(*s[:5], dtype=dtype, device=device) if s.combiner != "sum"
                      else torch.ones(s.num_bags, dtype=dtype, device=device) for s in bag_sets])


def _combine(summed, n: int, offsets, weights, num_bags: int, combiner: str) -> torch.Tensor:
    """Divide bag sums by the bag's weight (``mean``) or root of squared weights (``sqrtn``)."""
    if combiner == "sum":
        return summed
    return summed / _denom(n, offsets, weights, num_bags, combiner, summed.dtype, summed.device).unsqueeze(1)


def _denom(n: int, offsets, weights, num_bags: int, combiner: str, dtype, device) -> torch.Tensor:
    """``[num_bags]`` divisors of one ``mean``/``sqrtn`` set; 1 for empty (or zero-weight) bags."""
    ends = torch.cat([offsets[1:], offsets.new_tensor([n])])
    counts = ends - offsets
    if weights is None:
        denom = counts.to(dtype)
        denom = denom if combiner == "mean" else denom.sqrt()
    else:
        weights = weights.to(dtype)
        bag = torch.repeat_interleave(torch.arange(num_bags, device=offsets.device), counts)
        w = weights if combiner == "mean" else weights * weights
        denom = torch.zeros(num_bags, dtype=dtype, device=device).index_add_(0, bag, w)
        denom = denom if combiner == "mean" else denom.sqrt()
    return torch.where(denom == 0, torch.ones_like(denom), denom)
