"""Native sparse optimizers. Defaults follow torch.optim (TF for FTRL). Every update touches only given rows."""

from __future__ import annotations

import math

import torch

from ..serialization import serializable
from .base import SparseOptimizer

__all__ = ["SGD", "Adagrad", "RowWiseAdagrad", "Adam", "FTRL"]

# Each class's type name is its kind (SparseOptimizer.kind); the alias is how dynemb 0.1 named it in saved state.


def _check_range(name: str, value, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value < high:
        raise ValueError(f"{name} must be a float in [{low}, {high}), got {value!r}")


@serializable("sgd", aliases=("SGD",))
class SGD(SparseOptimizer):
    """SGD with optional momentum/Nesterov and weight decay, as ``torch.optim.SGD`` (dampening 0) on touched rows.

    Example:
        >>> import dynemb
        >>> emb = dynemb.DynamicEmbedding(4, initializer="zeros")
        >>> opt = dynemb.optim.SGD([emb], lr=0.5)
        >>> emb(torch.tensor([3])).sum().backward(); opt.step()
        >>> emb.find(torch.tensor([3])).tolist()
        [[-0.5, -0.5, -0.5, -0.5]]
    """

    def __init__(self, tables=None, *, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, fused: bool = False) -> None:
        _check_range("momentum", momentum, 0.0)
        _check_range("weight_decay", weight_decay, 0.0)
        if nesterov and momentum <= 0:
            raise ValueError("nesterov=True requires momentum > 0")
        self.slots = {"momentum_buffer": (None, 0.0)} if momentum > 0 else {}
        super().__init__(tables, fused=fused, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)

    def kernel_args(self, group, scalars):
        slots = ("momentum_buffer",) if group["momentum"] else ()
        return self.kind, (group["lr"], group["momentum"], group["weight_decay"], float(group["nesterov"])), slots

    def _update(self, table, rows, grad, group, scalars):
        if group["weight_decay"]:
            grad = grad.add(self._gather(table, None, rows), alpha=group["weight_decay"])
        if group["momentum"]:
            key = self.slot_key("momentum_buffer")
            buf = self._gather(table, key, rows).mul_(group["momentum"]).add_(grad)
            self._scatter(table, key, rows, buf)
            grad = grad.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
        self._add(table, None, rows, grad.mul(-group["lr"]))


@serializable("adagrad", aliases=("Adagrad",))
class Adagrad(SparseOptimizer):
    """``torch.optim.Adagrad`` on touched rows (defaults ``lr=1e-2, eps=1e-10, initial_accumulator_value=0``)."""

    slots = {"sum": (None, "initial_accumulator_value")}

    def __init__(self, tables=None, *, lr: float = 1e-2, lr_decay: float = 0.0, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, fused: bool = False) -> None:
        for name, value in (("lr_decay", lr_decay), ("weight_decay", weight_decay),
                            ("initial_accumulator_value", initial_accumulator_value), ("eps", eps)):
            _check_range(name, value, 0.0)
        super().__init__(tables, fused=fused, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                         initial_accumulator_value=initial_accumulator_value, eps=eps)

    @staticmethod
    def _lr(group: dict, scalars: dict) -> float:
        """The decayed lr of the step being taken (``scalars["step"]`` already counts it)."""
        return group["lr"] / (1 + (scalars["step"] - 1) * group["lr_decay"])

    def kernel_args(self, group, scalars):
        return self.kind, (self._lr(group, scalars), group["weight_decay"], group["eps"]), ("sum",)

    def _update(self, table, rows, grad, group, scalars):
        if group["weight_decay"]:
            grad = grad.add(self._gather(table, None, rows), alpha=group["weight_decay"])
        clr = self._lr(group, scalars)
        key = self.slot_key("sum")
        state = self._gather(table, key, rows).addcmul_(grad, grad, value=1)
        self._scatter(table, key, rows, state)
        self._add(table, None, rows, torch.div(grad, state.sqrt_().add_(group["eps"])).mul_(-clr))


@serializable("rowwise_adagrad", aliases=("RowWiseAdagrad",))
class RowWiseAdagrad(SparseOptimizer):
    """Adagrad with one accumulator per row (fbgemm/TorchRec): ``sum += mean(g**2)``; ``w -= lr g / (sqrt(sum)+eps)``.

    Its state is 4 bytes per row instead of ``4 * D``.
    """

    slots = {"sum": (1, "initial_accumulator_value")}
    row_statistic = True

    def __init__(self, tables=None, *, lr: float = 1e-2, weight_decay: float = 0.0,
                 initial_accumulator_value: float = 0.0, eps: float = 1e-10, fused: bool = False) -> None:
        for name, value in (("weight_decay", weight_decay), ("initial_accumulator_value", initial_accumulator_value),
                            ("eps", eps)):
            _check_range(name, value, 0.0)
        super().__init__(tables, fused=fused, lr=lr, weight_decay=weight_decay,
                         initial_accumulator_value=initial_accumulator_value, eps=eps)

    def kernel_args(self, group, scalars):
        return self.kind, (group["lr"], group["weight_decay"], group["eps"]), ("sum",)

    def _update(self, table, rows, grad, group, scalars):
        if group["weight_decay"]:
            grad = grad.add(self._gather(table, None, rows), alpha=group["weight_decay"])
        key = self.slot_key("sum")
        # Row reductions and a per-row scale keep this to two passes over the [U, D] gradient.
        mean_square = torch.linalg.vector_norm(grad, dim=1, keepdim=True).square_().div_(grad.shape[1])
        state = self._gather(table, key, rows).add_(mean_square)
        self._scatter(table, key, rows, state)
        self._add(table, None, rows, grad * state.sqrt_().add_(group["eps"]).reciprocal_().mul_(-group["lr"]))

    def row_square_part(self, table, grad, values):
        grad, decay = grad.float(), self.param_groups[self._index(table)]["weight_decay"]
        if decay:  # the update's gradient, as _update_shared forms it
            grad = grad.add(values.float(), alpha=decay)
        return torch.linalg.vector_norm(grad, dim=1).square_()

    def _update_shared(self, table, rows, grad, group, scalars, shared):
        # a column shard: the sum of squares over the whole row is this shard's plus the others' (shared)
        if group["weight_decay"]:
            grad = grad.add(self._gather(table, None, rows), alpha=group["weight_decay"])
        key = self.slot_key("sum")
        square = torch.linalg.vector_norm(grad, dim=1).square_()
        square = square.add_(shared.lookup(table.row_keys.index_select(0, rows)))
        state = self._gather(table, key, rows).add_(square.div_(shared.dim).unsqueeze(1))
        self._scatter(table, key, rows, state)
        self._add(table, None, rows, grad * state.sqrt_().add_(group["eps"]).reciprocal_().mul_(-group["lr"]))


@serializable("adam", aliases=("Adam",))
class Adam(SparseOptimizer):
    """Lazy Adam, exactly ``torch.optim.SparseAdam``: moments and values of touched rows only; bias correction
    uses the table's step count. Defaults ``lr=1e-3, betas=(0.9, 0.999), eps=1e-8``."""

    slots = {"exp_avg": (None, 0.0), "exp_avg_sq": (None, 0.0)}

    def __init__(self, tables=None, *, lr: float = 1e-3, betas: tuple = (0.9, 0.999), eps: float = 1e-8,
                 fused: bool = False) -> None:
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair of floats in [0, 1), got {betas!r}")
        _check_range("betas[0]", betas[0], 0.0, 1.0)
        _check_range("betas[1]", betas[1], 0.0, 1.0)
        _check_range("eps", eps, 0.0)
        super().__init__(tables, fused=fused, lr=lr, betas=tuple(betas), eps=eps)

    @staticmethod
    def _step_size(group: dict, scalars: dict) -> float:
        """The bias-corrected lr of the step being taken (``scalars["step"]`` already counts it)."""
        (beta1, beta2), step = group["betas"], scalars["step"]
        return group["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step)

    def kernel_args(self, group, scalars):
        beta1, beta2 = group["betas"]
        return self.kind, (beta1, beta2, group["eps"], self._step_size(group, scalars)), ("exp_avg", "exp_avg_sq")

    def _update(self, table, rows, grad, group, scalars):
        beta1, beta2 = group["betas"]
        k1, k2 = self.slot_key("exp_avg"), self.slot_key("exp_avg_sq")
        m_old, v_old = self._gather(table, k1, rows), self._gather(table, k2, rows)
        m = grad.sub(m_old).mul_(1 - beta1).add_(m_old)
        v = grad.square().sub_(v_old).mul_(1 - beta2).add_(v_old)
        self._scatter(table, k1, rows, m)
        self._scatter(table, k2, rows, v)
        step_size = self._step_size(group, scalars)
        self._add(table, None, rows, m.div_(v.sqrt_().add_(group["eps"])).mul_(-step_size))


@serializable("ftrl", aliases=("FTRL",))
class FTRL(SparseOptimizer):
    """FTRL-proximal with TF's semantics (``tf.keras.optimizers.Ftrl``, ``l2_shrinkage=0``).

    Defaults ``learning_rate_power=-0.5, initial_accumulator_value=0.1, l1=l2=0``.
    """

    slots = {"accumulator": (None, "initial_accumulator_value"), "linear": (None, 0.0)}

    def __init__(self, tables=None, *, lr: float = 1e-3, learning_rate_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1: float = 0.0, l2: float = 0.0,
                 fused: bool = False) -> None:
        if not isinstance(learning_rate_power, (int, float)) or learning_rate_power > 0:
            raise ValueError(f"learning_rate_power must be a float <= 0, got {learning_rate_power!r}")
        for name, value in (("initial_accumulator_value", initial_accumulator_value), ("l1", l1), ("l2", l2)):
            _check_range(name, value, 0.0)
        super().__init__(tables, fused=fused, lr=lr, learning_rate_power=learning_rate_power,
                         initial_accumulator_value=initial_accumulator_value, l1=l1, l2=l2)

    def kernel_args(self, group, scalars):
        hparams = (group["lr"], -group["learning_rate_power"], group["l1"], group["l2"])
        return self.kind, hparams, ("accumulator", "linear")

    def _update(self, table, rows, grad, group, scalars):
        power = -group["learning_rate_power"]
        ka, kl = self.slot_key("accumulator"), self.slot_key("linear")
        w = self._gather(table, None, rows)
        acc = self._gather(table, ka, rows)
        new_acc = acc + grad.square()
        sigma = (new_acc.pow(power) - acc.pow(power)) / group["lr"]
        linear = self._gather(table, kl, rows).add_(grad).sub_(sigma * w)
        quadratic = new_acc.pow(power) / group["lr"] + 2 * group["l2"]
        w = torch.where(linear.abs() > group["l1"], (torch.sign(linear) * group["l1"] - linear) / quadratic, 0.0)
        self._scatter(table, ka, rows, new_acc)
        self._scatter(table, kl, rows, linear)
        self._scatter(table, None, rows, w)
