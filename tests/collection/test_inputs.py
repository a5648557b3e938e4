"""Every input form of a feature against nn.EmbeddingBag, malformed inputs named and harmless, and the modes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import dynemb
from dynemb import Bags, EmbeddingCollection, FeatureConfig, TableConfig

V, D = 30, 4


def static_collection(combiner="sum") -> EmbeddingCollection:
    return EmbeddingCollection([TableConfig(name="t", dim=D, vocabulary_size=V, seed=1, combiner=combiner)],
                               [FeatureConfig(name="f", table="t"), FeatureConfig(name="g", table="t")])


def reference(ec, ids, offsets, weights=None, mode="sum"):
    bag = torch.nn.EmbeddingBag(V, D, mode=mode)
    bag.weight.data.copy_(ec.embeddings["t"].table.values)
    return bag(ids, offsets, per_sample_weights=weights)


@st.composite
def jagged(draw):
    lengths = draw(st.lists(st.integers(0, 5), min_size=1, max_size=8))
    ids = draw(st.lists(st.integers(0, V - 1), min_size=sum(lengths), max_size=sum(lengths)))
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)


@settings(max_examples=60, deadline=None)
@given(jagged(), st.booleans())
def test_every_jagged_form_equals_embedding_bag(bags, weighted):
    ids, lengths = bags
    offsets = lengths.cumsum(0) - lengths
    weights = torch.rand(ids.numel()) if weighted else None
    ec = static_collection().eval()
    want = reference(ec, ids, offsets, weights)
    forms = [(ids, offsets) if weights is None else (ids, offsets, weights),
             Bags(ids, offsets=offsets, weights=weights),
             Bags(ids, lengths=lengths, weights=weights),
             Bags(ids, offsets=torch.cat([offsets, torch.tensor([ids.numel()])]), weights=weights,
                  include_last_offset=True),
             {"ids": ids, "lengths": lengths, "weights": weights}]
    for form in forms:
        torch.testing.assert_close(ec({"f": form})["f"], want, rtol=0, atol=1e-6)


def test_dense_sparse_and_one_per_sample_forms():
    ec = static_collection(combiner="mean").eval()
    dense = torch.tensor([[1, 2, -1], [3, -1, -1]])
    padded = EmbeddingCollection([TableConfig(name="t", dim=D, vocabulary_size=V, seed=1)],
                                 [FeatureConfig(name="f", table="t", padding_value=-1)]).eval()
    want = reference(ec, torch.tensor([1, 2, 3]), torch.tensor([0, 2]), mode="mean")
    torch.testing.assert_close(padded({"f": dense})["f"], want)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1], [0, 1, 0]]), torch.tensor([1, 2, 3]), (2, 3))
    torch.testing.assert_close(ec({"f": sparse})["f"], want)
    torch.testing.assert_close(ec({"f": torch.tensor([5, 6])})["f"], ec.embeddings["t"].table.values[[5, 6]])


@pytest.mark.parametrize("combiner", ["mean", "sqrtn"])
@pytest.mark.parametrize("weighted", [False, True])
def test_one_id_per_sample_pools_and_trains_as_bags_of_one(combiner, weighted):
    """Ids ``[B]`` and dense ``[B, 1]`` (padded or not) pool each sample's one id: the same bits, forward and after
    a fused update, as the same bags given with lengths, whose divisors are computed."""
    def trained(form, padded=False):
        ec = EmbeddingCollection([TableConfig(name="t", dim=D, seed=3, combiner=combiner,
                                              optimizer=dynemb.optim.Adagrad(lr=0.5, fused=True))],
                                 [FeatureConfig(name="f", table="t", padding_value=-7 if padded else None)])
        w = {"f": weights["f"].view(form.shape)} if weights and isinstance(form, torch.Tensor) else weights
        out = ec({"f": form}, weights=w)["f"]
        (out * torch.arange(1.0, 1.0 + out.numel()).view_as(out)).sum().backward()
        rows = ec.embeddings["t"].table.export()
        return out.detach(), (rows.keys, torch.cat([rows.values, *rows.slots.values()], 1))

    ids = torch.tensor([5, -1, 5, 2**63 - 1, 0])
    weights = {"f": torch.tensor([0.5, 2.0, 1.5, 3.0, 0.25])} if weighted else {}
    want_out, (want_keys, want_values) = trained(Bags(ids, lengths=torch.ones(5, dtype=torch.int64)))
    for form, padded in [(ids, False), (ids.view(-1, 1), False), (ids.view(-1, 1), True)]:
        out, (keys, values) = trained(form, padded)
        assert torch.equal(out, want_out)
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
    if not weighted:  # a padded sample is an empty bag: zeros, as a bag of no ids
        padded_ids = torch.tensor([[5], [-7], [2]])
        want_out, _ = trained(Bags(torch.tensor([5, 2]), lengths=torch.tensor([1, 0, 1])))
        out, _ = trained(padded_ids, padded=True)
        assert torch.equal(out, want_out) and not out[1].any()



@pytest.mark.parametrize("form", ["ids", "lengths"])
@pytest.mark.parametrize("backend", ["torch", "numba"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adam"])
def test_bags_of_one_id_train_as_the_same_bags_written_out(form, backend, fused, optimizer):
    """Features of one id per sample (ids ``[B]``, or lengths all 1 as a KeyedJaggedTensor gives them) share one
    offsets tensor, which tells the lookup that id ``j`` is bag ``j``: its backward then builds no bag of each id.
    The same bits, forward and after two steps, as the same bags given with explicit offsets, on each CPU backend,
    fused or stepped, with one feature on a table and with two, and on a table that also serves a sequence feature
    (pooled by ``BagSum``)."""
    make = {"sgd": lambda: dynemb.optim.SGD(lr=0.3, fused=fused),
            "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.3, fused=fused),
            "adam": lambda: dynemb.optim.Adam(lr=0.3, fused=fused)}[optimizer]

    def trained(explicit: bool):
        ec = EmbeddingCollection([TableConfig(name="a", dim=D, seed=3, optimizer=make()),
                                  TableConfig(name="b", dim=D, seed=4, optimizer=make())],
                                 [FeatureConfig(name="f", table="a"), FeatureConfig(name="g", table="a"),
                                  FeatureConfig(name="h", table="b"),
                                  FeatureConfig(name="s", table="b", combiner="none")])
        outs = []
        for step in range(2):
            ids = {name: torch.tensor([5, -1, 5, 2**63 - 1, step, 5]) * k for k, name in enumerate("fgh", 1)}
            batch = {n: (v, torch.arange(v.numel())) if explicit else v if form == "ids"
                     else Bags(v, lengths=torch.ones_like(v)) for n, v in ids.items()}
            batch["s"] = torch.tensor([[3, 5], [7, 3]])
            out = ec(batch)
            loss = sum((o * torch.arange(1.0, 1.0 + o.numel()).view_as(o)).sum() for o in out.values())
            loss.backward()
            ec.optimizer.step()
            ec.optimizer.zero_grad()
            outs.append(torch.cat([out[n].detach() for n in "fgh"]))
        tables = [ec.embeddings[t].table.export() for t in "ab"]
        return outs, [(r.keys, torch.cat([r.values, *r.slots.values()], 1)) for r in tables]

    with dynemb.kernels.use_backend(backend):
        want_outs, want_tables = trained(explicit=True)
        outs, tables = trained(explicit=False)
    assert all(torch.equal(a, b) for a, b in zip(outs, want_outs))
    for (keys, values), (want_keys, want_values) in zip(tables, want_tables):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_shared_offsets_of_one_id_bags_are_internal_and_never_trusted_once_written():
    """Only dynemb's own feature preparation gets the shared offsets of bags of one id (``to_bags`` hands a user a
    tensor of their own); one written in place all the same (its version counter moved) is no longer taken for them,
    and the next lookup gets a fresh one. Inference mode, whose tensors keep no version counter, changes nothing."""
    from dynemb.functional.pooling import is_one_id_bags, one_id_bags, to_bags

    ids = torch.tensor([[4], [5], [6]])
    assert not is_one_id_bags(to_bags(ids)[1], 3)
    flat, ones = ids.view(-1), torch.ones(3, dtype=torch.int64)
    assert is_one_id_bags(to_bags(flat, lengths=ones, shared_offsets=True)[1], 3)
    assert not is_one_id_bags(to_bags(flat, lengths=torch.tensor([2, 0, 1]), shared_offsets=True)[1], 3)
    _, offsets, _, _ = to_bags(ids, shared_offsets=True)
    assert offsets is one_id_bags(3, torch.device("cpu")) and is_one_id_bags(offsets, 3)
    assert not is_one_id_bags(offsets, 4) and not is_one_id_bags(torch.arange(3), 3)
    offsets[1] = 0
    assert not is_one_id_bags(offsets, 3)
    fresh = one_id_bags(3, torch.device("cpu"))
    assert fresh is not offsets and fresh.tolist() == [0, 1, 2] and is_one_id_bags(fresh, 3)

    ec = dynamic_pair()
    with torch.inference_mode():
        first = ec.eval()({"fa": torch.tensor([1, 2, 3, 4, 5, 6, 7])})["fa"]  # a batch size not seen before here
        assert torch.equal(ec({"fa": torch.tensor([1, 2, 3, 4, 5, 6, 7])})["fa"], first)
    ec.train()({"fa": torch.tensor([1, 2, 3, 4, 5, 6, 7])})["fa"].sum().backward()

def dynamic_pair():
    tables = [TableConfig(name="a", dim=D, seed=1, optimizer=dynemb.optim.SGD(lr=0.1)),
              TableConfig(name="b", dim=D, seed=2, optimizer=dynemb.optim.SGD(lr=0.1))]
    features = [FeatureConfig(name="fa", table="a"), FeatureConfig(name="fb", table="b"),
                FeatureConfig(name="seq", table="b", combiner="none", padding_value=-1)]
    return EmbeddingCollection(tables, features)


IDS = torch.tensor([10, 11, 12, 13])
MALFORMED = [
    ((IDS, torch.tensor([2, 2, 0])), ValueError, r"offsets must start at 0 and never decrease"),  # lengths as offsets
    ((IDS, torch.tensor([0, 3, 1])), ValueError, r"never decrease"),
    ((IDS, torch.tensor([0, 2, 9])), ValueError, r"offsets must be <= the number of ids \(4\)"),
    (Bags(IDS, offsets=torch.tensor([0, 2, 3]), include_last_offset=True), ValueError, r"must end with the number"),
    (Bags(IDS, lengths=torch.tensor([2, 1, 0])), ValueError, r"lengths must be >= 0 and sum to the number of ids"),
    (Bags(IDS, lengths=torch.tensor([5, -1, 0])), ValueError, r"lengths must be >= 0"),
    (Bags(IDS, lengths=torch.tensor([2.0, 2.0, 0.0])), TypeError, r"lengths must be a 1-D int32/int64 tensor"),
    ((IDS, torch.tensor([0, 2, 4]), torch.ones(3)), ValueError, r"weights must have the shape \(4,\)"),
    ((IDS, torch.tensor([0, 2, 4]), torch.ones(4, dtype=torch.int64)), TypeError, r"floating-point"),
    ([1, 2], TypeError, r"must be one of .*got a list of 2 int"),
    ((IDS, torch.tensor([0, 1]), torch.ones(4), 3), TypeError, r"got a tuple of 4"),
    ({"ids": IDS, "offset": torch.tensor([0])}, ValueError, r"dict input needs 'ids'"),
    (IDS.to(torch.float64), TypeError, r"ids must have dtype torch.int64 .*or a narrower integer"),
]


@pytest.mark.parametrize("bad,error,match", MALFORMED)
def test_malformed_inputs_are_named_and_change_nothing(bad, error, match):
    ec = dynamic_pair()
    ec({"fa": torch.tensor([1, 2, 3]), "fb": torch.tensor([4, 5, 6])})
    before = {n: m.table.export() for n, m in ec.embeddings.items()}
    # the good feature comes first: its table must not change either
    with pytest.raises(error, match=rf"feature 'fb' \(table 'b'\): .*{match}"):
        ec({"fa": torch.tensor([7, 8, 9]), "fb": bad})
    for name, module in ec.embeddings.items():
        after = module.table.export()
        assert torch.equal(after.keys, before[name].keys) and torch.equal(after.values, before[name].values)


def test_bag_counts_must_agree_across_pooled_features():
    ec = dynamic_pair()
    kjt_offsets = torch.tensor([0, 1, 2, 4])  # B + 1 entries, TorchRec style, passed as EmbeddingBag offsets
    with pytest.raises(ValueError, match=r"bag counts differ: \{'fa': 3, 'fb': 4\}.*include_last_offset=True"):
        ec({"fa": torch.tensor([1, 2, 3]), "fb": (IDS, kjt_offsets)})
    assert len(ec.embeddings["a"]) == 0


def test_weights_that_would_be_dropped_are_errors():
    ec = dynamic_pair()
    with pytest.raises(ValueError, match=r"weights given for features \['fb'\], which are not in this batch"):
        ec({"fa": torch.tensor([1])}, {"fb": torch.ones(1)})
    with pytest.raises(ValueError, match=r"feature 'seq' \(table 'b'\): weights are for pooled features"):
        ec({"seq": torch.tensor([[1, 2]])}, {"seq": torch.ones(1, 2)})


def test_no_grad_and_eval_are_read_only():
    ec = dynamic_pair()
    batch = {"fa": torch.tensor([1, 2, 3]), "fb": torch.tensor([4, 5, 6])}
    with torch.no_grad():  # a validation loop that forgot eval()
        out = ec(batch)
    assert len(ec.embeddings["a"]) == 0 and len(ec.embeddings["b"]) == 0
    ec.eval()
    assert torch.equal(ec(batch)["fa"], out["fa"]) and len(ec.embeddings["a"]) == 0
    ec.train()
    ec(batch)["fa"].sum().backward()
    assert len(ec.embeddings["a"]) == 3


def test_padding_value_skips_ids_of_sequence_features():
    ec = dynamic_pair()
    out = ec({"seq": torch.tensor([[7, -1, 8], [-1, -1, 9]])})["seq"]
    assert out.shape == (2, 3, D)
    assert torch.equal(out[0, 1], torch.zeros(D)) and torch.equal(out[1, 0], torch.zeros(D))
    out.sum().backward()
    ec.optimizer.step()
    assert sorted(ec.embeddings["b"].export()[0].tolist()) == [7, 8, 9]  # -1 was neither inserted nor trained


def test_keyed_jagged_tensor():
    kjt_module = pytest.importorskip("torchrec.sparse.jagged_tensor")
    ec = static_collection().eval()
    kjt = kjt_module.KeyedJaggedTensor.from_lengths_sync(
        keys=["f", "g"], values=torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([2, 1, 0, 3]),
        weights=torch.tensor([1.0, 2.0, 3.0, 1.0, 1.0, 0.5]))
    out = ec(kjt)
    torch.testing.assert_close(out["f"], reference(ec, torch.tensor([1, 2, 3]), torch.tensor([0, 2]),
                                                   torch.tensor([1.0, 2.0, 3.0])))
    torch.testing.assert_close(out["g"], reference(ec, torch.tensor([4, 5, 6]), torch.tensor([0, 0]),
                                                   torch.tensor([1.0, 1.0, 0.5])))


class _Jagged:
    """The part of TorchRec's JaggedTensor the collection reads (torchrec is optional; its int64 values are the
    point here)."""

    def __init__(self, values, lengths):
        self._values, self._lengths = values, lengths

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def weights_or_none(self):
        return None


class _KeyedJagged:
    """The part of TorchRec's KeyedJaggedTensor the collection reads."""

    def __init__(self, features: dict):
        self._features = features

    def keys(self):
        return list(self._features)

    def to_dict(self):
        return dict(self._features)


