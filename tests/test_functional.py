"""Pooled and plain lookups against torch's embedding_bag and a NumPy port of TF's embedding_lookup_sparse."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import dynemb
from dynemb.kernels import get_default_backend, use_backend
from dynemb.functional import embedding_lookup, embedding_lookup_sparse

D = 5
KEYS = torch.tensor([0, -1, 2**63 - 1, -(2**63), 11, 12, 13, 2**33], dtype=torch.int64)


def make():
    emb = dynemb.DynamicEmbedding(D, seed=3, initializer="normal")
    weight = emb.find(KEYS)  # same rows the table will create
    return emb, weight


def tf_lookup_sparse_np(weight, bags, bag_weights, combiner, max_norm):
    """NumPy port of tf.nn.embedding_lookup_sparse (+ clip_by_norm of each row when max_norm is set)."""
    out = np.zeros((len(bags), weight.shape[1]), dtype=np.float64)
    for b, (idx, w) in enumerate(zip(bags, bag_weights)):
        if not idx:
            continue
        rows = weight[idx].astype(np.float64)
        if max_norm is not None:
            norms = np.linalg.norm(rows, axis=1, keepdims=True)
            rows = rows * max_norm / np.maximum(norms, max_norm)
        w = np.asarray(w, dtype=np.float64)[:, None]
        total = (rows * w).sum(0)
        if combiner == "sum":
            out[b] = total
        elif combiner == "mean":
            out[b] = total / w.sum()
        else:
            out[b] = total / np.sqrt((w**2).sum())
    return out


bag_strategy = st.lists(st.lists(st.integers(0, len(KEYS) - 1), min_size=0, max_size=6), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(bags=bag_strategy, combiner=st.sampled_from(["sum", "mean", "sqrtn"]),
       max_norm=st.sampled_from([None, 0.1, 10.0]), weighted=st.booleans(), data=st.data())
def test_matches_tf_reference(bags, combiner, max_norm, weighted, data):
    emb, weight = make()
    flat = [i for bag in bags for i in bag]
    w = [data.draw(st.floats(0.1, 2.0)) for _ in flat] if weighted else [1.0] * len(flat)
    offsets = torch.tensor(np.cumsum([0] + [len(b) for b in bags[:-1]]), dtype=torch.int64)
    got = embedding_lookup_sparse(emb, KEYS[torch.tensor(flat, dtype=torch.int64)], offsets,
                                  torch.tensor(w) if weighted else None, combiner=combiner, max_norm=max_norm)
    bag_w, pos = [], 0
    for bag in bags:
        bag_w.append(w[pos: pos + len(bag)])
        pos += len(bag)
    want = tf_lookup_sparse_np(weight.numpy(), bags, bag_w, combiner, max_norm)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_torch_embedding_bag_with_empty_bags(mode, weighted):
    emb, weight = make()
    idx = torch.tensor([1, 2, 2, 5, 7, 0, 0, 3])
    offsets = torch.tensor([0, 3, 3, 6, 8])  # bags 1 and 4 are empty
    w = torch.rand(idx.numel()) + 0.5 if weighted else None
    got = embedding_lookup_sparse(emb, KEYS[idx], offsets, w, combiner=mode)
    if mode == "sum" or not weighted:
        want = F.embedding_bag(idx, weight, offsets, mode=mode, per_sample_weights=w)
    else:  # torch has no weighted mean: weighted sum / sum of weights
        s = F.embedding_bag(idx, weight, offsets, mode="sum", per_sample_weights=w)
        cnt = F.embedding_bag(idx, torch.ones(len(KEYS), 1), offsets, mode="sum", per_sample_weights=w)
        want = s / cnt.clamp(min=1e-30)
    torch.testing.assert_close(got.detach(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(got[1], torch.zeros(D)) and torch.equal(got[4], torch.zeros(D))


def test_input_forms_agree():
    emb, _ = make()
    dense = KEYS[torch.tensor([[1, 2, 0], [3, 4, 4]])]
    pad = torch.tensor([[1, 2, -7], [3, -7, -7]])
    by_offsets = embedding_lookup_sparse(emb, KEYS[torch.tensor([1, 2, 0, 3, 4, 4])], torch.tensor([0, 3]))
    assert torch.allclose(embedding_lookup_sparse(emb, dense), by_offsets)
    rows, cols = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")
    coo = torch.sparse_coo_tensor(torch.stack([rows.reshape(-1), cols.reshape(-1)]), dense.reshape(-1), (2, 3),
                                  check_invariants=True)
    assert torch.allclose(embedding_lookup_sparse(emb, coo), by_offsets)
    padded = embedding_lookup_sparse(emb, torch.where(pad == -7, pad, KEYS[pad.clamp(min=0)]), padding_value=-7)
    manual = embedding_lookup_sparse(emb, KEYS[torch.tensor([1, 2, 3])], torch.tensor([0, 2]))
    assert torch.allclose(padded, manual)


def test_gradient_is_sparse_and_deduplicated():
    emb, _ = make()
    out = embedding_lookup(emb, KEYS[torch.tensor([1, 1, 1, 2])])
    out.sum().backward()
    keys, grad = emb.table.sparse_grad.coalesce()
    assert grad.shape == (2, D)
    assert torch.equal(grad[keys == KEYS[1]], torch.full((1, D), 3.0))


def test_eval_inserts_nothing_and_no_grad_path():
    emb, weight = make()
    emb.eval()
    out = embedding_lookup(emb, KEYS)
    assert len(emb) == 0 and torch.equal(out, weight)
    emb.train()
    with torch.no_grad():  # a validation loop without eval(): read-only all the same
        assert torch.equal(embedding_lookup(emb, KEYS[:2]), weight[:2])
    assert len(emb) == 0
    embedding_lookup(emb, KEYS[:2])
    assert len(emb) == 2


def test_bad_inputs_name_the_argument():
    emb, _ = make()
    with pytest.raises(ValueError, match="combiner"):
        embedding_lookup_sparse(emb, KEYS[:2], torch.tensor([0]), combiner="max")
    with pytest.raises(ValueError, match="max_norm"):
        embedding_lookup(emb, KEYS[:2], max_norm=-1.0)
    with pytest.raises(TypeError, match="ids must have dtype torch.int64 .*or a narrower integer"):
        embedding_lookup(emb, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="offsets"):
        embedding_lookup_sparse(emb, KEYS[:2])
    assert len(emb) == 0


@pytest.mark.parametrize("static", [False, True])
def test_a_refilled_id_buffer_trains_the_ids_of_the_forward(static):
    """A data loader that refills its id buffer before the backward: the update goes to the forward's ids, on a
    static table as on a dynamic one (found by review: the static lookup kept the caller's tensor for its backward,
    and autograd refused the refilled one)."""
    tables = []
    for refill in (False, True):
        config = dynemb.TableConfig(name="t", dim=3, vocabulary_size=10 if static else None, seed=5,
                                    optimizer=dynemb.optim.SGD(lr=1.0, fused=True))
        ec = dynemb.EmbeddingCollection([config], [dynemb.FeatureConfig(name="f", table="t")])
        buffer = torch.tensor([1, 2, 2, 7])
        out = ec({"f": (buffer, torch.tensor([0, 2]))})
        if refill:
            buffer.copy_(torch.tensor([3, 4, 5, 6]))
        out["f"].sum().backward()
        ec.eval()
        tables.append(ec({"f": (torch.arange(10), torch.arange(10))})["f"])  # every id's row
    assert torch.equal(*tables)


def test_a_static_tables_rows_are_not_the_callers_ids():
    table = dynemb.StaticEmbedding(10, 2).table
    ids = torch.tensor([3, 4])
    rows = table.find_rows(ids)
    rows += 1
    assert ids.tolist() == [3, 4]


def _four_tables(fused: bool = True):
    """A dynamic, a row-grouped dynamic (uniform ids), a static table and one with a sequence feature."""
    opt = dict(lr=0.5, fused=fused)
    tables = [dynemb.TableConfig(name="a", dim=3, seed=1, optimizer=dynemb.optim.Adagrad(**opt)),
              dynemb.TableConfig(name="b", dim=3, seed=2, optimizer=dynemb.optim.SGD(**opt), combiner="mean"),
              dynemb.TableConfig(name="s", dim=3, vocabulary_size=50, seed=3, optimizer=dynemb.optim.SGD(**opt)),
              dynemb.TableConfig(name="q", dim=3, seed=4, optimizer=dynemb.optim.SGD(**opt))]
    features = [dynemb.FeatureConfig(name=n, table=n) for n in "abs"] + [
        dynemb.FeatureConfig(name="q_bag", table="q"), dynemb.FeatureConfig(name="q_seq", table="q", combiner="none")]
    return dynemb.EmbeddingCollection(tables, features)


def _state(ec):
    return {name: ec.export(name) for name in "abqs"}


def test_a_collection_trains_as_its_tables_one_at_a_time():
    """A collection pools its tables in one autograd node: the outputs and every table's rows and optimizer state
    after two fused steps equal those of each table's features looked up on their own, one table at a time."""
    gen = torch.Generator().manual_seed(0)
    batches = [{"a": torch.randint(-3, 3, (6, 2), generator=gen), "b": torch.randint(0, 40, (6, 3), generator=gen),
                "s": torch.randint(0, 50, (6, 2), generator=gen), "q_bag": torch.randint(0, 9, (6,), generator=gen),
                "q_seq": torch.randint(0, 9, (6, 2), generator=gen)} for _ in range(2)]
    together, apart = _four_tables(), _four_tables()
    for batch in batches:
        out = together(batch)
        sum((o * (i + 1)).sum() for i, o in enumerate(out.values())).backward()
        alone = {}
        for names in (["a"], ["b"], ["s"], ["q_bag", "q_seq"]):
            alone.update(apart({n: batch[n] for n in names}))
        alone = {n: alone[n] for n in out}
        sum((o * (i + 1)).sum() for i, o in enumerate(alone.values())).backward()
        assert all(torch.equal(out[n], alone[n]) for n in out)
    for name, (want, got) in zip("abqs", zip(_state(apart).values(), _state(together).values())):
        assert all(torch.equal(w, g) for w, g in zip(want, got)), name
    assert together.state_dict().keys() == apart.state_dict().keys()
    for key, value in apart.state_dict().items():
        assert torch.equal(together.state_dict()[key], value) if torch.is_tensor(value) else True, key


