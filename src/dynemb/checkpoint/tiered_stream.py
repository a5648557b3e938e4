"""Streaming a tiered table's rows to and from checkpoint files, ``CHUNK_ROWS`` rows at a time.

A :class:`~dynemb.table.TieredTable` may hold many times the memory it is allowed, so nothing here materializes
all its rows: a save writes each column as a :class:`ColumnStream` (the fast tier's rows, then the slow tier's,
read a chunk at a time; a delta gathers its changed rows a chunk at a time), and a load checks each file's size,
header and checksum in one streaming pass before anything changes, then reads it again a chunk of rows at a time
into :meth:`~dynemb.table.TieredTable.replace_chunks`. The files are the ones an untiered table writes: the tiers
never show in them. Extra memory is O(``CHUNK_ROWS`` rows) plus, for a delta, the int64 positions of its changed
rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from .shard_tensors import ADMISSION_COUNTS, ADMISSION_KEYS, DELETED, KEYS, ORDER, check_shard
from .errors import CheckpointError
from .tensorfile import FileRecord, verify_file

__all__ = ["CHUNK_ROWS", "ColumnStream", "StreamedShard", "stream_column", "tiered_columns", "tiered_delta_columns",
           "verify_shard", "verify_sources", "stream_into", "read_chunks", "largest_chunk"]

#: rows per chunk moved between a tiered table and a file (a dim-64 float32 chunk of values is 4 MiB)
CHUNK_ROWS = 1 << 14
#: bytes of the largest chunk materialized since :func:`largest_chunk` was last reset (tests check the bound)
_LARGEST = [0]


def largest_chunk(reset: bool = False) -> int:
    """Bytes of the largest chunk this module materialized (read, gathered or converted); ``reset`` restarts."""
    value = _LARGEST[0]
    if reset:
        _LARGEST[0] = 0
    return value


def _noted(t: torch.Tensor) -> torch.Tensor:
    _LARGEST[0] = max(_LARGEST[0], t.numel() * t.element_size())
    return t


class ColumnStream:
    """A column written a piece at a time: ``dtype``, ``shape`` and ``pieces()``, an iterator of tensors whose
    concatenation along dim 0 is the column. :func:`~dynemb.checkpoint.tensorfile.write_tensors` takes it where
    it takes a tensor.

    Example:
        >>> s = ColumnStream(torch.int64, (5,), lambda: iter([torch.arange(3), torch.arange(2)]))
        >>> s.numel(), s.element_size(), torch.cat(list(s.pieces())).tolist()
        (5, 8, [0, 1, 2, 0, 1])
    """

    def __init__(self, dtype: torch.dtype, shape: tuple, pieces: Callable[[], Iterator[torch.Tensor]]) -> None:
        self.dtype, self.shape, self._pieces = dtype, torch.Size(shape), pieces
        self.layout = torch.strided

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def pieces(self) -> Iterator[torch.Tensor]:
        return self._pieces()

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype | None = None) -> "ColumnStream":
        """This column with ``fn`` applied to each piece (an elementwise map: user keys, a cast)."""
        return ColumnStream(dtype or self.dtype, self.shape, lambda: (_noted(fn(p)) for p in self._pieces()))

    def to(self, dtype: torch.dtype) -> "ColumnStream":
        """This column cast to ``dtype`` a piece at a time."""
        return self if dtype == self.dtype else self.map(lambda p: p.to(dtype), dtype)

    def materialize(self) -> torch.Tensor:
        """The whole column as one tensor (O(column) memory: only where a collective needs a tensor)."""
        pieces = list(self.pieces())
        return torch.cat(pieces) if pieces else torch.empty(self.shape, dtype=self.dtype)


class _Holed:
    """A column of a row-file level written as a log (:class:`~dynemb.table.slow.LogStore`) read where it stands:
    its ``n`` live rows are the ring rows ``holds`` marks, in ascending order (the level's ``stored_rows``, so
    :meth:`~dynemb.table.TieredTable.export`'s order). Read so, a save needs no free space in the ``Tiers.slow``
    directory (packing the file first rewrote every live row into a new file there: on a full disk, no checkpoint
    could be taken) and writes nothing but the checkpoint."""

    def __init__(self, col: torch.Tensor, holds: torch.Tensor, n: int) -> None:
        self.col, self.holds, self.n = col, holds, n
        self.dtype, self.shape = col.dtype, torch.Size((n,) + tuple(col.shape[1:]))
        self._rows = None

    def chunks(self) -> Iterator[torch.Tensor]:
        """The live rows, gathered from at most ``CHUNK_ROWS`` ring rows at a time."""
        for i in range(0, self.holds.numel(), CHUNK_ROWS):
            at = self.holds[i : i + CHUNK_ROWS].nonzero().squeeze(1)
            if at.numel():
                yield _noted(self.col.index_select(0, at + i))

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        """The live rows at ``positions`` (``0 .. n-1``, in export order): a delta's changed rows."""
        if self._rows is None:  # int64 a live row: as the level's changes_since already took
            self._rows = self.holds.nonzero().squeeze(1)
        return self.col.index_select(0, self._rows.index_select(0, positions))


def _tier_columns(table) -> dict[str, list]:
    """Each column's live rows as ``[fast rows, rows of each level below]``: views, or a :class:`_Holed` for a
    level whose row file has holes (names as in :class:`Rows`)."""
    n_fast = table.live_rows()
    names = {"keys": "key", "values": "value", "scores": "score",
             **{f"slot:{s}": f"slot:{s}" for s in table.slot_names}}

    def part(level, col):
        holds = getattr(level, "_holds", None)
        if holds is None or level._packed():
            return level._cols[col][: level.size()]
        return _Holed(level._cols[col], holds, level.size())

    return {name: [table._cols[col][:n_fast]] + [part(level, col) for level in table.levels]
            for name, col in names.items()}


def _chunked(parts: list) -> Callable[[], Iterator[torch.Tensor]]:
    def pieces():
        for p in parts:
            if isinstance(p, _Holed):
                yield from p.chunks()
            else:
                yield from (p[i : i + CHUNK_ROWS] for i in range(0, p.shape[0], CHUNK_ROWS))
    return pieces


def _gathered(parts: list, rows: torch.Tensor) -> Callable[[], Iterator[torch.Tensor]]:
    """Pieces of ``cat(parts)[rows]``, gathered ``CHUNK_ROWS`` rows at a time, for ``rows`` that list the first
    part's positions before the second's (as a tiered table's ``changes_since`` does; any order with one part)."""
    from ..table.ops import gather_rows

    starts = [0]
    for p in parts:
        starts.append(starts[-1] + p.shape[0])

    def pieces():
        for i in range(0, rows.numel(), CHUNK_ROWS):
            chunk = rows[i : i + CHUNK_ROWS]
            for part, start, stop in zip(parts, starts, starts[1:]):
                mine = chunk[(chunk >= start) & (chunk < stop)] - start
                if mine.numel():
                    got = part.gather(mine) if isinstance(part, _Holed) else gather_rows(part, mine.to(part.device))
                    yield _noted(got)
    return pieces


def stream_column(parts: list[torch.Tensor], rows: torch.Tensor | None = None) -> ColumnStream:
    """The column ``cat(parts)`` (its rows at positions ``rows`` when given) as a :class:`ColumnStream` read
    ``CHUNK_ROWS`` rows at a time: slices of ``parts`` themselves, or, with ``rows``, chunks gathered from them.

    Example:
        >>> col = stream_column([torch.arange(6).view(3, 2)], rows=torch.tensor([2, 0]))
        >>> col.shape, torch.cat(list(col.pieces())).tolist()
        (torch.Size([2, 2]), [[4, 5], [0, 1]])
    """
    tail = tuple(parts[0].shape[1:])
    if rows is None:
        return ColumnStream(parts[0].dtype, (sum(p.shape[0] for p in parts),) + tail, _chunked(parts))
    rows = rows.cpu()
    return ColumnStream(parts[0].dtype, (rows.numel(),) + tail, _gathered(parts, rows))


def tiered_columns(shard, *, state: bool = True) -> dict[str, ColumnStream]:
    """A tiered table's live rows as streamed columns named as in the files (``keys``, ``values``, with
    ``state`` also ``scores`` and ``slot.<name>``), in :meth:`~dynemb.table.TieredTable.export`'s row order."""
    return _streamed(shard, None, state)


def tiered_delta_columns(shard, rows: torch.Tensor, *, state: bool = True) -> dict[str, ColumnStream]:
    """The rows at positions ``rows`` (in export order, from ``changes_since``) of every column, streamed."""
    return _streamed(shard, rows, state)


def _streamed(shard, rows: torch.Tensor | None, state: bool) -> dict[str, ColumnStream]:
    cols = {}
    for name, parts in _tier_columns(shard.table).items():
        if not state and name not in ("keys", "values"):
            continue
        stream = stream_column(parts, rows)
        cols[name.replace("slot:", "slot.")] = stream.map(shard.user_keys) if name == "keys" else stream
    return cols


# ---------------------------------------------------------------------------------------------------- reading
def verify_shard(path: Path, record: FileRecord | None) -> tuple[dict, dict]:
    """Check ``path``'s size and checksum against ``record`` in one streaming pass and parse its header.

    Returns ``(layout, meta)``: ``{name: (dtype, shape, offset)}`` (offsets from the file start) and a ``meta``
    tensor of every column (dtype and shape, no data) for :func:`~dynemb.checkpoint.shard_tensors.check_shard`.
    """
    layout = verify_file(path, record)
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape, _) in layout.items()}
    return layout, meta


