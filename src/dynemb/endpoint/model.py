"""The served model: a run directory's DLRM with its tables read through a :class:`ParameterServer`.

The preprocessing comes from the run directory's model card; the tables come from a serving export of the same
run, loaded into the parameter server with ``"initializer"`` default rows, so an id training never saw reads the row
the eval-mode model would (``dynemb predict`` runs the model in eval mode). Probabilities therefore equal ``dynemb
predict`` on the same rows. The dense part (bottom MLP, interactions, top MLP) comes from the version the parameter
server loaded when it carries one (``dynemb train --publish-every``), else from the run's final checkpoint: tables
and MLPs are always of one version, even when training publishes while the server starts.

A new version (:meth:`ServedModel.apply_update`) is read and checked first, then swapped in (tables and dense part)
under the lock every forward pass holds: a forward pass sees exactly one version, the one it reports.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..checkpoint.dense import check_dense, dense_state
from ..checkpoint.fsutil import read_pointer
from ..checkpoint.export_format import read_dense, read_export, version_name
from ..data.batch import Batch, concat_batches
from ..functional import clip_rows, pool, to_bags
from ..job.score import probabilities
from ..serving.ps import ParameterServer
from .inference_protocol import OUTPUT, decode_request, model_metadata

__all__ = ["ServedModel", "ensure_export"]

MAX_IDS_PER_TABLE = 1 << 22
"""The parameter server's ``max_batch_size``: most ids of one table in one forward pass."""


def ensure_export(run: Path, export: Optional[Path]) -> Path:
    """The export root to serve: ``export`` if given, else ``run/export``, written from the run's final model
    when it holds no export yet.

    Raises:
        ValueError: ``export`` was given but holds no serving export.
    """
    from ..checkpoint import export_for_serving
    from ..job import load_model

    if export is not None:
        if not (Path(export) / "latest").is_file():
            raise ValueError(f"--export {export}: no serving export there (no 'latest'); write one with dynemb export")
        return Path(export)
    root = Path(run) / "export"
    if not (root / "latest").is_file():
        model, _ = load_model(Path(run))
        export_for_serving(root, model)
    return root


