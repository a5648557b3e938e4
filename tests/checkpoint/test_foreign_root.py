"""``save`` and ``export_for_serving`` into a path that is not theirs: a file, or a directory of the user's files.
A save into a directory holding the user's ``latest`` replaced that file with its pointer; a file as the path said
``[Errno 17] File exists``."""

import json

import pytest
import torch

import dynemb
from dynemb.checkpoint import export_for_serving, load, save


def _emb():
    emb = dynemb.DynamicEmbedding(4, seed=0)
    emb(torch.tensor([1, 2, 3]))
    return emb


def _tree(root):
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else None) for p in root.rglob("*"))


@pytest.mark.parametrize("files, message", [
    ({"thesis.tex": "x"}, r"path .*user is not empty and holds no checkpoint \(thesis.tex\); save into a new or "
                          r"empty directory$"),
    ({"latest": "my notes"}, r"user/latest is not a checkpoint pointer \(.*unreadable JSON.*\); .*user holds no "
                             r"checkpoint: save into a new or empty directory$"),
    ({"latest": "[1, 2]"}, r"user/latest is not a checkpoint pointer \(.*expected a JSON object"),
])
def test_save_refuses_a_directory_of_user_files_and_changes_nothing(tmp_path, files, message):
    root = tmp_path / "user"
    root.mkdir()
    for name, text in files.items():
        (root / name).write_text(text)
    before = _tree(root)
    with pytest.raises(ValueError, match=message):
        save(root, _emb(), step=1)
    assert _tree(root) == before


def test_save_refuses_a_file(tmp_path):
    (tmp_path / "ckpt").write_text("x")
    with pytest.raises(ValueError, match=r"path .*ckpt is a file; a checkpoint root is a directory"):
        save(tmp_path / "ckpt", _emb(), step=1)
    with pytest.raises(ValueError, match=r"path .*ckpt is a file; a serving export root is a directory"):
        export_for_serving(tmp_path / "ckpt", _emb())
    assert (tmp_path / "ckpt").read_text() == "x"


def test_save_still_takes_new_empty_and_checkpoint_roots(tmp_path):
    emb = _emb()
    save(tmp_path / "new" / "deep", emb, step=1)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".hidden").write_text("x")  # a dot file (an editor's, a crashed save's temp) is no obstacle
    save(tmp_path / "empty", emb, step=1)
    save(tmp_path / "empty", emb, step=2)  # a root with checkpoints
    (tmp_path / "empty" / "README").write_text("notes beside my checkpoints")
    save(tmp_path / "empty", emb, step=3)
    assert json.loads((tmp_path / "empty" / "latest").read_text())["name"] == "step-00000003"
    # a root whose pointer is gone still holds checkpoints
    (tmp_path / "new" / "deep" / "latest").unlink()
    save(tmp_path / "new" / "deep", emb, step=2)
    fresh = dynemb.DynamicEmbedding(4, seed=1)
    assert load(tmp_path / "new" / "deep", fresh)["step"] == 2 and len(fresh) == 3
