"""The storage engine: int keys -> rows. No autograd, no distribution, no I/O."""

from .admission import FrequencyAdmission
from .index import HashIndex
from .initializers import Constant, Initializer, Normal, TruncatedNormal, Uniform, resolve_initializer
from .policy import EvictionPolicy
from .kv import KeyValueTable
from .tiered import TieredTable, Tiers, tier_traffic
from .rows import EvictHook, Rows

__all__ = [
    "HashIndex",
    "FrequencyAdmission",
    "KeyValueTable",
    "TieredTable",
    "Tiers",
    "tier_traffic",
    "Rows",
    "EvictHook",
    "EvictionPolicy",
    "Initializer",
    "Uniform",
    "Normal",
    "TruncatedNormal",
    "Constant",
    "resolve_initializer",
]
