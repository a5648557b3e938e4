"""EmbeddingCollection: many features over shared tables, pooled and sequence outputs, per-table optimizers.

    python examples/collection.py

Tables:
    item     dynamic int64 table shared by three features: the candidate item (one id per sample), the clicked
             items (a multi-hot bag, mean-pooled) and the watch history (a sequence, not pooled);
    user     dynamic, bounded to 300 rows with LRU eviction;
    country  static table of 50 rows (ids 0..49);
    tag_a,   two int32 dynamic tables of the same dim and optimizer; each keeps its own int32 ids, rows, seed
    tag_b    and optimizer step count, so it trains exactly as it would alone.
"""

import torch
from torch import nn

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig

D, B = 8, 64


def build() -> EmbeddingCollection:
    adagrad = dynemb.optim.Adagrad(lr=0.1)  # an unbound spec: each table gets its own bound copy
    tables = [
        TableConfig(name="item", dim=D, optimizer=adagrad, seed=1),
        TableConfig(name="user", dim=D, optimizer=dynemb.optim.Adam(lr=0.01), max_capacity=300, eviction="lru",
                    seed=2),
        TableConfig(name="country", dim=D, vocabulary_size=50, optimizer=adagrad, seed=3),
        TableConfig(name="tag_a", dim=D, key_dtype=torch.int32, optimizer=adagrad, seed=4),
        TableConfig(name="tag_b", dim=D, key_dtype=torch.int32, optimizer=adagrad, seed=5),
    ]
    features = [
        FeatureConfig(name="candidate", table="item"),
        FeatureConfig(name="clicked", table="item", combiner="mean", padding_value=-1),
        FeatureConfig(name="history", table="item", combiner="none"),
        FeatureConfig(name="user", table="user"),
        FeatureConfig(name="country", table="country"),
        FeatureConfig(name="tag_a", table="tag_a", combiner="sum"),
        FeatureConfig(name="tag_b", table="tag_b", combiner="sum"),
    ]
    return EmbeddingCollection(tables, features)


def items(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, 2000, shape, generator=g) * 7919 - 10**6


def batch(g: torch.Generator):
    """Inputs in the forms a feature accepts: ``[B]`` ids, padded ``[B, M]`` bags and ``(ids, offsets)``."""
    clicked = items(g, B, 5)
    clicked[:, 3:] = -1  # padding: skipped by the clicked feature's padding_value
    lengths = torch.randint(0, 6, (B,), generator=g)
    history = (items(g, int(lengths.sum())), torch.cumsum(lengths, 0) - lengths)  # jagged: ids + bag starts
    user = torch.randint(-(2**40), 2**40, (B,), generator=g) % 1000
    inputs = {"candidate": items(g, B), "clicked": clicked, "history": history, "user": user,
              "country": torch.randint(0, 50, (B,), generator=g),
              "tag_a": torch.randint(-5, 5, (B, 2), generator=g, dtype=torch.int32),
              "tag_b": torch.randint(-5, 5, (B, 3), generator=g, dtype=torch.int32)}
    labels = ((inputs["candidate"] // 7919) % 3 == 0).float()
    return inputs, labels


def main() -> None:
    torch.manual_seed(0)
    ec = build()
    print("tables:", {name: type(m).__name__ for name, m in ec.embeddings.items()})
    pooled = ["candidate", "clicked", "user", "country", "tag_a", "tag_b"]
    top = nn.Sequential(nn.Linear((len(pooled) + 1) * D, 32), nn.ReLU(), nn.Linear(32, 1))
    dense_opt = torch.optim.Adam(top.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        inputs, labels = batch(g)
        out = ec(inputs)  # one dedup + find/insert + gather per table, however many features use it
        if step == 0:
            for name, value in out.items():
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else \
                    f"Jagged(values {tuple(value.values.shape)}, offsets {tuple(value.offsets.shape)})"
                print(f"  {name:9s} -> {shape}")
        # The history sequence, mean-pooled here by hand, sits beside the pooled features.
        values, offsets = out["history"]
        lengths = torch.diff(offsets, append=torch.tensor([len(values)]))
        history = torch.zeros(B, D).index_add_(0, torch.repeat_interleave(torch.arange(B), lengths), values)
        history = history / lengths.clamp(min=1).unsqueeze(1)
        logits = top(torch.cat([out[f] for f in pooled] + [history], 1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        ec.optimizer.step()  # every table's sparse optimizer
        ec.optimizer.zero_grad()
        dense_opt.step()
        dense_opt.zero_grad()
        if step % 20 == 0 or step == 59:
            print(f"step {step:2d}  loss {loss.item():.4f}")
    sizes = {name: len(m.table) for name, m in ec.embeddings.items()}
    print("rows per table:", sizes)
    ids, values = ec.export("tag_b")  # the table the user configured: its own int32 ids
    print(f"tag_b export: {ids.numel()} ids {ids.dtype} in [{int(ids.min())}, {int(ids.max())}]")


if __name__ == "__main__":
    main()
