"""A training lookup of a table with optimizer state groups its ids by row, not by key (``find._find_by_row``):
an execution detail, so every result must be the same bits as grouping by key, for every policy, bound, admission
filter, optimizer and kernel path."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynemb
from dynemb.functional import embedding_lookup_sparse
from dynemb.functional import find as lookup
from dynemb.kernels import use_backend


_EXTREMES = [-(2**63), -1, 0, 2**63 - 1]
_OPTIMIZERS = {
    "rowwise_adagrad": lambda m: dynemb.optim.RowWiseAdagrad([m], lr=0.1, fused=True),
    "adam": lambda m: dynemb.optim.Adam([m], lr=0.05, fused=True),
    "sgd_momentum_step": lambda m: dynemb.optim.SGD([m], lr=0.1, momentum=0.9, fused=False),
    "sgd": lambda m: dynemb.optim.SGD([m], lr=0.1, fused=True),
}
_TABLES = {
    "unbounded lru": {},
    "bounded lru, evicting": {"max_capacity": 24},
    "bounded decayed_lfu, evicting": {"max_capacity": 24, "eviction": "decayed_lfu"},
    "decayed_lfu, half_life 3": {"eviction": "decayed_lfu", "half_life": 3, "max_capacity": 1 << 16},  # no eviction
    "lfu": {"eviction": "lfu", "max_capacity": 64},
    "epoch_lfu": {"eviction": "epoch_lfu", "max_capacity": 64},
    "epoch_lru": {"eviction": "epoch_lru", "max_capacity": 24},
    "admission 2": {"admission": 2},
}


def _train(batches, optimizer: str, table: dict, backend: str) -> dict:
    torch.manual_seed(0)
    emb = dynemb.DynamicEmbedding(4, seed=5, **table)
    opt = _OPTIMIZERS[optimizer](emb)
    outputs = []
    with use_backend(backend):
        for ids, offsets in batches:
            out = embedding_lookup_sparse(emb, ids, offsets, combiner="mean")
            (out * torch.arange(1, 5.0)).sum().backward()
            opt.step()
            opt.zero_grad()
            outputs.append(out.detach())  # the loss is linear in them: the pooled values show only here
    t = emb.table
    rows = t.export()
    versions = t._cols["version"][: t.size()].clone()  # export's rows are the table's rows, in row order
    state = {"keys": rows.keys, "values": rows.values, "scores": rows.scores, "versions": versions, "clock": t.clock,
             "size": t.size(), "evicted": t.evicted, "inserted": t.inserted, "policy": t.policy.value,
             "outputs": torch.cat(outputs)}
    state.update({f"slot {name}": value for name, value in rows.slots.items()})
    order = rows.keys.argsort()  # export order follows rows, which may differ only by placement
    return {k: v.index_select(0, order) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == order.numel()
            else v for k, v in state.items()}


_batch = st.lists(st.one_of(st.integers(0, 40), st.sampled_from(_EXTREMES)), min_size=1, max_size=60)


@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("table", sorted(_TABLES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(_batch, min_size=1, max_size=4), data=st.data())
@pytest.mark.slow
def test_grouping_by_row_gives_the_bits_of_grouping_by_key(probe_path, optimizer, table, batches, data):
    prepared = []
    for ids in batches:
        cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=5)) if len(ids) > 1 else [])
        prepared.append((torch.tensor(ids), torch.tensor([0, *cuts])))
    calls = []
    by_row = lookup._find_by_row
    with pytest.MonkeyPatch.context() as patch:  # every training lookup by row that can be, from the first
        patch.setattr(lookup, "_groups_by_row", lookup._can_group_by_row)
        patch.setattr(lookup, "_find_by_row", lambda *a: calls.append(1) or by_row(*a))
        grouped_by_row = _train(prepared, optimizer, _TABLES[table], probe_path)
    assert calls  # every policy groups by row, decayed_lfu included (its scores' bits do not depend on the order)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lookup, "_groups_by_row", lambda t: False)
        grouped_by_key = _train(prepared, optimizer, _TABLES[table], probe_path)
    assert grouped_by_row.keys() == grouped_by_key.keys()
    for name, value in grouped_by_key.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(grouped_by_row[name], value), name
        else:
            assert grouped_by_row[name] == value, name


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
@settings(max_examples=8, deadline=None)
@given(batches=st.lists(_batch, min_size=1, max_size=3))
def test_grouping_by_row_through_the_numba_pool_kernel(optimizer, batches):
    """Where torch has no fbgemm, the numba pool kernel pools straight from each id's row (``inverse=None``)."""
    from dynemb.kernels import numba_pool

    prepared = [(torch.tensor(ids), torch.tensor([0, len(ids) // 2] if len(ids) > 1 else [0])) for ids in batches]
    results = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(numba_pool, "USE_TORCH_BAG", False)
        for by_row in (True, False):
            patch.setattr(lookup, "_groups_by_row", lookup._can_group_by_row if by_row else lambda t: False)
            results.append(_train(prepared, optimizer, {}, "numba"))
    for name, value in results[1].items():
        assert torch.equal(results[0][name], value) if isinstance(value, torch.Tensor) else results[0][name] == value


def test_grouping_by_row_follows_the_share_of_distinct_ids():
    plain, stateful = dynemb.DynamicEmbedding(4), dynemb.DynamicEmbedding(4)
    dynemb.optim.SGD([plain], lr=0.1, fused=True)
    dynemb.optim.RowWiseAdagrad([stateful], lr=0.1, fused=True)
    distinct, most, repeated = torch.arange(100), torch.arange(100) % 60, torch.arange(100) % 10
    offsets = torch.arange(0, 100, 10)
    chosen = {}
    for name, emb in (("plain", plain), ("stateful", stateful)):
        chosen[name] = []
        for ids in (distinct, distinct, most, repeated, repeated):
            chosen[name].append(lookup._groups_by_row(emb.table))
            embedding_lookup_sparse(emb, ids, offsets, combiner="sum").sum().backward()
    # not before a first lookup; then by the share of distinct ids in the last one: 1.0, 1.0, 0.6, 0.1
    assert chosen == {"plain": [False, True, True, False, False], "stateful": [False, True, True, True, False]}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "step"])
def test_rows_moved_between_lookup_and_backward_find_their_keys(fused):
    """Grouped by row, a lookup leaves its keys to the backward, which needs them only when rows moved since (here:
    a second lookup evicts and reuses rows of the first before either backward runs)."""
    def train(by_row: bool) -> dict:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lookup, "_groups_by_row", lambda t: by_row)
            torch.manual_seed(0)
            emb = dynemb.DynamicEmbedding(4, seed=1, max_capacity=12, eviction="lru")
            opt = dynemb.optim.RowWiseAdagrad([emb], lr=0.1, fused=fused)
            first = torch.tensor([5, -1, 2**63 - 1, 5, 7, 8, 9, 10])
            second = torch.arange(100, 110)  # ten new keys: the table keeps 12, so most of the first's rows go
            ids_buffer = first.clone()
            a = embedding_lookup_sparse(emb, ids_buffer, torch.tensor([0, 3]), combiner="sum")
            ids_buffer.fill_(0)  # a data loader reusing its buffer before backward
            b = embedding_lookup_sparse(emb, second, torch.tensor([0, 5]), combiner="sum")
            (a.sum() + 2 * b.sum()).backward()
            opt.step()
            rows = emb.table.export()
            return {"keys": rows.keys, "values": rows.values, "slots": rows.slots}
    by_row, by_key = train(True), train(False)
    assert torch.equal(by_row["keys"], by_key["keys"])
    assert torch.equal(by_row["values"], by_key["values"])
    assert all(torch.equal(by_row["slots"][k], v) for k, v in by_key["slots"].items())


def test_decayed_lfu_scores_are_the_same_grouped_by_row():
    """Found by review: over every occurrence, decayed_lfu's float arithmetic (torch's exp2/log2, which round by an
    element's place in a vector) gave a score one fixed-point unit off the score computed over distinct keys with
    counts, and such tables grouped by key. Its arithmetic is now the same bits at every place: they group by row."""
    def run(rule) -> tuple:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(lookup, "_groups_by_row", rule)
            emb = dynemb.DynamicEmbedding(2, eviction="decayed_lfu", half_life=3, seed=0, max_capacity=1000)
            opt = dynemb.optim.RowWiseAdagrad([emb], lr=0.1, fused=True)
            for ids in _DECAYED_BATCHES:
                embedding_lookup_sparse(emb, torch.tensor(ids), torch.tensor([0]), combiner="sum").sum().backward()
            opt.step()
            rows = emb.table.export()
            order = rows.keys.argsort()
            return rows.keys[order], rows.scores[order]
    keys, scores = run(lambda t: False)
    assert lookup._can_group_by_row(dynemb.DynamicEmbedding(2, eviction="decayed_lfu", max_capacity=1000).table)
    assert torch.equal(run(lookup._groups_by_row)[1], scores)
    assert torch.equal(run(lambda t: True)[1], scores)


_DECAYED_BATCHES = [
    [13, 1, 2, 4, 11, 17, 7, 12],
    [13, 13, 8, 18, 12, 4, 4, 5, 1, 18, 14, 13, 19, 17, 4, 15, 3, 17, 17, 16, 11, 2, 18, 0, 13, 17, 17, 16, 17, 16, 9,
     8, 0, 6, 18],
    [0, 3, 7, 1, 12, 8, 11, 4, 0, 11, 13, 19, 15, 1, 16, 17, 15],
]


def test_only_plain_cpu_tables_group_by_row(tmp_path):
    """A tiered table counts hits per id and moves rows down to make room, so it is given each distinct key once;
    Triton's one-launch insert sizes its headroom by the keys passed."""
    from dynemb.table import KeyValueTable, Tiers

    assert lookup._can_group_by_row(dynemb.DynamicEmbedding(4).table)
    tiered = dynemb.DynamicEmbedding(4, tiers=Tiers(fast_capacity=8, slow=str(tmp_path)))
    assert not lookup._can_group_by_row(tiered.table)
    triton = KeyValueTable(4, backend="triton") if dynemb.kernels.triton_available() else None
    if triton is not None:  # CPU tensors run Triton's kernels under its interpreter in the tests
        assert not lookup._can_group_by_row(triton)
    dynemb.optim.RowWiseAdagrad([tiered], lr=0.1, fused=True)
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lookup, "_find_by_row", lambda *a: calls.append(1))
        for _ in range(3):
            embedding_lookup_sparse(tiered, torch.arange(40), torch.arange(0, 40, 4), combiner="sum").sum().backward()
    assert not calls
