"""Serving: a hierarchical parameter server (device cache -> memory/Redis -> RocksDB/LMDB) and lookup layers."""

from .config import ModelConfig, ServerConfig
from .layers import LookupLayer, SparseLookupLayer
from ..checkpoint.export_format import read_export
from .ps import ParameterServer

__all__ = ["ParameterServer", "ServerConfig", "ModelConfig", "LookupLayer", "SparseLookupLayer", "read_export"]
