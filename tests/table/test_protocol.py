"""Both table classes offer the EmbeddingTable interface, and keep their own optimizer binding and write marks."""

import torch

import dynemb
from dynemb.checkpoint import write_marks
from dynemb.table import KeyValueTable
from dynemb.table.protocol import EmbeddingTable
from dynemb.table.static import StaticTable


def test_both_tables_offer_the_protocol():
    for table in (KeyValueTable(3), StaticTable(5, 3)):
        assert isinstance(table, EmbeddingTable)
        assert table.sparse_optimizer is None and table.sparse_grad is None


def test_optimizer_binding_and_write_marks_belong_to_each_table(tmp_path):
    a, b = dynemb.DynamicEmbedding(2, seed=0), dynemb.DynamicEmbedding(2, seed=0)
    opt = dynemb.optim.SGD([a], lr=0.1)
    assert a.table.sparse_optimizer is opt and b.table.sparse_optimizer is None
    a(torch.tensor([1]))
    with write_marks.tick([a.table]):
        pass
    write_marks.record([a.table], "checkpoint", str(tmp_path), "step-1")
    assert write_marks.parent([a.table], "checkpoint", str(tmp_path)) == "step-1"
    assert write_marks.parent([b.table], "checkpoint", str(tmp_path)) is None  # no shared registry
    assert b.table.write_marks == {}
