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


def _ignored(reason: str, *names: str, silent: tuple = ()) -> dict:
    """``{name: Field}`` for HPS fields dropped for one reason."""
    return dict.fromkeys(names, Field(reason=reason, silent=silent))


_KEYS = "ids may be int32 or int64 for any table; each table's key dtype comes from its export"
_DENSE = "only the embedding tables are served here, not the dense model"
_POOLS = "lookups run on the callers' threads, with no buffer pools"
_REFRESH = "rows reach the cache by write-backs of the rows looked up, not by periodic refreshes"
_CACHE = "the cache is always a bounded LRU table on the model's device"
_NO_KNOB = "there is no such setting here"
_OVERFLOW = "HPS bounds each partition; here set max_rows_per_table, overflow and eviction"
_TLS = "TLS is not supported"
_SHARED = "the memory store lives in the server's process"
_LOADED = "load writes every row of the export to the stores"
_FILTERS = "updates go to every table of the export they name"

TOP_LEVEL = {
    **_ignored(_KEYS, "supportlonglong"),
    **_ignored("tables are served by their own names, never fused", "fuse_embedding_table", silent=_FALSE),
    **_ignored(_POOLS, "use_multi_worker"),
    **_ignored("updates come through ParameterServer.apply_update, not a message queue", "update_source"),
}

MODEL = {
    "gpucacheper": Field(rename="cache_fraction"),
    **_ignored("the cache cannot be turned off (cache_fraction sizes it)", "gpucache", silent=_TRUE),
    **_ignored("a server caches on one device: set device (e.g. 'cuda:0')", "deployed_device_list"),
    **_ignored(_KEYS, "i64_input_key"),
    **_ignored(_POOLS, "num_of_worker_buffer_in_pool", "num_of_refresher_buffer_in_pool", "thread_pool_size"),
    **_ignored(_REFRESH, "cache_refresh_percentage_per_iteration", "refresh_delay", "refresh_interval"),
    **_ignored("lookups are bounded by max_batch_size alone", "maxnum_catfeature_query_per_table_per_sample"),
    **_ignored(_DENSE, "maxnum_des_feature_per_sample", "dense_file", "network_file", "non_trainable_params_file",
               "label_dim", "slot_num", "scaler", "use_algorithm_search", "use_cuda_graph"),
    **_ignored(_CACHE, "use_static_table", silent=_FALSE),
    **_ignored(_CACHE, "embedding_cache_type", silent=("dynamic",)),
    **_ignored(_CACHE, "use_hctr_cache_implementation"),
    **_ignored(_NO_KNOB, "use_context_stream"),
    **_ignored("rows are served in the dtype of their export", "use_mixed_precision"),
}

VOLATILE_DB = {
    "num_partitions": Field(rename="shards", stores=("redis",), reason="the memory store is not partitioned"),
    "max_batch_size": Field(rename="chunk_size", stores=("redis",), reason="the memory store takes any batch"),
    "enable_tls": Field(reason=_TLS, silent=_FALSE, refused=_TRUE),
    **_ignored("Redis is reached with a password only (no ACL user)", "user_name"),
    **_ignored(_TLS, "tls_ca_certificate", "tls_client_certificate", "tls_client_key",
               "tls_server_name_identification"),
    **_ignored(_OVERFLOW, "overflow_margin", "overflow_policy", "overflow_resolution_target"),
    **_ignored(_NO_KNOB, "allocation_rate"),
    **_ignored(_SHARED, "shared_memory_size", "shared_memory_name", "shared_memory_auto_remove"),
    **_ignored("redis-py pools connections itself", "num_node_connections"),
    **_ignored(_LOADED, "initial_cache_rate"),
    **_ignored(_LOADED, "initialize_after_startup", silent=_TRUE),
    **_ignored("rows found below the volatile store are always copied into it", "cache_missed_embeddings",
               silent=_TRUE),
    **_ignored(_REFRESH, "refresh_time_after_fetch"),
    **_ignored(_FILTERS, "update_filters"),
}

PERSISTENT_DB = {
    **_ignored("reads run on the callers' threads", "num_threads"),
    **_ignored("the persistent stores take any batch", "max_batch_size"),
    **_ignored(_LOADED, "initialize_after_startup", silent=_TRUE),
    **_ignored(_FILTERS, "update_filters"),
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
        if _among(value, field.refused):
            raise ValueError(f"{where}.{name}={value!r} cannot be honoured here: {field.reason}")
        if field.rename and (not field.stores or store_type in field.stores):
            if field.rename in data and data[field.rename] != value:
                raise ValueError(f"{where}: {name}={value!r} (HPS) and {field.rename}={data[field.rename]!r} "
                                 f"disagree; they mean the same, give one")
            out[field.rename] = value
        elif not _among(value, field.silent):
            warnings.warn(f"{where}.{name} is ignored: {field.reason}", stacklevel=4)
    return out


def _among(value, values: tuple) -> bool:
    """``value`` is one of ``values``, type and all (``1`` is not ``True``)."""
    return any(value == v and type(value) is type(v) for v in values)
