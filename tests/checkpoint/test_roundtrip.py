"""save -> load restores tables, counters, dense state and optimizer state bit-exactly; resumed training equals an
uninterrupted run; bad checkpoints and mismatched models fail with errors naming the file and the field."""

from __future__ import annotations

import json
import logging

import pytest
import safetensors.torch
import torch
from ckpt_util import TwoTables, assert_same_models, assert_same_tables, table_state, train_step, trained_model

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import CheckpointError, load, save
from dynemb.checkpoint.tables import find_tables


def test_round_trip_is_bit_exact(tmp_path):
    trained = trained_model()
    opt = torch.optim.Adam(trained.dense.parameters(), lr=0.01, betas=(0.8, 0.9))
    trained.dense(torch.randn(3, 12)).sum().backward()
    opt.step()
    save(tmp_path, trained, opt, step=6, extra={"epoch": 2, "note": "x"})
    fresh = TwoTables(seed=99)
    fresh_opt = torch.optim.Adam(fresh.dense.parameters(), lr=0.5)
    manifest = load(tmp_path, fresh, fresh_opt)
    assert_same_models(trained, fresh)
    assert manifest["step"] == 6 and manifest["extra"] == {"epoch": 2, "note": "x"}
    a, b = opt.state_dict(), fresh_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for p in a["state"]:
        for k, v in a["state"][p].items():
            assert torch.equal(v, b["state"][p][k]), k


def test_resume_equals_uninterrupted_run(tmp_path):
    straight = TwoTables()
    for i in range(10):
        train_step(straight, i)
    save(tmp_path, straight, step=10)
    for i in range(10, 20):
        train_step(straight, i)
    resumed = TwoTables(seed=7)
    load(tmp_path, resumed)
    for i in range(10, 20):
        train_step(resumed, i)
    assert_same_models(straight, resumed)


class _Both:
    """The sparse and the dense optimizer saved as one object (what the optimizer hook expects)."""

    def __init__(self, sparse, dense):
        self.sparse, self.dense = sparse, dense

    def state_dict(self):
        return {"sparse": self.sparse.state_dict(), "dense": self.dense.state_dict()}

    def load_state_dict(self, state):
        self.sparse.load_state_dict(state["sparse"])
        self.dense.load_state_dict(state["dense"])


def _optimized(seed: int):
    model = TwoTables(seed=seed, slots=False)
    opt = _Both(dynemb.optim.Adam([model.user, model.item], lr=0.05), torch.optim.Adam(model.dense.parameters()))
    return model, opt


