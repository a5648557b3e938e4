"""ParameterServer: hierarchical embedding lookups for inference.

Lookup order for each table: device cache (a bounded LRU :class:`KeyValueTable`, shared by the tables of a row shape) ->
volatile store (in-process memory or Redis) -> persistent store (RocksDB or LMDB) -> the default row.
:meth:`ParameterServer.lookup_many` takes every table of a request at once, as HPS does: each lower tier then answers
the misses of all tables in one call (one Redis round trip per request). Rows found below the cache are written back up.
As in HPS, the hit rate of the lookup itself decides how: under ``hit_rate_threshold`` (a cold cache) before the lookup
returns; above it, by a background thread, in batches of up to 4096 rows per table (sizes vary at random, so that the
tables of a request do not all insert at once): an insert into a full cache pays a fixed cost (it scans the cache for
eviction victims) that outweighs the per-row cost of hundreds of rows. While that thread inserts into a table's cache,
lookups of the table read the lower tiers instead of waiting for it. A tier that fails (Redis went away, or lost its
rows) is skipped until a monitor thread sees it back (:mod:`.tiers`); lookups answer from a tier that holds every row,
or raise :class:`TierUnavailableError`, never default rows for ids the export holds.

Thread safety: any number of threads may call :meth:`~ParameterServer.lookup`. Reads and writes of a table's cache take
the lock of its group's cache, and :meth:`~ParameterServer.apply_update` replaces each row under it, so no reader sees
half of an old row and half of a new one. Statistics and pending write-backs have a lock of their own. An update also
moves the table's epoch on, which drops write-backs of rows read before it. The stores are row-atomic themselves (one
value per key in Redis, transactions in LMDB/RocksDB).

Modules: :mod:`.server` (:class:`ParameterServer`: config, loading, lookups, statistics), :mod:`.tiers` (the stores,
their health and markers), :mod:`.cache` (the state of each served table), :mod:`.group_cache` (one cache for the
tables of a row shape), :mod:`.request_lookup` (a request's tables together: the path lookups take),
:mod:`.table_lookup` (one table's part of a lookup, down the tiers: the path while a write-back fills a cache),
:mod:`.writeback` (pending rows and the background thread), :mod:`.updates` (online updates and the replay of an
export chain) and :mod:`.lineage` (which export each table holds; updates go only forward on their own model)."""

from .lineage import LineageError
from .server import ParameterServer
from .tiers import TierUnavailableError

__all__ = ["ParameterServer", "LineageError", "TierUnavailableError"]
