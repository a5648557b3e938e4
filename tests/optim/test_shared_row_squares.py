"""A column shard's record of the other shards' row-statistic parts lives for one update, not for the process."""

import gc
import weakref

import torch

from dynemb.optim.base import SharedRowSquares


def test_a_record_does_not_keep_its_tensors_alive():
    keys, others = torch.arange(3), torch.ones(3)
    alive = weakref.ref(keys)
    record = SharedRowSquares(keys, others, 4)
    assert torch.equal(record.lookup(torch.tensor([2, 7])), torch.tensor([1.0, 0.0]))
    del record, keys, others
    gc.collect()
    assert alive() is None  # a cache around the class kept every step's keys until the process ended
