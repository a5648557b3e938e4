"""DynamicEmbedding: the user's module. Forward in train and eval, the table's verbs and TFRA's names for them,
state dicts, devices."""

from __future__ import annotations

import warnings

import pytest
import torch

import dynemb
from dynemb import DynamicEmbedding, EmbeddingCollection, FeatureConfig, StaticEmbedding, TableConfig
from dynemb.serialization import dtype_name
from dynemb.table import Tiers


def _emb(key_dtype, device, dim=4, **kw) -> DynamicEmbedding:
    kw.setdefault("seed", 11)
    kw.setdefault("init_capacity", 4)
    return DynamicEmbedding(dim, key_dtype=key_dtype, device=device, **kw)


def _k(values, key_dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=key_dtype, device=device)


# ------------------------------------------------------------------------------------------------------------- forward
def test_forward_train_inserts_and_keeps_shape(key_dtype, device, extreme_keys):
    emb = _emb(key_dtype, device)
    ids = extreme_keys.to(device).view(2, 4)
    out = emb(ids)
    assert out.shape == (2, 4, 4) and out.dtype == torch.float32 and out.device.type == device.type
    assert len(emb) == emb.size() == 8
    assert torch.equal(emb(ids), out)  # the same rows on the next call
    assert torch.equal(out.view(8, 4), emb.find(ids.view(-1)))


def test_forward_duplicates_share_a_row(key_dtype, device):
    emb = _emb(key_dtype, device)
    out = emb(_k([[3, 3], [-1, 3]], key_dtype, device))
    assert torch.equal(out[0, 0], out[0, 1]) and torch.equal(out[0, 0], out[1, 1])
    assert len(emb) == 2


def test_forward_eval_inserts_nothing_and_returns_initial_rows(key_dtype, device):
    emb = _emb(key_dtype, device)
    emb.insert_or_assign(_k([1], key_dtype, device), torch.ones(1, 4, device=device))
    emb.eval()
    ids = _k([1, 2, 2**20], key_dtype, device)
    out = emb(ids)
    assert len(emb) == 1 and not emb.training
    assert torch.equal(out[0], torch.ones(4, device=device))
    emb.train()
    created = emb(ids)
    assert torch.equal(created[1:], out[1:])  # an unseen id reads the row it will be created with
    assert len(emb) == 3


def test_forward_beyond_max_capacity_still_returns_rows(key_dtype, device):
    got = []
    emb = _emb(key_dtype, device, max_capacity=2, on_evict=lambda k, v, s: got.append(k))
    ids = _k([1, 2, 3, 4], key_dtype, device)
    out = emb(ids)
    assert len(emb) == 2 and torch.cat(got).numel() == 2
    assert torch.equal(out, emb.eval()(ids))  # stored and dropped ids alike read their initializer rows


def test_forward_rejects_bad_ids(key_dtype, device, fails_cleanly):
    emb = _emb(key_dtype, device)
    emb(_k([1], key_dtype, device))
    other = torch.uint64  # wider than the keys, and not int64 (cast to int32 when it fits): never narrowed
    for mode in (True, False):
        emb.train(mode)
        with fails_cleanly(emb, TypeError, rf"ids must have dtype {key_dtype} .*or a narrower integer.*got {other}"):
            emb(torch.tensor([1, 2], dtype=other, device=device))
        with fails_cleanly(emb, TypeError, "ids must be a torch.Tensor.*got list"):
            emb([1, 2])
        with fails_cleanly(emb, TypeError, "ids must have dtype.*got torch.float32"):
            emb(torch.tensor([1.0], device=device))


