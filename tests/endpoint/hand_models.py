"""Two models written by hand, as a user would, for ``export_model`` + ``dynemb serve --export``.

- :class:`DLRM`: TorchRec's DLRM layout (bottom MLP, pairwise dot interactions, top MLP), its sparse features fed
  as a ``KeyedJaggedTensor``. torchrec is not installed here, so :class:`KJT` stands in for it: the part of its API
  the collection reads (``keys``, ``values``, ``lengths``, ``weights_or_none``, ``to_dict``) and a pytree
  registration as torchrec gives its KJT (values and lengths the leaves, the keys the context), so a model taking
  one exports as it would with torchrec's.
- :class:`TwoTower`: a user tower (user id, a multi-hot history of tags as ``Bags(ids, lengths=...)``) and an
  item tower, each with a collection of its own, scored by the dot product of the towers' outputs.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch import nn

import dynemb
from dynemb import EmbeddingCollection, FeatureConfig, TableConfig
from dynemb.collection.features import Bags


class KJT:
    """A ``KeyedJaggedTensor`` stand-in: ``values [N]`` and ``lengths [F * B]`` key-major, as TorchRec lays them out."""

    def __init__(self, keys, values: torch.Tensor, lengths: torch.Tensor) -> None:
        self._keys, self._values, self._lengths = list(keys), values, lengths

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def lengths(self):
        return self._lengths

    def weights_or_none(self):
        return None

    def to_dict(self):
        per_key = self._lengths.view(len(self._keys), -1)
        parts = torch.split(self._values, per_key.sum(1).tolist())
        return {k: Bags(v, lengths=n) for k, v, n in zip(self._keys, parts, per_key)}


pytree.register_pytree_node(
    KJT, lambda k: ([k._values, k._lengths], k._keys), lambda children, keys: KJT(keys, *children),
    flatten_with_keys_fn=lambda k: ([(pytree.GetAttrKey("values"), k._values),
                                     (pytree.GetAttrKey("lengths"), k._lengths)], k._keys))


class DLRM(nn.Module):
    """``forward(dense [B, 4], sparse: KJT of F features) -> logits [B]``."""

    def __init__(self, features: int = 3, dim: int = 8, dense: int = 4) -> None:
        super().__init__()
        self.keys = [f"cat_{i}" for i in range(features)]
        opt = dynemb.optim.Adagrad(lr=0.5)
        self.sparse_arch = EmbeddingCollection(
            [TableConfig(name=f"t_cat_{i}", dim=dim, optimizer=opt) for i in range(features)],
            [FeatureConfig(name=k, table=f"t_cat_{i}", combiner="sum") for i, k in enumerate(self.keys)])
        self.dense_arch = nn.Sequential(nn.Linear(dense, 16), nn.ReLU(), nn.Linear(16, dim), nn.ReLU())
        pairs = (features + 1) * features // 2
        self.over_arch = nn.Sequential(nn.Linear(dim + pairs, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, sparse: KJT) -> torch.Tensor:
        x = self.dense_arch(dense)
        pooled = self.sparse_arch(sparse)
        z = torch.stack([x] + [pooled[k] for k in self.keys], 1)
        inter = torch.bmm(z, z.transpose(1, 2))
        i, j = torch.triu_indices(z.shape[1], z.shape[1], 1)
        return self.over_arch(torch.cat([x, inter[:, i, j]], 1)).squeeze(1)


class TwoTower(nn.Module):
    """``forward(user_id [B], history [N], history_lengths [B], item_id [B]) -> scores [B]``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        opt = dynemb.optim.Adagrad(lr=0.5)
        self.user_tower_embeddings = EmbeddingCollection(
            [TableConfig(name="user", dim=dim, optimizer=opt), TableConfig(name="tag", dim=dim, optimizer=opt)],
            [FeatureConfig(name="user_id", table="user"), FeatureConfig(name="history", table="tag")])
        self.item_tower_embeddings = EmbeddingCollection([TableConfig(name="item", dim=dim, optimizer=opt)],
                                                         [FeatureConfig(name="item_id", table="item")])
        self.user_tower = nn.Sequential(nn.Linear(2 * dim, 16), nn.ReLU(), nn.Linear(16, dim))
        self.item_tower = nn.Sequential(nn.Linear(dim, 16), nn.ReLU(), nn.Linear(16, dim))

    def forward(self, user_id, history, history_lengths, item_id) -> torch.Tensor:
        u = self.user_tower_embeddings({"user_id": user_id, "history": Bags(history, lengths=history_lengths)})
        i = self.item_tower_embeddings({"item_id": item_id})
        user = self.user_tower(torch.cat([u["user_id"], u["history"]], 1))
        return (user * self.item_tower(i["item_id"])).sum(1)


def dlrm_batch(model: DLRM, rows: int, g: torch.Generator, ids: int = 50) -> tuple:
    lengths = torch.randint(0, 3, (len(model.keys) * rows,), generator=g)
    values = torch.randint(0, ids, (int(lengths.sum()),), generator=g)
    return torch.randn(rows, 4, generator=g), KJT(model.keys, values, lengths)


def two_tower_batch(rows: int, g: torch.Generator, ids: int = 40) -> tuple:
    lengths = torch.randint(0, 4, (rows,), generator=g)
    return (torch.randint(0, ids, (rows,), generator=g), torch.randint(0, ids, (int(lengths.sum()),), generator=g),
            lengths, torch.randint(0, ids, (rows,), generator=g))


def train(model: nn.Module, batches, steps: int) -> None:
    """A few steps of logistic loss on random labels: the tables grow, the MLPs move."""
    dense = torch.optim.SGD([p for p in model.parameters()], lr=0.05)
    sparse = [m.optimizer for m in model.modules() if isinstance(m, EmbeddingCollection)]
    model.train()
    for _ in range(steps):
        batch = batches()
        logits = model(*batch)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, (torch.rand(logits.shape) > 0.5).float())
        loss.backward()
        dense.step()
        dense.zero_grad()
        for opt in sparse:
            opt.step()
            opt.zero_grad()


class SparseOnly(nn.Module):
    """``forward(sparse: KJT of F features) -> scores [B]``: fed by a ``KeyedJaggedTensor`` alone, so no input has
    a row per sample (its batch size is the KJT's stride, ``lengths.numel() // F``)."""

    def __init__(self, features: int = 3, dim: int = 8) -> None:
        super().__init__()
        self.keys = [f"cat_{i}" for i in range(features)]
        self.sparse_arch = EmbeddingCollection(
            [TableConfig(name=f"s_cat_{i}", dim=dim) for i in range(features)],
            [FeatureConfig(name=k, table=f"s_cat_{i}", combiner="sum") for i, k in enumerate(self.keys)])
        self.over_arch = nn.Linear(features * dim, 1)

    def forward(self, sparse: KJT) -> torch.Tensor:
        pooled = self.sparse_arch(sparse)
        return self.over_arch(torch.cat([pooled[k] for k in self.keys], 1)).squeeze(1)


def sparse_only_batch(model: SparseOnly, rows: int, g: torch.Generator, ids: int = 50) -> tuple:
    lengths = torch.randint(0, 3, (len(model.keys) * rows,), generator=g)
    return (KJT(model.keys, torch.randint(0, ids, (int(lengths.sum()),), generator=g), lengths),)