@pytest.mark.parametrize("backend", ["torch", None])
def test_an_unused_tables_output_leaves_it_untouched(backend):
    with use_backend(backend or get_default_backend()):
        ec = _four_tables()
        batch = {"a": torch.tensor([[1, 2]]), "b": torch.tensor([[3, 4, 5]]), "s": torch.tensor([[6, 7]])}
        ec(batch)  # inserts the keys
        before = {k: v.clone() if torch.is_tensor(v) else v for k, v in ec.state_dict().items()}
        out = ec(batch)
        out["a"].sum().backward()

        def changed():
            after = ec.state_dict()
            trained = [k for k in before if k.split(".")[2] in ("values", "slot", "optimizer")]  # not the stamps
            return {k.split(".")[1] for k in trained
                    if not (torch.equal(before[k], after[k]) if torch.is_tensor(before[k]) else before[k] == after[k])}

        assert changed() == {"a"}
        if not ec.plan.groups[0].lookup._group():  # the per-table path pools every table in one node
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                out["b"].sum().backward()  # the call's one node was freed, as any node shared by two losses
        else:  # grouped: "b" (SGD) is in another group than "a" (Adagrad), whose node a second loss still runs
            out["b"].sum().backward()
            assert changed() == {"a", "b"}


def test_two_losses_over_one_calls_outputs_with_retain_graph_train_as_their_sum():
    batch = {"a": torch.tensor([[1, 2], [2, 9]]), "b": torch.tensor([[3, 4, 5], [5, 5, 6]]),
             "s": torch.tensor([[6, 7], [7, 7]])}
    states = []
    for separate in (False, True):
        ec = _four_tables(fused=False)
        out = ec(batch)
        losses = [(out["a"] * 2).sum() + out["b"].sum(), (out["a"] ** 2).sum() + out["s"].sum()]
        if separate:
            losses[0].backward(retain_graph=True)
            losses[1].backward()
        else:
            sum(losses).backward()
        ec.optimizer.step()
        states.append(ec.state_dict())
    for key, value in states[0].items():
        if torch.is_tensor(value):
            torch.testing.assert_close(states[1][key], value, rtol=0, atol=1e-6, msg=key)


