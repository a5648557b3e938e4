"""Configs as JSON-safe dicts and back: one registry of config classes and one dtype codec.

A config class registers itself under a stable type name with :func:`serializable` and inherits
:class:`Serializable`; it then has ``to_dict()`` and ``from_dict()`` (as keras-rs configs have ``get_config`` and
``from_config``). Checkpoint manifests, serving exports, the parameter server and the main job's model card
write and read configs only this way.

``to_dict`` gives ``{"type": <type name>, <field>: <value>, ...}`` with every field, values made JSON-safe:

==============================  ===========================================================================
value                           written as
==============================  ===========================================================================
None, bool, int, str            itself
float                           itself; NaN and infinities are refused (JSON cannot hold them)
``torch.dtype``                 its name through :func:`dtype_name` (``"float32"``)
enum member                     its value (``"decayed_lfu"``)
registered config               its own ``to_dict()``, nested
path (``os.PathLike``)          its ``str``
list, tuple, dict of str keys   list (a tuple too), dict, each value as above
a callable, any other object    refused: :class:`NotSerializableError` naming the field
==============================  ===========================================================================

A callable field that holds its default (``Sharding.partitioner``'s ``mod_partitioner``) is left out, and
``from_dict`` gives the default back. ``from_dict`` checks the type name (an alias names the type as files of
dynemb 0.1 wrote it), refuses fields it does not know (a file written by a newer dynemb with a field this one
lacks is an error naming the field, never half-read) and requires the fields without a default (a field with a
default that a file lacks, because it was written before the field existed, takes the default). The values go
to the class's constructor, whose validation (``__post_init__``) turns names back into dtypes and enums.

This module sits below every layer: it imports nothing of dynemb.

Example:
    >>> import torch
    >>> from dynemb import TableConfig
    >>> TableConfig(name="user", dim=4, dtype=torch.bfloat16, initializer="zeros").to_dict()["dtype"]
    'bfloat16'
    >>> from_dict({"type": "table", "name": "user", "dim": 4, "dtype": "bfloat16"}).dtype
    torch.bfloat16
    >>> TableConfig.from_dict({"name": "user", "dim": 4, "width": 2})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: TableConfig: unknown field(s) ['width']; allowed fields are [...] (a file written by a newer dynemb?)
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
import os
from typing import Any, Mapping, TypeVar

import torch

__all__ = ["Serializable", "serializable", "from_dict", "registered", "lookup", "type_name", "NotSerializableError",
           "dtype_name", "parse_dtype", "canonical_dtype", "TYPE"]

#: The key that names a config's type in its dict.
TYPE = "type"

# The one dtype codec: names as numpy and JSON files spell them. Before it, files held str(dtype) ("torch.float32"),
# which parse_dtype still reads.
_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_LEGACY_PREFIX = "torch."

_REGISTRY: dict[str, type] = {}  # type name or alias -> class

C = TypeVar("C")


class NotSerializableError(TypeError):
    """A config holds something that is not data (a callable, an arbitrary object), or a record of such a value
    is being rebuilt. The message names the field."""


def dtype_name(dtype: torch.dtype, what: str = "dtype") -> str:
    """The canonical name of ``dtype``: ``"float32"``, ``"bfloat16"``, ``"int64"``, ...

    Raises:
        TypeError: ``dtype`` is not a dtype of the codec.

    Example:
        >>> dtype_name(torch.bfloat16)
        'bfloat16'
    """
    name = _DTYPE_NAMES.get(dtype) if isinstance(dtype, torch.dtype) else None
    if name is None:
        raise TypeError(f"{what} must be one of the dtypes {sorted(_DTYPES)}, got {dtype!r}")
    return name


def parse_dtype(value, what: str = "dtype") -> torch.dtype:
    """The dtype ``value`` names: a ``torch.dtype`` itself, its name (``"float32"``) or the ``str(dtype)`` form
    (``"torch.float32"``) that files of dynemb 0.1 hold.

    Raises:
        TypeError: ``value`` is neither a dtype nor a str. ValueError: a str that names no dtype of the codec.

    Example:
        >>> parse_dtype("float16"), parse_dtype("torch.int32")
        (torch.float16, torch.int32)
    """
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a torch.dtype or its name (one of {sorted(_DTYPES)}), got {value!r}")
    name = value[len(_LEGACY_PREFIX):] if value.startswith(_LEGACY_PREFIX) else value
    if name not in _DTYPES:
        raise ValueError(f"{what} must name one of the dtypes {sorted(_DTYPES)}, got {value!r}")
    return _DTYPES[name]


def canonical_dtype(value):
    """The canonical name of a dtype or of any spelling :func:`parse_dtype` reads (``"torch.float32"`` ->
    ``"float32"``); anything else is returned as it is, for a comparison to report.

    Example:
        >>> canonical_dtype("torch.int32"), canonical_dtype(torch.bfloat16), canonical_dtype("complex")
        ('int32', 'bfloat16', 'complex')
    """
    try:
        return dtype_name(parse_dtype(value))
    except (TypeError, ValueError):
        return value


def serializable(name: str, *, aliases: tuple = (), nested: tuple = ()):
    """Class decorator: register a :class:`Serializable` class under type name ``name``.

    Args:
        name: the stable type name written in its dicts (never derived from the class name, so a renamed class
            still reads its files).
        aliases: other names that read as this type (how files of older versions named it).
        nested: fields whose dict values (or list items) are configs to rebuild with :func:`from_dict`; every
            other field's value goes to the constructor as it was read.

    Raises:
        ValueError: a name is taken by another class. TypeError: the class is not :class:`Serializable`.
    """
    def register(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, Serializable)):
            raise TypeError(f"@serializable({name!r}) applies to Serializable subclasses, got {cls!r}")
        for key in (name, *aliases):
            if not isinstance(key, str) or not key:
                raise ValueError(f"@serializable: type names must be non-empty str, got {key!r}")
            if _REGISTRY.get(key, cls) is not cls:
                raise ValueError(f"type name {key!r} is taken by {_REGISTRY[key].__qualname__}")
        for key in (name, *aliases):
            _REGISTRY[key] = cls
        cls._config_type = name  # set on the class itself: a subclass is not registered through its parent
        cls._config_nested = frozenset(nested)
        return cls

    return register


def type_name(config) -> str | None:
    """The registered type name of a config (or config class), or None when it is not registered itself."""
    cls = config if isinstance(config, type) else type(config)
    return cls.__dict__.get("_config_type")


def lookup(name: str) -> type | None:
    """The class registered under type name (or alias) ``name``, or None."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def registered(base: type = object) -> dict[str, type]:
    """``{type name: class}`` of every registered class that is ``base`` or a subclass, aliases left out, in
    registration order.

    Example:
        >>> import dynemb
        >>> sorted(registered(dynemb.optim.SparseOptimizer))
        ['adagrad', 'adam', 'ftrl', 'rowwise_adagrad', 'sgd']
    """
    return {key: cls for key, cls in _REGISTRY.items() if type_name(cls) == key and issubclass(cls, base)}


