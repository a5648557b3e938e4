"""``export_for_serving(attach=...)``: files and manifest fields a version carries beside its tables (what
``dynemb.serving.export_model`` attaches its program with), covered by the manifest's checksums and digest."""

import pytest
import torch

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.checkpoint.errors import CheckpointError
from dynemb.checkpoint.export_format import read_attached, read_export


def test_attached_files_and_fields_are_in_the_version_and_checked(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=0)
    emb(torch.tensor([1, 2]))
    out = export_for_serving(tmp_path, emb, attach={"files": {"extra.bin": b"\x00abc"}, "fields": {"note": [1, 2]}})
    manifest, data = read_attached(out, "extra.bin")
    assert data == b"\x00abc" and manifest["note"] == [1, 2]
    assert read_export(tmp_path)[0]["files"]["extra.bin"]["bytes"] == 4
    (out / "extra.bin").write_bytes(b"\x00abd")
    with pytest.raises(CheckpointError, match="xxh3-128 checksum mismatch"):
        read_attached(out, "extra.bin")
    with pytest.raises(CheckpointError, match="no file 'other.bin'"):
        read_attached(out, "other.bin")


@pytest.mark.parametrize("attach", [{"fields": {"version": 3}}, {"other": {}}, [1]])
def test_attach_cannot_replace_the_manifests_own_fields(tmp_path, attach):
    emb = dynemb.DynamicEmbedding(4, seed=0)
    with pytest.raises(TypeError, match="attach must be a dict"):
        export_for_serving(tmp_path, emb, attach=attach)
    assert not (tmp_path / "latest").exists()
