"""Checkpoints: save a model with dynamic tables and its optimizers, load it into a fresh process state, resume.

    python examples/checkpoint_resume.py

A run of 40 steps is compared with a run that stops at step 20, saves, is rebuilt from scratch (other seeds), loads
the checkpoint and continues: both end bit-identical, tables, optimizer slots and dense weights alike. Saves are
atomic (a crash leaves ``latest`` at the previous complete checkpoint); ``incremental=True`` writes only the rows
changed since the previous save.
"""

import json
import tempfile
from pathlib import Path

import torch
from torch import nn

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import load, save


class Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        tables = [TableConfig(name="user", dim=8, optimizer=dynemb.optim.Adam(lr=0.01), max_capacity=500),
                  TableConfig(name="item", dim=8, optimizer=dynemb.optim.RowWiseAdagrad(lr=0.1))]
        self.embeddings = EmbeddingCollection(tables, [FeatureConfig(name=t.name, table=t.name) for t in tables])
        self.top = nn.Linear(16, 1)

    def forward(self, inputs: dict) -> torch.Tensor:
        out = self.embeddings(inputs)
        return self.top(torch.cat([out["user"], out["item"]], 1)).squeeze(1)


class Optimizers:
    """The tables' sparse optimizers and the dense Adam as one object: ``save``/``load`` take one optimizer."""

    def __init__(self, model: Model) -> None:
        self.sparse, self.dense = model.embeddings.optimizer, torch.optim.Adam(model.top.parameters(), lr=0.01)

    def step(self) -> None:
        self.sparse.step()
        self.dense.step()
        self.sparse.zero_grad()
        self.dense.zero_grad()

    def state_dict(self) -> dict:
        return {"sparse": self.sparse.state_dict(), "dense": self.dense.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sparse.load_state_dict(state["sparse"])
        self.dense.load_state_dict(state["dense"])


def train(model: Model, opt: Optimizers, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)  # batch i is the same in every run
        inputs = {"user": torch.randint(-(2**62), 2**62, (128,), generator=g) % 2000,
                  "item": torch.randint(0, 300, (128,), generator=g) * 2**50}
        labels = (inputs["user"] % 2).float()
        nn.functional.binary_cross_entropy_with_logits(model(inputs), labels).backward()
        opt.step()


def same(a: Model, b: Model) -> bool:
    for name, emb in a.embeddings.embeddings.items():
        other = b.embeddings.embeddings[name]
        keys, values = emb.export()
        other_keys, other_values = other.export()
        if not (torch.equal(keys, other_keys) and torch.equal(values, other_values)):
            return False
        if any(not torch.equal(emb.table.slot(s)[: len(emb)], other.table.slot(s)[: len(other)])
               for s in emb.table.slot_names):
            return False
    return all(torch.equal(p, q) for p, q in zip(a.top.parameters(), b.top.parameters()))


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        straight = Model(seed=0)
        opt = Optimizers(straight)
        train(straight, opt, range(0, 20))
        path = save(root, straight, opt, step=20, extra={"note": "after 20 steps"})
        print(f"saved {path.name}: {sorted(p.name for p in path.iterdir())}")
        train(straight, opt, range(20, 30))
        delta = save(root, straight, opt, step=30, incremental=True)
        manifest = json.loads((delta / "manifest.json").read_text())
        changed = {n: t["shards"][0]["changed_rows"] for n, t in manifest["tables"].items()}
        print(f"saved {delta.name} ({manifest['kind']}, parent {manifest['parent']}): changed rows {changed}")
        train(straight, opt, range(30, 40))

        resumed = Model(seed=1)  # different initial weights and table seeds: the checkpoint replaces them
        resumed_opt = Optimizers(resumed)
        info = load(Path(root) / "step-00000020", resumed, resumed_opt)
        print(f"loaded step {info['step']} ({info['extra']['note']})")
        train(resumed, resumed_opt, range(20, 40))
        print("resumed run equals uninterrupted run:", same(straight, resumed))

        chained = Model(seed=2)
        chained_opt = Optimizers(chained)
        print(f"loaded latest: step {load(root, chained, chained_opt)['step']} (full checkpoint + delta)")
        train(chained, chained_opt, range(30, 40))
        print("resume from the incremental checkpoint equals it too:", same(straight, chained))


if __name__ == "__main__":
    main()
