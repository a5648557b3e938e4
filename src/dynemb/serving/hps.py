"""HPS config fields: what each one becomes in a :class:`~dynemb.serving.ServerConfig`.

An HPS ``ps.json`` loads as it is. A field that maps onto one of ours is renamed (``gpucacheper`` is
``cache_fraction``; a ``redis_cluster`` volatile store is ``{"type": "redis", "cluster": true}``); a field that means
nothing here (worker buffer pools, the dense model's files, a Kafka update source) is dropped with a warning that
says why. A value that cannot be honoured (``enable_tls: true``) is an error. The tables below are the whole story;
docs/serving.md shows them as one table.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Mapping, Optional

__all__ = ["translate", "Field", "TOP_LEVEL", "MODEL", "VOLATILE_DB", "PERSISTENT_DB", "VOLATILE_TYPES",
           "PERSISTENT_TYPES"]

_TRUE, _FALSE = (True, "true", "True"), (False, "false", "False")


@dataclasses.dataclass(frozen=True)
class Field:
    """What an HPS field becomes.

    Attributes:
        rename: our field of the same meaning (only for stores of type ``stores``, when given); else the field is
            dropped.
        reason: why it is dropped, for the warning.
        stores: the store types ``rename`` applies to (empty: every type).
        silent: values that ask for what happens here anyway: dropped without a warning.
        refused: values that cannot be honoured: a ``ValueError``.
    """

    rename: Optional[str] = None
    reason: str = ""
    stores: tuple = ()
    silent: tuple = ()
    refused: tuple = ()


_KEYS = "ids may be int32 or int64 for any table; each table's key dtype comes from its export"
_DENSE = "only the embedding tables are served here, not the dense model"
_POOLS = "lookups run on the callers' threads, with no buffer pools"
_REFRESH = "rows reach the cache by write-backs of the rows looked up, not by periodic refreshes"
_CACHE = "the cache is always a bounded LRU table on the model's device"
_NO_KNOB = "there is no such setting here"
_OVERFLOW = "HPS bounds each partition; here set max_rows_per_table, overflow and eviction"

TOP_LEVEL = {
    "supportlonglong": Field(reason=_KEYS),
    "fuse_embedding_table": Field(reason="tables are served by their own names, never fused", silent=_FALSE),
    "use_multi_worker": Field(reason=_POOLS),
    "update_source": Field(reason="updates come through ParameterServer.apply_update, not a message queue"),
}

MODEL = {
    "gpucacheper": Field(rename="cache_fraction"),
    "gpucache": Field(reason="the cache cannot be turned off (cache_fraction sizes it)", silent=_TRUE),
    "deployed_device_list": Field(reason="a server caches on one device: set device (e.g. 'cuda:0')"),
    "i64_input_key": Field(reason=_KEYS),
    "num_of_worker_buffer_in_pool": Field(reason=_POOLS),
    "num_of_refresher_buffer_in_pool": Field(reason=_POOLS),
    "thread_pool_size": Field(reason=_POOLS),
    "cache_refresh_percentage_per_iteration": Field(reason=_REFRESH),
    "refresh_delay": Field(reason=_REFRESH),
    "refresh_interval": Field(reason=_REFRESH),
    "maxnum_catfeature_query_per_table_per_sample": Field(reason="lookups are bounded by max_batch_size alone"),
    "maxnum_des_feature_per_sample": Field(reason=_DENSE),
    "dense_file": Field(reason=_DENSE),
    "network_file": Field(reason=_DENSE),
    "non_trainable_params_file": Field(reason=_DENSE),
    "label_dim": Field(reason=_DENSE),
    "slot_num": Field(reason=_DENSE),
    "use_static_table": Field(reason=_CACHE, silent=_FALSE),
    "embedding_cache_type": Field(reason=_CACHE, silent=("dynamic",)),
    "use_hctr_cache_implementation": Field(reason=_CACHE),
    "use_context_stream": Field(reason=_NO_KNOB),
    "use_mixed_precision": Field(reason="rows are served in the dtype of their export"),
    "scaler": Field(reason=_DENSE),
    "use_algorithm_search": Field(reason=_DENSE),
    "use_cuda_graph": Field(reason=_DENSE),
}

VOLATILE_DB = {
    "num_partitions": Field(rename="shards", stores=("redis",), reason="the memory store is not partitioned"),
    "max_batch_size": Field(rename="chunk_size", stores=("redis",), reason="the memory store takes any batch"),
    "user_name": Field(reason="Redis is reached with a password only (no ACL user)"),
    "enable_tls": Field(reason="TLS is not supported", silent=_FALSE, refused=_TRUE),
    "tls_ca_certificate": Field(reason="TLS is not supported"),
    "tls_client_certificate": Field(reason="TLS is not supported"),
    "tls_client_key": Field(reason="TLS is not supported"),
    "tls_server_name_identification": Field(reason="TLS is not supported"),
    "overflow_margin": Field(reason=_OVERFLOW),
    "overflow_policy": Field(reason=_OVERFLOW),
    "overflow_resolution_target": Field(reason=_OVERFLOW),
    "allocation_rate": Field(reason=_NO_KNOB),
    "shared_memory_size": Field(reason="the memory store lives in the server's process"),
    "shared_memory_name": Field(reason="the memory store lives in the server's process"),
    "shared_memory_auto_remove": Field(reason="the memory store lives in the server's process"),
    "num_node_connections": Field(reason="redis-py pools connections itself"),
    "initial_cache_rate": Field(reason="load writes every row of the export to the stores"),
    "initialize_after_startup": Field(reason="load writes every row of the export to the stores", silent=_TRUE),
    "cache_missed_embeddings": Field(reason="rows found below the volatile store are always copied into it",
                                     silent=_TRUE),
    "refresh_time_after_fetch": Field(reason=_REFRESH),
    "update_filters": Field(reason="updates go to every table of the export they name"),
}

PERSISTENT_DB = {
    "num_threads": Field(reason="reads run on the callers' threads"),
    "max_batch_size": Field(reason="the persistent stores take any batch"),
    "initialize_after_startup": Field(reason="load writes every row of the export to the stores", silent=_TRUE),
    "update_filters": Field(reason="updates go to every table of the export they name"),
}

# HPS store types -> ours (fields added); None: no store. Our own type names pass through unchanged.
VOLATILE_TYPES = {
    "hash_map": {"type": "memory"},
    "parallel_hash_map": {"type": "memory"},
    "multi_process_hash_map": {"type": "memory"},  # in-process here: not shared with other processes
    "redis_cluster": {"type": "redis", "cluster": True},
    "disabled": {"type": "memory"},  # a volatile store is always used
}
PERSISTENT_TYPES = {"rocks_db": {"type": "rocksdb"}, "disabled": None}


def translate(data):
    """``data`` (a parameter server config dict) with its HPS fields taken as the tables of this module say.

    Anything that is not a dict where one is expected is returned as it is, for the config's own checks to name.

    Raises:
        ValueError: an HPS field and ours of the same meaning disagree, or a value cannot be honoured.
    """
    if not isinstance(data, Mapping):
        return data
    out = _fields(data, TOP_LEVEL, "parameter server config")
    if isinstance(out.get("models"), list):
        out["models"] = [_fields(m, MODEL, f"models[{i}]") if isinstance(m, Mapping) else m
                         for i, m in enumerate(out["models"])]
    for name, table, types in (("volatile_db", VOLATILE_DB, VOLATILE_TYPES),
                               ("persistent_db", PERSISTENT_DB, PERSISTENT_TYPES)):
        store = out.get(name)
        if isinstance(store, Mapping) and store.get("type") in types:
            mapped = types[store["type"]]
            if mapped is None:
                out[name] = None
                continue
            store = {**store, **mapped}
        if isinstance(store, Mapping):
            out[name] = _fields(store, table, name, store.get("type"))
    return out


def _fields(data: Mapping, table: Mapping[str, Field], where: str, store_type: Optional[str] = None) -> dict:
    out = {k: v for k, v in data.items() if k not in table}
    for name in (k for k in data if k in table):
        field, value = table[name], data[name]
        if any(value == v and type(value) is type(v) for v in field.refused):
            raise ValueError(f"{where}.{name}={value!r} cannot be honoured here: {field.reason}")
        if field.rename and (not field.stores or store_type in field.stores):
            if field.rename in data and data[field.rename] != value:
                raise ValueError(f"{where}: {name}={value!r} (HPS) and {field.rename}={data[field.rename]!r} "
                                 f"disagree; they mean the same, give one")
            out[field.rename] = value
        elif not any(value == v and type(value) is type(v) for v in field.silent):
            warnings.warn(f"{where}.{name} is ignored: {field.reason}", stacklevel=4)
    return out
