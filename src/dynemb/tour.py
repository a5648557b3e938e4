"""A short printed tour of the table API (the demo until the training demo lands)."""

from __future__ import annotations

import torch

from .embedding import DynamicEmbedding


def run_tour() -> None:
    torch.manual_seed(0)
    show = print
    evicted = []
    emb = DynamicEmbedding(4, max_capacity=4, eviction="lru", seed=7, on_evict=lambda k, v, s: evicted.append(k))
    ids = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    show("1. Any int64 is a key, including 0, -1, max and min:")
    show(f"   emb(ids) for ids={ids.tolist()} -> shape {tuple(emb(ids).shape)}, size={len(emb)}")
    show("2. The table is bounded (max_capacity=4, lru): two new ids evict the two least recent:")
    emb(torch.tensor([2**63 - 1, -(2**63)]))
    emb(torch.tensor([10, 11]))
    show(f"   evicted keys: {torch.cat(evicted).tolist()}  size={len(emb)}  stats={emb.table.stats()['evicted']}")
    show("3. Eval lookups insert nothing and return the row a key would be initialized with:")
    emb.eval()
    unseen = emb(torch.tensor([12345]))
    emb.train()
    created = emb(torch.tensor([12345]))
    show(f"   unseen row == row created later: {torch.equal(unseen, created)}")
    show("4. upsert / accum / remove / export:")
    emb.upsert(torch.tensor([7]), torch.ones(1, 4))
    old, exists = emb.lookup(torch.tensor([7]), return_exists=True)
    emb.accum(torch.tensor([7]), old, old + 0.5, exists)
    show(f"   row 7 after accum(+0.5): {emb.lookup(torch.tensor([7])).tolist()}")
    emb.remove(torch.tensor([7, 999]))
    keys, values, scores = emb.export(with_scores=True)
    show(f"   exported {keys.numel()} rows; keys={keys.tolist()} scores={scores.tolist()}")
    show("5. state_dict round trip:")
    clone = DynamicEmbedding(4)
    clone.load_state_dict(emb.state_dict())
    show(f"   equal after load: {torch.equal(clone.export()[1], values)}")
