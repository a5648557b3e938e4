"""``row_moves``: a table counts the calls that move a stored key to another row or drop rows, and a fused backward
skips re-checking its rows (``grads.current_rows``) while the count is unchanged since its lookup. Checked here:
which operations count, that an ordinary fused step skips the check, and that each counted operation between
forward and backward leaves the numba path equal to the torch path (which always re-checks)."""

from __future__ import annotations

import pytest
import torch

import dynemb
from dynemb import optim
from dynemb.functional import embedding_lookup_sparse, grads
from dynemb.kernels import use_backend
from dynemb.table import KeyValueTable, Rows

pytest.importorskip("numba")

D = 4


def _full_table(**kw) -> KeyValueTable:
    table = KeyValueTable(D, initializer="zeros", **kw)
    table.find_or_insert(torch.arange(60))
    return table


# (what to do to a table holding keys 0..59, whether it moves or drops rows)
OPS = {
    "erase": (lambda t: t.erase(torch.tensor([3, 50])), True),  # key 59 moves into key 3's row
    "erase_last": (lambda t: t.erase(torch.tensor([59])), True),  # no hole: the size shrinks
    "evict": (lambda t: t.evict(5), True),
    "clear": (lambda t: t.clear(), True),
    "replace": (lambda t: t.replace(Rows(torch.arange(59, -1, -1), torch.zeros(60, D), None, {})), True),
    "insert_reusing_rows": (lambda t: t.find_or_insert(torch.arange(100, 110)), True),  # max_capacity 60: evicts
    "find_or_insert_present": (lambda t: t.find_or_insert(torch.arange(10)), False),
    "insert_appending": (lambda t: t.insert_or_assign(torch.tensor([200]), torch.ones(1, D)), False),
    "find": (lambda t: t.find(torch.arange(5), update_scores=True), False),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_row_moves_counts_the_calls_that_move_or_drop_rows(name):
    op, moves = OPS[name]
    table = _full_table(max_capacity=60 if name == "insert_reusing_rows" else None)
    before = table.row_moves
    op(table)
    assert (table.row_moves != before) == moves


def test_an_ordinary_fused_step_skips_the_row_check(monkeypatch):
    """No row moved between lookup and backward: neither the kernel check nor the torch re-find runs."""
    with use_backend("numba"):
        emb = dynemb.DynamicEmbedding(D, seed=1)
        optim.SGD([emb], lr=0.5, fused=True)
        out = embedding_lookup_sparse(emb, torch.arange(40), torch.arange(0, 40, 4))

        def fail(*args):
            raise AssertionError("rows were re-checked")

        monkeypatch.setattr(emb.table, "find_rows", fail)
        monkeypatch.setattr(grads, "gather_rows", fail)
        monkeypatch.setattr("dynemb.kernels.numba_pool.rows_current", fail)
        before = emb.table.values.clone()
        out.sum().backward()
        assert not torch.equal(emb.table.values, before)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", sorted(OPS))
def test_rows_changed_between_forward_and_backward_train_like_torch(name, fused, monkeypatch):
    """Whatever happens to the table between a lookup and its backward, each gradient reaches its key's row (or
    is dropped with the key) exactly as on the torch path made to re-check every row."""
    op, _ = OPS[name]
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(10, D, generator=g)
    results = []
    for backend in ("numba", "torch"):
        if backend == "torch":  # the reference: no table counts as unmoved, so every backward re-checks its rows
            monkeypatch.setattr(KeyValueTable, "rows_unmoved_since", lambda self, moves: False)
        with use_backend(backend):
            emb = dynemb.DynamicEmbedding(D, seed=1, max_capacity=60 if name == "insert_reusing_rows" else None)
            emb.table.find_or_insert(torch.arange(60))
            opt = optim.SGD([emb], lr=0.5, fused=fused)
            out = embedding_lookup_sparse(emb, torch.arange(20, 60), torch.arange(0, 40, 4))
            op(emb.table)
            (out * grad).sum().backward()
            opt.step()
            keys = torch.arange(120)
            results.append((emb.table.find(keys)[0], emb.table.contains(keys)))
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][0], results[1][0])