def read_column(path: Path, layout: dict, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Rows ``start:stop`` of column ``name`` of a file whose ``layout`` :func:`verify_shard` returned."""
    dtype, shape, offset = layout[name]
    stop = shape[0] if stop is None else min(stop, shape[0])
    row = dtype.itemsize * (shape[1:].numel() if len(shape) > 1 else 1)
    out = torch.empty((max(0, stop - start),) + tuple(shape[1:]), dtype=dtype)
    with open(path, "rb") as f:
        f.seek(offset + start * row)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        if out.numel() and f.readinto(view) != len(view):
            raise CheckpointError(f"{path}: file ends inside tensor {name!r} (changed since it was checked?)")
    return _noted(out)


def read_chunks(path: Path, layout: dict, names: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """``{name: rows}`` of the row-aligned columns ``names``, ``CHUNK_ROWS`` rows at a time."""
    n = layout["keys"][1][0]
    for start in range(0, n, CHUNK_ROWS):
        yield {name: read_column(path, layout, name, start, start + CHUNK_ROWS) for name in names}


class StreamedShard(NamedTuple):
    """A tiered table's part of a checkpoint, verified and not yet read: per saved rank its chain of files
    (``(path, layout, is_delta)``, full file first), the rows of the last files, whether rows are filtered by owner
    (a resharding load), and the (small) admission columns of the last files."""

    chains: list
    rows: int
    reshard: bool
    admission: dict


def verify_sources(sources: dict, reshard: bool, config: dict, progress) -> StreamedShard:
    """Verify every file of ``sources`` (``{rank: steps}``, see the loader): size, checksum, header and the row
    count the manifest gives, without reading their rows into memory."""
    chains, rows, admission = [], 0, {}
    for steps in sources.values():
        chain = []
        for path, is_delta, record, entry in steps:
            layout, meta = verify_shard(path, record)
            n = check_shard(meta, config, path, delta=is_delta)
            if not is_delta and n != entry["rows"]:
                raise CheckpointError(f"{path}: the table has {n} rows here, the manifest says {entry['rows']}")
            if progress is not None and record is not None:
                progress(record.bytes)
            chain.append((path, layout, is_delta))
        rows += steps[-1][3]["rows"]
        path, layout, _ = chain[-1]
        for name in (ADMISSION_KEYS, ADMISSION_COUNTS):
            if name in layout:
                admission.setdefault(name, []).append(read_column(path, layout, name))
        chains.append(chain)
    if len(admission.get(ADMISSION_KEYS, ())) != len(chains):  # as in memory: only when every file has them
        admission = {}
    return StreamedShard(chains, rows, reshard, {name: torch.cat(parts) for name, parts in admission.items()})


def stream_into(streamed: StreamedShard, shard, table_rows: Callable) -> Callable:
    """A function that loads ``streamed`` into ``shard``'s tiered table a chunk at a time: every rank's full file
    through :meth:`~dynemb.table.TieredTable.replace_chunks`, then each delta's deleted keys and rows through
    :meth:`~dynemb.table.TieredTable.load_chunk` (only ``shard``'s own rows when resharding). ``table_rows`` turns
    a chunk of file columns into the table's :class:`Rows`."""
    def chunks(path, layout):
        names = [n for n in layout if n not in (ADMISSION_KEYS, ADMISSION_COUNTS, DELETED, ORDER)]
        for chunk in read_chunks(path, layout, names):
            if streamed.reshard:
                kept = shard.owned(chunk[KEYS]).nonzero().squeeze(1)
                chunk = {name: _noted(col.index_select(0, kept)) for name, col in chunk.items()}
            yield table_rows(shard, chunk, "cpu")  # most go to the slow tier: never via the device

    def load(table) -> None:
        deltas = any(is_delta for chain in streamed.chains for _, _, is_delta in chain)
        total = None if streamed.reshard or deltas else streamed.rows
        table.replace_chunks((rows for chain in streamed.chains for rows in chunks(*chain[0][:2])), total)
        for chain in streamed.chains:
            for path, layout, _ in chain[1:]:
                for start in range(0, layout[DELETED][1][0], CHUNK_ROWS):
                    deleted = read_column(path, layout, DELETED, start, start + CHUNK_ROWS)
                    table.load_chunk(deleted=shard.shard_keys(deleted.to(table.device)))
                for rows in chunks(path, layout):
                    table.load_chunk(rows)
        if not streamed.reshard and table.size() != streamed.rows:
            raise CheckpointError(f"{streamed.chains[0][-1][0]}: the table has {table.size()} rows after its chain, "
                                  f"the manifest says {streamed.rows}")
        table.inserted = table.size()
    return load