class ServedModel:
    """Click probabilities of a trained run, its tables served by a parameter server.

    Args:
        run: a ``dynemb train --out`` run directory.
        export: a serving export root of that run (``dynemb export``); default ``run/export``, written if missing.
        name: the model's name in the parameter server and on the endpoint.
        volatile_db: the parameter server's volatile store (``{"type": "memory"}`` or a Redis store).
        persistent_db: its persistent store (LMDB or RocksDB), or ``None``.
        cache_fraction: share of each table's rows in the parameter server's cache.
        device: device of the dense part and of the cache.

    Raises:
        ValueError: the run directory or the export is missing or does not match the run's tables.

    Shape:
        ``predict(batch)``: a batch of ``B`` rows -> probabilities ``[B]`` (float64, as ``dynemb predict`` writes
        them: :func:`dynemb.job.score.probabilities`).
    """

    def __init__(self, run, *, export=None, name: str = "dynemb", volatile_db: Optional[dict] = None,
                 persistent_db: Optional[dict] = None, cache_fraction: float = 0.2, device: str = "cpu") -> None:
        self.run, self.name = Path(run), name
        self.export = ensure_export(self.run, None if export is None else Path(export))
        model, self.card = _skeleton(self.run)
        collection = model.embeddings
        self.features = list(model.features)
        self._tables = {f: collection.feature_configs[f].table_name for f in self.features}
        table_names = list(dict.fromkeys(self._tables.values()))
        dims = [collection.table_configs[t].dim for t in table_names]
        model.embeddings = nn.Module()  # the tables live in the parameter server from here on; free the copies
        self.model = model.eval()
        config = {"models": [{"model": name, "sparse_files": [str(self.export)], "embedding_table_names": table_names,
                              "embedding_vecsize_per_table": dims,
                              "default_value_for_each_table": ["initializer"] * len(table_names),
                              "cache_fraction": cache_fraction, "max_batch_size": MAX_IDS_PER_TABLE,
                              "device": device}],
                  "volatile_db": volatile_db or {"type": "memory"}, "persistent_db": persistent_db}
        self.ps = ParameterServer.from_config(config)
        try:
            self.ps.load(name, progress=False)
            # The dense part comes from the version the tables were loaded from, not from a second read of
            # `latest`: training may publish between the two, and the watcher only applies versions above it.
            _copy_dense(model, _dense_of(self.run, self.export / version_name(self.version), model))
        except BaseException:
            self.ps.close()
            raise
        model.to(torch.device(device))
        self._pooling = {}
        for f in self.features:
            fcfg, tcfg = collection.feature_configs[f], collection.table_configs[self._tables[f]]
            self._pooling[f] = dict(combiner=fcfg.combiner or tcfg.combiner, max_norm=fcfg.max_norm,
                                    padding_value=fcfg.padding_value)
        self.device = torch.device(device)
        self._lock = threading.Lock()  # held by each forward pass and by each update
        self._updating = False

    @property
    def preprocessing(self):
        """The run's :class:`~dynemb.data.preprocess.Preprocessing` (columns, id types, dense statistics): requests
        are read and normalized by it, as ``dynemb predict`` reads files."""
        return self.card.preprocessing

    @property
    def version(self) -> int:
        """The export version the parameter server serves."""
        return int(self.ps.versions[self.name]["version"])

    def predict(self, batch: Batch) -> torch.Tensor:
        """Probabilities ``[B]`` of ``batch``'s rows (raw dense values: normalized here, as ``dynemb predict`` does)."""
        return self.predict_versioned(batch)[0]

    @torch.no_grad()
    def predict_versioned(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """``(probabilities [B], the export version that scored them)``: the whole pass runs on one version."""
        batch = self.preprocessing.normalize(batch.to(self.device))
        with self._lock:
            return self._scores(batch), self.version

    def _scores(self, batch: Batch) -> torch.Tensor:
        bags = {f: self._bags(batch, f) for f in self.features}
        # One id a row: its rows are the answer, looked up as they come (the parameter server takes repeats).
        ids = {f: (bags[f][0], None) if bags[f][1] is None else torch.unique(bags[f][0], return_inverse=True)
               for f in self.features}
        keys: dict[str, list] = {}
        for f, (unique, _) in ids.items():
            keys.setdefault(self._tables[f], []).append(unique)
        found = self.ps.lookup_many(self.name, {t: torch.cat(parts) for t, parts in keys.items()})  # one call
        split = {t: list(torch.split(found[t], [u.numel() for u in keys[t]])) for t in keys}
        pooled = {}
        for f in self.features:
            rows, inverse = split[self._tables[f]].pop(0), ids[f][1]
            if self._pooling[f]["max_norm"] is not None:
                rows = clip_rows(rows, self._pooling[f]["max_norm"])
            if bags[f][1] is None:
                pooled[f] = rows  # one id a row: every combiner gives the row itself
            else:
                pooled[f] = pool(rows, inverse, *bags[f][1:], self._pooling[f]["combiner"])
        return probabilities(self.model(batch, pooled=pooled))

    def _bags(self, batch: Batch, f: str) -> tuple:
        """``(ids [N], offsets, weights, B)`` as the collection forms them; offsets ``None`` for one id a row."""
        padding = self._pooling[f]["padding_value"]
        if f not in batch.offsets and padding is None:
            return batch.sparse[f], None
        offsets = batch.offsets[f][:-1] if f in batch.offsets else torch.arange(len(batch), device=self.device)
        return to_bags(batch.sparse[f], offsets, None, padding_value=padding)

    def updating(self) -> bool:
        """Whether an update is being swapped in now (a forward pass would wait for it)."""
        return self._updating

    # The endpoint's view of the model (:class:`~dynemb.endpoint.service.Servable`).
    def metadata(self) -> dict:
        """The v2 metadata's ``platform``, ``inputs`` and ``outputs`` (see :mod:`.inference_protocol`)."""
        return model_metadata(self.name, self.version, self.preprocessing)

    def decode_request(self, request, max_rows: int) -> Batch:
        """The batch of an infer request (:func:`~dynemb.endpoint.inference_protocol.decode_request`)."""
        return decode_request(request, self.preprocessing, max_rows)

    @staticmethod
    def join(batches: list) -> Batch:
        return concat_batches(batches)

    def infer(self, batch: Batch) -> tuple[dict, int]:
        """``({"probability": [B] float64}, the version that scored them)``."""
        probs, version = self.predict_versioned(batch) if len(batch) else (torch.zeros(0, dtype=torch.float64),
                                                                            self.version)
        return {OUTPUT: probs}, version

    def table_stats(self) -> dict:
        """The parameter server's statistics of this model (ids served per tier, per table)."""
        return self.ps.stats(self.name)

    def newest_version(self) -> Optional[tuple[int, float]]:
        """``(version, unix time it appeared)`` of the newest version in the export (what ``latest`` names)."""
        return newest_version(self.export)

    def apply_update(self, export_dir) -> int:
        """Apply a serving export version (full or delta) to the served tables, and its dense part when it has
        one; returns the version now served. The files are read and checked before the swap, which forward
        passes wait for (no request sees half an update).

        Raises:
            LineageError: the version does not follow the one served (see ``ParameterServer.apply_update``).
            CheckpointError: a file does not match its checksum. Nothing changes on any error.
        """
        export = read_export(export_dir)
        dense = read_dense(export[0]["path"])
        if dense is not None:
            dense = check_dense(self.model, dense, strict=True, source=Path(export[0]["path"]))
        with self._lock:
            self._updating = True
            try:
                self.ps.apply_update(export_dir, export=export)
                if dense is not None:
                    _copy_dense(self.model, dense)
                return self.version
            finally:
                self._updating = False

    def close(self) -> None:
        self.ps.close()


def newest_version(root: Path) -> Optional[tuple[int, float]]:
    """``(version, unix time its directory appeared)`` of what export ``root``'s ``latest`` names; None without."""
    try:
        name = read_pointer(Path(root))
        if name is None or not name.startswith("version-"):
            return None
        return int(name.removeprefix("version-")), (Path(root) / name).stat().st_mtime
    except (OSError, ValueError):
        return None


def _skeleton(run: Path):
    """``(the run's model with untrained weights, its card)``: the dense part is filled by :func:`_dense_of`."""
    from ..job import read_card
    from ..train import build_dlrm

    card = read_card(run)
    prep = card.preprocessing
    return build_dlrm(len(prep.dense), prep.features, card.config).eval(), card


def _dense_of(run: Path, version_dir: Path, model: nn.Module) -> dict:
    """The checked dense state of export ``version_dir`` when it carries one, else of the run's final checkpoint."""
    from ..job import load_model

    dense, source = read_dense(version_dir), version_dir
    if dense is None:
        dense, source = dense_state(load_model(run)[0]), run
    return check_dense(model, dense, strict=True, source=source)


@torch.no_grad()
def _copy_dense(model: nn.Module, state: dict) -> None:
    """Copy a checked dense state into ``model``'s parameters and buffers, in place."""
    targets = dense_state(model, keep_vars=True)
    for name, value in state.items():
        targets[name].copy_(value)
