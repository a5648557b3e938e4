"""The Redis volatile store: binary rows moved with pipelined ``MGET``/``MSET`` through redis-py.

Key layout (Redis-Cluster-safe: every multi-key command touches one hash tag, so one slot):

=====================================  =====================================================================
key                                    holds
=====================================  =====================================================================
``{<table>:<shard>}`` + 8-byte key     the row: ``D`` little-endian values of the table's dtype
``{<table>:<shard>}#z``                sorted set of the shard's 8-byte keys, scored by write time (µs);
                                       gives ``size`` (``ZCARD``) and the eviction order (oldest write first)
``dynemb:tables``                      hash: table name -> JSON ``{"dim", "dtype", "shards"}``
``dynemb:served:<namespace>``          a reader's marker (:meth:`RedisStore.guard`): the version whose rows the
                                       namespace's tables hold
=====================================  =====================================================================

The 8-byte key is big-endian with the sign bit flipped; ``shard = splitmix64(key) mod shards``, zero-padded to a
fixed width. The shard count is stored with the table, so reopening with another ``shards`` keeps the layout.

Reads. ``get_many`` of several tables is one round trip: on a single server one ``MGET`` per ``chunk_size`` keys of
all the tables together (hash tags only matter to a cluster); on a cluster one ``MGET`` per table and shard, in one
pipeline. ``get_concat`` and ``get_concat_into`` (the parameter server's reads of a request's misses) on a single
server write the ``MGET`` commands in one numba pass and parse the reply from the socket's bytes in another
(:func:`~dynemb.kernels.numba_find_many.read_mget_reply`, RESP2 or RESP3), rows copied straight to their place, on
reader connections the store keeps (redis-py's connection class: handshake, password, timeouts); every other command
goes through redis-py's client and pool.

Markers. Redis can lose rows behind a reader's back (a restart without persistence, ``FLUSHALL``, eviction under
``maxmemory``) or another server can overwrite them (another version of the same model). A reader that registers
a marker key for its tables (:meth:`RedisStore.guard`) gets it read in the same round trip as every read of those
tables (one more ``MGET`` in the same send, its reply parsed after the rows'), and a
:class:`~dynemb.serving.stores.store.StoreRowsLostError` when the marker is gone or holds a value it does not
accept, so a lookup never answers from rows the store lost. The parameter server writes the marker after its rows
(:mod:`dynemb.serving.ps.tiers`).

Failures. Construction pings the server and raises :class:`StoreUnavailableError` (a ``ConnectionError``)
naming the address when it cannot be reached or rejects the password. During calls a lost or timed-out
connection raises :class:`StoreUnavailableError` and any other Redis error :class:`StoreError`; the parameter
server catches ``StoreError`` to fall through to the next tier. Each call retries once at once (to replace a
pooled connection broken by a server restart) and never blocks longer than about ``2 * timeout_s`` per round
trip. Backoff between failing calls is the caller's job. In standalone mode each write runs in one
``MULTI``/``EXEC``, so a failed write changes nothing; a Redis Cluster has no cross-slot transactions, so there a
write is atomic per row and per shard only.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import socket
import time

import numpy as np
import redis
import redis.cluster
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from dynemb.checkpoint.tensorfile import byte_view
from dynemb.checks import check_positive_int
from dynemb.kernels.dispatch import numba_available
from dynemb.table.hashing import mix64

from .store import (OverflowPolicy, Store, StoreConfig, StoreCorruptError, StoreError, StoreFullError,
                    StoreRowsLostError, StoreUnavailableError, TableSchema)
from .row_bytes import decode_keys, decode_rows, encode_keys, encode_rows, unsort

__all__ = ["RedisStore", "RedisStoreConfig", "parse_address"]

SCHEMA_KEY = b"dynemb:tables"
MARKER_PREFIX = "dynemb:served:"
_MARKER_REPLY_BYTES = 512  # reply bytes kept for each marker value (a version and a digest: ~80 bytes)
_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterError)
_UNAVAILABLE += (redis.exceptions.RedisClusterException,)
_NO_PREFIX = np.empty(0, dtype=np.uint8)
_MAX_SHARDS = 16384
_KEPT_BYTES = 16 << 20  # most buffer bytes a reader connection keeps between reads


def parse_address(address) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[ipv6]:port"``) into ``(host, port)``; ValueError on any other form."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a 'host:port' str, got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"address must be 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class RedisStoreConfig(StoreConfig):
    """Config of :class:`RedisStore`.

    Args:
        address: ``"host:port"`` of the server (of any cluster node when ``cluster``).
        password: the server's ``requirepass``, or None.
        cluster: connect with ``redis.cluster.RedisCluster`` instead of a single server.
        shards: hash-tag groups per table; more shards spread a table over more cluster nodes.
        max_rows_per_table: bound on rows per table; ``None`` for unbounded.
        overflow: ``"evict"`` or ``"refuse"`` (raise StoreFullError) when a put would exceed the bound. ``evict``
            drops the oldest-written rows of the fullest shards, which keeps shards balanced; with keys hashed
            evenly over shards that is close to the table's oldest writes.
        chunk_size: keys per ``MGET``/``MSET`` command; a pipeline carries all chunks of a call.
        timeout_s: connect and socket timeout in seconds.
    """

    address: str = "127.0.0.1:6379"
    password: str | None = None
    cluster: bool = False
    shards: int = 16
    max_rows_per_table: int | None = None
    overflow: str = "evict"
    chunk_size: int = 4096
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        parse_address(self.address)
        if self.password is not None and not isinstance(self.password, str):
            raise TypeError(f"password must be a str or None, got {type(self.password).__name__}")
        if not isinstance(self.cluster, bool):
            raise TypeError(f"cluster must be a bool, got {self.cluster!r}")
        check_positive_int(self.shards, "shards")
        if self.shards > _MAX_SHARDS:
            raise ValueError(f"shards must be <= {_MAX_SHARDS} (the hash slots of a Redis Cluster), got {self.shards}")
        check_positive_int(self.max_rows_per_table, "max_rows_per_table", allow_none=True)
        OverflowPolicy.parse(self.overflow)
        check_positive_int(self.chunk_size, "chunk_size")
        timeout = self.timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout_s must be a number > 0, got {timeout!r}")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One table's keys: ``prefixes[s]`` is ``{table:s}`` as uint8, ``index_keys[s]`` the shard's sorted set and
    ``record`` the table's entry in ``dynemb:tables``."""

    shards: int
    prefixes: np.ndarray
    index_keys: list
    record: bytes

    @classmethod
    def build(cls, table: str, record: bytes) -> "_Layout":
        shards = json.loads(record)["shards"]
        width = len(str(shards - 1))
        tags = [f"{{{table}:{s:0{width}d}}}".encode() for s in range(shards)]
        prefixes = np.frombuffer(b"".join(tags), dtype=np.uint8).reshape(shards, -1)
        return cls(shards, prefixes, [tag + b"#z" for tag in tags], record)


