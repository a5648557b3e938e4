"""Argument checks for public entry points, shared by every layer above the kernels. Messages name the argument, the
expected form and what came in."""

from __future__ import annotations

import torch

__all__ = [
    "check_keys",
    "fit_keys",
    "check_rows_like",
    "check_scores",
    "check_int",
    "check_positive_int",
    "is_int",
    "check_dtype",
    "resolve_device",
    "KEY_DTYPES",
    "VALUE_DTYPES",
]

KEY_DTYPES = (torch.int32, torch.int64)
VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _describe(t: torch.Tensor) -> str:
    return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def check_keys(keys, key_dtype: torch.dtype, device: torch.device, name: str = "keys") -> torch.Tensor:
    """Validate keys of any shape and return them flattened to ``[N]`` in ``key_dtype``.

    Keys of a narrower integer dtype are widened (int32 ids for an int64 table, as ``nn.Embedding`` and TorchRec
    take them): every value keeps its meaning. A wider dtype is refused, never narrowed.

    Example:
        >>> check_keys(torch.tensor([[-1, 7]], dtype=torch.int32), torch.int64, torch.device("cpu"))
        tensor([-1,  7])
    """
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype {key_dtype}, got {type(keys).__name__}")
    if keys.dtype == key_dtype and keys.device == device and keys.dim() == 1:
        return keys  # the common case, without the microseconds of a reshape and a cast that change nothing
    if keys.dtype != key_dtype and not _widens(keys.dtype, key_dtype):
        raise TypeError(f"{name} must have dtype {key_dtype} (the table's key_dtype) or a narrower integer dtype, "
                        f"got {_describe(keys)}")
    if keys.device != device:
        raise ValueError(f"{name} must be on the table's device {device}, got {_describe(keys)}")
    return keys.reshape(-1).to(key_dtype)


_INT32 = torch.iinfo(torch.int32)


def fit_keys(keys, key_dtype: torch.dtype, device: torch.device, name: str = "ids", *,
             check: bool | None = None) -> torch.Tensor:
    """int64 ``keys`` for an int32 table, cast to int32 when every one fits; anything else is returned as it came
    (:func:`check_keys` then judges it). TorchRec's ``KeyedJaggedTensor`` and ``torch.tensor([python ints])``
    carry int64 ids, which an int32 table takes this way.

    A key that does not fit is never wrapped onto another key. ``check=True`` reads the keys' min and max (a device
    sync on CUDA) and raises; ``check=False`` asserts on the keys' device without a sync (on CUDA a key that does
    not fit then fails a later kernel launch with this message, as an out-of-range id of a static table does);
    ``None`` is True on CPU, where the check costs no sync, and False elsewhere.

    Shape: ``keys`` any shape ``S`` -> ``S``.

    Raises:
        ValueError: a key outside ``[-2**31, 2**31 - 1]``, naming ``name``, the dtypes and the key.

    Example:
        >>> cpu = torch.device("cpu")
        >>> fit_keys(torch.tensor([[-1, 7]]), torch.int32, cpu)
        tensor([[-1,  7]], dtype=torch.int32)
        >>> fit_keys(torch.tensor([1, 2**31]), torch.int32, cpu)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: ids are torch.int64 and the table's key_dtype is torch.int32: ... but 2147483648 does not
    """
    if not (isinstance(keys, torch.Tensor) and keys.dtype == torch.int64 and key_dtype == torch.int32
            and keys.device == device):
        return keys
    if keys.numel():
        if check is None:
            check = keys.device.type == "cpu"
        if check and not torch.compiler.is_compiling():
            low, high = torch.stack(torch.aminmax(keys)).tolist()
            if low < _INT32.min or high > _INT32.max:
                raise ValueError(_does_not_fit(name, key_dtype, low if low < _INT32.min else high))
        else:
            fits = ((keys >= _INT32.min) & (keys <= _INT32.max)).all()
            torch._assert_async(fits, _does_not_fit(name, key_dtype, "one of them"))
    return keys.to(torch.int32)


def _does_not_fit(name: str, key_dtype: torch.dtype, key) -> str:
    return (f"{name} are torch.int64 and the table's key_dtype is {key_dtype}: they are cast when every id fits in "
            f"[{_INT32.min}, {_INT32.max}], but {key} does not")


def _widens(dtype: torch.dtype, key_dtype: torch.dtype) -> bool:
    """Whether every value of integer ``dtype`` is a value of ``key_dtype``."""
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        return False
    have, want = torch.iinfo(dtype), torch.iinfo(key_dtype)
    return want.min <= have.min and have.max <= want.max


