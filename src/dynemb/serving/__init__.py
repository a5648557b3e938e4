"""Serving: a hierarchical parameter server (device cache -> memory/Redis -> RocksDB/LMDB) and lookup layers."""

from .server_config import ModelConfig, ServerConfig
from .layers import LookupLayer, SparseLookupLayer
from ..checkpoint.export_format import read_chain, read_export
from .ps import LineageError, ParameterServer

__all__ = ["ParameterServer", "ServerConfig", "ModelConfig", "LookupLayer", "SparseLookupLayer", "LineageError",
           "read_export", "read_chain"]