@dataclasses.dataclass
class _Batch:
    """Keys of one call sorted by shard: ``order`` maps back to the caller's positions."""

    order: torch.Tensor
    keys: torch.Tensor
    shard_of: np.ndarray
    bounds: list


def _translated(method):
    """Raise redis-py failures as StoreUnavailableError / StoreError naming the server."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except _UNAVAILABLE as error:
            raise StoreUnavailableError(f"Redis at {self.config.address} is unavailable: {error}") from error
        except redis.exceptions.RedisError as error:
            raise StoreError(f"Redis at {self.config.address} failed: {error}") from error

    return wrapper


class RedisStore(Store):
    """Rows in a Redis server or cluster. Thread-safe (redis-py pools connections).

    Args:
        config: a :class:`RedisStoreConfig`.

    Raises:
        StoreUnavailableError: the server cannot be reached, times out, or rejects the password.

    Example (needs a server, so not run as a doctest)::

        store = make_store({"type": "redis", "address": "127.0.0.1:6379", "max_rows_per_table": 10_000_000})
        store.create_table("user", dim=64)
        store.put("user", keys, rows)
        try:
            values, found = store.get("user", keys)
        except StoreError:
            ...  # fall through to the persistent tier
    """

    def __init__(self, config: RedisStoreConfig) -> None:
        super().__init__()
        if not isinstance(config, RedisStoreConfig):
            raise TypeError(f"config must be a RedisStoreConfig, got {type(config).__name__}")
        self.config = config
        self.overflow = OverflowPolicy.parse(config.overflow)
        self._layouts: dict[str, _Layout] = {}
        self._concat_names_of: dict[tuple, tuple] = {}  # tables of get_concat -> how their keys are named
        self._packings: dict[tuple, tuple] = {}  # tables of get_concat -> their prefixes for pack_mget
        self._readers: list = []  # free connections of _read_rows (the pool's lending costs more than a read)
        self._reader_pid = os.getpid()
        self._marker_of: dict[str, bytes] = {}  # table -> its marker key (guard)
        self._accepted: dict[bytes, frozenset] = {}  # marker key -> the values its readers accept
        self._markers_of: dict[tuple, tuple] = {}  # tables of a read -> (marker keys, their MGET command bytes)
        self._client = self._connect()

    def __repr__(self) -> str:
        return f"RedisStore(address={self.config.address!r}, cluster={self.config.cluster})"

    # ------------------------------------------------------------------ markers
    def guard(self, tables, marker: str, accepted) -> None:
        """Check the marker key ``dynemb:served:<marker>`` on every read of ``tables`` from now on: a read raises
        :class:`StoreRowsLostError` when it is gone (``lost``) or holds none of the values ``accepted`` (strs).
        Called again, it replaces what the marker accepts."""
        key = (MARKER_PREFIX + marker).encode()
        self._accepted[key] = frozenset(v.encode() for v in accepted)
        for table in tables:
            self._marker_of[table] = key
        self._markers_of = {}

    @_translated
    def read_marker(self, marker: str) -> bytes | None:
        """The value of the marker key of ``marker`` (see :meth:`guard`), or None when it is not set."""
        return self._client.get(MARKER_PREFIX + marker)

    @_translated
    def write_marker(self, marker: str, value: str) -> None:
        """Set the marker key of ``marker`` to ``value``."""
        self._client.set(MARKER_PREFIX + marker, value)

    @_translated
    def check_markers(self) -> None:
        """Read every guarded marker (one round trip): raises :class:`StoreRowsLostError` as a read would,
        StoreUnavailableError when the server cannot be reached."""
        keys = sorted(self._accepted)
        if keys:
            self._check_markers(keys, self._client.execute_command("MGET", *keys))
        else:
            self._client.ping()

    @_translated
    def evictions(self) -> tuple[str, int, int]:
        """``(maxmemory_policy, maxmemory, evicted_keys)`` from the server's ``INFO``: whether and how many keys
        Redis dropped on its own."""
        info = self._client.info("memory") if not self.config.cluster else {}
        stats = self._client.info("stats") if not self.config.cluster else {}
        return str(info.get("maxmemory_policy", "noeviction")), int(info.get("maxmemory", 0)), \
            int(stats.get("evicted_keys", 0))

    def _read_markers(self, tables) -> tuple:
        """``(marker keys, the MGET command reading them in RESP)`` of a read of ``tables`` (empty: none
        guarded)."""
        kept = self._markers_of.get(tables)
        if kept is None:
            keys = tuple(sorted({self._marker_of[t] for t in tables if t in self._marker_of}))
            command = b""
            if keys:
                parts = [b"*%d\r\n$4\r\nMGET\r\n" % (1 + len(keys))]
                parts += [b"$%d\r\n%s\r\n" % (len(k), k) for k in keys]
                command = b"".join(parts)
            if len(self._markers_of) > 256:
                self._markers_of.clear()
            kept = self._markers_of[tables] = (keys, command)
        return kept

    def _check_markers(self, keys, values) -> None:
        for key, value in zip(keys, values):
            if value is None:
                raise StoreRowsLostError(f"Redis at {self.config.address} lost the rows of {key.decode()!r}: its "
                                         "marker key is gone (the server restarted empty, was flushed, or evicted "
                                         "keys)", lost=True)
            if value not in self._accepted[key]:
                raise StoreRowsLostError(f"Redis at {self.config.address}: {key.decode()!r} holds the rows of "
                                         f"{value.decode(errors='replace')!r}, another server's version; this one "
                                         f"serves {' or '.join(sorted(v.decode() for v in self._accepted[key]))}",
                                         lost=False)

    def _connect(self):
        host, port = parse_address(self.config.address)
        timeout = self.config.timeout_s
        # One immediate retry replaces a pooled connection that a server restart broke; backoff is the caller's.
        options = dict(password=self.config.password, socket_timeout=timeout, socket_connect_timeout=timeout)
        options.update(host=host, port=port, retry=Retry(NoBackoff(), 1))
        try:
            client = (redis.cluster.RedisCluster if self.config.cluster else redis.Redis)(**options)
            client.ping()
        except redis.exceptions.AuthenticationError as error:
            raise StoreUnavailableError(f"Redis at {self.config.address} rejected the password: {error}") from error
        except (*_UNAVAILABLE, redis.exceptions.ResponseError) as error:
            raise StoreUnavailableError(f"cannot reach Redis at {self.config.address}: {error}") from error
        return client

    # ------------------------------------------------------------------ schema
    def _remember(self, table: str, record: bytes) -> TableSchema:
        self._layouts[table] = _Layout.build(table, record)
        return TableSchema.from_dict(json.loads(record))

    @_translated
    def _create(self, table: str, schema: TableSchema) -> TableSchema:
        record = json.dumps({**schema.to_dict(), "shards": self.config.shards}, sort_keys=True)
        self._client.hsetnx(SCHEMA_KEY, table, record)  # a concurrent creator may win: read back what is stored
        return self._remember(table, self._client.hget(SCHEMA_KEY, table))

    @_translated
    def _drop(self, table: str) -> None:
        layout = self._layouts.pop(table, None)
        pipe = self._pipeline(write=True)
        for key in layout.index_keys if layout is not None else ():  # empty already: DEL of each, slot by slot
            pipe.execute_command("DEL", key)
        pipe.hdel(SCHEMA_KEY, table)
        pipe.execute()

    @_translated
    def _load_schema(self, table: str) -> TableSchema | None:
        raw = self._client.hget(SCHEMA_KEY, table)
        return None if raw is None else self._remember(table, raw)

    @_translated
    def _tables(self) -> list[str]:
        return [name.decode() for name in self._client.hkeys(SCHEMA_KEY)]

    # ------------------------------------------------------------------ rows
    def _batch(self, layout: _Layout, keys) -> _Batch:
        shard = mix64(keys).remainder(layout.shards).numpy().astype(np.int16)
        order = np.argsort(shard, kind="stable")  # a radix sort for int16
        shard_of = shard[order]
        ends = np.cumsum(np.bincount(shard_of, minlength=layout.shards)).tolist()
        step = self.config.chunk_size
        bounds = [
            (s, lo, min(lo + step, hi)) for s, (start, hi) in enumerate(zip([0] + ends[:-1], ends))
            for lo in range(start, hi, step)
        ]
        order = torch.from_numpy(order)
        return _Batch(order, keys.index_select(0, order), shard_of, bounds)

    def _pipeline(self, write: bool):
        # MULTI/EXEC makes a standalone write all-or-nothing; cluster pipelines cannot span slots in a transaction.
        return self._client.pipeline(transaction=write and not self.config.cluster)

    def _get(self, table, schema, keys):
        return self._get_many([(table, schema, keys)])[table]

    @_translated
    def _get_many(self, requests):
        # A cluster command must stay in one hash slot: one MGET per shard of each table. A single server takes the
        # keys of every table and shard in one MGET (redis-py spends more time per command than the server spends
        # on a hundred keys).
        return (self._get_per_shard if self.config.cluster else self._get_at_once)(requests)

    def _get_per_shard(self, requests) -> dict:
        batches = [self._batch(self._layouts[table], keys) for table, _, keys in requests]
        names = [encode_keys(b.keys, self._layouts[table].prefixes, b.shard_of) for (table, _, _), b in
                 zip(requests, batches)]
        replies = iter(self._mget([n[lo:hi] for n, b in zip(names, batches) for _, lo, hi in b.bounds],
                                  tuple(table for table, _, _ in requests)))
        out = {}
        for (table, schema, _), n, b in zip(requests, names, batches):
            values, found = decode_rows(list(itertools.chain.from_iterable(next(replies) for _ in b.bounds)), schema, n)
            out[table] = unsort(values, b.order), unsort(found, b.order)
        return out

    def _get_at_once(self, requests) -> dict:
        sizes = [keys.numel() for _, _, keys in requests]
        hashes = mix64(torch.cat([keys for _, _, keys in requests])).split(sizes)
        names = []
        for (table, _, keys), hashed in zip(requests, hashes):
            layout = self._layouts[table]
            names += encode_keys(keys, layout.prefixes, hashed.remainder(layout.shards).numpy().astype(np.int16))
        step = self.config.chunk_size
        blobs = list(itertools.chain.from_iterable(self._mget([names[lo: lo + step]
                                                               for lo in range(0, len(names), step)],
                                                              tuple(table for table, _, _ in requests))))
        out, start = {}, 0
        for schema, group in itertools.groupby(zip(requests, sizes), key=lambda item: item[0][1]):
            tables, counts = zip(*((table, n) for (table, _, _), n in group))  # one decode per run of one schema
            end = start + sum(counts)
            values, found = decode_rows(blobs[start:end], schema, names[start:end])
            out.update(zip(tables, zip(values.split(counts), found.split(counts))))
            start = end
        return out

    @_translated
    def _get_concat(self, tables, schema, keys, sizes):
        if self.config.cluster:  # one MGET per shard of each table, as get_many sends them
            return super()._get_concat(tables, schema, keys, sizes)
        tables = tuple(tables)
        if numba_available():  # the MGET commands written and their replies parsed by numba (read_rows)
            values = torch.empty(keys.numel(), schema.dim, dtype=schema.dtype)
            found = np.empty(keys.numel(), np.bool_)
            table_of = np.repeat(np.arange(len(tables), dtype=np.int64), sizes)
            self._read_rows(tables, schema, keys.numpy(), table_of, byte_view(values).numpy(), found, True)
            return values, torch.from_numpy(found)
        names = self._names(tables, keys, sizes)
        step = self.config.chunk_size
        blobs = list(itertools.chain.from_iterable(self._mget([names[lo: lo + step]
                                                               for lo in range(0, len(names), step)], tables)))
        return decode_rows(blobs, schema, names)

    @property
    def reads_into(self) -> bool:
        """Whether :meth:`get_concat_into` serves: a single server (a cluster takes one ``MGET`` a shard) with
        numba."""
        return not self.config.cluster and numba_available()

    @_translated
    def get_concat_into(self, tables: tuple, keys: np.ndarray, table_of: np.ndarray, out: np.ndarray) -> np.ndarray:
        """:meth:`get_concat` into the caller's arrays, in one round trip and two numba passes (the ``MGET``
        commands written, their reply parsed from the socket's bytes straight into ``out``): how the parameter
        server's fused path reads a request's misses. Only where :attr:`reads_into` says so.

        Args:
            tables: distinct created tables of one schema.
            keys: ``[N]`` int64 numpy array; ``table_of``: ``[N]`` int64, the index in ``tables`` of each key's
                table (any order).
            out: ``[N, D]`` C-contiguous numpy array of the tables' dtype: the row of each key found is written to
                ``out[j]`` with its stored bits; the other rows are left as they are.

        Returns:
            ``found [N]`` bool numpy array.

        Raises:
            ValueError: bad arguments (nothing is read). StoreError: the server failed (``out`` may hold rows of
            keys not marked found).
        """
        if not self.reads_into:
            raise NotImplementedError(f"{self} reads with get_concat (get_concat_into needs a single server and numba)")
        tables = tuple(tables)
        self._check_open()
        schema = self._concat_schema(tables)
        if schema is None:
            raise ValueError("tables must name at least one table, got none")
        n = keys.shape[0] if isinstance(keys, np.ndarray) else -1
        if not isinstance(keys, np.ndarray) or keys.dtype != np.int64 or keys.ndim != 1:
            raise ValueError(f"keys must be a 1-D int64 numpy array, got {keys!r:.80}")
        if not isinstance(table_of, np.ndarray) or table_of.dtype != np.int64 or table_of.shape != (n,):
            raise ValueError(f"table_of must be a [{n}] int64 numpy array, got {table_of!r:.80}")
        if not isinstance(out, np.ndarray) or out.shape != (n, schema.dim) or \
                out.dtype.itemsize != schema.dtype.itemsize or \
                not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous [{n}, {schema.dim}] numpy array of {schema.dtype}, got "
                             f"{getattr(out, 'shape', out)!r:.80} of {getattr(out, 'dtype', None)}")
        found = np.zeros(n, np.bool_)
        if n:
            self._read_rows(tables, schema, keys, table_of, out.view(np.uint8).reshape(n, schema.row_bytes), found,
                            False)
        return found

    def _read_rows(self, tables: tuple, schema, keys: np.ndarray, table_of: np.ndarray, out: np.ndarray,
                   found: np.ndarray, zero: bool) -> None:
        """The rows of ``keys`` (``table_of``: index in ``tables``, checked here) into the bytes ``out [N,
        row_bytes]`` and ``found [N]``, in one round trip on a reader connection: the ``MGET`` commands packed into
        a buffer the connection keeps, their reply read with ``recv_into`` into another and parsed as it comes
        (:func:`~dynemb.kernels.numba_find_many.read_mget_reply`); redis-py's parser is not involved. A null leaves
        ``out``'s row as it is (zeros when ``zero``). As redis-py's ``execute_command`` does, a connection error or
        timeout is retried once at once on a new connection (a server restart broke the kept one); a connection
        that failed is closed, so that no reply is left unread on it."""
        from dynemb.kernels.numba_find_many import (mget_command_bound, mget_reply_bound, mget_reply_state,
                                                    pack_mget_into)

        shards, base, width, prefixes, widest = self._packing(tables)
        markers, marker_command = self._read_markers(tables)
        n, chunk = keys.shape[0], self.config.chunk_size
        commands = -(-n // chunk)
        conn = self._take_reader()
        try:
            extra = len(marker_command)
            request, reply = _buffers(conn, mget_command_bound(n, chunk, widest) + extra,
                                      mget_reply_bound(n, chunk, schema.row_bytes) + _MARKER_REPLY_BYTES * len(markers))
            used = pack_mget_into(keys, table_of, shards, base, width, prefixes, chunk, request)
            if used < 0:
                raise ValueError(f"table_of must index the {len(tables)} tables, got {int(table_of[-1 - used])}")
            if extra:  # the markers' MGET in the same send: no round trip more
                request[used:used + extra] = np.frombuffer(marker_command, np.uint8)
                used += extra
            for attempt in (0, 1):
                try:
                    conn.send_packed_command([memoryview(request)[:used]], check_health=False)
                    values = self._receive(conn._sock, reply, mget_reply_state(commands), out, found, zero, keys,
                                           schema, len(markers))
                    if markers:
                        self._check_markers(markers, values)
                    return
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    conn.disconnect()
                    if attempt:
                        raise
                except BaseException:
                    conn.disconnect()
                    raise
        finally:
            self._readers.append(conn)  # list.append and pop are atomic: no lock

    def _take_reader(self):
        """A connection of this store's own for the reads of :meth:`_read_rows` (redis-py's pool takes tens of
        microseconds a call to lend one): a free one, or a new one made by the pool's factory (same address,
        password, timeouts; it connects on first use). Dropped after a fork, as the pool drops its own."""
        if self._reader_pid != os.getpid():
            self._readers, self._reader_pid = [], os.getpid()
        try:
            return self._readers.pop()
        except IndexError:
            pool = self._client.connection_pool
            return pool.connection_class(**pool.connection_kwargs)

    def _receive(self, sock, reply: np.ndarray, state: np.ndarray, out: np.ndarray, found: np.ndarray, zero: bool,
                 keys: np.ndarray, schema, markers: int = 0) -> list | None:
        """Read MGET replies from ``sock`` into ``reply`` and parse them into ``out`` and ``found`` as they come;
        then, with ``markers``, the reply of the markers' MGET that follows: its values (bytes or None)."""
        from dynemb.kernels.numba_find_many import (MGET_BAD_LENGTH, MGET_DONE, MGET_ERROR_REPLY, MGET_RUNNING,
                                                    read_mget_reply)

        view = memoryview(reply)
        end = 0
        while True:
            try:
                got = sock.recv_into(view[end:])
            except socket.timeout:
                raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
            except OSError as error:
                raise redis.exceptions.ConnectionError(f"Error while reading from socket: {error}") from error
            if not got:
                raise redis.exceptions.ConnectionError("Connection closed by server.")
            end += got
            status = state[4] if state[4] == MGET_DONE else read_mget_reply(reply, end, state, out, found, zero)
            if status == MGET_DONE:
                if not markers:
                    return None
                values = _marker_values(reply, int(state[0]), end, markers)
                if values is not None:
                    return values
                if end < reply.shape[0]:
                    continue
            if status == MGET_RUNNING and end < reply.shape[0]:
                continue
            if status == MGET_BAD_LENGTH:
                raise StoreCorruptError(f"stored row for key {int(keys[state[1]])} has {int(state[5])} bytes; the "
                                        f"table's {schema} needs {schema.row_bytes}")
            line = bytes(reply[state[0]:end]).split(b"\r\n", 1)[0]
            if status == MGET_ERROR_REPLY:
                raise redis.exceptions.ResponseError(line[1:].decode(errors="replace"))
            raise redis.exceptions.InvalidResponse(f"Protocol error, got {line[:40]!r} in an MGET reply")

    def _packing(self, tables: tuple) -> tuple:
        """``(shards [T], base [T], width [T], prefixes, widest)`` of ``tables`` for
        :func:`~dynemb.kernels.numba_find_many.pack_mget_into` (numpy arrays, kept per list; ``widest`` the longest
        prefix)."""
        kept = self._packings.get(tables)
        if kept is None:
            layouts = [self._layouts[t] for t in tables]
            sizes = [layout.prefixes.size for layout in layouts]
            widths = [layout.prefixes.shape[1] for layout in layouts]
            if len(self._packings) > 256:
                self._packings.clear()
            kept = self._packings[tables] = (
                np.array([layout.shards for layout in layouts], dtype=np.int64),
                np.cumsum([0] + sizes[:-1], dtype=np.int64), np.array(widths, dtype=np.int64),
                np.concatenate([layout.prefixes.reshape(-1) for layout in layouts]), max(widths, default=0))
        return kept

    def _names(self, tables: tuple, keys: torch.Tensor, sizes: list) -> list:
        """The Redis names of ``keys`` (``sizes[i]`` of ``tables[i]``, one after the other): one ``encode_keys`` for
        the tables of each prefix length, not one a table."""
        kept = self._concat_names_of.get(tables)
        if kept is None:
            layouts = [self._layouts[t] for t in tables]
            widths = sorted({layout.prefixes.shape[1] for layout in layouts})
            group = [widths.index(layout.prefixes.shape[1]) for layout in layouts]
            first, stacked = [], [[] for _ in widths]  # each table's first prefix row in its group's stack
            for layout, g in zip(layouts, group):
                first.append(sum(p.shape[0] for p in stacked[g]))
                stacked[g].append(layout.prefixes)
            if len(self._concat_names_of) > 256:
                self._concat_names_of.clear()
            kept = self._concat_names_of[tables] = (
                torch.tensor([layout.shards for layout in layouts]), torch.tensor(first), torch.tensor(group),
                [np.concatenate(p) for p in stacked])
        shards, first, group, prefixes = kept
        table_of = torch.repeat_interleave(torch.arange(len(tables)), torch.tensor(sizes), output_size=keys.numel())
        row = (first.index_select(0, table_of) + mix64(keys).remainder(shards.index_select(0, table_of))).numpy()
        if len(prefixes) == 1:
            return encode_keys(keys, prefixes[0], row)
        names = np.empty(keys.numel(), dtype=object)
        group_of = group.index_select(0, table_of).numpy()
        for g, stack in enumerate(prefixes):
            at = np.flatnonzero(group_of == g)
            if at.size:
                names[at] = encode_keys(keys[torch.from_numpy(at)], stack, row[at])
        return names.tolist()

    def _mget(self, commands: list, tables: tuple = ()) -> list:
        """The reply of one MGET per list of names in ``commands``, all sent in one round trip, with the markers
        of ``tables`` (:meth:`guard`) read and checked in it too."""
        markers = self._read_markers(tables)[0]
        if len(commands) == 1 and not markers:
            return [self._client.execute_command("MGET", *commands[0])]
        pipe = self._pipeline(write=False)
        for names in commands:
            pipe.execute_command("MGET", *names)
        if markers:
            pipe.execute_command("MGET", *markers)
        replies = pipe.execute()
        if markers:
            self._check_markers(markers, replies.pop())
        return replies

    @_translated
    def _put(self, table, schema, keys, values) -> None:
        layout = self._layouts[table]
        batch = self._batch(layout, keys)
        members = encode_keys(batch.keys, _NO_PREFIX)
        bound = self.config.max_rows_per_table
        if bound is not None and self.overflow is OverflowPolicy.REFUSE:
            self._check_room(table, layout, batch, members, bound)
        names = encode_keys(batch.keys, layout.prefixes, batch.shard_of)
        rows = encode_rows(values.index_select(0, batch.order))
        stamp = time.time_ns() // 1000
        pipe = self._pipeline(write=True)
        pipe.hsetnx(SCHEMA_KEY, table, layout.record)  # re-registers the table if the server restarted empty
        for shard, lo, hi in batch.bounds:
            pipe.execute_command("MSET", *_interleave(names[lo:hi], rows[lo:hi]))
            pipe.execute_command("ZADD", layout.index_keys[shard], *_interleave([stamp] * (hi - lo), members[lo:hi]))
        pipe.execute()
        if bound is not None and self.overflow is OverflowPolicy.EVICT:
            self._evict_oldest(table, schema, layout, bound)

    def _check_room(self, table: str, layout: _Layout, batch: _Batch, members: list, bound: int) -> None:
        pipe = self._pipeline(write=False)
        for shard, lo, hi in batch.bounds:
            pipe.execute_command("ZMSCORE", layout.index_keys[shard], *members[lo:hi])
        new = list(itertools.chain.from_iterable(pipe.execute())).count(None)
        held = sum(self._counts(layout))
        if held + new > bound:
            message = f"table {table!r} holds {held} rows; {new} new would exceed max_rows_per_table={bound}"
            raise StoreFullError(message)

    def _evict_oldest(self, table, schema, layout: _Layout, bound: int) -> None:
        counts = np.array(self._counts(layout), dtype=np.int64)
        excess = int(counts.sum()) - bound
        if excess <= 0:
            return
        pipe = self._pipeline(write=False)
        for shard, n in enumerate(_spread(counts, excess).tolist()):
            if n:
                pipe.execute_command("ZRANGE", layout.index_keys[shard], 0, n - 1)
        self._delete(table, schema, decode_keys(list(itertools.chain.from_iterable(pipe.execute()))))

    @_translated
    def _delete(self, table, schema, keys) -> int:
        layout = self._layouts[table]
        batch = self._batch(layout, keys)
        names = encode_keys(batch.keys, layout.prefixes, batch.shard_of)
        members = encode_keys(batch.keys, _NO_PREFIX)
        pipe = self._pipeline(write=True)
        for shard, lo, hi in batch.bounds:
            pipe.execute_command("DEL", *names[lo:hi])
            pipe.execute_command("ZREM", layout.index_keys[shard], *members[lo:hi])
        return sum(pipe.execute()[0::2])

    @_translated
    def _size(self, table, schema) -> int:
        return sum(self._counts(self._layouts[table]))

    @_translated
    def _keys(self, table, schema) -> torch.Tensor:
        pipe = self._pipeline(write=False)
        for key in self._layouts[table].index_keys:
            pipe.execute_command("ZRANGE", key, 0, -1)
        return decode_keys(list(itertools.chain.from_iterable(pipe.execute())))

    def _counts(self, layout: _Layout) -> list:
        pipe = self._pipeline(write=False)
        for key in layout.index_keys:
            pipe.zcard(key)
        return pipe.execute()

    def _close(self) -> None:
        readers, self._readers = self._readers, []
        for conn in readers:
            conn.disconnect()
        self._client.close()