def int32_tables(**kw) -> EmbeddingCollection:
    tables = [TableConfig(name="small", dim=D, key_dtype=torch.int32, seed=1, optimizer=dynemb.optim.SGD(lr=0.5)),
              TableConfig(name="wide", dim=D, seed=2, optimizer=dynemb.optim.SGD(lr=0.5))]
    features = [FeatureConfig(name="f", table="small"), FeatureConfig(name="w", table="wide"),
                FeatureConfig(name="seq", table="small", combiner="none", padding_value=-(2**40))]
    return EmbeddingCollection(tables, features, **kw)


def test_int64_ids_of_an_int32_table_are_cast_per_table_when_they_fit():
    """TorchRec's KeyedJaggedTensor carries int64 ids, as do plain tensors of Python ints: an int32 table takes
    them when they fit, with the results and training of the same ids given as int32. The int64 table beside it
    keeps ids past int32."""
    ec, twin = int32_tables(), int32_tables()
    ids = torch.tensor([-(2**31), 5, 2**31 - 1, 5])
    wide = torch.tensor([2**40, -1])
    seq = torch.tensor([[7, -(2**40)], [-(2**40), 2**31 - 1]])  # an int64 padding value, not stored
    for _ in range(2):
        out = ec({"f": _Jagged(ids, torch.tensor([2, 2])), "w": wide, "seq": seq})
        ref = twin({"f": Bags(ids.int(), lengths=torch.tensor([2, 2])), "w": wide,
                    "seq": (torch.tensor([7, 2**31 - 1], dtype=torch.int32), torch.tensor([0, 1]))})
        for name in ("f", "w"):
            torch.testing.assert_close(out[name], ref[name], rtol=0, atol=0)
        torch.testing.assert_close(out["seq"][[0, 1], [0, 1]], ref["seq"].values, rtol=0, atol=0)
        (out["f"].sum() + out["w"].sum() + out["seq"].sum()).backward()
        (ref["f"].sum() + ref["w"].sum() + ref["seq"].values.sum()).backward()
        ec.optimizer.step(), twin.optimizer.step()
        ec.optimizer.zero_grad(), twin.optimizer.zero_grad()
    for table in ("small", "wide"):
        keys, values = ec.export(table)
        ref_keys, ref_values = twin.export(table)
        assert keys.dtype == ref_keys.dtype and torch.equal(keys.sort().values, ref_keys.sort().values)
        torch.testing.assert_close(values[keys.argsort()], ref_values[ref_keys.argsort()], rtol=0, atol=0)
    kjt = _KeyedJagged({"f": _Jagged(ids, torch.tensor([1, 3])), "w": _Jagged(wide, torch.tensor([1, 1]))})
    assert set(ec(kjt)) == {"f", "w"}  # the KeyedJaggedTensor itself


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_int64_ids_that_do_not_fit_an_int32_table_are_named_before_any_table_changes(bad, fails_cleanly,
                                                                                      leaves_unchanged):
    ec = int32_tables()
    ec({"f": torch.tensor([1, 2]), "w": torch.tensor([3, 4])})
    batch = _KeyedJagged({"w": _Jagged(torch.tensor([2**40]), torch.tensor([1, 0])),
                          "f": _Jagged(torch.tensor([3, bad, 4]), torch.tensor([1, 2]))})
    message = (rf"^feature 'f' \(table 'small'\): ids are torch.int64 and the table's key_dtype is torch.int32: "
               rf"they are cast when every id fits in \[-2147483648, 2147483647\], but {bad} does not$")
    with leaves_unchanged(ec.embeddings["wide"]), fails_cleanly(ec.embeddings["small"], ValueError, message):
        ec(batch)
    with fails_cleanly(ec.embeddings["small"], ValueError, rf"^feature 'seq' \(table 'small'\): .* but {bad} does"):
        ec({"seq": torch.tensor([[1, bad]])})


def test_int64_ids_that_do_not_fit_unchecked_still_fail():
    """validate=False skips the check's device sync, not the check: a device-side assert (immediate on CPU) names
    the feature and the table, and no id is wrapped onto another."""
    ec = int32_tables(validate=False)
    with pytest.raises(RuntimeError, match=r"ids of feature 'f' \(table 'small'\) are torch.int64 .* but one of them"):
        ec({"f": torch.tensor([1, 2**32 + 1])})
    assert len(ec.embeddings["small"]) == 0
    ec({"f": torch.tensor([1, 2**31 - 1])})
    assert sorted(ec.export("small")[0].tolist()) == [1, 2**31 - 1]
