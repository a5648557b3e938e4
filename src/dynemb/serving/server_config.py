"""The parameter server's JSON config (HPS-style field names; HPS-only fields in :mod:`.hps`), validated with errors
that name the field."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Mapping, Optional, Union

from ..serialization import TYPE, Serializable, lookup, serializable
from . import hps

__all__ = ["ModelConfig", "ServerConfig"]


@serializable("served_model")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig(Serializable):
    """One served model. ``to_dict()``/``from_dict()`` (:mod:`dynemb.serialization`) write and read it; its
    lists are kept as lists and its paths as str.

    Attributes:
        model: its name.
        sparse_files: serving-export roots (``dynemb export`` / ``export_for_serving`` output), one per table, or
            a single root holding every table (a single path may be given as it is, not in a list).
        embedding_table_names: the tables to serve (names in the export).
        embedding_vecsize_per_table: their dims, checked against the export.
        default_value_for_each_table: the row of a key found in no tier: a float fills the row, ``"initializer"``
            returns the row training would have created for the key (the export records initializer and seed),
            which is what the trained model's eval lookup returns. Default: ``"initializer"`` for every table (zeros,
            with a warning, for a table whose initializer is a Python callable).
        cache_fraction: device cache size as a fraction of each table's rows (HPS ``gpucacheper``); tables of
            up to 4096 rows are cached whole.
        hit_rate_threshold: below it, rows found in lower tiers are written to the cache before a lookup returns;
            above it, in the background.
        max_batch_size: most keys per lookup call.
        device: device of the cache (``"cpu"`` or ``"cuda[:i]"``).
    """

    model: str
    sparse_files: list
    embedding_table_names: list
    embedding_vecsize_per_table: list
    default_value_for_each_table: list = dataclasses.field(default_factory=list)
    cache_fraction: float = 0.2
    hit_rate_threshold: float = 0.9
    max_batch_size: int = 65536
    device: str = "cpu"

    def __post_init__(self):
        where = f"models[{self.model!r}]"
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        n = len(self.embedding_table_names)
        if n == 0:
            raise ValueError(f"{where}.embedding_table_names must list at least one table")
        if len(self.embedding_vecsize_per_table) != n:
            raise ValueError(f"{where}.embedding_vecsize_per_table has {len(self.embedding_vecsize_per_table)} "
                             f"entries for {n} tables")
        if self.default_value_for_each_table and len(self.default_value_for_each_table) != n:
            raise ValueError(f"{where}.default_value_for_each_table has {len(self.default_value_for_each_table)} "
                             f"entries for {n} tables")
        for d in self.default_value_for_each_table:
            if d != "initializer" and (isinstance(d, bool) or not isinstance(d, (int, float))):
                raise ValueError(f"{where}.default_value_for_each_table entries must be floats or 'initializer', "
                                 f"got {d!r}")
        if isinstance(self.sparse_files, (str, Path)):  # one root for every table; len() would count characters
            object.__setattr__(self, "sparse_files", [self.sparse_files])
        if not isinstance(self.sparse_files, (list, tuple)) or \
                not all(isinstance(f, (str, Path)) for f in self.sparse_files):
            raise ValueError(f"{where}.sparse_files must be a list of export roots (paths), one per table or one "
                             f"for all, or a single path; got {self.sparse_files!r}")
        if len(self.sparse_files) not in (1, n):
            raise ValueError(f"{where}.sparse_files must have 1 entry or one per table ({n}), "
                             f"got {len(self.sparse_files)}")
        # lists and str paths, as JSON gives them back: a config read from its to_dict() equals it
        object.__setattr__(self, "sparse_files", [os.fspath(f) for f in self.sparse_files])
        for name in ("embedding_table_names", "embedding_vecsize_per_table", "default_value_for_each_table"):
            object.__setattr__(self, name, list(getattr(self, name)))
        for name in ("cache_fraction", "hit_rate_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}.{name} must be a number, got {value!r}")
        if not 0.0 < self.cache_fraction <= 1.0:
            raise ValueError(f"{where}.cache_fraction must be in (0, 1], got {self.cache_fraction!r}")
        if not 0.0 <= self.hit_rate_threshold <= 1.0:
            raise ValueError(f"{where}.hit_rate_threshold must be in [0, 1], got {self.hit_rate_threshold!r}")
        if isinstance(self.max_batch_size, bool) or not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ValueError(f"{where}.max_batch_size must be an int >= 1, got {self.max_batch_size!r}")

    def default_for(self, i: int):
        """Table ``i``'s default row: a float or ``"initializer"``."""
        return self.default_value_for_each_table[i] if self.default_value_for_each_table else "initializer"

    def export_root(self, i: int) -> Path:
        """The export root of table ``i``."""
        return Path(self.sparse_files[i if len(self.sparse_files) > 1 else 0])

    def export_roots(self) -> list[Path]:
        """Every export root of the model, once each."""
        return list(dict.fromkeys(Path(f) for f in self.sparse_files))



@serializable("parameter_server", nested=("models",))
@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig(Serializable):
    """``{"models": [...], "volatile_db": {...}, "persistent_db": {...} | null}``.

    ``volatile_db`` defaults to the in-process store ``{"type": "memory"}``; ``persistent_db`` (``rocksdb`` or
    ``lmdb`` with a ``path``) is optional. Store fields are those of :func:`dynemb.serving.stores.make_store`.
    :meth:`load` also takes an HPS ``ps.json``: its fields are renamed where they map onto ours and dropped with a
    warning where they mean nothing here (see :mod:`dynemb.serving.hps`). :meth:`to_dict` writes what
    :meth:`from_dict` (that is, :meth:`load`) reads back.
    """

    models: tuple
    volatile_db: dict = dataclasses.field(default_factory=lambda: {"type": "memory"})
    persistent_db: Optional[dict] = None

    @classmethod
    def from_dict(cls, data: Mapping, where: Optional[str] = None) -> "ServerConfig":
        """:meth:`load` of a dict, which may name its type (``"parameter_server"``), as :meth:`to_dict` does."""
        if isinstance(data, Mapping) and TYPE in data:
            if lookup(data[TYPE]) is not cls:
                raise ValueError(f"{where or 'parameter server config'}: {TYPE} {data[TYPE]!r} is not "
                                 f"'parameter_server'")
            data = {k: v for k, v in data.items() if k != TYPE}
        return cls.load(data)

    @classmethod
    def load(cls, source: Union[str, Path, Mapping]) -> "ServerConfig":
        """From a JSON file path or a dict, HPS fields taken as :mod:`dynemb.serving.hps` says."""
        if isinstance(source, (str, Path)):
            path = Path(source)
            try:
                data = json.loads(path.read_text())
            except FileNotFoundError:
                raise FileNotFoundError(f"parameter server config {path} does not exist") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"parameter server config {path} is not valid JSON: {e}") from None
        else:
            data = source
        data = hps.translate(data)
        if not isinstance(data, Mapping):
            raise TypeError(f"parameter server config must be a JSON object, got {type(data).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"parameter server config: unknown field(s) {unknown}; allowed fields are {fields}")
        if "models" not in data:
            raise ValueError("parameter server config: missing required field(s) ['models']")
        models = data["models"]
        if not isinstance(models, list) or not models:
            raise ValueError("parameter server config: models must be a non-empty list")
        parsed = tuple(ModelConfig.from_dict(m, f"models[{i}]") for i, m in enumerate(models))
        names = [m.model for m in parsed]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter server config: model names must be unique, got {names}")
        return cls(models=parsed, volatile_db=dict(data.get("volatile_db") or {"type": "memory"}),
                   persistent_db=data.get("persistent_db"))
