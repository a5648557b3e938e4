"""The served model: a run directory's DLRM with its tables read through a :class:`ParameterServer`.

The preprocessing comes from the run directory's model card; the tables come from a serving export of the same
run, loaded into the parameter server with ``"initializer"`` default rows, so an id training never saw reads the row
the eval-mode model would (``dynemb predict`` runs the model in eval mode). Probabilities therefore equal ``dynemb
predict`` on the same rows. The dense part (bottom MLP, interactions, top MLP) comes from the version the parameter
server loaded when it carries one (``dynemb train --publish-every``), else from the run's best checkpoint: tables
and MLPs are always of one version, even when training publishes while the server starts.

A new version (:meth:`ServedModel.apply_update`) is read and checked first, then swapped in (tables and dense part)
under the lock every forward pass holds: a forward pass sees exactly one version, the one it reports.

Features are pooled by the collection's own code: the batch's features are prepared as the collection's forward
prepares them (:func:`~dynemb.collection.features.prepare_features`: bags, padding, combiner, ``max_norm``) and
each feature's output is formed from its rows by :func:`~dynemb.collection.features.finish`, the same function
the collection's executors finish features with; only the rows come from elsewhere (one parameter-server call for
all the tables of a request). One exception, the DLRM's usual case: when every feature is one id a row pooled
plainly, a bag of one id pools to ``0.0 + row`` under every combiner, and the parameter server writes each row so
straight into the dense part's ``[B, F, D]`` input (:meth:`ServedModel.pooled_stacked`);
``tests/endpoint/test_served_pooling.py`` checks it against the collection bit for bit.
"""

from __future__ import annotations

import operator
import threading
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from ..checkpoint.dense import check_dense, dense_state
from ..collection.features import finish, prepare_features
from ..checkpoint.fsutil import read_pointer
from ..checkpoint.export_format import read_dense, read_export, version_name
from ..data.batch import Batch, concat_batches
from ..functional.pooling import BagSet, one_id_bags, pool_many
from ..job.score import probabilities
from ..models.dlrm import DLRM
from ..serving.exported_model import export_server_config
from ..serving.ps import ParameterServer
from .inference_protocol import OUTPUT, decode_request, model_metadata

__all__ = ["ServedModel", "ensure_export"]

_BUFFER_ROWS = 4096  # the largest batch whose [B, F, D] input ServedModel keeps between requests



