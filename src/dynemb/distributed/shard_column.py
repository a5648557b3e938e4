"""Column-wise sharding: a table's dim split into column shards on ``ranks``; every shard holds every key.

Each requester sends each unique key to every column shard (so every shard sees the same keys, in the same order,
with the same counts, and takes the same insert, eviction and admission decisions); each shard returns its columns
and the requester puts the row together, so what spans the whole row on the requester side (``max_norm``,
pooling) sees the whole row. Backward sends each shard its columns of the gradient. An optimizer whose update
reads a statistic of the whole row (:attr:`~dynemb.optim.base.SparseOptimizer.row_statistic`, RowWiseAdagrad's
mean square) gets the other shards' parts of it from one all-to-all among the owners before it runs; an
:class:`~dynemb.optim.OptimizerWrapper` whose torch optimizer couples columns is refused.

Wire floor: each unique key a requester looks up to every column shard not on its rank (8 bytes each), each
shard's columns of the row back and of the gradient there (``dim`` floats in all, each way), plus one float a
key between the shards for a row statistic. Each shard holds every row (its columns) and finds every key.
"""

from __future__ import annotations

import torch

from .sharding import Sharding
from .strategy import ColumnSlice, Route, ShardingStrategy, TableLoad, TableStats, even_widths, register

__all__ = ["ColumnWise", "couples_columns"]


