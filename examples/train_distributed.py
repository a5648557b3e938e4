"""Train a small CTR model with sharded dynamic embeddings and a DDP-replicated MLP.

    torchrun --nproc_per_node=2 examples/train_distributed.py            # CPU, gloo
    torchrun --nproc_per_node=8 examples/train_distributed.py --cuda     # GPUs, NCCL

Embedding rows live on their owner rank (row-wise sharding, key % world_size); the dense MLP is replicated with
torch's DistributedDataParallel. Each rank reads its own slice of the data.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dynemb
from dynemb import DistributedEmbeddingCollection, FeatureConfig, TableConfig

FEATURES = ["user", "item", "category"]


def batch(step: int, rank: int, size: int, dim: int = 8):
    """Synthetic clicks: the label depends on a hidden per-id score, so the model has something to learn."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    ids = {f: (torch.randint(0, 500, (size,), generator=g) ** 2) * (1 + i) - 7 for i, f in enumerate(FEATURES)}
    score = sum(torch.sin(v.double() * 0.37 + i) for i, v in enumerate(ids.values()))
    return ids, (score > 0).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--cuda", action="store_true", help="use NCCL and one GPU per rank")
    args = parser.parse_args()
    backend = "nccl" if args.cuda else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    tables = [TableConfig(name=f, dim=args.dim, optimizer=dynemb.optim.Adagrad(lr=0.1, fused=True), seed=i)
              for i, f in enumerate(FEATURES)]
    embeddings = DistributedEmbeddingCollection(tables, [FeatureConfig(name=f, table=f) for f in FEATURES],
                                                timeout=120, device=device)
    mlp = nn.Sequential(nn.Linear(len(FEATURES) * args.dim, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    mlp = DistributedDataParallel(mlp, device_ids=[device.index] if args.cuda else None)
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=1e-2)

    for step in range(args.steps):
        ids, labels = batch(step, rank, args.batch_size + 37 * rank)  # uneven batches across ranks
        out = embeddings({f: v.to(device) for f, v in ids.items()})
        logits = mlp(torch.cat([out[f] for f in FEATURES], 1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels.to(device))
        loss.backward()
        embeddings.optimizer.step()  # no-op for fused tables: they updated during backward
        embeddings.optimizer.zero_grad()
        dense_opt.step()
        dense_opt.zero_grad()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            rows = sum(len(m) for m in embeddings.embeddings.values())
            print(f"step {step:4d}  loss {loss.item():.4f}  rows on rank 0: {rows}", flush=True)
    # Leave together: a rank that tears its group down while a peer still talks to it can abort that peer.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