def _optimizer_step(model, opt, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    user = model.user(torch.randint(-100, 200, (16,), generator=g))
    item = model.item(torch.randint(-40, 40, (16,), dtype=torch.int32, generator=g)).float()
    model.dense(torch.cat([user, item], 1)).square().mean().backward()
    opt.sparse.step()
    opt.dense.step()
    opt.sparse.zero_grad()
    opt.dense.zero_grad()


def test_resume_with_optimizer_state(tmp_path):
    straight, opt = _optimized(seed=0)
    for i in range(8):
        _optimizer_step(straight, opt, i)
    save(tmp_path, straight, opt, step=8)
    for i in range(8, 18):
        _optimizer_step(straight, opt, i)
    resumed, resumed_opt = _optimized(seed=5)
    load(tmp_path, resumed, resumed_opt)
    for i in range(8, 18):
        _optimizer_step(resumed, resumed_opt, i)
    assert_same_models(straight, resumed)
    assert resumed_opt.sparse.state_dict() == opt.sparse.state_dict()


def test_model_that_is_an_embedding(tmp_path, key_dtype, extreme_keys):
    emb = dynemb.DynamicEmbedding(3, key_dtype=key_dtype, seed=1)
    emb(extreme_keys)
    save(tmp_path, emb, step=0)
    fresh = dynemb.DynamicEmbedding(3, key_dtype=key_dtype, seed=2)
    load(tmp_path, fresh)
    assert_same_tables(emb, fresh)
    assert json.loads((tmp_path / "step-00000000" / "manifest.json").read_text())["tables"].keys() == {"embedding"}


def test_empty_table_round_trips(tmp_path):
    save(tmp_path, TwoTables(), step=1)
    fresh = TwoTables(seed=3)
    fresh.user(torch.tensor([5, 6]))
    load(tmp_path, fresh)
    assert len(fresh.user) == 0 and len(fresh.item) == 0


def test_rows_over_the_loading_tables_capacity_are_refused_naming_the_bound(tmp_path):
    emb = dynemb.DynamicEmbedding(3, seed=1)
    emb(torch.arange(10))
    save(tmp_path, emb, step=0)
    small = dynemb.DynamicEmbedding(3, seed=2, max_capacity=5)
    small(torch.tensor([-1]))
    with pytest.raises(CheckpointError, match=r"table 'embedding': 10 rows do not fit max_capacity=5 of the model's "
                                              r"table, which bounds the rows one rank holds: raise max_capacity, or "
                                              r"load on more ranks$"):
        load(tmp_path, small)
    assert small.contains(torch.tensor([-1])).all() and len(small) == 1  # the failed load changed nothing


def test_load_replaces_table_contents(tmp_path):
    trained = trained_model()
    save(tmp_path, trained, step=1)
    other = TwoTables()
    other.user(torch.tensor([10**12, -(10**12)]))
    load(tmp_path, other)
    assert not bool(other.user.contains(torch.tensor([10**12, -(10**12)])).any())
    assert_same_tables(trained.user, other.user)


def test_files_are_standard_safetensors_and_json(tmp_path):
    trained = trained_model()
    directory = save(tmp_path, trained, step=3)
    manifest = json.loads((directory / "manifest.json").read_text())
    shard = manifest["tables"]["user"]["shards"][0]
    assert shard["rank"] == 0 and "rank-00000-of-00001" in shard["file"]
    assert manifest["world_size"] == 1 and manifest["partitioner"] == "mod" and manifest["format_version"] == 4
    assert manifest["tables"]["item"]["config"]["key_dtype"] == "int32"
    tensors = safetensors.torch.load_file(directory / shard["file"])
    assert torch.equal(tensors["values"], trained.user.table.export().values)
    dense = safetensors.torch.load_file(directory / "dense.safetensors")
    assert torch.equal(dense["dense.weight"], trained.dense.weight)
    assert json.loads((tmp_path / "latest").read_text())["name"] == "step-00000003"


@pytest.mark.parametrize("field,change", [("dim", {"dim": 5}), ("dtype", {"dtype": torch.float16}),
                                          ("key_dtype", {"key_dtype": torch.int32})])
def test_config_mismatch_names_file_and_field(tmp_path, field, change):
    trained = trained_model()
    save(tmp_path, trained, step=1)
    other = TwoTables()
    other.user = dynemb.DynamicEmbedding(**{"dim": 8, **change})
    before = table_state(other.item)
    with pytest.raises(CheckpointError, match=rf"[0-9]{{3}}-user.*safetensors: table 'user': {field} is"):
        load(tmp_path, other)
    assert_same_state(before, table_state(other.item))


def assert_same_state(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_is_a_checksum_error_naming_the_file(tmp_path, where):
    trained = trained_model()
    directory = save(tmp_path, trained, step=1)
    shard = next((directory / "tables").glob("*user*"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) - 7 if where == "data" else 30] ^= 0x01
    shard.write_bytes(bytes(raw))
    other = TwoTables(seed=4)
    other.user(torch.tensor([1, 2, 3]))
    before = table_state(other.user)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: xxh3-128 checksum mismatch"):
        load(tmp_path, other)
    assert_same_state(before, table_state(other.user))


def test_missing_shard_names_the_file(tmp_path):
    trained = trained_model()
    directory = save(tmp_path, trained, step=1)
    shard = next((directory / "tables").glob("*item*"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: shard file of table 'item' rank 0 is missing"):
        load(tmp_path, TwoTables())


def test_strict_table_and_slot_sets(tmp_path, caplog):
    trained = trained_model()
    save(tmp_path, trained, step=1)
    fewer_slots = TwoTables(slots=False)
    with pytest.raises(CheckpointError, match="slot 'm' is only in the checkpoint"):
        load(tmp_path, fewer_slots)
    extra = TwoTables()
    extra.more = dynemb.DynamicEmbedding(2)
    with pytest.raises(CheckpointError, match=r"only in the model \(they keep their current rows\): \['more'\]"):
        load(tmp_path, extra)
    with pytest.warns(UserWarning, match=r"only in the model .*\['more'\]") as caught:
        load(tmp_path, extra, strict=False)
    assert_same_tables(trained.user, extra.user)
    assert "only in the checkpoint" not in str(caught[0].message)  # no empty list


def test_a_table_added_since_the_save_loads_with_its_collections_optimizer_when_not_strict(tmp_path):
    """A collection with a table added since the save, loaded with ``ec.optimizer`` too: strict says which table;
    ``strict=False`` restores the saved tables and their optimizer state and keeps the new table's (as its rows)."""
    def collection(names):
        return EmbeddingCollection([TableConfig(name=n, dim=4, optimizer=dynemb.optim.Adagrad(lr=0.1)) for n in names],
                                   [FeatureConfig(name=n, table=n) for n in names])

    ec = collection(["user", "item"])
    ec({"user": torch.tensor([11, 12, 11]), "item": torch.tensor([7, 8, 9])})["user"].sum().backward()
    ec.optimizer.step()
    save(tmp_path, ec, ec.optimizer, step=1)
    bigger = collection(["user", "item", "query"])
    with pytest.raises(CheckpointError, match=r"only in the model .*\['query'\]"):
        load(tmp_path, bigger, bigger.optimizer)
    with pytest.warns(UserWarning, match=r"only in the model .*\['query'\]"):
        load(tmp_path, bigger, bigger.optimizer, strict=False)
    assert torch.equal(bigger.export("user")[1], ec.export("user")[1])
    states = bigger.optimizer.state_dict()["optimizers"]
    assert states["user"] == ec.optimizer.state_dict()["optimizers"]["user"]
    assert states["user"]["tables"] == [{"step": 1}]
    assert states["query"]["tables"] == [{"step": 0}]
    with pytest.raises(ValueError, match=r"no entry for \['query'\]"):
        bigger.optimizer.load_state_dict(ec.optimizer.state_dict())


def test_dense_state_must_match_when_strict(tmp_path):
    trained = trained_model()
    save(tmp_path, trained, step=1)
    other = TwoTables()
    other.extra = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"dense.safetensors: dense state does not match.*extra.weight"):
        load(tmp_path, other)
    other.dense = torch.nn.Linear(3, 1)
    with pytest.raises(CheckpointError, match=r"'dense.weight' has shape \(1, 12\) in the checkpoint"):
        load(tmp_path, other, strict=False)


def test_bad_arguments_write_nothing(tmp_path):
    trained = trained_model()
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        save(tmp_path, trained, step=-1)
    with pytest.raises(ValueError, match="step must be"):
        save(tmp_path, trained, step=True)
    with pytest.raises(TypeError, match="extra must be JSON-serializable"):
        save(tmp_path, trained, step=1, extra={"x": object()})
    with pytest.raises(ValueError, match="keep_last"):
        save(tmp_path, trained, step=1, keep_last=0)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        save(tmp_path, "model", step=1)
    with pytest.raises(TypeError, match="optimizer must have state_dict"):
        save(tmp_path, trained, object(), step=1)
    with pytest.raises(TypeError, match="cannot save a object at param_groups/0/x"):
        save(tmp_path, trained, _Opaque(), step=1)
    assert list(tmp_path.iterdir()) == []
    save(tmp_path, trained, step=1)
    with pytest.raises(ValueError, match="step-00000001 already exists"):
        save(tmp_path, trained, step=1)
    with pytest.raises(CheckpointError, match="nothing: no such directory"):
        load(tmp_path / "nothing", trained)


class _Opaque:
    def state_dict(self):
        return {"param_groups": [{"x": object()}]}

    def load_state_dict(self, state):
        pass


def test_optimizer_state_required_when_strict(tmp_path):
    trained = trained_model()
    save(tmp_path, trained, step=1)
    opt = torch.optim.SGD(trained.dense.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="no optimizer state was saved"):
        load(tmp_path, TwoTables(), opt)
    load(tmp_path, TwoTables(), opt, strict=False)


def test_load_a_given_checkpoint_directory_and_log_throughput(tmp_path, caplog):
    trained = trained_model()
    first = save(tmp_path, trained, step=1)
    train_step(trained, 6)
    save(tmp_path, trained, step=2)
    fresh = TwoTables()
    with caplog.at_level(logging.INFO, logger="dynemb.checkpoint"):
        assert load(first, fresh)["step"] == 1
    assert "MB/s" in caplog.text and "step-00000001" in caplog.text


def test_dense_state_names_skip_the_ddp_wrapper_and_old_wrapped_names_still_load(tmp_path):
    """A DistributedDataParallel wrapper is layout: its ``module.`` never shows in a file (it made ``dynemb serve``
    refuse the MLPs a torchrun run published), and files written with it load into the unwrapped model."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from dynemb.checkpoint.dense import check_dense, dense_state, load_dense

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = torch.nn.ModuleDict({"top": torch.nn.Sequential(torch.nn.Linear(3, 2))})
        wrapped = torch.nn.ModuleDict({"top": DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(3, 2)))})
        assert sorted(dense_state(wrapped)) == sorted(dense_state(plain)) == ["top.0.bias", "top.0.weight"]
        load_dense(wrapped, check_dense(wrapped, dense_state(plain), True, tmp_path))
        assert torch.equal(wrapped["top"].module[0].weight, plain["top"][0].weight)
        old = {k.replace("top.", "top.module."): v + 1 for k, v in dense_state(plain).items()}
        load_dense(plain, check_dense(plain, old, True, tmp_path))
        assert torch.equal(plain["top"][0].bias, old["top.module.0.bias"])
    finally:
        dist.destroy_process_group()


class _Compiled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin = dynemb.DynamicEmbedding(4, seed=3), torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.lin(self.emb(ids))


def test_a_compiled_model_names_its_tables_as_the_plain_model_and_old_wrapped_names_still_load(tmp_path, monkeypatch):
    """``torch.compile`` is layout: a compiled model's checkpoint named its table ``_orig_mod.emb`` and its dense
    weights ``_orig_mod.lin.weight``, so it did not load into the plain model (strict) and exports named the table
    by the wrapper. Now both forms save the same names, each loads into the other, and files written the old way
    still load."""
    from dynemb.checkpoint import dense as dense_module
    from dynemb.checkpoint import tables as tables_module

    ids = torch.tensor([5, -1, 2**40])
    plain = _Compiled()
    plain.emb(ids)
    compiled = torch.compile(plain)  # the module tree only: nothing is compiled until called
    assert list(find_tables(compiled)) == ["emb"] and list(find_tables(torch.compile(plain.emb))) == ["embedding"]
    save(tmp_path / "new", compiled, step=1)
    fresh = _Compiled()
    load(tmp_path / "new", fresh)  # strict
    assert torch.equal(fresh.emb(ids), plain.emb(ids)) and torch.equal(fresh.lin.weight, plain.lin.weight)
    again = _Compiled()
    load(tmp_path / "new", torch.compile(again))
    assert torch.equal(again.lin.bias, plain.lin.bias)
    with monkeypatch.context() as old:  # as versions before this one wrote them
        old.setattr(dense_module, "unwrap", lambda m: m)
        old.setattr(tables_module, "unwrap", lambda m: m)
        assert list(find_tables(compiled)) == ["_orig_mod.emb"]
        save(tmp_path / "old", compiled, step=1)
    fresh = _Compiled()
    load(tmp_path / "old", fresh)
    assert torch.equal(fresh.emb(ids), plain.emb(ids)) and torch.equal(fresh.lin.weight, plain.lin.weight)