def ensure_export(run: Path, export: Optional[Path]) -> Path:
    """The export root to serve: ``export`` if given, else ``run/export``, written from the run's best model when it
    holds no export yet.

    Raises:
        ValueError: ``export`` was given but holds no serving export.
    """
    from ..checkpoint import export_for_serving
    from ..job import load_model
    from ..job.publish import run_lock

    if export is not None:
        if not (Path(export) / "latest").is_file():
            raise ValueError(f"--export {export}: no serving export there (no 'latest'); write one with dynemb export")
        return Path(export)
    root = Path(run) / "export"
    with run_lock(Path(run)):
        if not (root / "latest").is_file():
            model, _ = load_model(Path(run), optimizer=False)
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
        config = export_server_config(name, self.export, table_names, dims, cache_fraction=cache_fraction,
                                      device=device, volatile_db=volatile_db, persistent_db=persistent_db)
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
        # The collection's feature and table configs, which say how each feature pools (its tables' rows are not
        # kept: they come from the parameter server).
        self.feature_configs = {f: collection.feature_configs[f] for f in self.features}
        self.table_configs = {t: collection.table_configs[t] for t in table_names}
        self.device = torch.device(device)
        self._lock = threading.Lock()  # held by each forward pass and by each update
        self._updating = False
        self._plan: Optional[_FeaturePlan] = None  # what every request's features reuse (see pooled)
        self._buffers: dict[int, tuple] = {}  # [B, F + 1, D] inputs of the dense part, per batch size (_buffer)

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
        if not _on(batch, self.device):
            batch = batch.to(self.device)
        batch = self.preprocessing.normalize(batch)
        with self._lock:
            return self._scores(batch), self.version

    def _scores(self, batch: Batch) -> torch.Tensor:
        if isinstance(self.model, DLRM):
            # the [B, F + 1, D] input of this batch size, reused (a forward pass holds the lock, the logits do not
            # alias it): the rows go to [:, 1:], the bottom MLP's output to [:, 0] (DLRM.forward_stacked: no stack
            # or concatenation of the F + 1 vectors)
            kept = self._buffer(len(batch))
            if kept is not None:
                whole, rows, rows_array = kept
                if self.pooled_stacked(batch, out=rows, out_array=rows_array) is not None:
                    return probabilities(self.model.forward_stacked(batch.dense, whole))
            else:
                stacked = self.pooled_stacked(batch)
                if stacked is not None:
                    return probabilities(self.model(batch, pooled=stacked))
        return probabilities(self.model(batch, pooled=self.pooled(batch)))

    def _buffer(self, n: int) -> Optional[tuple]:
        """``(a float32 [n, F + 1, D], its [:, 1:], that as a numpy array)`` kept per batch size (a few of them, up
        to :data:`_BUFFER_ROWS` rows: a server's usual batches) for :meth:`pooled_stacked` and
        :meth:`DLRM.forward_stacked`; None for a larger batch (new tensors then)."""
        kept = self._buffers.get(n)
        if kept is None:
            if n > _BUFFER_ROWS:
                return None
            if len(self._buffers) >= 4:
                self._buffers.clear()
            dim = self.table_configs[self._tables[self.features[0]]].dim
            whole = torch.empty(n, len(self.features) + 1, dim, device=self.device)
            rows = whole[:, 1:]
            kept = self._buffers[n] = (whole, rows, rows.numpy() if self.device.type == "cpu" else None)
        return kept

    def pooled_stacked(self, batch: Batch, out: Optional[torch.Tensor] = None,
                       out_array=None) -> Optional[torch.Tensor]:
        """``[B, F, D]``: :meth:`pooled`'s outputs as one tensor, features in :attr:`features` order, when every
        feature is one id a row pooled plainly (the DLRM's interaction takes it as it is); else None.

        A bag of one id pools to ``0.0 + row`` by sum, mean or sqrtn alike, so the parameter server writes each
        row to its place (:meth:`~dynemb.serving.ParameterServer.lookup_stacked`: with one cache, of any export
        dtype, the cache probe, the misses' store reads and default rows and the writes are two numba calls); ``out``: a
        ``[B, F, D]`` to write into (default a new tensor), contiguous or a slice ``[:, k:k + F]`` of a contiguous
        buffer; ``out_array``: ``out.numpy()`` kept with it."""
        plan = self._request_plan()
        ids = plan.one_id_ids(batch)
        if ids is None:
            return None
        return self.ps.lookup_stacked(self.name, plan.tables, ids, len(batch), out=out, out_array=out_array)

    def pooled(self, batch: Batch) -> dict:
        """``{feature: [B, D]}``: the features' outputs of a normalized ``batch`` (on :attr:`device`), as the
        run's ``EmbeddingCollection`` gives them from the same rows (what :meth:`predict` feeds the dense part).

        The whole batch is one parameter-server call (:meth:`~dynemb.serving.ParameterServer.lookup_concat`: the
        ids of every feature in one tensor, looked up as they come) and one pooling call
        (:func:`~dynemb.functional.pooling.pool_many`, the collection's sum-pooling, for every pooled feature);
        only features with ``max_norm`` or sequence outputs are finished one by one
        (:func:`~dynemb.collection.features.finish`)."""
        plan = self._request_plan()
        ids = plan.one_id_ids(batch)
        if ids is not None:  # every feature one id a row, pooled plainly: their BagSets are known beforehand
            n = len(batch)
            rows = self.ps.lookup_concat(self.name, plan.tables, ids, plan.sizes(n))
            return dict(zip(plan.features, pool_many(rows, one_id_bags(ids.numel(), ids.device),
                                                     plan.bag_sets(n, ids.device))))
        # Prepared as EmbeddingCollection.forward prepares them (ids checked, bags formed, combiner chosen).
        prepared = prepare_features(self.model.sparse_inputs(batch), {}, self.feature_configs, self.table_configs,
                                    self.device)
        parts = [p for table_parts in prepared.values() for p in table_parts]
        plain, rest = [p for p in parts if p.plain], [p for p in parts if not p.plain]
        order = plain + rest
        if not order:
            return {}
        sizes = [p.ids.numel() for p in order]
        ids = torch.cat([p.ids.to(torch.int64) for p in order])
        if plan.one_width:
            runs = self.ps.lookup_concat(self.name, [p.table for p in order], ids, sizes).split(sizes)
        else:  # tables of several widths: one call all the same, rows by table
            keys = {p.table: None for p in order}
            for p, run in zip(order, ids.split(sizes)):
                keys[p.table] = run if keys[p.table] is None else torch.cat([keys[p.table], run])
            found = self.ps.lookup_many(self.name, keys)
            taken = dict.fromkeys(keys, 0)
            runs = []
            for p, n in zip(order, sizes):
                runs.append(found[p.table][taken[p.table]:taken[p.table] + n])
                taken[p.table] += n
        out = {}
        if plain:
            n = sum(sizes[:len(plain)])
            values = runs[0] if len(plain) == 1 else torch.cat(runs[:len(plain)])
            out.update(zip((p.name for p in plain), pool_many(values, one_id_bags(n, ids.device),
                                                              [p.bags for p in plain])))
        for p, values in zip(rest, runs[len(plain):]):
            out[p.name] = finish(p, values, one_id_bags(values.shape[0], values.device))
        return {p.name: out[p.name] for p in parts}

    def _request_plan(self) -> "_FeaturePlan":
        """The kept :class:`_FeaturePlan`, made again when a feature's config changed."""
        plan = self._plan
        if plan is None or not plan.current(self.feature_configs):
            plan = self._plan = _FeaturePlan(self.features, self.feature_configs, self.table_configs, self.device)
        return plan

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


