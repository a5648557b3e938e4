"""A model written by :func:`~dynemb.serving.export_model`, served: its program run with every collection lookup
answered by a :class:`ParameterServer` holding its tables.

Tables and program of one version are swapped in together (:meth:`ExportedModel.apply_update`, under the lock each
forward pass holds), so a forward pass sees exactly one version, the one it reports.
"""

from __future__ import annotations

import difflib
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
from .model_export import PROGRAM_FILE, batch_rule
from .ps import ParameterServer
from .served_features import bind, prepared_lookup

__all__ = ["ExportedModel", "MAX_IDS_PER_TABLE", "export_server_config"]

MAX_IDS_PER_TABLE = 1 << 22
"""The parameter server's ``max_batch_size``: most ids of one table in one forward pass."""


def export_server_config(name: str, export, tables: list, dims: list, *, cache_fraction: float, device,
                         volatile_db: Optional[dict], persistent_db: Optional[dict]) -> dict:
    """The :class:`~dynemb.serving.ps.ParameterServer` configuration that serves the tables of one serving export
    as model ``name``: ids never trained read their table's initializer row (as the trained model does)."""
    return {"models": [{"model": name, "sparse_files": [str(export)], "embedding_table_names": list(tables),
                        "embedding_vecsize_per_table": list(dims),
                        "default_value_for_each_table": ["initializer"] * len(tables),
                        "cache_fraction": cache_fraction, "max_batch_size": MAX_IDS_PER_TABLE, "device": device}],
            "volatile_db": volatile_db or {"type": "memory"}, "persistent_db": persistent_db}


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
        self.tables = {name: t["dim"] for name, t in manifest["tables"].items()}
        try:
            program = torch.export.load(io.BytesIO(data))
        except Exception as exc:  # noqa: BLE001  (torch.export's own errors: a schema or an op of another torch)
            wrote = meta.get("torch", "an unknown version")
            raise ValueError(f"{directory / PROGRAM_FILE}: torch {torch.__version__} cannot load this program, which "
                             f"torch {wrote} wrote ({type(exc).__name__}: {exc}); serve it with torch {wrote}, or "
                             "export the model again with this torch") from exc
        self.inputs, self.outputs = meta["inputs"], meta["outputs"]
        # rows = dim 0 of batch_input // batch_divisor (model_export.batch_rule); read off the program where an
        # export written before the divisor was recorded lacks it (its KeyedJaggedTensor-only models had no rule)
        self.batch_input, self.batch_divisor = (meta.get("batch_input"), meta["batch_divisor"]) \
            if "batch_divisor" in meta else batch_rule(program, [t["name"] for t in self.inputs])
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


def _integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def check_input_names(given, names: list, error: type = ValueError) -> None:
    """Raise ``error`` naming the first of ``names`` missing from ``given``, or the first name in ``given`` that
    is not in ``names`` (in-process calls and both endpoints' requests say it the same way). A missing input that
    came under another name (``Workclass`` for ``workclass``, a typo) is named with it."""
    missing = [n for n in names if n not in given]
    unknown = sorted(set(given) - set(names))
    if missing:
        # the given name most like it (case aside): a mistyped name is then one error, not "missing" alone
        folded = {str(n).lower(): n for n in unknown}
        like = difflib.get_close_matches(missing[0].lower(), list(folded), n=1, cutoff=0.6)
        instead = f": the request has {folded[like[0]]!r}, which the model does not read" if like else ""
        raise error(f"input {missing[0]!r} is missing{instead} (the model reads {names})")
    if unknown:
        raise error(f"input {unknown[0]!r} is not an input of this model (it reads {names})")


def _checked_inputs(inputs: dict, specs: list) -> list:
    """``inputs`` in the program's order, each checked against its spec (``{"name", "dtype", "shape"}``) as the
    endpoint checks a request's; a narrower integer dtype widened (as a collection takes narrower ids)."""
    check_input_names(inputs, [spec["name"] for spec in specs])
    out = []
    for spec in specs:
        name, want, expected, t = spec["name"], parse_dtype(spec["dtype"]), spec["shape"], inputs[spec["name"]]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"input {name!r} must be a tensor, got {type(t).__name__}")
        if t.dtype != want:
            if not (_integer(want) and _integer(t.dtype) and torch.iinfo(t.dtype).min >= torch.iinfo(want).min
                    and torch.iinfo(t.dtype).max <= torch.iinfo(want).max):
                also = " (or a narrower integer dtype)" if _integer(want) else ""
                raise ValueError(f"input {name!r}: dtype must be {want}{also}, got {t.dtype}")
            t = t.to(want)
        if t.dim() != len(expected):
            raise ValueError(f"input {name!r}: shape {list(t.shape)}, but the model's shape is {expected} (-1: any "
                             f"size): a {len(expected)}-D tensor")
        fixed = [(i, e) for i, (d, e) in enumerate(zip(t.shape, expected)) if e != -1 and d != e]
        if fixed:
            raise ValueError(f"input {name!r}: shape {list(t.shape)}, but size {fixed[0][0]} must be {fixed[0][1]} "
                             f"(the model's shape is {expected})")
        out.append(t)
    return out


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
        config = export_server_config(name, self.export, names, [manifest["tables"][t]["dim"] for t in names],
                                      cache_fraction=cache_fraction, device=device, volatile_db=volatile_db,
                                      persistent_db=persistent_db)
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

        Inputs are checked as ``dynemb serve`` checks a request's: each of the program's dtype (an integer input
        also takes a narrower integer dtype, widened), rank and fixed sizes (``inputs`` metadata).

        Raises:
            ValueError: an input is missing, unknown, of another dtype, rank or fixed size, or the inputs' shapes do
                not fit the program (the message names the inputs); a feature's ids are invalid (the message names
                the feature). TypeError: an input is not a tensor.
        """
        with self._lock, bind(self):
            program = self.program
            args = _checked_inputs(inputs, program.inputs)
            try:
                out = program.module(*[t.to(self.device) for t in args])
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
        config = self.ps.models[self.name]
        served = dict(zip(config.embedding_table_names, config.embedding_vecsize_per_table))
        if program.tables != served:  # the parameter server serves the tables it was built with: the program
            # would look up tables it lacks (every request failing) while rows of the old ones stay served
            added = sorted(set(program.tables) - set(served))
            gone = sorted(set(served) - set(program.tables))
            dims = sorted(t for t in set(served) & set(program.tables) if served[t] != program.tables[t])
            change = "; ".join(part for part in (f"adds {added}" if added else "", f"drops {gone}" if gone else "",
                                                 f"changes the dim of {dims}" if dims else "") if part)
            raise ValueError(f"{export[0]['path']}: version {export[0]['version']} {change} (tables "
                             f"{sorted(program.tables)}, served: {sorted(served)}): a version that changes the tables "
                             "is served by a new server (restart dynemb serve, or a new ExportedModel); nothing "
                             "changed")
        with self._lock:
            self._updating = True
            try:
                updated = self.ps.apply_update(export_dir, export=export)
                if self.name not in updated:  # (its tables are this model's: not reached, but never a program
                    raise ValueError(f"{export[0]['path']}: no table of model {self.name!r} took it")  # w/o tables)
                self.program = program
                return self.version
            finally:
                self._updating = False

    def close(self) -> None:
        self.ps.close()
