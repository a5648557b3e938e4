"""A model written by :func:`~dynemb.serving.export_model`, served: its program run with every collection lookup
answered by a :class:`ParameterServer` holding its tables.

Tables and program of one version are swapped in together (:meth:`ExportedModel.apply_update`, under the lock each
forward pass holds), so a forward pass sees exactly one version, the one it reports.
"""

from __future__ import annotations

import io
import re
import threading
from pathlib import Path
from typing import Optional

import torch

from ..checkpoint.export_format import read_attached, read_export, version_name
from ..checkpoint.fsutil import read_pointer
from ..checkpoint.manifest import SERVING_FORMAT, read_manifest, resolve
from ..collection.config import FeatureConfig, TableConfig
from ..serialization import parse_dtype
from .model_export import PROGRAM_FILE
from .ps import ParameterServer
from .served_features import bind, prepared_lookup

__all__ = ["ExportedModel", "MAX_IDS_PER_TABLE"]

MAX_IDS_PER_TABLE = 1 << 22
"""The parameter server's ``max_batch_size``: most ids of one table in one forward pass."""


class _Program:
    """One version's program: the callable module, its inputs and outputs, its collections' configs."""

    def __init__(self, version_dir) -> None:
        directory = resolve(version_dir)
        if not isinstance(read_manifest(directory, SERVING_FORMAT).get("program"), dict):
            raise ValueError(f"{directory}: no 'program' in its manifest; this is a table export "
                             "(export_for_serving), not a model export (dynemb.serving.export_model); a `dynemb "
                             "train` run is served with `dynemb serve --model RUN_DIR`")
        manifest, data = read_attached(directory, PROGRAM_FILE)
        meta = manifest["program"]
        program = torch.export.load(io.BytesIO(data))
        self.inputs, self.outputs, self.batch_input = meta["inputs"], meta["outputs"], meta.get("batch_input")
        # The export keeps no example inputs (see export_model); the program's shape checks are generated from
        # inputs of its structure, so stand-ins of it come back here (only their placement in the call is read).
        program.example_inputs = (tuple(torch.zeros([2 if d == -1 else d for d in t["shape"]],
                                                    dtype=parse_dtype(t["dtype"])) for t in self.inputs), {})
        self.module = program.module()
        self.collections = {}
        for path, record in meta["collections"].items():
            tables = {t["name"]: TableConfig(**t) for t in record["tables"]}
            features = {f["name"]: FeatureConfig.from_dict(f) for f in record["features"]}
            self.collections[path] = (features, tables)


