import pytest
import torch

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig, optim


def build(static=False, key_dtype=torch.int32, opt=None, names=("user", "item")):
    opt = opt or optim.Adagrad(lr=0.1)
    vocab = 50 if static else None
    key_dtype = torch.int64 if static else key_dtype
    tables = [TableConfig(name="user", dim=4, vocabulary_size=vocab, key_dtype=key_dtype, optimizer=opt, seed=1),
              TableConfig(name="item", dim=4, vocabulary_size=vocab, key_dtype=key_dtype, optimizer=opt, seed=2,
                          combiner="sum", initializer="normal")]
    features = [FeatureConfig(name="uid", table="user"), FeatureConfig(name="clicked", table="item"),
                FeatureConfig(name="viewed", table="item", combiner="sqrtn")]
    tables = [t for t in tables if t.name in names]
    return EmbeddingCollection(tables, [f for f in features if f.table_name in names])


WEIGHT = {"uid": 1.0, "clicked": 2.0, "viewed": 3.0}


def batch(step, dtype, names=("user", "item")):
    g = torch.Generator().manual_seed(step)
    ids = lambda *shape: torch.randint(0, 50, shape, generator=g).to(dtype)  # noqa: E731
    out = {"uid": ids(8), "clicked": (ids(20), torch.tensor([0, 3, 3, 7, 10, 12, 15, 19])), "viewed": ids(8, 3)}
    return {f: v for f, v in out.items() if (f == "uid") == ("user" in names) or (f != "uid" and "item" in names)}


def train(ec, dtype, steps=5, names=("user", "item")):
    for step in range(steps):
        out = ec(batch(step, dtype, names))
        loss = sum((o * weight).sum() for o, weight in zip(out.values(), (WEIGHT[f] for f in out)))
        loss.backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()
    return {t: ec.export(t) for t in names}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic_int32", "static"])
def test_a_table_trains_the_same_beside_other_tables(static):
    dtype = torch.int64 if static else torch.int32
    together = train(build(static), dtype)
    for name in ("user", "item"):
        alone = train(build(static, names=(name,)), dtype, names=(name,))
        ka, va = together[name]
        kb, vb = alone[name]
        oa, ob = ka.argsort(), kb.argsort()
        assert ka.dtype == dtype and torch.equal(ka[oa], kb[ob])
        assert torch.equal(va[oa], vb[ob])


def test_each_table_has_its_own_module():
    ec = build(key_dtype=torch.int32)
    assert sorted(ec.embeddings) == ["item", "user"]


def test_shapes_and_sequence_outputs():
    tables = [TableConfig(name="t", dim=3, seed=0)]
    features = [FeatureConfig(name="hist", table="t", combiner="none"), FeatureConfig(name="one", table="t")]
    ec = EmbeddingCollection(tables, features)
    out = ec({"hist": torch.tensor([[1, 2, 3], [4, 5, 6]]), "one": torch.tensor([1, 9])})
    assert out["hist"].shape == (2, 3, 3) and out["one"].shape == (2, 3)
    assert torch.equal(out["hist"][0, 0], out["one"][0])
    jag = ec({"hist": (torch.tensor([1, 2, 3]), torch.tensor([0, 1]))})["hist"]
    assert jag.values.shape == (3, 3) and torch.equal(jag.offsets, torch.tensor([0, 1]))


def test_static_matches_dynamic_initial_rows():
    d = EmbeddingCollection([TableConfig(name="t", dim=4, seed=5)], [FeatureConfig(name="f", table="t")])
    s = EmbeddingCollection([TableConfig(name="t", dim=4, seed=5, vocabulary_size=10)],
                            [FeatureConfig(name="f", table="t")])
    ids = torch.tensor([0, 3, 9])
    assert torch.equal(d({"f": ids})["f"], s({"f": ids})["f"])


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="dim"):
        TableConfig(name="t", dim=0)
    with pytest.raises(ValueError, match="combiner"):
        TableConfig(name="t", dim=2, combiner="max")
    with pytest.raises(ValueError, match="unbound"):
        emb = dynemb.DynamicEmbedding(2)
        TableConfig(name="t", dim=2, optimizer=optim.SGD([emb], lr=0.1))
    with pytest.raises(ValueError, match="not in tables"):
        EmbeddingCollection([TableConfig(name="t", dim=2)], [FeatureConfig(name="f", table="u")])
    ec = EmbeddingCollection([TableConfig(name="t", dim=2, vocabulary_size=5)], [FeatureConfig(name="f", table="t")])
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        ec({"f": torch.tensor([5])})
    with pytest.raises(ValueError, match="not configured"):
        ec({"g": torch.tensor([1])})