def test_narrower_integer_ids_are_widened(key_dtype, device):
    """int32 ids look up an int64 table as nn.Embedding and TorchRec take them (int8/int16/uint8 any table), with the
    rows, shapes and inserts of the same ids in the table's dtype; extreme values keep their meaning."""
    emb = _emb(key_dtype, device)
    narrow = [torch.int8, torch.uint8, torch.int16] + ([torch.int32] if key_dtype == torch.int64 else [])
    for dtype in narrow:
        info = torch.iinfo(dtype)
        ids = torch.tensor([[info.min, -1 if info.min < 0 else 1], [0, info.max]], dtype=dtype, device=device)
        out = emb(ids)
        assert out.shape == (2, 2, emb.dim)
        assert torch.equal(out, emb(ids.to(key_dtype)))  # the same rows: the first call inserted them
        assert bool(emb.contains(ids.to(key_dtype).reshape(-1)).all())
    assert len(emb) == len(set(v for d in narrow for v in (torch.iinfo(d).min, torch.iinfo(d).max, -1, 0, 1)
                               if torch.iinfo(d).min <= v))


def test_int64_ids_of_an_int32_table_are_cast_when_they_fit(device):
    """int64 ids (TorchRec's, or torch.tensor of Python ints) reach an int32 table through every method that takes
    ids, with the rows of the same int32 ids."""
    emb, twin = _emb(torch.int32, device), _emb(torch.int32, device)
    ids = torch.tensor([[-(2**31), 7], [2**31 - 1, 7]], device=device)
    assert torch.equal(emb(ids), twin(ids.int()))
    assert torch.equal(emb.find(ids), twin.find(ids.int())) and bool(emb.contains(ids).all())
    emb.insert_or_assign(torch.tensor([9], device=device), torch.ones(1, 4, device=device))
    assert emb.erase(torch.tensor([7, 8], device=device)) == 1
    assert sorted(emb.export()[0].tolist()) == [-(2**31), 9, 2**31 - 1] and emb.export()[0].dtype == torch.int32


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**40])
def test_int64_ids_that_do_not_fit_an_int32_table_are_named_and_change_nothing(bad, fails_cleanly):
    emb = _emb(torch.int32, "cpu")
    emb(torch.tensor([1, 2]))
    keys = torch.tensor([[3, bad]])
    message = rf"are torch.int64 and the table's key_dtype is torch.int32: .* but {bad} does not"
    for mode in (True, False):
        emb.train(mode)
        with fails_cleanly(emb, ValueError, "^ids " + message):
            emb(keys)
    for call in (emb.lookup, emb.contains, emb.remove,
                 lambda k: emb.insert_or_assign(k, torch.zeros(1, 2, 4)),
                 lambda k: emb.accum(k, torch.zeros(1, 2, 4), torch.ones(1, 2, 4), torch.ones(1, 2).bool())):
        with fails_cleanly(emb, ValueError, "^keys " + message):
            call(keys)


def test_int64_ids_that_do_not_fit_fail_without_a_sync_where_unchecked():
    """Where the check would sync (CUDA), a device-side assert says it instead; on CPU it fires at once."""
    from dynemb.checks import fit_keys

    keys = torch.tensor([1, 2**31])
    with pytest.raises(RuntimeError, match="ids are torch.int64 .* but one of them does not"):
        fit_keys(keys, torch.int32, keys.device, "ids", check=False)
    assert fit_keys(keys[:1], torch.int32, keys.device, "ids", check=False).dtype == torch.int32


# ------------------------------------------------------------------------------------------------------------- methods
def test_find_with_and_without_exists(key_dtype, device):
    emb = _emb(key_dtype, device)
    emb.insert_or_assign(_k([5], key_dtype, device), torch.full((1, 4), 2.0, device=device))
    keys = _k([[5, 6]], key_dtype, device)
    values = emb.find(keys)
    values2, exists = emb.find(keys, return_exists=True)
    assert values.shape == (1, 2, 4) and exists.shape == (1, 2)
    assert exists.tolist() == [[True, False]]
    assert torch.equal(values, values2) and values[0, 0].eq(2.0).all()
    assert len(emb) == 1


