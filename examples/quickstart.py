"""Quickstart: one dynamic embedding table, trained with a sparse optimizer, bounded by eviction, then exported.

    python examples/quickstart.py

Ids are arbitrary int64 values (negative ones and the extremes included); the table grows as new ids arrive and,
past ``max_capacity``, evicts the least frequently used rows. The model learns a hidden 0/1 label per id.
"""

import tempfile

import torch

import dynemb
from dynemb.checkpoint import export_for_serving

torch.manual_seed(0)
VOCAB = torch.cat([torch.tensor([-(2**63), 2**63 - 1, -1, 0]), torch.randint(-(2**62), 2**62, (4996,))])
HIDDEN = torch.randint(0, 2, (VOCAB.numel(),)).float()  # the label of each id


def batch(size: int = 256):
    """Power-law traffic: a few ids are frequent, most are rare."""
    idx = (torch.rand(size) ** 3 * VOCAB.numel()).long()
    return VOCAB[idx], HIDDEN[idx]


def main() -> None:
    emb = dynemb.DynamicEmbedding(8, max_capacity=2000, eviction="lfu", seed=0)
    sparse_opt = dynemb.optim.Adagrad([emb], lr=0.2)  # its per-row state lives in the table, beside each row
    head = torch.nn.Linear(8, 1)
    dense_opt = torch.optim.Adam(head.parameters(), lr=0.01)
    loss_fn = torch.nn.BCEWithLogitsLoss()

    losses = []
    for step in range(300):
        ids, labels = batch()
        loss = loss_fn(head(emb(ids)).squeeze(1), labels)  # training mode: unseen ids are inserted
        loss.backward()
        sparse_opt.step()  # updates only the rows this batch touched
        dense_opt.step()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        losses.append(loss.item())
        if step % 100 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  rows {len(emb):5d}  evicted {emb.table.evicted}")
    print(f"loss: first 20 steps {sum(losses[:20]) / 20:.4f} -> last 20 steps {sum(losses[-20:]) / 20:.4f}")

    stats = emb.table.stats()
    assert stats["size"] + stats["evicted"] == stats["inserted"] - stats["removed"]  # no key is lost silently
    print(f"table: {stats['size']} rows (max {stats['max_capacity']}), {stats['evicted']} evicted, "
          f"{stats['bytes'] / 1e6:.2f} MB")

    emb.eval()  # eval mode: lookups of unseen ids return their initializer row and insert nothing
    probe = torch.tensor([2**63 - 1, 123456789])
    values, found = emb.find(probe, return_exists=True)
    print(f"lookup {probe.tolist()}: found {found.tolist()}, shape {tuple(values.shape)}")

    keys, values = emb.export()
    print(f"export: keys {tuple(keys.shape)} {keys.dtype}, values {tuple(values.shape)}")
    with tempfile.TemporaryDirectory() as root:
        out = export_for_serving(root, emb, dtype=torch.float16)
        print(f"serving export written to {out.name}/ ({len(keys)} rows, float16)")


if __name__ == "__main__":
    main()
