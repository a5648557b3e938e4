"""The user's tables are the unit of state: names, optimizer state, admission counts and files do not depend on
which other tables share the collection, and hostile names work everywhere a name goes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import CheckpointError, export_for_serving, load, save
from dynemb.serving import ParameterServer, read_export

OPTIMIZERS = {
    "sgd": lambda: dynemb.optim.SGD(lr=0.1, momentum=0.9),
    "adagrad": lambda: dynemb.optim.Adagrad(lr=0.1, lr_decay=0.01),
    "rowwise_adagrad": lambda: dynemb.optim.RowWiseAdagrad(lr=0.1),
    "adam": lambda: dynemb.optim.Adam(lr=0.05),
}
# int32 dynamic tables and static tables of one dim and optimizer: the tables version 0.1 merged into one.
NAMES = ("a", "b", "s1", "s2")


def tables(opt: str, names=NAMES) -> list[TableConfig]:
    spec = OPTIMIZERS[opt]()
    all_tables = [TableConfig(name="a", dim=4, key_dtype=torch.int32, optimizer=spec, seed=1),
                  TableConfig(name="b", dim=4, key_dtype=torch.int32, optimizer=spec, seed=2, combiner="sum"),
                  TableConfig(name="s1", dim=4, vocabulary_size=30, optimizer=spec, seed=3),
                  TableConfig(name="s2", dim=4, vocabulary_size=20, optimizer=spec, seed=4, combiner="sqrtn")]
    return [t for t in all_tables if t.name in names]


def collection(opt: str, names=NAMES) -> EmbeddingCollection:
    ts = tables(opt, names)
    return EmbeddingCollection(ts, [FeatureConfig(name=f"f_{t.name}", table=t.name) for t in ts])


def batch(step: int, names) -> dict:
    """Step ``step`` feeds only some tables (a different subset each step)."""
    g = torch.Generator().manual_seed(step)
    full = {"f_a": torch.randint(-20, 20, (6, 3), generator=g, dtype=torch.int32),
            "f_b": torch.randint(-(2**31), 2**31 - 1, (6, 2), generator=g, dtype=torch.int32),
            "f_s1": torch.randint(0, 30, (6, 2), generator=g), "f_s2": torch.randint(0, 20, (6,), generator=g)}
    fed = [n for i, n in enumerate(NAMES) if (step >> i) & 1 or step % 5 == 0]
    return {f"f_{n}": full[f"f_{n}"] for n in fed if n in names}


def train(ec: EmbeddingCollection, steps: range, names=NAMES) -> None:
    for step in steps:
        inputs = batch(step, names)
        if not inputs:
            continue
        out = ec(inputs)
        sum(o.square().sum() * (1 + NAMES.index(f[2:])) for f, o in out.items()).backward()
        ec.optimizer.step()
        ec.optimizer.zero_grad()


def table_state(ec: EmbeddingCollection, name: str) -> dict:
    rows = ec.embeddings[name].table.export()
    order = rows.keys.argsort()
    state = {"keys": rows.keys[order], "values": rows.values[order],
             **{s: t[order] for s, t in rows.slots.items()}}
    return state


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_tables_train_save_and_export_the_same_alone_or_together(tmp_path, opt):
    together = collection(opt)
    train(together, range(20))
    save(tmp_path / "together", together, step=20)
    export_for_serving(tmp_path / "export-together", together)
    ckpt = json.loads((tmp_path / "together" / "step-00000020" / "manifest.json").read_text())
    _, exported = read_export(tmp_path / "export-together")
    for name in NAMES:
        alone = collection(opt, (name,))
        train(alone, range(20), (name,))
        want, got = table_state(alone, name), table_state(together, name)
        assert want.keys() == got.keys()
        for col in want:
            assert torch.equal(want[col], got[col]), (name, col)
        assert alone.optimizer.state_dict()["optimizers"][name] == together.optimizer.state_dict()["optimizers"][name]
        save(tmp_path / name, alone, step=20)
        export_for_serving(tmp_path / f"export-{name}", alone)
        solo = json.loads((tmp_path / name / "step-00000020" / "manifest.json").read_text())
        entry, solo_entry = ckpt["tables"][name], solo["tables"][name]
        assert entry["config"] == solo_entry["config"]
        assert entry["shards"][0]["optimizer"] == solo_entry["shards"][0]["optimizer"]
        files = (load_file(tmp_path / d / n / e["shards"][0]["file"]) for d, n, e in
                 (("together", "step-00000020", entry), (name, "step-00000020", solo_entry)))
        mine, theirs = files
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        _, solo_export = read_export(tmp_path / f"export-{name}")
        assert all(torch.equal(exported[name][k], solo_export[name][k]) for k in ("keys", "values"))
        assert exported[name]["keys"].dtype == (torch.int32 if name in "ab" else torch.int64)


def test_save_then_load_continues_bit_identically_with_the_collections_own_adam(tmp_path):
    straight = collection("adam")
    train(straight, range(7))
    save(tmp_path, straight, step=7)  # no optimizer passed: the collection's own optimizers are saved with it
    train(straight, range(7, 15))
    resumed = collection("adam")
    torch.manual_seed(123)
    load(tmp_path, resumed)
    train(resumed, range(7, 15))
    for name in NAMES:
        want, got = table_state(straight, name), table_state(resumed, name)
        assert all(torch.equal(want[c], got[c]) for c in want), name
    assert straight.optimizer.state_dict() == resumed.optimizer.state_dict()


def test_strict_load_needs_the_state_of_every_optimizer_the_model_owns(tmp_path):
    plain = EmbeddingCollection([TableConfig(name="a", dim=4, seed=1)], [FeatureConfig(name="f", table="a")])
    plain({"f": torch.tensor([1, 2])})
    save(tmp_path, plain, step=1)
    owning = EmbeddingCollection([TableConfig(name="a", dim=4, seed=1, optimizer=dynemb.optim.SGD(lr=0.1))],
                                 [FeatureConfig(name="f", table="a")])
    with pytest.raises(CheckpointError, match="optimizer"):
        load(tmp_path, owning)
    assert len(owning.embeddings["a"]) == 0  # a failed load changes nothing
    load(tmp_path, owning, strict=False)
    assert len(owning.embeddings["a"]) == 2


def test_a_table_added_or_removed(tmp_path, caplog):
    old = collection("sgd", ("a", "s1"))
    train(old, range(6), ("a", "s1"))
    save(tmp_path, old, step=6)
    grown = collection("sgd", ("a", "b", "s1"))
    with pytest.raises(CheckpointError, match=r"only in the model .*: \['b'\]"):
        load(tmp_path, grown)
    with pytest.warns(UserWarning, match=r"only in the model \(they keep their current rows\): \['b'\]"):
        load(tmp_path, grown, strict=False)
    for name in ("a", "s1"):  # the tables on both sides keep every row
        want, got = table_state(old, name), table_state(grown, name)
        assert all(torch.equal(want[c], got[c]) for c in want)
    shrunk = collection("sgd", ("s1",))
    with pytest.raises(CheckpointError, match=r"only in the checkpoint .*: \['a'\]"):
        load(tmp_path, shrunk)
    with pytest.warns(UserWarning, match=r"only in the checkpoint \(not loaded\): \['a'\]"):
        load(tmp_path, shrunk, strict=False)
    assert torch.equal(table_state(shrunk, "s1")["values"], table_state(old, "s1")["values"])


HOSTILE = ["items", "keys", "values", "update", "type", "training", "user.id", "stack:a+b", "用户 ids", "a/b", ".."]


def hostile_collection(seed_offset: int = 0) -> EmbeddingCollection:
    ts = [TableConfig(name=n, dim=3, seed=i + seed_offset, optimizer=dynemb.optim.Adagrad(lr=0.1),
                      key_dtype=torch.int32 if i % 2 else torch.int64) for i, n in enumerate(HOSTILE)]
    return EmbeddingCollection(ts, [FeatureConfig(name=n, table=n) for n in HOSTILE])


def hostile_batch() -> dict:
    return {n: torch.tensor([i, -1, 7], dtype=torch.int32 if i % 2 else torch.int64) for i, n in enumerate(HOSTILE)}


def test_hostile_table_names_work_everywhere(tmp_path):
    ec = hostile_collection()
    sum(o.sum() for o in ec(hostile_batch()).values()).backward()
    ec.optimizer.step()
    assert sorted(ec.embeddings) == sorted(HOSTILE)
    # checkpoint
    save(tmp_path / "ckpt", ec, step=1)
    fresh = hostile_collection(seed_offset=50)
    load(tmp_path / "ckpt", fresh)
    for name in HOSTILE:
        assert all(torch.equal(a, b) for a, b in zip(table_state(ec, name).values(), table_state(fresh, name).values()))
    # state_dict, through torch.save with weights_only loading
    torch.save(ec.state_dict(), tmp_path / "sd.pt")
    again = hostile_collection(seed_offset=90)
    again.load_state_dict(torch.load(tmp_path / "sd.pt", weights_only=True))
    for name in HOSTILE:
        assert all(torch.equal(a, b) for a, b in zip(table_state(ec, name).values(), table_state(again, name).values()))
    assert again.optimizer.state_dict() == ec.optimizer.state_dict()
    # serving by name
    export_for_serving(tmp_path / "export", ec)
    ps = ParameterServer.from_config({"models": [{"model": "m", "sparse_files": [str(tmp_path / "export")],
                                                  "embedding_table_names": HOSTILE,
                                                  "embedding_vecsize_per_table": [3] * len(HOSTILE)}]})
    ps.load("m", progress=False)
    for i, name in enumerate(HOSTILE):
        ids = torch.tensor([i, -1, 7])
        assert torch.equal(ps.lookup("m", name, ids), ec.embeddings[name].find(ids.to(ec.embeddings[name].key_dtype)))
    ps.close()


@pytest.mark.parametrize("name", ["", "a\nb", "tab\there", "x" * 201, "nul\0"])
def test_names_that_cannot_work_are_refused_when_the_config_is_built(name):
    with pytest.raises(ValueError, match="TableConfig.name"):
        TableConfig(name=name, dim=2)


def test_state_dict_is_keyed_by_table_names_and_strict_about_them():
    ec = hostile_collection()
    ec(hostile_batch())
    state = ec.state_dict()
    assert "tables.user.id.values" in state and "tables.stack:a+b.keys" in state
    assert not any("embeddings" in k for k in state)
    del state["tables.items.values"]
    state["tables.nope.values"] = torch.zeros(1, 3)
    result = hostile_collection().load_state_dict(state, strict=False)
    assert "tables.items.values" in result.missing_keys and "tables.nope.values" in result.unexpected_keys
    with pytest.raises(RuntimeError, match="tables.nope.values"):
        hostile_collection().load_state_dict(state)


def test_a_key_pending_admission_at_save_is_admitted_at_the_same_step_after_resume(tmp_path):
    def build():
        return EmbeddingCollection([TableConfig(name="u", dim=2, admission=3, seed=1,
                                                optimizer=dynemb.optim.SGD(lr=0.1))],
                                   [FeatureConfig(name="f", table="u")])

    def step(ec):
        ec({"f": torch.tensor([42, 7])})["f"].sum().backward()
        ec.optimizer.step()

    straight = build()
    for _ in range(2):
        step(straight)
    assert not straight.embeddings["u"].contains(torch.tensor([42])).item()  # seen twice: pending
    save(tmp_path, straight, step=2)
    resumed = build()
    load(tmp_path, resumed)
    for ec in (straight, resumed):
        step(ec)  # the third sighting admits it, in both
        assert ec.embeddings["u"].contains(torch.tensor([42, 7])).tolist() == [True, True]
    assert torch.equal(table_state(straight, "u")["values"], table_state(resumed, "u")["values"])


def test_two_collections_with_one_table_name_cannot_be_saved(tmp_path):
    model = torch.nn.ModuleDict({"x": collection("sgd", ("a",)), "y": collection("sgd", ("a",))})
    with pytest.raises(ValueError, match="two tables are named 'a'"):
        save(tmp_path, model, step=0)


def test_print_shows_the_users_tables_and_features_and_nothing_of_the_groups():
    """``print(model)`` showed ``EmbeddingCollection()``: now the tables and features by the user's names, the same
    whether the tables run as execution groups (fused optimizers) or one by one."""
    def collection(fused: bool) -> EmbeddingCollection:
        return EmbeddingCollection(
            [TableConfig(name="user", dim=8, optimizer=dynemb.optim.Adagrad(lr=0.1, fused=fused)),
             TableConfig(name="shop", dim=16, optimizer=dynemb.optim.Adagrad(lr=0.1, fused=fused)),
             TableConfig(name="country", dim=4, vocabulary_size=200)],
            [FeatureConfig(name="user_id", table="user"), FeatureConfig(name="shop_id", table="shop"),
             FeatureConfig(name="country", table="country")])

    grouped, alone = collection(True), collection(False)
    assert grouped.plan.describe_groups() != alone.plan.describe_groups()  # the layouts differ ...
    assert repr(grouped) == repr(alone) == (  # ... and do not show
        "EmbeddingCollection(tables=[user(dim=8), shop(dim=16), country(dim=4, vocabulary_size=200)], "
        "features=[user_id->user, shop_id->shop, country->country])")
