"""Reference models used by the demo and the benchmarks."""

from .dlrm import DLRM, dlrm_tables, mlp

__all__ = ["DLRM", "dlrm_tables", "mlp"]