def _buffers(conn, request: int, reply: int) -> tuple[np.ndarray, np.ndarray]:
    """Two uint8 buffers of at least ``request`` and ``reply`` bytes that ``conn`` keeps from call to call (a pooled
    connection serves one call at a time), grown by half again when too short."""
    kept = getattr(conn, "_dynemb_buffers", None)
    if kept is None or kept[0].shape[0] < request or kept[1].shape[0] < reply:
        have = (0, 0) if kept is None else (kept[0].shape[0], kept[1].shape[0])
        kept = tuple(np.empty(max(need, old + old // 2, 1 << 16), np.uint8)
                     for need, old in zip((request, reply), have))
        if kept[0].shape[0] + kept[1].shape[0] > _KEPT_BYTES:  # a bulk read: its buffers are not kept
            return kept
        conn._dynemb_buffers = kept
    return kept


def _marker_values(reply: np.ndarray, pos: int, end: int, count: int) -> list | None:
    """The ``count`` values (bytes, or None for a null) of the MGET reply at ``reply[pos:end]``; None while it is
    incomplete. Raises redis-py's ResponseError / InvalidResponse for an error or another reply."""
    data = bytes(reply[pos:end])
    line, sep, rest = data.partition(b"\r\n")
    if not sep:
        return None
    if line[:1] == b"-":
        raise redis.exceptions.ResponseError(line[1:].decode(errors="replace"))
    if line != b"*%d" % count:
        raise redis.exceptions.InvalidResponse(f"Protocol error, got {line[:40]!r} in a marker reply")
    values = []
    for _ in range(count):
        line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            return None
        if line in (b"$-1", b"_"):
            values.append(None)
            continue
        if line[:1] != b"$" or not line[1:].isdigit():
            raise redis.exceptions.InvalidResponse(f"Protocol error, got {line[:40]!r} in a marker reply")
        length = int(line[1:])
        if len(rest) < length + 2:
            return None
        values.append(rest[:length])
        rest = rest[length + 2:]
    return values


def _interleave(a: list, b: list) -> list:
    """``[a0, b0, a1, b1, ...]`` with C-level slice assignment."""
    out = [None] * (2 * len(a))
    out[0::2], out[1::2] = a, b
    return out


def _spread(counts: np.ndarray, excess: int) -> np.ndarray:
    """Rows to evict per shard, ``excess`` in all, taken from the fullest shards first (water-filling)."""
    lo, hi = 0, int(counts.max())
    while lo < hi:  # smallest level whose overflow fits in `excess`
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if np.maximum(counts - mid, 0).sum() <= excess else (mid + 1, hi)
    take = np.maximum(counts - lo, 0)
    short = excess - int(take.sum())
    at_level = np.flatnonzero(counts - take >= lo)[:short] if short else np.empty(0, dtype=np.int64)
    take[at_level] += 1
    return take
