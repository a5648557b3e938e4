"""OptimizerWrapper: any ``torch.optim`` algorithm applied to the rows a step touched (SOK's OptimizerWrapper).

Each step gathers the touched rows and their per-row optimizer state into a temporary ``[U, D]`` parameter,
runs the torch optimizer's own ``step()`` on it, and scatters values and state back. Per-row state tensors live
in table slots; scalar state (such as Adam's ``step``) is kept per table, so bias corrections follow the table's
step count exactly as ``torch.optim.SparseAdam`` does. Rows not touched by a step do not change (lazy semantics).
The gradient is dense, or sparse (``[U, D]`` rows as a COO tensor) for optimizers that take only sparse gradients,
such as ``torch.optim.SparseAdam``.
"""

from __future__ import annotations

import torch

from .base import SparseOptimizer

__all__ = ["OptimizerWrapper"]


class OptimizerWrapper(SparseOptimizer):
    """Wrap a torch optimizer class (or an instance, whose class and defaults are used).

    Args:
        optimizer: e.g. ``torch.optim.Adagrad`` or ``torch.optim.Adagrad(params, lr=0.1)``.
        tables: what to optimize (``None`` for a TableConfig spec).
        fused: apply inside backward (the torch optimizer's own ``fused`` kernel flag is not a hyper-parameter
            here: its updates run on small temporary tensors).
        **hparams: constructor arguments of the torch optimizer (when a class is given).

    ``defaults`` and each table's param group hold every hyper-parameter of the torch optimizer (``lr`` too when
    left at its default), so LR schedulers work as for the native optimizers.

    Example:
        >>> import dynemb
        >>> emb = dynemb.DynamicEmbedding(2, initializer="zeros")
        >>> opt = dynemb.OptimizerWrapper(torch.optim.Adagrad, [emb], lr=1.0)
        >>> emb(torch.tensor([5])).sum().backward(); opt.step()
        >>> [round(x, 4) for x in emb.find(torch.tensor([5]))[0].tolist()]
        [-1.0, -1.0]
    """

    def __init__(self, optimizer, tables=None, *, fused: bool = False, **hparams) -> None:
        if isinstance(optimizer, torch.optim.Optimizer):
            if hparams:
                raise ValueError("pass hyper-parameters either in the optimizer instance or as keywords, not both")
            cls, hparams = type(optimizer), dict(optimizer.defaults)
        elif isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
            cls = optimizer
        else:
            raise TypeError(f"optimizer must be a torch.optim.Optimizer class or instance, got {optimizer!r}")
        self._cls = cls
        self._probe_cache: dict = {}
        self._instance = cls([torch.zeros(1, requires_grad=True)], **hparams)
        defaults = {k: v for k, v in self._instance.defaults.items() if k != "fused"}
        super().__init__(tables, fused=fused, **defaults)

    @property
    def name(self) -> str:
        return "wrap_" + self._cls.__name__.lower()

    def _config_fields(self) -> dict:
        # the torch class is code, not data: to_dict refuses it, naming this field
        return {"optimizer": self._cls, **super()._config_fields()}

    def __eq__(self, other) -> bool:
        return super().__eq__(other) and self._cls is other._cls

    def __hash__(self) -> int:
        return hash((self._cls, super().__hash__()))

    def _probe(self, dim: int) -> tuple[dict, list, bool]:
        """Per-row state (name -> (width, init)), scalar state names, and whether the optimizer takes only sparse
        gradients, from one zero-gradient step."""
        if dim not in self._probe_cache:
            p = torch.zeros(1, dim, requires_grad=True)
            opt = self._cls([p], **self.defaults)
            p.grad = torch.zeros_like(p)
            try:
                opt.step()
                sparse = False
            except RuntimeError as dense_error:  # e.g. "SparseAdam does not support dense gradients"
                opt = self._cls([p], **self.defaults)
                p.grad = _sparse_rows(torch.zeros(1, dim))
                try:
                    opt.step()
                except RuntimeError as e:
                    raise TypeError(f"{self._cls.__name__} takes neither dense gradients ({dense_error}) nor sparse "
                                    f"ones ({e})") from None
                sparse = True
            rows, scalars = {}, []
            for key, value in opt.state[p].items():
                if isinstance(value, torch.Tensor) and value.shape == p.shape:
                    flat = value.reshape(-1).float()
                    if not bool((flat == flat[0]).all()):
                        raise ValueError(f"{self._cls.__name__} state {key!r} starts non-constant; not supported")
                    rows[key] = (dim, float(flat[0]))
                else:
                    scalars.append(key)
            self._probe_cache[dim] = (rows, scalars, sparse)
        return self._probe_cache[dim]

    def slot_widths(self, dim: int) -> dict:
        return self._probe(dim)[0]

    def _slot_init(self, slot: str, init) -> float:
        return float(init)

    def _update(self, table, rows, grad, group, scalars):
        row_state, scalar_names, sparse = self._probe(table.dim)
        param = torch.nn.Parameter(self._gather(table, None, rows))
        param.grad = _sparse_rows(grad) if sparse else grad
        state = {}
        if any(f"torch.{key}" in scalars for key in scalar_names) or not scalar_names:
            # Before a table's first update every row still holds the initial state: torch creates it itself.
            state = {key: self._gather(table, self.slot_key(key), rows) for key in row_state}
            state.update({key: scalars[f"torch.{key}"] for key in scalar_names})
        opt = self._instance
        opt.param_groups[0].update({k: v for k, v in group.items() if k != "params"})  # this table's (scheduled) lr
        opt.param_groups[0]["params"] = [param]
        opt.state.clear()
        opt.state[param] = state
        opt.step()
        new_state = opt.state.pop(param)
        opt.param_groups[0]["params"] = []
        for key in row_state:
            self._scatter(table, self.slot_key(key), rows, new_state[key])
        for key in scalar_names:
            scalars[f"torch.{key}"] = new_state[key]
        self._scatter(table, None, rows, param.detach())

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["tables"] = [{k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                           for s in state["tables"]]
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        # Tensor scalars (Adam's step) were saved as floats; plain ints (SparseAdam's step) stay ints.
        self._scalars = [{k: (torch.tensor(v) if k.startswith("torch.") and isinstance(v, float) else v)
                          for k, v in s.items()} for s in self._scalars]


def _sparse_rows(grad: torch.Tensor) -> torch.Tensor:
    """``grad [U, D]`` as a sparse COO gradient of a ``[U, D]`` parameter, every row present (valid by
    construction: no invariant check)."""
    rows = torch.arange(grad.shape[0], device=grad.device).unsqueeze(0)
    return torch.sparse_coo_tensor(rows, grad, grad.shape, is_coalesced=True, check_invariants=False)