class Serializable:
    """Mixin of the config classes: :meth:`to_dict` and :meth:`from_dict` through the registry.

    A dataclass needs nothing more. Another class says which values are its config (:meth:`_config_fields`,
    keyed by its constructor's argument names) and which constructor arguments are not config
    (``_not_config``)."""

    _config_type: str | None = None
    _config_nested: frozenset = frozenset()
    _not_config: tuple = ()  # constructor arguments that are not config (an optimizer's tables)

    def _config_fields(self) -> dict[str, Any]:
        """``{constructor argument: value}`` that rebuild this config (a dataclass: its init fields)."""
        if not dataclasses.is_dataclass(self):
            return {}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def _config_label(self) -> str:
        """How errors name this config: its class, and its name where it has one."""
        label = type(self).__name__
        name = getattr(self, "name", None) if dataclasses.is_dataclass(self) else None
        return f"{label}({name!r})" if isinstance(name, str) else label

    def to_dict(self) -> dict:
        """This config as a JSON-safe dict (see the module docstring).

        Raises:
            NotSerializableError: a field holds a callable or another value that is not data; the message names
                the field (``TableConfig('user').initializer``).
        """
        return _encode_config(self, self._config_label())

    @classmethod
    def from_dict(cls: type[C], data: Mapping, where: str | None = None) -> C:
        """The config ``data`` describes (:meth:`to_dict`'s output). Its ``"type"`` may be left out when called on
        the registered class itself; on a base class (``Initializer.from_dict``) it picks the subclass.

        Raises:
            TypeError: ``data`` is not a dict. ValueError: an unknown type, another class's type, an unknown field
            or a missing required one (the message names it). The constructor's own errors for bad values.
        """
        return _decode(data, where, cls)


def from_dict(data: Mapping, where: str | None = None):
    """The registered config that ``data`` describes; its ``"type"`` picks the class.

    Raises:
        As :meth:`Serializable.from_dict`; a dict without ``"type"`` is a ValueError.
    """
    return _decode(data, where, None)


