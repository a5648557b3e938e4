"""Column-wise and table-row-wise sharding: N gloo ranks train as one process does, for every built-in optimizer,
dynamic and static tables, fused and not; checkpoints go from each kind to row-wise and back, at 2 and 4 ranks,
and back to one process. Every scenario of a world runs in one start of its ranks (a start costs more than a
scenario)."""

import numpy as np
import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import export_for_serving, load, save
from dynemb.collection.plan import ExecutionPlan
from dynemb.distributed.sharding import Sharding
from dynemb.serving import read_export

from .harness import run

STEPS = 4
SPLITS = {2: [14, 10], 4: [9, 0, 8, 7]}  # uneven batches; a rank with no samples at all
OPTIMIZERS = {
    "sgd": lambda fused: dynemb.optim.SGD(lr=0.3, momentum=0.5, fused=fused),
    "adagrad": lambda fused: dynemb.optim.Adagrad(lr=0.2, fused=fused),
    "rowwise": lambda fused: dynemb.optim.RowWiseAdagrad(lr=0.2, weight_decay=0.01, fused=fused),
    "adam": lambda fused: dynemb.optim.Adam(lr=0.05, fused=fused),
    "ftrl": lambda fused: dynemb.optim.FTRL(lr=0.1, fused=fused),
}
SCENARIOS = [("sgd", False, None), ("adagrad", True, None), ("rowwise", False, None), ("rowwise", True, "lfu"),
             ("adam", True, None), ("ftrl", False, None)]
"""(optimizer, fused, eviction policy of the dynamic tables)"""


def plans(world):
    last = world - 1
    return {
        "column": {"wide": "column", "wstat": Sharding("column", ranks=(last, 0), columns=(3, 2)),
                   "grp": ("table_row", (0, 1)), "gstat": ("table_row", (last, 0))},
        "row": {"wide": "row", "wstat": "row", "grp": "row", "gstat": "row"},
    }


def configs(opt_name, fused, policy=None):
    opt = OPTIMIZERS[opt_name](fused)
    bounded = {"eviction": policy, "admission": 2, "max_capacity": 1 << 16} if policy else {}
    tables = [TableConfig(name="wide", dim=6, optimizer=opt, seed=1, **bounded),  # dynamic, column
              TableConfig(name="wstat", dim=5, vocabulary_size=30, optimizer=opt, seed=2),  # static, column
              TableConfig(name="grp", dim=4, optimizer=opt, seed=3, combiner="sum", **bounded),  # dynamic, table_row
              TableConfig(name="gstat", dim=3, vocabulary_size=25, optimizer=opt, seed=4)]  # static, table_row
    features = [FeatureConfig(name="w", table="wide"), FeatureConfig(name="wn", table="wide", max_norm=0.04),
                FeatureConfig(name="ws", table="wstat"), FeatureConfig(name="g", table="grp"),
                FeatureConfig(name="gs", table="gstat")]
    return tables, features


def global_batch(step, n=24):
    g = torch.Generator().manual_seed(300 + step)
    return {"w": torch.randint(-(2**62), 2**62, (8,), generator=g)[torch.randint(0, 8, (n, 2), generator=g)],
            "wn": torch.randint(0, 40, (n,), generator=g), "ws": torch.randint(0, 30, (n, 3), generator=g),
            "g": torch.randint(-20, 20, (n, 2), generator=g), "gs": torch.randint(0, 25, (n,), generator=g),
            "r": torch.randn(n, 6 + 6 + 5 + 4 + 3, generator=g)}


def train(ec, lo_hi, steps=range(STEPS)):
    for step in steps:
        b = global_batch(step)
        lo, hi = lo_hi or (0, 24)
        b = {k: v[lo:hi] for k, v in b.items()}
        r = b.pop("r")
        out = ec(b)
        (torch.cat([out[k] for k in ("w", "wn", "ws", "g", "gs")], 1) * r).sum().backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()


def gathered(ec, tables):
    result = {}
    for t in tables:
        keys, values = ec.gather_export(t.name)
        order = np.argsort(keys.numpy(), kind="stable")
        result[t.name + ".keys"], result[t.name + ".values"] = keys.numpy()[order], values.numpy()[order]
    return result


def _scenarios(rank, world, root):
    result = {}
    splits = SPLITS[world]
    lo = sum(splits[:rank])
    for i, (opt_name, fused, policy) in enumerate(SCENARIOS):
        tables, features = configs(opt_name, fused, policy)
        ec = EmbeddingCollection(tables, features, plan=plans(world)["column"], timeout=60)
        train(ec, (lo, lo + splits[rank]))
        result.update({f"{i}/{k}": v for k, v in gathered(ec, tables).items()})
    # checkpoints: column/table_row -> row -> column, each load equal to what was saved; then one process
    tables, features = configs("rowwise", False)
    first = EmbeddingCollection(tables, features, plan=plans(world)["column"], timeout=60)
    train(first, (lo, lo + splits[rank]))
    save(root, first, step=1)
    export_for_serving(root + "-export", first)  # rank 0 writes the one export, column shards joined
    want = gathered(first, tables)
    as_row = EmbeddingCollection(tables, features, plan=plans(world)["row"], timeout=60)
    load(root, as_row)
    result.update({f"ckpt-row/{k}": v for k, v in gathered(as_row, tables).items()})
    train(as_row, (lo, lo + splits[rank]), steps=[STEPS])
    save(root, as_row, step=2)
    after = gathered(as_row, tables)
    back = EmbeddingCollection(tables, features, plan=plans(world)["column"], timeout=60)
    load(root, back)
    result.update({f"ckpt-col/{k}": v for k, v in gathered(back, tables).items()})
    result.update({f"want/{k}": v for k, v in want.items()})
    result.update({f"after/{k}": v for k, v in after.items()})
    return result if rank == 0 else None