def test_pooled_lookups_of_one_table_twice_are_those_of_one_lookup_after_the_other():
    from dynemb.functional.lookup import pooled_lookup, pooled_lookups
    from dynemb.functional.pooling import BagSet

    def bags(n):
        return [BagSet(n, torch.arange(n), None, n, "sum")]

    results = []
    for grouped in (True, False):
        emb = dynemb.DynamicEmbedding(2, seed=0, max_capacity=3)
        dynemb.optim.SGD([emb], lr=1.0, fused=True)
        first, second = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 1])
        if grouped:
            outs = [o[0] for o in pooled_lookups([(emb, first, bags(3)), (emb, second, bags(3))])]
        else:
            outs = [pooled_lookup(emb, first, bags(3))[0], pooled_lookup(emb, second, bags(3))[0]]
        (outs[0].sum() + 2 * outs[1].sum()).backward()
        results.append((outs, emb.table.export()))
    (want, want_rows), (got, got_rows) = results
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert torch.equal(want_rows.keys, got_rows.keys) and torch.equal(want_rows.values, got_rows.values)


@pytest.mark.parametrize("combiner", ["sum", "mean"])
def test_read_only_pooled_lookups_without_dedup_give_the_dedup_paths_bits(combiner):
    # a read-only lookup of a plain CPU table finds each id's row directly while every id has one; an unseen id
    # sends it (and the table's next read-only lookups, until one finds every id) through the dedup path, which
    # reads initializer rows: the same bits either way, nothing inserted
    from dynemb.functional import lookup
    from dynemb.functional.pooling import BagSet

    emb, _ = make()
    emb.train()
    embedding_lookup(emb, KEYS)  # every key stored
    emb.eval()
    table = emb.table
    ids = KEYS[torch.tensor([4, 4, 0, 7, 1, 4, 3, 2])]
    offsets = torch.tensor([0, 3, 3, 5])
    with_unseen = torch.cat([ids, torch.tensor([12345, 12345])])

    def pooled(flat, offsets):
        bags = [BagSet(offsets.numel(), offsets, None, flat.numel(), combiner)]
        return lookup.pooled_lookup(emb, flat, bags, training=False)[0]

    def by_dedup(flat, offsets):
        lookup._missed[table] = True  # the dedup path, as after a lookup with an unseen id
        try:
            return pooled(flat, offsets)
        finally:
            lookup._missed.pop(table)

    for flat, offs in ((ids[:0], torch.tensor([0])), (ids[:1], torch.tensor([0])), (ids, offsets),
                       (with_unseen, torch.tensor([0, 3, 3, 8]))):  # no id, one id, repeats, an unseen id
        lookup._missed.pop(table, None)
        direct = pooled(flat, offs)
        assert torch.equal(direct.view(torch.int32), by_dedup(flat, offs).view(torch.int32))
    pooled(with_unseen, torch.tensor([0, 3, 3, 8]))
    assert lookup._missed[table] is True  # an unseen id: the next read-only lookups dedup ...
    pooled(ids, offsets)
    assert lookup._missed[table] is False and len(emb) == KEYS.numel()  # ... until one finds every id
