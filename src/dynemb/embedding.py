"""DynamicEmbedding: the user's embedding variable over a growable, evicting hash table."""

from __future__ import annotations

import torch
from torch import nn

from .functional.custom_ops import register_table
from .serialization import canonical_dtype, dtype_name
from .table import EvictionPolicy, KeyValueTable, Rows, TieredTable, Tiers
from .table.admission import FrequencyAdmission
from .table.static import StaticTable
from .checks import VALUE_DTYPES, check_keys, check_rows_like, fit_keys, resolve_device
from .table.initializers import InitializerSpec
from .table import EvictHook

__all__ = ["DynamicEmbedding", "StaticEmbedding"]

_FORMAT = 1


def check_move(args: tuple, kwargs: dict) -> None:
    """Check the device of ``module.to(*args, **kwargs)`` before anything moves (a device this process cannot
    use is a ``ValueError`` naming it, not torch's bare ``AssertionError`` halfway through the move)."""
    try:  # nn.Module.to's own parser: every form .to() takes (device, dtype, tensor, keywords)
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"to(): {e}") from None
    if device is not None:
        resolve_device(device, "to(device)")


def check_cuda(device) -> None:
    """:func:`check_move` for ``module.cuda(device)`` (``None``: the current CUDA device, an int: its index)."""
    target = torch.device("cuda", device) if isinstance(device, int) else ("cuda" if device is None else device)
    resolve_device(target, "cuda(device)")


class _TableModule(nn.Module):
    """What ``nn.Module`` does to its Parameters, done to the module's table (which is not a Parameter)."""

    table: KeyValueTable | StaticTable

    def to(self, *args, **kwargs):
        check_move(args, kwargs)
        return super().to(*args, **kwargs)

    def cuda(self, device=None):
        check_cuda(device)
        return super().cuda(device)

    def _apply(self, fn, recurse=True):
        # .to(device)/.cuda()/.cpu() move the table; floating casts (.half(), .to(torch.bfloat16), .float())
        # convert its value rows. Optimizer slots stay float32, like torch.optim state under an AMP model.
        t = self.table
        probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
        dtype = probe.dtype if probe.dtype.is_floating_point else t.dtype
        if dtype not in VALUE_DTYPES:
            raise TypeError(f"{type(self).__name__} rows can be {', '.join(map(str, VALUE_DTYPES))}; cannot cast "
                            f"them to {dtype}")
        if probe.device != t.device:
            t.to(probe.device)
        t.cast(dtype)
        return super()._apply(fn, recurse)

    def __setstate__(self, state) -> None:
        # A copy (deepcopy, pickle, torch.load) holds a copy of the table, which comes without a handle (the
        # original's would lead the compiled ops to the original): register it. A copier may get here before it
        # has filled the table in (a table whose on_evict leads back to this module); the table's state then
        # arrives without a handle, and this one stays.
        super().__setstate__(state)
        table = self.__dict__.get("table")
        if table is not None:
            register_table(table)

    def requires_grad_(self, requires_grad: bool = True) -> "_TableModule":
        """Freeze (``False``) or unfreeze the table, as ``nn.Module.requires_grad_`` does its Parameters.

        A frozen table still answers lookups, but passes no gradient, so its optimizer never changes it; like a
        table under ``torch.no_grad()`` it is read-only (no insert, eviction or count). ``requires_grad_`` on a
        parent module reaches only Parameters: call it on this module (``ec.embeddings[name]`` inside an
        ``EmbeddingCollection``).

        Example:
            >>> emb = DynamicEmbedding(2, seed=0).requires_grad_(False)
            >>> emb(torch.tensor([1, 2])).requires_grad
            False
        """
        if not isinstance(requires_grad, bool):
            raise TypeError(f"requires_grad must be a bool, got {requires_grad!r}")
        self.table.requires_grad = requires_grad
        return super().requires_grad_(requires_grad)