def _single(opt_name, fused, policy=None, steps=range(STEPS)):
    tables, features = configs(opt_name, fused, policy)
    ec = EmbeddingCollection(tables, features)
    train(ec, None, steps)
    return ec, tables


def _close(got, want, what):
    assert np.linalg.norm(got - want) <= 1e-5 * max(np.linalg.norm(want), 1e-12), what


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.slow
def test_column_and_table_row_sharding_equal_one_process(tmp_path, world):
    got = run(_scenarios, world, tmp_path, str(tmp_path / "ckpt"))
    assert got is not None, [p.read_text() for p in tmp_path.glob("*.err")]
    for i, (opt_name, fused, policy) in enumerate(SCENARIOS):
        ec, tables = _single(opt_name, fused, policy)
        want = gathered(ec, tables)
        for key, value in want.items():
            what = f"{opt_name}, fused={fused}, policy={policy}: {key} at world {world}"
            if key.endswith(".keys"):
                np.testing.assert_array_equal(got[f"{i}/{key}"], value, err_msg=what)
            else:
                _close(got[f"{i}/{key}"], value, what)
    for stage, saved in (("ckpt-row", "want"), ("ckpt-col", "after")):
        for key in (k for k in got if k.startswith(saved + "/")):
            np.testing.assert_array_equal(got[f"{stage}/{key[len(saved) + 1:]}"], got[key], err_msg=f"{stage} {key}")
    _, exported = read_export(tmp_path / "ckpt-export")
    for name, cols in exported.items():
        order = np.argsort(cols["keys"].numpy(), kind="stable")
        np.testing.assert_array_equal(cols["keys"].numpy()[order], got[f"want/{name}.keys"], err_msg=name)
        np.testing.assert_array_equal(cols["values"].numpy()[order], got[f"want/{name}.values"], err_msg=name)
    # back to one process: the row-wise checkpoint of world N loads into one process and equals it
    one, tables = _single("rowwise", False, steps=[])
    load(tmp_path / "ckpt", one)
    for key, value in gathered(one, tables).items():
        np.testing.assert_array_equal(value, got[f"after/{key}"], err_msg=f"one process: {key}")


def test_an_optimizer_wrapper_that_couples_columns_is_refused_for_column_sharding():
    class Normed(torch.optim.Optimizer):  # a step scaled by the whole row's gradient norm couples the columns
        def __init__(self, params, lr=0.1):
            super().__init__(params, {"lr": lr})

        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(p.grad / p.grad.norm(), alpha=-group["lr"])

    coupled = TableConfig(name="t", dim=4, optimizer=dynemb.optim.OptimizerWrapper(Normed, lr=0.1))
    with pytest.raises(ValueError, match=r"table 't' is column-sharded: its optimizer .*Normed.* couples columns"):
        ExecutionPlan([coupled], {"t": 1}, shardings={"t": Sharding("column")}, rank=0, world=2)
    ExecutionPlan([coupled], {"t": 1}, shardings={"t": Sharding("row")}, rank=0, world=2)  # row-wise takes it
    elementwise = TableConfig(name="t", dim=4, optimizer=dynemb.optim.OptimizerWrapper(torch.optim.Adagrad, lr=0.1))
    plan = ExecutionPlan([elementwise], {"t": 1}, shardings={"t": Sharding("column")}, rank=1, world=2)
    assert plan["t"].table.dim == 2


def test_column_shards_start_as_their_columns_of_the_whole_table():
    config = TableConfig(name="s", dim=5, vocabulary_size=7, seed=3)
    whole = ExecutionPlan([config], {"s": 3})["s"].table.values
    sharding = Sharding("column", ranks=(2, 0, 1), columns=(1, 3, 1))
    parts = {}
    for rank in range(3):
        shard = ExecutionPlan([config], {"s": 3}, shardings={"s": sharding}, rank=rank, world=3)["s"]
        parts[rank] = shard.table.values
    assert torch.equal(torch.cat([parts[2], parts[0], parts[1]], 1), whole)


def test_column_sharding_refuses_max_bytes_and_tiers_naming_the_table():
    for extra, field in (({"max_bytes": 1 << 20}, "max_bytes"), ({"tiers": dynemb.table.Tiers(fast_capacity=8)},
                                                                    "tiers")):
        config = TableConfig(name="big", dim=4, **extra)
        with pytest.raises(ValueError, match=f"table 'big' is column-sharded.*{field}"):
            ExecutionPlan([config], {"big": 1}, shardings={"big": Sharding("column")}, rank=0, world=2)
