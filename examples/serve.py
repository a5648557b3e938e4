"""Serving: export trained tables, load them into a ParameterServer (cache -> memory -> LMDB), look them up with
HPS-style layers, and apply an online delta update from further training.

    python examples/serve.py

The parameter server reads a JSON config with HPS field names. Each lookup deduplicates its ids and reads them
from the cache (a bounded LRU table), then the volatile tier (here the in-process memory store; Redis works the
same way), then the persistent tier (here LMDB); ids found nowhere get a default row. A delta export holds only
the rows written (and keys deleted) since the previous export; ``apply_update`` replaces each row atomically.
"""

import json
import tempfile
from pathlib import Path

import torch
from torch import nn

import dynemb
from dynemb.checkpoint import export_for_serving
from dynemb.functional import embedding_lookup_sparse
from dynemb.serving import LookupLayer, ParameterServer, SparseLookupLayer

D = 8


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = dynemb.DynamicEmbedding(D, seed=0, initializer="normal")
        self.item = dynemb.DynamicEmbedding(D, seed=1)
        self.optimizer = dynemb.optim.Adagrad([self.user, self.item], lr=0.1)

    def train_steps(self, steps: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            users = torch.randint(0, 5000, (256,), generator=g) * 104729 - 2**40
            items = torch.randint(0, 3000, (256 * 4,), generator=g) - 1500  # 4 items per user, mean-pooled
            pooled = embedding_lookup_sparse(self.item, items, torch.arange(0, 1024, 4), combiner="mean")
            score = (self.user(users) * pooled).sum(1)
            nn.functional.binary_cross_entropy_with_logits(score, (users % 3 == 0).float()).backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def main() -> None:
    torch.manual_seed(0)
    model = Towers()
    model.train_steps(20, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        full = export_for_serving(tmp / "export", model)  # version-1: every row of "user" and "item"
        print(f"exported {full.name}: {len(model.user)} user rows, {len(model.item)} item rows")

        config = {
            "models": [{
                "model": "ctr",
                "sparse_files": [str(tmp / "export")],
                "embedding_table_names": ["user", "item"],
                "embedding_vecsize_per_table": [D, D],
                "default_value_for_each_table": ["initializer", 0.0],
                "cache_fraction": 0.1,
            }],
            # A memory tier smaller than the tables, so some rows are served from LMDB.
            "volatile_db": {"type": "memory", "max_rows_per_table": 1000},
            "persistent_db": {"type": "lmdb", "path": str(tmp / "lmdb")},
        }
        (tmp / "ps.json").write_text(json.dumps(config, indent=2))
        ps = ParameterServer.from_config(tmp / "ps.json")
        ps.load("ctr", progress=False)

        user_layer = LookupLayer("ctr", "user", ps=ps)
        item_layer = SparseLookupLayer("ctr", "item", ps=ps)
        trained = model.user.export()[0]
        users = torch.cat([trained[:510], torch.tensor([123, -5])]).view(2, 256)  # 123 and -5 were never trained
        items = torch.tensor([[-1500, 3, 7, 7], [0, 1, 2, 3]])
        model.eval()  # eval lookups insert nothing: they are what serving should return
        for _ in range(3):  # cold cache, then warm
            served_users, served_items = user_layer(users), item_layer(items, combiner="mean")
        assert torch.equal(served_users, model.user(users))  # unknown ids: the row training would have created
        assert torch.equal(served_items, embedding_lookup_sparse(model.item, items, combiner="mean"))
        print(f"LookupLayer {tuple(users.shape)} -> {tuple(served_users.shape)}, "
              f"SparseLookupLayer {tuple(items.shape)} -> {tuple(served_items.shape)}: equal to training lookups")

        model.train()
        model.train_steps(5, seed=1)
        delta = export_for_serving(tmp / "export", model, incremental=True)  # version-2: changed rows only
        rows = json.loads((delta / "manifest.json").read_text())["tables"]
        print(f"delta {delta.name}: {rows['user']['rows']} user rows, {rows['item']['rows']} item rows changed")
        print(f"applied version {ps.apply_update(delta)['ctr']['version']} while serving")
        model.eval()
        assert torch.equal(user_layer(users), model.user(users))
        assert torch.equal(item_layer(items, combiner="mean"), embedding_lookup_sparse(model.item, items))
        print("after the online update, served rows equal the newly trained ones")

        for name, s in ps.stats("ctr")["tables"].items():
            print(f"  {name}: {s['lookups']} ids looked up, hit rate {s['hit_rate']:.2f} "
                  f"(cache {s['cache']}, memory {s['volatile']}, lmdb {s['persistent']}, default {s['default']})")
        ps.close()


if __name__ == "__main__":
    main()
