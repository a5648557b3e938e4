"""``keep_last`` keeps the most recent checkpoints and every checkpoint their incremental chains need."""

from __future__ import annotations

import torch

import dynemb
from dynemb.checkpoint import load, save


def _names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_keep_last_never_breaks_a_chain(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=0)
    expected = {
        (1, False): [1],
        (2, True): [1, 2],
        (3, True): [1, 2, 3],  # 3 and 2 are the newest; 3 -> 2 -> 1
        (4, False): [1, 2, 3, 4],  # 4 and 3 are the newest; 3 still needs 2 and 1
        (5, True): [4, 5],  # 5 -> 4
        (6, False): [4, 5, 6],  # 6 and 5 are the newest; 5 -> 4
    }
    for (step, incremental), kept in expected.items():
        emb(torch.arange(step * 10))
        save(tmp_path, emb, step=step, incremental=incremental, keep_last=2)
        assert _names(tmp_path) == [f"step-{s:08d}" for s in kept], step
    fresh = dynemb.DynamicEmbedding(4, seed=1)
    assert load(tmp_path / "step-00000005", fresh)["kind"] == "incremental"
    assert torch.equal(fresh.export()[0].sort().values, torch.arange(50))


def test_keep_last_removes_temp_dirs_older_than_every_kept_checkpoint(tmp_path):
    emb = dynemb.DynamicEmbedding(4, seed=0)
    stale = tmp_path / ".tmp-step-00000002-123-abcd"  # left by a crash before the oldest kept checkpoint
    stale.mkdir(parents=True)
    save(tmp_path, emb, step=1)
    live = tmp_path / ".tmp-step-00000009-456-ef01"  # may belong to a writer still running
    live.mkdir()
    save(tmp_path, emb, step=3, keep_last=5)
    assert not stale.exists() and live.exists()
    assert _names(tmp_path) == ["step-00000001", "step-00000003"]
