"""Train a small CTR model with sharded dynamic embeddings and a DDP-replicated MLP.

    torchrun --nproc_per_node=2 examples/train_distributed.py            # CPU, gloo
    torchrun --nproc_per_node=8 examples/train_distributed.py --cuda     # GPUs, NCCL
    torchrun --nproc_per_node=2 examples/train_distributed.py --checkpoint ckpt --save-every 20

Embedding rows live on their owner rank (row-wise sharding, key % world_size); the dense MLP is replicated with
torch's DistributedDataParallel. Each rank reads its own slice of the data.

With ``--checkpoint DIR`` it resumes from DIR's latest checkpoint (saved at any world size) and saves there every
``--save-every`` steps in the background (``save(..., blocking=False)``: training goes on while the files are
written) and at the end.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dynemb
from dynemb import DistributedEmbeddingCollection, FeatureConfig, TableConfig
from dynemb.checkpoint import load, save

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
    parser.add_argument("--checkpoint", help="checkpoint directory: resume from it, save into it")
    parser.add_argument("--save-every", type=int, default=0, help="steps between background saves (0: at the end)")
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

    # What a checkpoint holds: the tables (with their optimizer state) and the MLP (not its DDP wrapper).
    model = nn.ModuleDict({"embeddings": embeddings, "mlp": mlp.module})
    first, pending = 0, None
    if args.checkpoint and os.path.exists(os.path.join(args.checkpoint, "latest")):
        manifest = load(args.checkpoint, model, dense_opt)  # any saved world size: rows move to their new owners
        first = manifest["step"]
        if rank == 0:
            print(f"resumed at step {first} (saved by {manifest['world_size']} ranks, now {dist.get_world_size()})",
                  flush=True)

    for step in range(first, args.steps):
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
        if args.checkpoint and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            if pending is not None:
                pending.wait()  # raises, on every rank, what the previous save raised
            pending = save(args.checkpoint, model, dense_opt, step=step + 1, keep_last=2, blocking=False)
    if args.checkpoint and first < args.steps:
        save(args.checkpoint, model, dense_opt, step=args.steps, keep_last=2)  # waits for `pending` first
        if pending is not None:
            pending.wait()
        if rank == 0:
            print(f"saved step {args.steps} to {args.checkpoint}", flush=True)
    # Leave together: a rank that tears its group down while a peer still talks to it can abort that peer.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