def test_tfra_names_are_the_table_verbs():
    """TFRA's lookup / upsert / remove are the table's find / insert_or_assign / erase: the same methods."""
    for tfra, verb in (("lookup", "find"), ("upsert", "insert_or_assign"), ("remove", "erase")):
        assert getattr(DynamicEmbedding, tfra) is getattr(DynamicEmbedding, verb), tfra
        assert verb in vars(DynamicEmbedding) and verb in vars(dynemb.KeyValueTable), verb


def test_insert_or_assign(key_dtype, device, value_dtype):
    emb = _emb(key_dtype, device, dtype=value_dtype)
    keys = _k([1, 2, 1], key_dtype, device)
    vals = torch.arange(12, device=device).view(3, 4).to(value_dtype)
    emb.insert_or_assign(keys, vals)
    assert len(emb) == 2
    assert torch.equal(emb.find(_k([1, 2], key_dtype, device)), vals[[2, 1]])  # the last duplicate wins
    emb.insert_or_assign(_k([2], key_dtype, device), torch.zeros(1, 4, dtype=value_dtype, device=device))
    assert emb.find(_k([2], key_dtype, device)).eq(0).all()


def test_accum_tfra_flow(key_dtype, device):
    emb = _emb(key_dtype, device, initializer="zeros")
    emb.insert_or_assign(_k([1, 2], key_dtype, device), torch.ones(2, 4, device=device))
    keys = _k([1, 2, 3], key_dtype, device)
    old, exists = emb.find(keys, return_exists=True)
    emb.erase(_k([2], key_dtype, device))  # removed by someone else in between
    emb.accum(keys, old, old + 0.5, exists)
    values, exists = emb.find(keys, return_exists=True)
    assert exists.tolist() == [True, False, True]
    assert values[0].eq(1.5).all() and values[2].eq(0.5).all()


def test_erase_contains_size_clear(key_dtype, device, extreme_keys):
    emb = _emb(key_dtype, device)
    keys = extreme_keys.to(device)
    emb(keys)
    assert emb.contains(keys).all()
    assert emb.erase(torch.cat([keys[:3], keys[:3], _k([77], key_dtype, device)])) == 3
    assert emb.contains(keys).tolist() == [False] * 3 + [True] * 5
    assert emb.size() == len(emb) == 5
    emb.clear()
    assert len(emb) == 0 and not emb.contains(keys).any()


def test_export_with_and_without_scores(key_dtype, device):
    emb = _emb(key_dtype, device, eviction="lfu", max_capacity=100)
    keys = _k([4, 9], key_dtype, device)
    emb.insert_or_assign(torch.cat([keys, keys[:1]]), torch.ones(3, 4, device=device))
    k, v = emb.export()
    k2, v2, s = emb.export(with_scores=True)
    assert torch.equal(k, k2) and torch.equal(v, v2) and v.eq(1).all()
    assert dict(zip(k.tolist(), s.tolist())) == {4: 2, 9: 1}
    assert s.dtype == torch.int64


def test_restrict_with_and_without_trigger(key_dtype, device):
    emb = _emb(key_dtype, device, eviction="lfu", max_capacity=100)
    emb.insert_or_assign(_k([1, 1, 1, 2, 2, 3], key_dtype, device), torch.zeros(6, 4, device=device))
    assert emb.restrict(2, trigger=3).keys.numel() == 0 and len(emb) == 3
    assert emb.restrict(2).keys.tolist() == [3]
    assert sorted(emb.export()[0].tolist()) == [1, 2]


def test_repr_names_the_config(key_dtype, device):
    text = repr(_emb(key_dtype, device, max_capacity=10, eviction="lfu"))
    for part in ("dim=4", f"key_dtype={key_dtype}", "max_capacity=10", "eviction='lfu'", "size=0"):
        assert part in text


