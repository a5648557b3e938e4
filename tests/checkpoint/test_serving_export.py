"""``export_for_serving``: full exports of keys and values, and deltas that turn one export into the next."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import safetensors.torch
import torch
import xxhash
from ckpt_util import train_step, trained_model

from dynemb.checkpoint import CheckpointError, export_for_serving, read_chain, read_export, save


def _read(directory) -> tuple[dict, dict]:
    """``(manifest, {table: (keys, values, deleted_keys)})`` of one export, checking each file's xxh3-128 checksum."""
    manifest = json.loads((directory / "manifest.json").read_text())
    tables = {}
    for name, entry in manifest["tables"].items():
        raw = (directory / entry["file"]).read_bytes()
        record = manifest["files"][entry["file"]]
        assert record == {"algorithm": "xxh3-128", "checksum": xxhash.xxh3_128(raw).hexdigest(), "bytes": len(raw)}
        assert (entry["algorithm"], entry["checksum"]) == (record["algorithm"], record["checksum"])
        t = safetensors.torch.load(raw)
        tables[name] = (t["keys"], t["values"], t.get("deleted_keys"))
    return manifest, tables


def _as_dict(keys, values) -> dict:
    return dict(zip(keys.tolist(), values.tolist()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_full_export_has_keys_and_values_only(tmp_path, dtype):
    model = trained_model()
    directory = export_for_serving(tmp_path, model, dtype=dtype)
    manifest, tables = _read(directory)
    assert manifest["format"] == "dynemb.serving" and manifest["version"] == 1 and manifest["kind"] == "full"
    assert json.loads((tmp_path / "latest").read_text())["name"] == "version-00000001"
    user = manifest["tables"]["user"]
    assert (user["dim"], user["dtype"], user["key_dtype"]) == (8, str(dtype).removeprefix("torch."), "int64")
    assert user["rows"] == user["size"] == len(model.user)
    assert user["seed"] == model.user.table.seed and user["initializer"]["type"] == "uniform"
    keys, values, deleted = tables["user"]
    rows = model.user.table.export()
    assert torch.equal(keys, rows.keys) and torch.equal(values, rows.values.to(dtype)) and deleted is None
    assert tables["item"][0].dtype == torch.int32


def test_delta_exports_replay_to_the_current_table(tmp_path):
    model = trained_model()
    _, tables = _read(export_for_serving(tmp_path, model))
    served = {name: _as_dict(k, v) for name, (k, v, _) in tables.items()}
    for step in (6, 7, 8):
        train_step(model, step)
        save(tmp_path / "ckpt", model, step=step)  # a checkpoint in between must not eat the export's deletions
        manifest, tables = _read(export_for_serving(tmp_path, model, incremental=True))
        assert manifest["kind"] == "delta" and manifest["version"] == step - 4
        for name, (keys, values, deleted) in tables.items():
            for key in deleted.tolist():
                served[name].pop(key, None)
            served[name].update(_as_dict(keys, values))
            assert manifest["tables"][name]["rows"] < manifest["tables"][name]["size"]
    for name, emb in (("user", model.user), ("item", model.item)):
        keys, values = emb.export()
        assert served[name] == _as_dict(keys, values)


def test_first_delta_export_is_full(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dynemb.checkpoint"):
        directory = export_for_serving(tmp_path, trained_model(), incremental=True)
    assert json.loads((directory / "manifest.json").read_text())["kind"] == "full"
    assert "writing a full one" in caplog.text


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match="dtype must be one of"):
        export_for_serving(tmp_path, trained_model(), dtype=torch.int16)  # int8 and float8 are 8-bit rows
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        export_for_serving(tmp_path, {})
    assert list(tmp_path.iterdir()) == []


def test_every_export_names_its_model_version_parent_and_digest(tmp_path):
    model = trained_model()
    full = _read(export_for_serving(tmp_path, model))[0]
    train_step(model, 6)
    delta = _read(export_for_serving(tmp_path, model, incremental=True))[0]
    again = _read(export_for_serving(tmp_path, model))[0]
    stored = json.loads((tmp_path / "model.json").read_text())["model"]
    assert stored.startswith(tmp_path.name) and full["model"] == delta["model"] == again["model"] == stored
    assert (full["version"], full["parent_version"], full["parent_digest"]) == (1, None, None)
    assert (delta["kind"], delta["parent_version"], delta["parent_digest"]) == ("delta", 1, full["digest"])
    assert (again["kind"], again["parent_version"], again["parent_digest"]) == ("full", 2, delta["digest"])
    for manifest in (full, delta, again):
        body = {k: v for k, v in manifest.items() if k != "digest"}
        assert manifest["digest"] == hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert len({full["digest"], delta["digest"], again["digest"]}) == 3


def test_model_name_is_stored_by_the_first_export_and_checked_after(tmp_path):
    model = trained_model()
    assert _read(export_for_serving(tmp_path, model, model_name="ctr"))[0]["model"] == "ctr"
    assert _read(export_for_serving(tmp_path, model))[0]["model"] == "ctr"  # the root's id, without model_name
    with pytest.raises(ValueError, match="model_name is 'other' but .* holds exports of model 'ctr'"):
        export_for_serving(tmp_path, model, model_name="other")
    with pytest.raises(TypeError, match="model_name must be a non-empty str"):
        export_for_serving(tmp_path, model, model_name="")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "model.json", "version-00000001",
                                                          "version-00000002"]


def test_read_export_refuses_a_changed_manifest_and_read_chain_follows_deltas(tmp_path):
    model = trained_model()
    export_for_serving(tmp_path, model)
    train_step(model, 6)
    export_for_serving(tmp_path, model, incremental=True)
    train_step(model, 7)
    last = export_for_serving(tmp_path, model, incremental=True)
    chain = read_chain(tmp_path)
    assert [(m["version"], m["kind"]) for m, _ in chain] == [(1, "full"), (2, "delta"), (3, "delta")]
    assert [m["version"] for m, _ in read_chain(tmp_path / "version-00000002")] == [1, 2]
    manifest = json.loads((last / "manifest.json").read_text())
    manifest["parent_version"] = 1
    (last / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not match its content"):
        read_export(tmp_path)


def test_a_first_export_never_writes_into_a_users_directory(tmp_path):
    """An export writes ``model.json`` and ``latest`` into its root: a directory holding anything else (a user's
    ``model.json`` included) is refused before anything is written, and its files stay as they were."""
    model = trained_model()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"mine is not empty and holds no serving export \(notes.txt\)"):
        export_for_serving(mine, model)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "model.json").write_text('{"layers": 3}')
    with pytest.raises(ValueError, match="is not a serving export's model file"):
        export_for_serving(tmp_path / "theirs", model)
    assert (tmp_path / "theirs" / "model.json").read_text() == '{"layers": 3}'
    run = tmp_path / "run"  # a `dynemb train` run directory: its card is a model.json with "model": "dlrm"
    (run / "checkpoint").mkdir(parents=True)
    card = '{"format": "dynemb.run", "version": 2, "model": "dlrm"}'
    (run / "model.json").write_text(card)
    with pytest.raises(ValueError, match="run directory's model card: .*run is not an export root"):
        export_for_serving(run, model)  # it was taken for an export root of model 'dlrm': the run then broke
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "model.json"]
    assert (run / "model.json").read_text() == card
    (tmp_path / "a-file").write_text("keep me")
    with pytest.raises(ValueError, match="path .*a-file is a file; export to a new or empty directory"):
        export_for_serving(tmp_path / "a-file", model)  # was FileExistsError '[Errno 17] File exists'
    assert (tmp_path / "a-file").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    first = export_for_serving(empty, model)
    assert export_for_serving(empty, model) != first  # the root's second export is a new version