class DynamicEmbedding(_TableModule):
    """An embedding keyed by arbitrary int32/int64 ids, growing as ids arrive and evicting under a bound.

    Args:
        dim: embedding width ``D``.
        key_dtype: ``torch.int64`` (default) or ``torch.int32``. Every value of the dtype is a valid key.
        dtype: float32, float16 or bfloat16.
        initializer: ``"uniform"`` (±0.05, default), ``"normal"``, ``"truncated_normal"`` (std 0.05),
            ``"zeros"``, a float constant, an :class:`dynemb.table.Initializer`, or a callable
            ``(n, dim) -> Tensor``. Built-in initializers give each key the same row on any device or rank.
        device: device of the table (default CPU); one this process cannot use is a ``ValueError``.
        init_capacity: rows allocated up front.
        max_capacity: most rows kept; beyond it the lowest-score rows are evicted. ``None``: unbounded.
        max_bytes: the same bound in bytes (values, slots, scores and index; see :mod:`dynemb.table.budget`);
            exclusive with ``max_capacity``.
        tiers: a :class:`dynemb.table.Tiers` to keep rows past a fast-tier budget in host memory or on disk
            instead of evicting them (a :class:`dynemb.table.TieredTable`); exclusive with the two bounds above.
        eviction: ``"lru"`` (default), ``"lfu"``, ``"decayed_lfu"``, ``"epoch_lru"``, ``"epoch_lfu"`` or
            ``"custom"``; defines the scores used by eviction and :meth:`restrict` (docs/tables.md compares them).
            Needs a bound (``max_capacity``, ``max_bytes`` or ``tiers``): an unbounded table never evicts, and
            ranks its rows lru for :meth:`restrict`.
        half_life: ``decayed_lfu`` only: clock ticks (about one per training step) in which an access's weight
            halves.
        on_evict: ``fn(keys, values, scores)`` called with every batch of evicted rows, before the table changes:
            if it raises, the call leaves the table as it was and the exception propagates.
        seed: initializer seed; ``None`` draws one from torch's global RNG (so ``torch.manual_seed`` fixes it).
        admission: an int threshold or :class:`dynemb.table.FrequencyAdmission`: a new id is stored and trained
            only from its ``threshold``-th sighting; before that it reads its initializer row.

    Shape:
        ``forward(ids)``: ids of any shape ``S`` -> ``S + (D,)``. Ids may be int32 or int64 whatever the
        ``key_dtype``: int64 ids of an int32 table are cast when they fit (see :func:`dynemb.checks.fit_keys`;
        on CPU one that does not is a ``ValueError`` before the table changes).

    Example:
        >>> emb = DynamicEmbedding(4, initializer="zeros")
        >>> emb(torch.tensor([[1, 2**40], [-1, 1]])).shape
        torch.Size([2, 2, 4])
        >>> len(emb)
        3
        >>> emb.eval()(torch.tensor([7])).sum().item(), len(emb)  # eval inserts nothing
        (0.0, 3)
    """

    def __init__(
        self,
        dim: int,
        *,
        key_dtype: torch.dtype = torch.int64,
        dtype: torch.dtype = torch.float32,
        initializer: InitializerSpec = "uniform",
        device: torch.device | str | None = None,
        init_capacity: int = 8192,
        max_capacity: int | None = None,
        eviction: EvictionPolicy | str | None = None,
        on_evict: EvictHook | None = None,
        seed: int | None = None,
        admission: FrequencyAdmission | int | None = None,
        max_bytes: int | None = None,
        tiers: Tiers | None = None,
        half_life: int | None = None,
    ) -> None:
        super().__init__()
        if eviction is not None and (max_capacity, max_bytes, tiers) == (None, None, None):
            # as the CLI's "--eviction needs --max-capacity": a policy on an unbounded table would never evict
            raise ValueError(f"eviction={eviction!r} needs a bound: give max_capacity or max_bytes (or tiers); only a "
                             "bounded table evicts, and an unbounded one keeps every key")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        kwargs = dict(key_dtype=key_dtype, dtype=dtype, device=device, init_capacity=init_capacity,
                      max_capacity=max_capacity, max_bytes=max_bytes, eviction=eviction, initializer=initializer,
                      half_life=half_life, seed=seed, on_evict=on_evict, admission=admission)
        self.table = KeyValueTable(dim, **kwargs) if tiers is None else TieredTable(dim, tiers=tiers, **kwargs)
        register_table(self.table)

    # ------------------------------------------------------------------ properties
    @property
    def dim(self) -> int:
        return self.table.dim

    @property
    def key_dtype(self) -> torch.dtype:
        return self.table.key_dtype

    @property
    def dtype(self) -> torch.dtype:
        return self.table.dtype

    @property
    def device(self) -> torch.device:
        return self.table.device

    # ------------------------------------------------------------------ lookups
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for ``ids`` (any shape ``S``) as ``S + (D,)``. Training: missing ids are inserted.
        Eval: missing ids read their initializer row and nothing is inserted."""
        from .functional import embedding_lookup

        ids = self._fit(ids, "ids")
        ids = check_keys(ids, self.key_dtype, self.device, "ids").view(ids.shape)  # int32 ids widened
        return embedding_lookup(self, ids)

    def _fit(self, keys, name: str = "keys"):
        """int64 keys of an int32 table cast when they fit (the table's own checks judge the rest)."""
        return fit_keys(keys, self.key_dtype, self.device, name)

    def find(self, keys: torch.Tensor, return_exists: bool = False):
        """Read rows without inserting (:meth:`dynemb.table.KeyValueTable.find`). Missing keys get their
        initializer row.

        Returns ``values`` ``S + (D,)``, and ``exists`` ``S`` bool when ``return_exists`` (the table's ``find``
        returns both always).
        """
        values, found = self.table.find(self._fit(keys))
        return (values, found) if return_exists else values

    def contains(self, keys: torch.Tensor) -> torch.Tensor:
        """Bool ``S``: whether each key is stored."""
        return self.table.contains(self._fit(keys))

    # ------------------------------------------------------------------ updates
    def insert_or_assign(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Insert or overwrite rows (``keys`` ``S``, ``values`` ``S + (D,)``); the last duplicate wins."""
        self.table.insert_or_assign(self._fit(keys), values)

    def accum(self, keys, old_values, new_values, exists) -> None:
        """TFRA's ``accum``: apply updates made to rows read earlier with ``find(keys, return_exists=True)``.

        By ``exists`` (when read) and whether the key is present now: both -> ``new - old`` is added; read
        but removed since -> nothing; not read but inserted since -> nothing (that insert wins); neither -> inserted
        with ``new``. Duplicates apply in order; see :meth:`dynemb.table.KeyValueTable.accum`.

        Shape: ``keys`` ``S``; ``old_values``/``new_values`` ``S + (D,)``; ``exists`` ``S`` bool.
        """
        self.table.accum(self._fit(keys), old_values, new_values, exists)

    def erase(self, keys: torch.Tensor) -> int:
        """Remove keys (missing keys are ignored); returns how many were removed."""
        return self.table.erase(self._fit(keys))

    def clear(self) -> None:
        """Remove every key."""
        self.table.clear()

    def restrict(self, num_reserved: int, trigger: int | None = None) -> Rows:
        """Keep the ``num_reserved`` highest-score rows when ``size > trigger``; returns the evicted rows."""
        return self.table.restrict(num_reserved, trigger)

    def export(self, with_scores: bool = False):
        """``(keys [N], values [N, D])``, plus ``scores [N]`` int64 when ``with_scores``. Copies."""
        rows = self.table.export()
        return (rows.keys, rows.values, rows.scores) if with_scores else (rows.keys, rows.values)

    def size(self) -> int:
        return self.table.size()

    def __len__(self) -> int:
        return self.table.size()

    def extra_repr(self) -> str:
        t = self.table
        return (
            f"dim={t.dim}, key_dtype={t.key_dtype}, dtype={t.dtype}, size={t.size()}, "
            f"max_capacity={t.max_capacity}, eviction={t.policy.value!r}, device={t.device}"
        )

    # ------------------------------------------------------------------ state dict
    def config(self) -> dict:
        t = self.table
        return {
            "format": _FORMAT,
            "dim": t.dim,
            "key_dtype": dtype_name(t.key_dtype),
            "dtype": dtype_name(t.dtype),
            "max_capacity": t.max_capacity,
            "eviction": t.policy.value,
            "half_life": t.half_life,
            "initializer": t.initializer.describe(),
            "seed": t.seed,
            "slots": {name: list(t.slot(name).shape[1:]) for name in t.slot_names},
        }

    def counters(self) -> dict:
        """The table's counters (clock, epoch, inserted/removed/evicted counts, initializer calls)."""
        t = self.table
        names = ("clock", "save_ticks", "epoch", "inserted", "removed", "evicted", "_init_calls")
        return {k: getattr(t, k) for k in names}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        rows = self.table.export()
        destination[prefix + "keys"] = rows.keys
        destination[prefix + "values"] = rows.values
        destination[prefix + "scores"] = rows.scores
        for name, tensor in rows.slots.items():
            destination[prefix + "slot." + name] = tensor
        destination[prefix + "_extra_state"] = {"config": self.config(), "counters": self.counters()}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        t = self.table
        names = ["keys", "values", "scores", "_extra_state"] + ["slot." + n for n in t.slot_names]
        absent = [prefix + n for n in names if prefix + n not in state_dict]
        if absent:
            missing_keys.extend(absent)
            return
        extra = state_dict[prefix + "_extra_state"]
        config = extra["config"]
        for field in ("dim", "key_dtype", "dtype"):
            saved = config[field] if field == "dim" else canonical_dtype(config[field])  # or str(dtype), as of 0.1
            if saved != self.config()[field]:
                errors.append(
                    f"{prefix}: {field} is {config[field]} in the state dict but {self.config()[field]} in this "
                    f"DynamicEmbedding"
                )
                return
        for key in state_dict:
            if key.startswith(prefix + "slot.") and key[len(prefix) + 5 :] not in t.slot_names:
                unexpected_keys.append(key)
        keys = state_dict[prefix + "keys"].to(t.device)
        try:
            keys = check_keys(keys, t.key_dtype, t.device, prefix + "keys")
            values = check_rows_like(
                state_dict[prefix + "values"].to(t.device), keys.numel(), t.dim, t.dtype, t.device,
                prefix + "values", keys.shape,
            )
            slots = {n: state_dict[prefix + "slot." + n] for n in t.slot_names}
            t.replace(Rows(keys, values, state_dict[prefix + "scores"], slots))
        except (TypeError, ValueError) as e:
            errors.append(str(e))
            return
        # The seed is state, like the counters: with it, keys first seen after the load get the same rows.
        t.seed = int(config["seed"])
        for name, value in extra.get("counters", {}).items():
            setattr(t, name, int(value))

    # ------------------------------------------------------------------ TFRA's names
    # TensorFlow Recommenders-Addons' DynamicEmbedding calls three of the table's verbs by other names. They are
    # the same methods, here and only here, for code written against TFRA (docs/tables.md).
    #: TFRA's name for :meth:`find`.
    lookup = find
    #: TFRA's name for :meth:`insert_or_assign`.
    upsert = insert_or_assign
    #: TFRA's name for :meth:`erase`.
    remove = erase


class StaticEmbedding(_TableModule):
    """A dense table for ids in ``[0, num_embeddings)`` with the interface (lookups, optimizers, export) of
    :class:`DynamicEmbedding`. Out-of-range ids are an error.

    Example:
        >>> emb = StaticEmbedding(10, 4, initializer="zeros")
        >>> emb(torch.tensor([[0, 9]])).shape
        torch.Size([1, 2, 4])
    """

    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype = torch.float32,
                 key_dtype: torch.dtype = torch.int64, initializer: InitializerSpec = "uniform", device=None,
                 seed: int | None = None) -> None:
        super().__init__()
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        self.table = StaticTable(num_embeddings, dim, key_dtype=key_dtype, dtype=dtype, device=device,
                                 initializer=initializer, seed=seed)
        register_table(self.table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from .functional import embedding_lookup

        return embedding_lookup(self, ids)

    def export(self):
        rows = self.table.export()
        return rows.keys, rows.values

    def config(self) -> dict:
        t = self.table
        return {"format": _FORMAT, "dim": t.dim, "key_dtype": dtype_name(t.key_dtype), "dtype": dtype_name(t.dtype),
                "vocabulary_size": t.num_rows, "initializer": t.initializer.describe(), "seed": t.seed}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "values"] = self.table.values.detach().clone()
        for name in self.table.slot_names:
            destination[prefix + "slot." + name] = self.table.slot(name).clone()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, errors):
        names = ["values"] + ["slot." + n for n in self.table.slot_names]
        absent = [prefix + n for n in names if prefix + n not in state_dict]
        if absent:
            missing_keys.extend(absent)
            return
        values = state_dict[prefix + "values"]
        if tuple(values.shape) != tuple(self.table.values.shape) or values.dtype != self.table.dtype:
            errors.append(f"{prefix}values: expected {self.table.dtype} {tuple(self.table.values.shape)}, got "
                          f"{values.dtype} {tuple(values.shape)}")
            return
        self.table.values.copy_(values)
        for name in self.table.slot_names:
            self.table.slot(name).copy_(state_dict[prefix + "slot." + name])