@register
class ColumnWise(ShardingStrategy):
    """Columns ``[lo, hi)`` of the table on each rank of ``ranks`` (widths ``columns``, default even)."""

    kind = "column"

    def __init__(self, sharding: Sharding, config, rank, world: int) -> None:
        super().__init__(sharding, config, rank, world)
        widths = list(sharding.columns) if sharding.columns is not None else even_widths(config.dim, len(self.group))
        if len(widths) != len(self.group) or sum(widths) != config.dim or min(widths) < 1:
            raise ValueError(f"table {config.name!r}: column sharding widths {widths} over ranks {self.group} must "
                             f"be >= 1 and add up to its dim {config.dim}")
        starts = [0]
        for w in widths:
            starts.append(starts[-1] + w)
        self.ranges = {r: (starts[i], starts[i + 1]) for i, r in enumerate(self.group)}
        optimizer = config.optimizer
        self.shares_row_statistic = bool(optimizer is not None and optimizer.row_statistic and len(self.group) > 1)

    def column_range(self, rank: int) -> tuple[int, int]:
        return self.ranges.get(rank, (0, 0))

    def owned(self, keys: torch.Tensor) -> torch.Tensor:
        return torch.full_like(keys, self.holds(), dtype=torch.bool)

    def initializer(self):
        lo, hi = self.column_range(self.rank)
        return ColumnSlice(self.config.initializer, self.config.dim, lo, hi)

    def check(self) -> None:
        cfg, where = self.config, f"table {self.config.name!r} is column-sharded"
        if cfg.tiers is not None:
            raise ValueError(f"{where}: column sharding does not take tiers (TableConfig.tiers); shard it row-wise")
        if cfg.max_bytes is not None:
            raise ValueError(f"{where}: give max_capacity (rows, the same in every column shard) instead of "
                             f"max_bytes={cfg.max_bytes}, which each shard would turn into a different row count")
        if cfg.optimizer is not None and couples_columns(cfg.optimizer, cfg.dim):
            torch_class = getattr(getattr(cfg.optimizer, "_cls", None), "__name__", "")
            raise ValueError(f"{where}: its optimizer {cfg.optimizer!r} of {torch_class} couples columns (an update "
                             "of one column reads others), so column shards would not train as the whole table "
                             "does; use row, table or table_row sharding for it")

    # ------------------------------------------------------------------ exchange
    def route(self, keys: torch.Tensor) -> Route:
        k = len(self.group)
        dest = torch.tensor(self.group, dtype=torch.int64, device=keys.device).repeat_interleave(keys.numel())
        return Route(dest, torch.arange(keys.numel(), device=keys.device).repeat(k))

    def assemble(self, size: int, copies: torch.Tensor, pieces: list, dtype) -> torch.Tensor:
        out = torch.empty(size, self.config.dim, device=copies.device)
        start = 0
        for rank, piece in enumerate(pieces):
            n = piece.shape[0]
            if n:
                lo, hi = self.column_range(rank)
                out[copies[start: start + n], lo:hi] = piece
            start += n
        return out.to(dtype)

    def split(self, grad: torch.Tensor, copies: torch.Tensor, counts: list) -> list:
        grad, out, start = grad.float(), [], 0
        for rank, n in enumerate(counts):
            lo, hi = self.column_range(rank)
            out.append(grad.index_select(0, copies[start: start + n])[:, lo:hi] if n else grad.new_empty(0, hi - lo))
            start += n
        return out

    def before_delivery(self, shard, keys: torch.Tensor, values: torch.Tensor, grad: torch.Tensor):
        optimizer = shard.optimizer
        if optimizer is None or not self.shares_row_statistic:
            return None
        # sorted unique keys: every column shard received the same keys, so every one has them in this order
        unique, inverse = torch.unique(keys.to(torch.int64), return_inverse=True)
        total = torch.zeros(unique.numel(), grad.shape[1], device=grad.device).index_add_(0, inverse, grad.float())
        rows = torch.zeros(unique.numel(), values.shape[1], device=values.device).index_copy_(0, inverse, values)
        return unique, optimizer.row_square_part(shard.table, total, rows)

    def deliver(self, shard, unique: torch.Tensor, shared: torch.Tensor) -> None:
        # the other column shards' parts of each row's statistic, for the optimizer's next update
        shard.optimizer.share_row_squares(shard.table, unique, shared, self.config.dim)

    # ------------------------------------------------------------------ checkpoints
    def select(self, cols: dict, columnar: set) -> dict:
        return self._columns(cols, columnar)

    def join(self, parts: dict, columnar: set) -> dict:
        ranks = [r for r in self.group if r in parts]
        first = parts[ranks[0]]
        for r in ranks[1:]:
            if not torch.equal(parts[r]["keys"], first["keys"]):
                raise ValueError(f"table {self.config.name!r}: the column shards of ranks {ranks[0]} and {r} hold "
                                 "different keys")
        return {name: torch.cat([parts[r][name] for r in ranks], 1) if name in columnar else t
                for name, t in first.items()}

    def part_config(self, config: dict, rank: int) -> dict:
        lo, hi = self.column_range(rank)
        slots = {n: {**s, "dim": hi - lo} if s["dim"] == config["dim"] else s
                 for n, s in config.get("slots", {}).items()}
        return {**config, "dim": hi - lo, "slots": slots}

    def logical_rows(self, rows: list) -> int:
        return int(max(rows)) if rows else 0

    # ------------------------------------------------------------------ estimates
    @classmethod
    def estimate(cls, sharding: Sharding, stats: TableStats, world: int) -> dict[int, TableLoad]:
        group = sharding.group(world)
        widths = list(sharding.columns) if sharding.columns else even_widths(stats.dim, len(group))
        out = {}
        for r, w in zip(group, widths):
            row_bytes = stats.row_bytes - (stats.dim - w) * (stats.column_bytes or stats.value_bytes)
            per_key = 8 + 2 * w * stats.value_bytes + 4 * stats.row_statistic
            out[r] = TableLoad(stats.rows, stats.rows * row_bytes, stats.accesses, stats.accesses * per_key)
        return out

    @classmethod
    def wire_floor(cls, sharding: Sharding, stats: TableStats, world: int) -> float:
        k = len(sharding.group(world))
        remote = 1.0 - 1.0 / world
        return stats.accesses * (remote * (8 * k + 2 * stats.dim * stats.value_bytes) + 4 * stats.row_statistic
                                 * (k - 1))


def couples_columns(optimizer, dim: int) -> bool:
    """Whether ``optimizer``'s update of a column reads other columns (beyond a row statistic the optimizer shares
    itself, :attr:`~dynemb.optim.base.SparseOptimizer.row_statistic`). The built-in optimizers do not; an
    :class:`~dynemb.optim.OptimizerWrapper`'s torch optimizer is probed: two steps on a row whose gradients differ
    only in its last column must leave its first column alike."""
    from ..optim.wrapper import OptimizerWrapper, _sparse_rows

    if not isinstance(optimizer, OptimizerWrapper) or dim < 2:
        return False
    sparse = optimizer._probe(dim)[2]
    firsts = []
    for last in (1.0, 100.0):
        p = torch.nn.Parameter(torch.linspace(-0.5, 0.5, dim).unsqueeze(0))
        opt = optimizer._cls([p], **optimizer.defaults)
        for step in range(2):
            grad = torch.full((1, dim), 0.3 * (step + 1))
            grad[0, -1] = last
            p.grad = _sparse_rows(grad) if sparse else grad
            opt.step()
        firsts.append(p.detach()[0, 0].item())
    return firsts[0] != firsts[1]