def check_rows_like(
    values, n: int, dim: int, dtype: torch.dtype, device: torch.device, name: str, key_shape: tuple
) -> torch.Tensor:
    """Validate ``values`` of shape ``key_shape + (dim,)`` and return them as ``[N, dim]``."""
    expected = tuple(key_shape) + (dim,)
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {expected}, got {type(values).__name__}")
    if values.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype} (the table's dtype), got {_describe(values)}")
    if tuple(values.shape) != expected:
        raise ValueError(f"{name} must have shape {expected} (keys.shape + (dim,)), got {_describe(values)}")
    if values.device != device:
        raise ValueError(f"{name} must be on the table's device {device}, got {_describe(values)}")
    return values.reshape(n, dim)


def check_scores(scores, shape: tuple, name: str = "scores") -> torch.Tensor:
    """Validate an int64 score tensor of ``shape`` and return it flattened to ``[N]``."""
    if not isinstance(scores, torch.Tensor) or scores.dtype != torch.int64 or tuple(scores.shape) != tuple(shape):
        got = _describe(scores) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise TypeError(f"{name} must be an int64 tensor of shape {tuple(shape)}, got {got}")
    return scores.reshape(-1)


def resolve_device(device, name: str = "device") -> torch.device:
    """The device tensors created on ``device`` report: ``"cuda"`` becomes ``cuda:<current>``, so that the
    device checks above compare equal for the table's own tensors. ``None`` is the CPU.

    Every device argument of the library comes here, so a device this process cannot use is one clear error
    (torch itself raises a bare ``AssertionError`` for ``"cuda"`` on a build without CUDA).

    Raises:
        ValueError: naming ``name``: not a device, CUDA asked for where ``torch.cuda.is_available()`` is False, a
            CUDA index past ``torch.cuda.device_count()``, or a device type this build of torch cannot use.

    Example:
        >>> resolve_device(None), resolve_device("cpu")
        (device(type='cpu'), device(type='cpu'))
        >>> resolve_device("gpu")
        Traceback (most recent call last):
            ...
        ValueError: device must be a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:1', got 'gpu'
    """
    if device is None:
        return torch.device("cpu")
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu', 'cuda' or 'cuda:1', "
                         f"got {device!r}") from None
    if wanted.type == "cuda":
        if not torch.cuda.is_available():
            built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
            raise ValueError(f"{name}={device!r} asks for CUDA, but torch.cuda.is_available() is False on this "
                             f"machine (torch {torch.__version__}, {built}); use 'cpu'")
        count = torch.cuda.device_count()
        if wanted.index is not None and wanted.index >= count:
            raise ValueError(f"{name}={device!r} is not a device of this machine, which has {count} CUDA "
                             f"device(s): cuda:0 to cuda:{count - 1}")
    try:
        return torch.empty(0, device=wanted).device
    except (AssertionError, RuntimeError, NotImplementedError) as e:  # mps, xpu, ... not in this build or machine
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{name}={device!r} cannot be used by this process: {first}") from None


def is_int(value) -> bool:
    """Whether ``value`` is a Python int and not a bool (``True`` is an int to Python, never a size or a seed)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(
    value, name: str, *, minimum: int | None = None, maximum: int | None = None, allow_none: bool = False
) -> int | None:
    """Return ``value`` if it is an int (not a bool) in ``[minimum, maximum]`` (either bound optional), or None
    if it is None and ``allow_none``. The message names ``name``, the expected form and what came in.

    Raises:
        TypeError: ``value`` is not an int and no bound is given ("seed must be an int, got '1'").
        ValueError: a bound is given and ``value`` is not an int within it ("dim must be an int >= 1, got 2.0").

    Example:
        >>> check_int(8, "dim", minimum=1)
        8
        >>> check_int(True, "dim", minimum=1)
        Traceback (most recent call last):
            ...
        ValueError: dim must be an int >= 1, got True
    """
    if value is None and allow_none:
        return None
    if is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return value
    if minimum is None and maximum is None:
        form, error = "an int", TypeError
    elif maximum is None:
        form, error = f"an int >= {minimum}", ValueError
    elif minimum is None:
        form, error = f"an int <= {maximum}", ValueError
    else:
        form, error = f"an int in [{minimum}, {maximum}]", ValueError
    raise error(f"{name} must be {'None or ' if allow_none else ''}{form}, got {value!r}")


def check_positive_int(value, name: str, *, allow_none: bool = False, minimum: int = 1) -> int | None:
    """:func:`check_int` with ``minimum=1`` unless given: the spelling that collection/, checkpoint/ and serving/
    still call. New code calls :func:`check_int`."""
    return check_int(value, name, minimum=minimum, allow_none=allow_none)


def check_dtype(value, allowed: tuple, name: str) -> torch.dtype:
    if value not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must be one of {names}, got {value!r}")
    return value