class ExportedModel:
    """An ``export_model`` export served: its tables in a parameter server, its program bound to it.

    Args:
        export: the export root (``export_model``'s ``path``): its ``latest`` version is served.
        name: the model's name in the parameter server (and on the endpoint).
        volatile_db: the parameter server's volatile store (``{"type": "memory"}`` or a Redis store).
        persistent_db: its persistent store (LMDB or RocksDB), or ``None``.
        cache_fraction: share of each table's rows in the parameter server's cache.
        device: where the program runs and rows land (``"cpu"``; ``"cuda"`` when the program was exported there).

    An id no version holds reads its table's initializer row (``"initializer"`` default rows), the row the model
    in eval mode reads for it: served outputs equal the eager model's in eval mode.

    Example:
        >>> # served = ExportedModel("exports/ranker")
        >>> # served({"dense": dense, "features_values": values, "features_lengths": lengths})
        >>> # -> ({"output": tensor [B]}, 1)
    """

    def __init__(self, export, *, name: str = "dynemb", volatile_db: Optional[dict] = None,
                 persistent_db: Optional[dict] = None, cache_fraction: float = 0.2, device: str = "cpu") -> None:
        self.name, self.device = name, torch.device(device)
        self.export = Path(export)
        if read_pointer(self.export) is None:
            if (self.export / "manifest.json").is_file() and read_pointer(self.export.parent) is not None:
                raise ValueError(f"{self.export}: this is one version of the export {self.export.parent}; serve the "
                                 "export's root (its 'latest' names the version served, and --watch follows it)")
            if (self.export / "model.json").is_file() and (self.export / "checkpoint").is_dir():
                raise ValueError(f"{self.export}: a `dynemb train` run directory, not an export of your own model; "
                                 "serve it with `dynemb serve --model RUN_DIR`")
            where = "no such directory" if not self.export.exists() else "no export there (no 'latest')"
            raise ValueError(f"{self.export}: {where}; write one with "
                             "dynemb.serving.export_model(path, model, example_inputs)")
        manifest = read_manifest(resolve(self.export), SERVING_FORMAT)
        names = list(manifest["tables"])
        config = {"models": [{"model": name, "sparse_files": [str(self.export)], "embedding_table_names": names,
                              "embedding_vecsize_per_table": [manifest["tables"][t]["dim"] for t in names],
                              "default_value_for_each_table": ["initializer"] * len(names),
                              "cache_fraction": cache_fraction, "max_batch_size": MAX_IDS_PER_TABLE,
                              "device": device}],
                  "volatile_db": volatile_db or {"type": "memory"}, "persistent_db": persistent_db}
        self.ps = ParameterServer.from_config(config)
        try:
            self.ps.load(name, progress=False)
            # the program of the version the tables were loaded from (training may publish meanwhile)
            self.program = _Program(self.export / version_name(self.version))
        except BaseException:
            self.ps.close()
            raise
        self._lock = threading.Lock()  # held by each forward pass and by each update
        self._updating = False

    @property
    def version(self) -> int:
        """The export version served."""
        return int(self.ps.versions[self.name]["version"])

    @property
    def inputs(self) -> list:
        """``[{"name", "dtype", "shape"}]`` of the program's inputs (``-1``: a dynamic size), in order."""
        return self.program.inputs

    @property
    def outputs(self) -> list:
        return self.program.outputs

    @torch.no_grad()
    def __call__(self, inputs: dict) -> tuple[dict, int]:
        """``({output name: tensor}, the version that computed them)`` of ``{input name: tensor}``.

        Raises:
            ValueError: an input is missing, or the inputs' shapes do not fit the program (the message names the
                inputs); a feature's ids are invalid (the message names the feature).
        """
        with self._lock, bind(self):
            program = self.program
            missing = [i["name"] for i in program.inputs if i["name"] not in inputs]
            if missing:
                raise ValueError(f"input {missing[0]!r} is missing (the model reads "
                                 f"{[i['name'] for i in program.inputs]})")
            try:
                out = program.module(*[inputs[i["name"]].to(self.device) for i in program.inputs])
            except AssertionError as exc:  # the program's shape guards, in terms of the inputs' names
                text = str(exc).splitlines()[0] if str(exc) else "a shape guard failed"
                named = [i["name"] for i in program.inputs if re.search(rf"\b{re.escape(i['name'])}\b", text)]
                given = ", ".join(f"{n} {list(inputs[n].shape)}" for n in named or [i["name"] for i in program.inputs])
                raise ValueError(f"the inputs' shapes do not fit the exported model: {text} (got {given})") from None
            return {o["name"]: v for o, v in zip(program.outputs, out)}, self.version

    def lookup(self, collection: str, features: dict, weights: dict) -> dict:
        """``{feature: output}`` of one call of ``collection`` (its module path in the user's model): what the
        graph's ``dynemb::served_features`` node asks while :meth:`__call__` runs."""
        feature_configs, table_configs = self.program.collections[collection]
        return prepared_lookup(self.ps, self.name, features, weights, feature_configs, table_configs, self.device)

    def updating(self) -> bool:
        """Whether an update is being swapped in now."""
        return self._updating

    def apply_update(self, export_dir) -> int:
        """Apply export version ``export_dir`` (tables full or delta, and its program); returns the version now
        served. Files are read and checked before the swap, which forward passes wait for.

        Raises:
            LineageError: the version does not follow the one served. CheckpointError: a checksum does not match.
            Nothing changes on any error.
        """
        export = read_export(export_dir)
        program = _Program(export[0]["path"])
        with self._lock:
            self._updating = True
            try:
                self.ps.apply_update(export_dir, export=export)
                self.program = program
                return self.version
            finally:
                self._updating = False

    def close(self) -> None:
        self.ps.close()
