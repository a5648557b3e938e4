"""Serving: a hierarchical parameter server (device cache -> memory/Redis -> RocksDB/LMDB), lookup layers, and a
user's own model exported (``export_model``) and served with its lookups bound to the parameter server
(``ExportedModel``)."""

from .server_config import ModelConfig, ServerConfig
from .layers import LookupLayer, SparseLookupLayer
from ..checkpoint.export_format import read_chain, read_export
from .ps import LineageError, ParameterServer
from .model_export import export_model
from .exported_model import ExportedModel

__all__ = ["ParameterServer", "ServerConfig", "ModelConfig", "LookupLayer", "SparseLookupLayer", "LineageError",
           "read_export", "read_chain", "export_model", "ExportedModel"]
