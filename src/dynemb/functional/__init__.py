"""Functional lookups over dynamic and static tables, with autograd.

==========  ====================================================================================================
module      job
==========  ====================================================================================================
``lookup``  embedding_lookup(_sparse), pooled_lookup(s), unique_rows: dedup, find/insert, gather or pool, max_norm
``pooling`` BagSet, to_bags, the combiners, pool / pool_many (shared with the serving layers)
``grads``   where a table's gradient goes: a fused optimizer at once, or SparseGrad until ``step()``
==========  ====================================================================================================
"""

from .grads import SparseGrad, current_rows, deliver_gradient, read_rows
from .find import counts_occurrences
from .lookup import (clip_rows, embedding_lookup, embedding_lookup_sparse, pooled_lookup,
                     pooled_lookups, unique_rows)
from .pooling import COMBINERS, BagSet, check_combiner, pool, pool_many, to_bags

__all__ = ["embedding_lookup", "embedding_lookup_sparse", "SparseGrad", "COMBINERS", "BagSet", "to_bags", "pool",
           "pool_many", "pooled_lookup", "pooled_lookups", "unique_rows", "read_rows", "deliver_gradient",
           "current_rows", "clip_rows", "check_combiner", "counts_occurrences"]
