"""The storage engine: int keys -> rows. No autograd, no distribution, no I/O."""

from .admission import FrequencyAdmission
from .index import HashIndex
from .initializers import Constant, Initializer, Normal, TruncatedNormal, Uniform, resolve_initializer
from .policy import EvictionPolicy
from .table import KeyValueTable, Rows

__all__ = [
    "HashIndex",
    "FrequencyAdmission",
    "KeyValueTable",
    "Rows",
    "EvictionPolicy",
    "Initializer",
    "Uniform",
    "Normal",
    "TruncatedNormal",
    "Constant",
    "resolve_initializer",
]