def test_seed_none_follows_torch_manual_seed(key_dtype, device):
    keys = _k([1, 2], key_dtype, device)
    rows = []
    for _ in range(2):
        torch.manual_seed(123)
        rows.append(DynamicEmbedding(4, key_dtype=key_dtype, device=device)(keys))
    assert torch.equal(rows[0], rows[1])


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"dim": 0}, ValueError, "dim"),
        ({"key_dtype": torch.float32}, TypeError, "key_dtype"),
        ({"dtype": torch.float64}, TypeError, "dtype"),
        ({"initializer": "xavier"}, ValueError, "initializer"),
        ({"eviction": "random"}, ValueError, "eviction"),
        ({"eviction": "lfu"}, ValueError, r"^eviction='lfu' needs a bound: give max_capacity or max_bytes \(or tiers"),
        ({"eviction": "lru", "seed": 1}, ValueError, r"^eviction='lru' needs a bound"),
        ({"max_capacity": -1}, ValueError, "max_capacity"),
        ({"init_capacity": 0}, ValueError, "init_capacity"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"on_evict": "print"}, TypeError, "on_evict"),
    ],
)
def test_constructor_errors(kwargs, exc, match):
    args = {"dim": 4, **kwargs}
    with pytest.raises(exc, match=match):
        DynamicEmbedding(args.pop("dim"), **args)


def test_eviction_with_a_bound_is_accepted():
    """As the CLI's ``--eviction needs --max-capacity``: any of the three bounds makes a policy mean something."""
    for bound in ({"max_capacity": 10}, {"max_bytes": 1 << 16}, {"tiers": Tiers(fast_capacity=10)}):
        assert DynamicEmbedding(4, eviction="lfu", **bound).table.policy.value == "lfu"
    state = torch.random.get_rng_state()
    with pytest.raises(ValueError, match="eviction"):
        DynamicEmbedding(4, eviction="lfu")
    assert torch.equal(torch.random.get_rng_state(), state)  # refused before a seed is drawn


def test_method_errors_change_nothing(key_dtype, device, fails_cleanly):
    emb = _emb(key_dtype, device)
    emb(_k([1, 2], key_dtype, device))
    keys = _k([1, 3], key_dtype, device)
    with fails_cleanly(emb, ValueError, r"values must have shape \(2, 4\)"):
        emb.insert_or_assign(keys, torch.zeros(2, 5, device=device))
    with fails_cleanly(emb, TypeError, "values must have dtype torch.float32"):
        emb.insert_or_assign(keys, torch.zeros(2, 4, dtype=torch.float16, device=device))
    with fails_cleanly(emb, TypeError, "keys must have dtype"):
        emb.erase(torch.tensor([1.0], device=device))
    with fails_cleanly(emb, TypeError, "keys must have dtype"):
        emb.find(torch.tensor([1.0], device=device))
    with fails_cleanly(emb, TypeError, "exists must be a bool tensor"):
        emb.accum(keys, torch.zeros(2, 4, device=device), torch.zeros(2, 4, device=device), [True, False])
    with fails_cleanly(emb, ValueError, "num_reserved"):
        emb.restrict(-2)