# ---------------------------------------------------------------------------------------------------- writing
def _encode_config(config: Serializable, where: str) -> dict:
    fields = config._config_fields()
    defaults = _defaults(type(config))
    out = {}
    for name, value in fields.items():
        if callable(value) and not isinstance(value, Serializable) and value is defaults.get(name, _NONE):
            continue  # a callable default (mod_partitioner): from_dict gives it back
        out[name] = _encode(value, f"{where}.{name}")
    kind = type_name(config)
    if kind is None:
        raise NotSerializableError(f"{where} is a {type(config).__qualname__}, which is no registered config type; "
                                   f"registered: {sorted(registered())}")
    return {TYPE: kind, **out}


def _encode(value, where: str):
    if value is None or isinstance(value, (bool, int, str)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value!r}; a saved config holds finite floats only (JSON has no NaN or inf)")
        return value
    if isinstance(value, torch.dtype):
        return dtype_name(value, where)
    if isinstance(value, enum.Enum):
        return _encode(value.value, where)
    if isinstance(value, Serializable):
        return _encode_config(value, where)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}
    if callable(value):
        what = getattr(value, "__qualname__", None) or repr(value)
        raise NotSerializableError(
            f"{where} is a callable ({what}); it cannot be saved. A saved config holds data only: give a built-in "
            "choice instead (a name, a number or a registered config), or keep this config in code")
    raise NotSerializableError(f"{where} is a {type(value).__qualname__} ({value!r}); it cannot be saved: a config "
                               "holds None, bools, numbers, strings, dtypes, enums, lists, dicts and configs")


# ---------------------------------------------------------------------------------------------------- reading
_NONE = object()


def _decode(data, where: str | None, expected: type | None):
    """``where`` names the dict in errors; None: the class asked for, or the one its type names."""
    label = where or (expected.__name__ if expected is not None else "config")
    if not isinstance(data, Mapping):
        raise TypeError(f"{label} must be a dict (a config's to_dict()), got {type(data).__name__}")
    kind = data.get(TYPE)
    if kind is None:
        if expected is None or type_name(expected) is None:
            choices = sorted(registered(expected or object))
            raise ValueError(f"{label}: no {TYPE!r}; expected one of {choices}")
        cls = expected
    else:
        cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ValueError(f"{label}: unknown {TYPE} {kind!r}; this dynemb knows "
                             f"{sorted(registered(expected or object))} (a file written by a newer dynemb?)")
        if expected is not None and not issubclass(cls, expected):
            raise ValueError(f"{label}: {TYPE} {kind!r} is a {cls.__name__}, expected a {expected.__name__}")
        if cls.__dict__.get("from_dict") is not None and cls is not expected:
            return cls.from_dict(data, where)  # a class that reads its dicts its own way
    where = where or cls.__name__
    fields = {k: v for k, v in data.items() if k != TYPE}
    accepted = _accepted(cls)
    unknown = sorted(set(fields) - set(accepted))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed fields are {list(accepted)} (a file written "
                         "by a newer dynemb?)")
    missing = [name for name, required in accepted.items() if required and name not in fields]
    if missing:
        raise ValueError(f"{where}: missing required field(s) {missing}")
    for name in cls._config_nested & set(fields):
        fields[name] = _nested(fields[name], f"{where}.{name}")
    return cls(**fields)


def _nested(value, where: str):
    if isinstance(value, Mapping):
        return _decode(value, where, None)
    if isinstance(value, list):
        return [_nested(v, f"{where}[{i}]") if isinstance(v, (Mapping, list)) else v for i, v in enumerate(value)]
    return value


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The constructor's config arguments: its named parameters, less ``_not_config``."""
    if dataclasses.is_dataclass(cls):
        return {f.name: f for f in dataclasses.fields(cls) if f.init}
    params = inspect.signature(cls.__init__).parameters
    return {n: p for n, p in list(params.items())[1:]
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in cls._not_config}


def _accepted(cls: type) -> dict[str, bool]:
    """``{field: required}`` of the constructor."""
    out = {}
    for name, p in _parameters(cls).items():
        if isinstance(p, dataclasses.Field):
            out[name] = p.default is dataclasses.MISSING and p.default_factory is dataclasses.MISSING
        else:
            out[name] = p.default is inspect.Parameter.empty
    return out


def _defaults(cls: type) -> dict[str, Any]:
    """Default values of the constructor's arguments (the factories' are left out)."""
    out = {}
    for name, p in _parameters(cls).items():
        default = p.default if isinstance(p, dataclasses.Field) else p.default
        if default is not dataclasses.MISSING and default is not inspect.Parameter.empty:
            out[name] = default
    return out
