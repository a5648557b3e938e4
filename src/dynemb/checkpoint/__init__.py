"""Checkpoints: atomic save/load of dynamic tables with optimizer state, incremental deltas, serving export.

Layout of a checkpoint root (format ``dynemb.checkpoint``, version 1)::

    root/
      latest                        {"name": "step-00000123", "step": 123}, replaced atomically
      step-00000123/
        manifest.json               written last: kind (full | incremental), parent, step, world_size,
                                    partitioner, per-table config + shards (rank, file, rows, counters),
                                    dense/optimizer file names, per-file checksum (xxh3-128) and size, extra
        tables/000-<name>.rank-00000-of-00001.safetensors
                                    keys [N], values [N, D], scores [N], slot.<name> [N, d]
                                    (+ deleted_keys [K] and, if rows were deleted, order [N] in a delta)
        dense.safetensors           every state_dict entry outside DynamicEmbeddings
        optimizer.safetensors       optimizer.state_dict(): tensors + a JSON tree in the header metadata
      .tmp-*                        an unfinished write; never read, removed by the next save on that host (a dead
                                    writer's) or by ``keep_last`` pruning

Everything is safetensors or JSON; nothing is pickled. Each table has one shard file per rank and the manifest
records ``world_size`` and the partitioner (``key % world_size``), so that multi-rank saving adds shards without
changing the format. Serving exports (format ``dynemb.serving``) live in their own root as ``version-<n>/``.
"""

from .background import SaveHandle
from .errors import CheckpointError
from .loader import load
from .manifest import FORMAT_VERSION
from .saver import save
from .export_format import export_for_serving, read_chain, read_export

__all__ = ["save", "load", "export_for_serving", "read_export", "read_chain", "SaveHandle", "CheckpointError",
           "FORMAT_VERSION"]