def test_gradients_with_no_optimizer_warn_once_per_table():
    """Backward with no optimizer bound keeps every gradient until an optimizer steps and zero_grads: said once per
    table (each table object), never for a table with an optimizer, fused or not (nor a frozen one, which gets no
    gradient: tests/test_collection.py)."""
    emb = _emb(torch.int64, "cpu")
    with pytest.warns(UserWarning, match=r"^a KeyValueTable \(dim=4, key_dtype=torch.int64, 2 rows\) got gradients "
                                         r"in backward but no optimizer is bound to it: they accumulate until"):
        emb(torch.tensor([1, 2])).sum().backward()
    others = [_emb(torch.int64, "cpu") for _ in range(2)]
    dynemb.optim.SGD([others[0]], lr=0.1)
    dynemb.optim.Adagrad([others[1]], lr=0.1, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module in [emb] + others:  # emb: already said
            module(torch.tensor([[3, 4]])).sum().backward()
    with pytest.warns(UserWarning, match="got gradients in backward but no optimizer"):
        _emb(torch.int64, "cpu")(torch.tensor([5])).sum().backward()  # another table: said again


# ---------------------------------------------------------------------------------------------------------- state dict
def _populated(key_dtype, device, **kw) -> DynamicEmbedding:
    kw.setdefault("max_capacity", 100)
    emb = _emb(key_dtype, device, eviction="lfu", **kw)
    emb.table.add_slot("acc", 2, init=0.1)
    info = torch.iinfo(key_dtype)
    emb(_k([info.min, info.max, -1, 0, 0x5851F42D, 7, 7], key_dtype, device))
    emb.insert_or_assign(_k([9, 7], key_dtype, device), torch.full((2, 4), 3.0, device=device))
    emb.erase(_k([0], key_dtype, device))
    emb.table.epoch = 3
    return emb


def _assert_same(a: DynamicEmbedding, b: DynamicEmbedding) -> None:
    ka, va, sa = a.export(with_scores=True)
    kb, vb, sb = b.export(with_scores=True)
    assert torch.equal(ka, kb) and torch.equal(va, vb) and torch.equal(sa, sb)
    assert torch.equal(a.table.export().slots["acc"], b.table.export().slots["acc"])
    assert a.counters() == b.counters()
    assert a.config() == b.config()


def test_state_dict_round_trip_is_exact(key_dtype, device):
    src = _populated(key_dtype, device, max_capacity=100)
    state = src.state_dict()
    assert set(state) >= {"keys", "values", "scores", "slot.acc", "_extra_state"}
    dst = DynamicEmbedding(4, key_dtype=key_dtype, device=device, eviction="lfu", max_capacity=100)  # seed drawn
    dst.table.add_slot("acc", 2, init=0.1)
    dst(_k([1234], key_dtype, device))  # whatever it held is replaced
    assert dst.load_state_dict(state) is not None
    _assert_same(src, dst)
    assert not dst.contains(_k([1234], key_dtype, device)).item()
    # The loaded module carries on exactly like the original, new keys included.
    ids = _k([7, 9, 55, -1, 56], key_dtype, device)
    assert torch.equal(src(ids), dst(ids))
    _assert_same(src, dst)


def test_state_dict_into_module_with_wrong_dim_or_dtype(key_dtype, device, fails_cleanly):
    state = _populated(key_dtype, device).state_dict()
    other_key = torch.int64 if key_dtype == torch.int32 else torch.int32
    bounded = {"device": device, "eviction": "lfu", "max_capacity": 100}
    cases = [
        (DynamicEmbedding(8, key_dtype=key_dtype, **bounded), "dim is 4 in the state dict but 8"),
        (
            DynamicEmbedding(4, key_dtype=key_dtype, dtype=torch.float16, **bounded),
            "dtype is float32 in the state dict but float16",
        ),
        (
            DynamicEmbedding(4, key_dtype=other_key, **bounded),
            f"key_dtype is {dtype_name(key_dtype)} in the state dict but {dtype_name(other_key)}",
        ),
    ]
    for dst, message in cases:
        dst.table.add_slot("acc", 2, init=0.1)
        dst(torch.tensor([1], dtype=dst.key_dtype, device=device))
        with fails_cleanly(dst, RuntimeError, message):
            dst.load_state_dict(state)


def test_state_dict_with_corrupt_scores_fails_cleanly(key_dtype, device, fails_cleanly):
    state = _populated(key_dtype, device).state_dict()
    dst = _populated(key_dtype, device)
    dst(_k([555], key_dtype, device))
    state["scores"] = state["scores"][:-1]
    with fails_cleanly(dst, RuntimeError, "scores must be an int64 tensor of shape"):
        dst.load_state_dict(state)


def test_state_dict_missing_entries(key_dtype, device):
    state = _populated(key_dtype, device).state_dict()
    del state["scores"]
    dst = _emb(key_dtype, device, eviction="lfu", max_capacity=100)
    dst.table.add_slot("acc", 2, init=0.1)
    with pytest.raises(RuntimeError, match="Missing key"):
        dst.load_state_dict(state)
    result = dst.load_state_dict(state, strict=False)
    assert "scores" in result.missing_keys and len(dst) == 0


# ------------------------------------------------------------------------------------------------------------- devices
_BUILDERS = {
    "DynamicEmbedding": lambda device: DynamicEmbedding(4, device=device),
    "StaticEmbedding": lambda device: StaticEmbedding(8, 4, device=device),
    "EmbeddingCollection": lambda device: EmbeddingCollection([TableConfig(name="t", dim=4)],
                                                              [FeatureConfig(name="f", table="t")], device=device),
}


@pytest.mark.parametrize("build", sorted(_BUILDERS))
def test_a_device_that_is_not_there_is_a_clear_error(build, monkeypatch):
    """Not torch's bare ``AssertionError`` ("Torch not compiled with CUDA enabled"): a ValueError naming the
    argument and why (the CLI prints it as its one-line error)."""
    build = _BUILDERS[build]
    if not torch.cuda.is_available():  # this machine, as it is
        with pytest.raises(ValueError, match=r"^device='cuda' asks for CUDA, but torch.cuda.is_available\(\) is "
                                             r"False on this machine \(torch .*\); use 'cpu'$"):
            build("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^device='cuda:0' asks for CUDA, but torch.cuda.is_available\(\) is Fa"):
        build("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"^device='cuda:3' is not a device of this machine, which has 2 CUDA "
                                         r"device\(s\): cuda:0 to cuda:1$"):
        build("cuda:3")
    with pytest.raises(ValueError, match=r"^device=device\(type='cuda', index=2\) is not a device"):
        build(torch.device("cuda", 2))
    with pytest.raises(ValueError, match=r"^device must be a torch.device or a device string .*, got 'gpu'$"):
        build("gpu")


@pytest.mark.parametrize("via_collection", [False, True], ids=["module", "collection"])
def test_moving_to_a_device_that_is_not_there_fails_before_anything_moves(via_collection, monkeypatch,
                                                                           fails_cleanly):
    owner, module, _, lookup, ids = _trained("dynamic", torch.int64, via_collection)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    to, cuda = r"to\(device\)", r"cuda\(device\)"
    for move, name in ((lambda m: m.to("cuda"), to), (lambda m: m.to("cuda:1", torch.float16), to),
                       (lambda m: m.to(device="cuda"), to), (lambda m: m.cuda(), cuda), (lambda m: m.cuda(1), cuda)):
        with fails_cleanly(module, ValueError, f"^{name}=.*asks for CUDA, but torch.cuda.is_available"):
            move(owner)
        assert module.dtype == torch.float32 and module.device.type == "cpu"
    assert owner.to("cpu") is owner and lookup(ids).device.type == "cpu"


def _module(kind: str, key_dtype, **kw):
    if kind == "static":
        return StaticEmbedding(64, 4, key_dtype=key_dtype, seed=11, **kw)
    return _emb(key_dtype, "cpu", **kw)


CASTS = {
    "half": (lambda m: m.half(), torch.float16),
    "to_bfloat16": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "to_float16_cpu": (lambda m: m.to("cpu", torch.float16), torch.float16),
}


def _trained(kind, key_dtype, via_collection):
    """A module (or a collection holding it as table "t") with rows and Adam slots, and a function to look up."""
    if via_collection:
        table = TableConfig(name="t", dim=4, vocabulary_size=64 if kind == "static" else None, seed=11,
                            key_dtype=key_dtype, optimizer=dynemb.optim.Adam(lr=0.1))
        ec = EmbeddingCollection([table], [FeatureConfig(name="f", table="t", combiner="none")])
        owner, module, opt = ec, ec.embeddings["t"], ec.optimizer
        lookup = lambda ids: ec({"f": ids})["f"]  # noqa: E731
    else:
        owner = module = _module(kind, key_dtype)
        opt, lookup = dynemb.optim.Adam([module], lr=0.1), module
    ids = _k([1, 2, 5], key_dtype, "cpu")
    lookup(ids).sum().backward()
    opt.step()
    opt.zero_grad()
    return owner, module, opt, lookup, ids


def _rows_of(module, ids) -> torch.Tensor:
    return module.table.values[module.table.find_rows(ids)].clone()


@pytest.mark.parametrize("via_collection", [False, True], ids=["module", "collection"])
@pytest.mark.parametrize("cast", sorted(CASTS))
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_dtype_casts_convert_the_rows_and_keep_slots_float32(kind, cast, via_collection, key_dtype):
    owner, module, opt, lookup, ids = _trained(kind, key_dtype, via_collection)
    before, looked_up = module.table.export(), _rows_of(module, ids)
    apply, dtype = CASTS[cast]
    assert apply(owner) is owner
    rows = module.table.export()
    assert module.table.dtype == dtype and module.config()["dtype"] == dtype_name(dtype)
    assert rows.values.dtype == dtype and torch.equal(rows.values, before.values.to(dtype))
    assert all(s.dtype == torch.float32 and torch.equal(s, before.slots[n]) for n, s in rows.slots.items())
    out = lookup(ids)
    assert out.dtype == dtype and torch.equal(out, looked_up.to(dtype))
    out.float().sum().backward()  # training goes on in the new dtype
    opt.step()
    assert not torch.equal(module.table.export().values, rows.values)
    owner.float()
    assert module.table.dtype == torch.float32 and lookup(ids).dtype == torch.float32


def test_dtype_casts_to_an_unsupported_dtype_fail_cleanly(key_dtype, fails_cleanly):
    emb = _emb(key_dtype, "cpu")
    emb(_k([1, 2], key_dtype, "cpu"))
    with fails_cleanly(emb, TypeError, "cannot cast them to torch.float64"):
        emb.double()
    assert emb.to("cpu") is emb and emb.dtype == torch.float32


@pytest.mark.parametrize("fused", [False, True], ids=["step", "fused"])
@pytest.mark.parametrize("via_collection", [False, True], ids=["module", "collection"])
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_requires_grad_false_freezes_the_table(kind, via_collection, fused, key_dtype):
    dense = torch.nn.Linear(4, 1)
    if via_collection:
        tables = [TableConfig(name=n, dim=4, vocabulary_size=64 if kind == "static" else None, seed=i,
                              key_dtype=key_dtype, optimizer=dynemb.optim.Adagrad(lr=0.1, fused=fused))
                  for i, n in enumerate(["frozen", "other"])]
        ec = EmbeddingCollection(tables, [FeatureConfig(name=n, table=n) for n in ["frozen", "other"]])
        frozen, other, sparse = ec.embeddings["frozen"], ec.embeddings["other"], ec.optimizer
        forward = lambda ids: ec({"frozen": ids, "other": ids})  # noqa: E731
    else:
        frozen, other = _module(kind, key_dtype), None
        sparse = dynemb.optim.Adagrad([frozen], lr=0.1, fused=fused)
        forward = lambda ids: {"frozen": frozen(ids).sum(1) if ids.dim() > 1 else frozen(ids)}  # noqa: E731
    ids = _k([1, 2, 5], key_dtype, "cpu")
    forward(ids)  # a dynamic table holds its keys before it is frozen
    assert frozen.requires_grad_(False) is frozen
    expected, before = _rows_of(frozen, ids), frozen.table.export()
    out = forward(ids)
    assert torch.equal(out["frozen"], expected)  # lookups still work
    assert not out["frozen"].requires_grad
    loss = dense(out["frozen"]).sum() + (out["other"].sum() if other is not None else 0)
    loss.backward()
    assert frozen.table.sparse_grad is None or frozen.table.sparse_grad.empty()  # no gradient reached it
    sparse.step()
    sparse.zero_grad()
    forward(_k([7, 8], key_dtype, "cpu"))  # read-only, as under no_grad: unseen keys are not inserted
    after = frozen.table.export()  # rows, scores and optimizer slots as they were
    assert torch.equal(after.keys, before.keys) and torch.equal(after.values, before.values)
    assert torch.equal(after.scores, before.scores)
    assert all(torch.equal(after.slots[n], slot) for n, slot in before.slots.items())
    assert dense.weight.grad is not None
    if other is not None:
        assert other.table.export().slots["adagrad.sum"].abs().sum() > 0  # the other table trained
    frozen.requires_grad_(True)
    forward(ids)["frozen"].sum().backward()
    sparse.step()
    assert not torch.equal(_rows_of(frozen, ids), expected)


def test_to_cuda_and_back(key_dtype, cuda_device):
    src = _populated(key_dtype, "cpu")
    emb = _populated(key_dtype, "cpu").to(cuda_device)
    assert emb.device.type == "cuda" and emb.export()[1].is_cuda
    ids = _k([7, 9, 55], key_dtype, "cuda")
    assert torch.equal(emb(ids).cpu(), src(ids.cpu()))
    emb.cpu()
    _assert_same(src, emb)


def test_cuda_module_accepts_tensors_on_the_default_cuda_device(key_dtype, cuda_device):
    emb = DynamicEmbedding(4, key_dtype=key_dtype, device="cuda", seed=0)
    ids = _k([1, 2], key_dtype, "cuda:0")
    assert emb(ids).device == ids.device
    emb.insert_or_assign(ids, torch.ones(2, 4, device="cuda:0"))
    assert emb.contains(ids).all()


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("static", [False, True])
def test_a_copied_module_trains_once_its_original_is_gone(how, static):
    """A copy carries its original's table handle; its lookups must not need the original's anchor (found by
    review: a KeyError once the original was collected, or in a fresh process)."""
    import copy
    import gc
    import io

    def make():
        emb = StaticEmbedding(10, 4, seed=1) if static else DynamicEmbedding(4, seed=1)
        dynemb.optim.SGD([emb], lr=0.5, fused=True)
        return emb

    def train(emb):
        out = emb(torch.tensor([[1, 2], [3, 3]])).sum()
        out.backward()
        return emb(torch.tensor([1, 2, 3])).detach()

    want = train(make())
    emb = make()
    if how == "deepcopy":
        twin = copy.deepcopy(emb)
    else:
        buffer = io.BytesIO()
        torch.save(emb, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)  # our own bytes, written just above
    from dynemb.functional.custom_ops import is_registered

    assert is_registered(twin.table) and twin.table.op_handle != emb.table.op_handle  # compiled ops reach the copy
    del emb
    gc.collect()
    assert torch.equal(train(twin), want)


class _EvictionWatchingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = DynamicEmbedding(4, seed=1, max_capacity=64, on_evict=self.evicted)

    def evicted(self, keys, values, scores):
        pass


def test_a_copy_rebuilt_table_first_gets_a_handle_of_its_own():
    """A copier may reach a table before its module (the optimizer, copied first, holds the table), and the table's
    state may lead back to the module (``on_evict`` a bound method of the model): the module's ``__setstate__`` then
    runs before the table is filled in. The copy must still not carry its original's handle, through which compiled
    lookups reached the original (found by review)."""
    import pickle

    from dynemb.functional.custom_ops import is_registered

    model = _EvictionWatchingModel()
    optimizer = dynemb.optim.SGD([model.emb], lr=0.1)
    _, twin = pickle.loads(pickle.dumps((optimizer, model)))  # our own bytes, written just above
    assert is_registered(twin.emb.table) and twin.emb.table.op_handle != model.emb.table.op_handle
    assert is_registered(model.emb.table)
    table = DynamicEmbedding(4, seed=1).table
    alone = pickle.loads(pickle.dumps(table))  # a table copied without its module has no handle, not the original's
    assert table.op_handle is not None and alone.op_handle is None