class _FeaturePlan:
    """What :meth:`ServedModel.pooled` reuses from request to request: each feature's table, whether every feature
    is one id a row pooled plainly (then a request's ids are one tensor and its bags are known beforehand), and
    the bags of each batch size seen. Made again when a feature's config changes (:meth:`current`)."""

    def __init__(self, features: list, feature_configs: dict, table_configs: dict, device: torch.device) -> None:
        self.features = list(features)
        self.configs = list(feature_configs.values())
        self.tables = [feature_configs[f].table_name for f in self.features]
        self.one_width = len({table_configs[t].dim for t in self.tables}) == 1
        self.one_id = device.type == "cpu" and self.one_width and list(feature_configs) == self.features and all(
            _plain_one_id(feature_configs[f], table_configs[t]) for f, t in zip(self.features, self.tables))
        self._bags: dict[int, tuple] = {}

    def current(self, feature_configs: dict) -> bool:
        """The configs are the ones this plan was made from (the same objects)."""
        configs = feature_configs.values()
        return len(configs) == len(self.configs) and all(map(operator.is_, configs, self.configs))

    def one_id_ids(self, batch: Batch) -> Optional[torch.Tensor]:
        """The ids of every feature, one run a feature, as one int64 tensor ``[F * B]``; None unless every feature
        is one id a row (no offsets) pooled plainly, the batch holding exactly the model's features."""
        sparse = batch.sparse
        if not self.one_id or batch.offsets or len(sparse) != len(self.features):
            return None
        try:
            runs = [sparse[f] for f in self.features]  # int64 [B] each (Batch checks it)
        except KeyError:
            return None
        return torch.cat(runs)

    def sizes(self, n: int) -> tuple:
        return self._bags_of(n)[0]

    def bag_sets(self, n: int, device: torch.device) -> list:
        """The features' bags of a batch of ``n`` rows as the collection prepares them: one id a bag, summed (a
        bag of one id: the mean's and sqrtn's divisor is 1), offsets shared (:func:`one_id_bags`)."""
        sizes, bags = self._bags_of(n)
        offsets = one_id_bags(n, device)
        if bags is None or bags[0].offsets is not offsets:  # one_id_bags makes its tensor again once written to
            bags = [BagSet(n, offsets, None, n, "sum", True)] * len(self.features)
            self._bags[n] = (sizes, bags)
        return bags

    def _bags_of(self, n: int) -> tuple:
        kept = self._bags.get(n)
        if kept is None:
            if len(self._bags) >= 64:
                self._bags.clear()
            kept = self._bags[n] = ((n,) * len(self.features), None)
        return kept


def _on(batch: Batch, device: torch.device) -> bool:
    """Every tensor of ``batch`` is on ``device`` already (``Batch.to`` would make a new batch all the same)."""
    tensors = (batch.dense, batch.labels, *batch.sparse.values(), *batch.offsets.values())
    if device.type == "cpu":  # no device object made a tensor
        return all(map(operator.attrgetter("is_cpu"), tensors))
    return all(t.device == device for t in tensors)


def _plain_one_id(feature, table) -> bool:
    """A one-id-a-row input of ``feature`` is prepared as a bag of that id, summed (``prepare_features``): no
    ``max_norm``, not a sequence, no padding, int64 ids of a dynamic table (no range to check)."""
    combiner = feature.combiner or table.combiner
    return (combiner != "none" and feature.max_norm is None and feature.padding_value is None
            and table.key_dtype == torch.int64 and not table.is_static)


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
    return build_dlrm(len(prep.dense), prep.features, card.config, optimizer=False).eval(), card


def _dense_of(run: Path, version_dir: Path, model: nn.Module) -> dict:
    """The checked dense state of export ``version_dir`` when it carries one, else of the run's best checkpoint."""
    from ..job import load_model

    dense, source = read_dense(version_dir), version_dir
    if dense is None:
        dense, source = dense_state(load_model(run, optimizer=False)[0]), run
    return check_dense(model, dense, strict=True, source=source)


@torch.no_grad()
def _copy_dense(model: nn.Module, state: dict) -> None:
    """Copy a checked dense state into ``model``'s parameters and buffers, in place."""
    targets = dense_state(model, keep_vars=True)
    for name, value in state.items():
        targets[name].copy_(value)
