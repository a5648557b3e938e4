"""The execution plan's shards of row-sharded static tables: each rank holds exactly the ids it owns, and a rank
that owns none (a vocabulary smaller than the world) holds none of the table, as a table-sharded table's other
ranks do. It used to hold one row standing for an id past the vocabulary, which checkpoints saved and exports
served, and which a load into fewer ranks then refused."""

import pytest
import torch

from dynemb import TableConfig
from dynemb.collection.plan import ExecutionPlan
from dynemb.distributed.sharding import Sharding


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("vocabulary", [1, 2, 3, 5])
def test_row_sharded_static_shards_hold_exactly_their_ids(vocabulary, world):
    config = TableConfig(name="s", dim=2, vocabulary_size=vocabulary, seed=3)
    whole = ExecutionPlan([config], {"s": 3})["s"].table
    held = []
    for rank in range(world):
        shard = ExecutionPlan([config], {"s": 3}, shardings={"s": Sharding("row")}, rank=rank, world=world)["s"]
        owned = list(range(rank, vocabulary, world))
        if not owned:
            assert shard.module is None and shard.table is None
            continue
        ids = shard.user_keys(shard.table.export().keys)
        assert ids.tolist() == owned and bool(shard.owned(ids).all())
        assert torch.equal(shard.table.values, whole.values[ids])  # each row starts as the whole table's
        held += owned
    assert sorted(held) == list(range(vocabulary))