@pytest.mark.parametrize("opt", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("weighted", [False, True])
def test_static_and_dynamic_tables_train_identically(opt, weighted):
    """A static table pools straight from its ids and sorts them once in backward; a dynamic table dedups first.
    Both must give the same rows, bit for bit."""
    spec = {"sgd": lambda: optim.SGD(lr=0.1, momentum=0.5), "rowwise_adagrad": lambda: optim.RowWiseAdagrad(lr=0.1),
            "adam": lambda: optim.Adam(lr=0.05)}[opt]
    ecs = [EmbeddingCollection([TableConfig(name="t", dim=5, seed=3, vocabulary_size=v, optimizer=spec(),
                                            combiner="sum")],
                               [FeatureConfig(name="f", table="t"), FeatureConfig(name="g", table="t",
                                                                                   combiner="sqrtn")])
           for v in (None, 40)]
    for step in range(6):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 40, (30,), generator=gen)
        offsets = torch.tensor([0, 4, 4, 11, 20, 29])
        weights = torch.rand(30, generator=gen) if weighted else None
        for ec in ecs:
            out = ec({"f": (ids, offsets), "g": ids.view(6, 5)}, {"f": weights} if weighted else None)
            (out["f"].square().sum() + out["g"].sum()).backward()
            ec.optimizer.step()
            ec.optimizer.zero_grad()
    (kd, vd), (_, vs) = ecs[0].export("t"), ecs[1].export("t")
    vs = vs[kd]  # the static table holds every id; compare the ones the dynamic table saw
    assert torch.equal(vd, vs)


def test_eviction_without_a_bound_is_refused():
    """As the CLI's ``--eviction needs --max-capacity``: a policy means something only where rows are evicted."""
    with pytest.raises(ValueError, match=r"^TableConfig\('t'\).eviction='lfu' needs a bound: give max_capacity or "
                                         r"max_bytes \(or tiers\)"):
        TableConfig(name="t", dim=2, eviction="lfu")
    for bound in ({"max_capacity": 10}, {"max_bytes": 1 << 16}, {"tiers": dynemb.table.Tiers(fast_capacity=10)}):
        assert TableConfig(name="t", dim=2, eviction="lfu", **bound).eviction.value == "lfu"
    assert TableConfig(name="t", dim=2).eviction is None  # unbounded, no policy given: fine


def test_gradients_with_no_optimizer_warn_once_per_table_by_name(recwarn):
    tables = [TableConfig(name="user", dim=4, seed=1), TableConfig(name="item", dim=4, seed=2),
              TableConfig(name="country", dim=4, vocabulary_size=8, seed=3, optimizer=optim.SGD(lr=0.1))]
    ec = EmbeddingCollection(tables, [FeatureConfig(name=t.name, table=t.name) for t in tables])
    ec.embeddings["item"].requires_grad_(False)  # a frozen table takes no gradient: nothing to warn about
    for step in range(3):
        out = ec({"user": torch.tensor([1, 2 + step]), "item": torch.tensor([[3, 4], [5, 6]]),
                  "country": torch.tensor([0, 7])})
        sum(o.sum() for o in out.values()).backward()
    messages = [str(w.message) for w in recwarn if issubclass(w.category, UserWarning)]
    assert messages == ["table 'user' got gradients in backward but no optimizer is bound to it: they accumulate "
                        "until an optimizer bound to the table steps and zero_grads. Bind one, e.g. "
                        "dynemb.optim.SGD([emb], lr=0.1) or TableConfig(optimizer=dynemb.optim.SGD(lr=0.1)), or "
                        "freeze the table with requires_grad_(False). (Warned once per table.)"]


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), "60", True, None])
def test_a_timeout_that_is_not_seconds_above_zero_is_named(timeout):
    # checked before any process group is touched: timeout=0 failed every rank with a bare
    # "DistStoreError: wait timeout after 0ms"; "60" or inf failed inside timedelta
    tables, features = [TableConfig(name="t", dim=4)], [FeatureConfig(name="f", table="t")]
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds > 0 .*got " +
                       repr(timeout).replace("(", r"\(")):
        EmbeddingCollection(tables, features, plan="auto", timeout=timeout)
    with pytest.raises(ValueError, match="timeout must be"):
        dynemb.DistributedEmbeddingCollection(tables, features, timeout=timeout)
    EmbeddingCollection(tables, features, timeout=0.5)  # a number > 0: fine (unused without a plan)
