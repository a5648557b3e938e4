"""8-bit rows of a serving export: row-wise int8 (scale and bias) and float8 (E4M3, E5M2; scale).

``export_for_serving(dtype=torch.int8 | torch.float8_e4m3fn | torch.float8_e5m2)`` writes each row as bytes
(``uint8 [N, W]``): its ``D`` codes, then float32 little-endian parameters, then a zero byte when that makes ``W``
odd (the parameter server keeps rows as 16-bit words):

=================  ==================================  ====================================  =============
kind               code of value ``x``                 value of code ``q``                    ``W`` (bytes)
=================  ==================================  ====================================  =============
``int8``           ``round((x - bias) / scale) - 128``  ``(q + 128) * scale + bias``          ``D + 8``
``float8_e4m3fn``  ``x / scale`` as E4M3 (round to      ``q * scale``                         ``D + 4``
                   nearest even), ``scale = amax/448``
``float8_e5m2``    ``x / scale`` as E5M2,               ``q * scale``                         ``D + 4``
                   ``scale = amax/57344``
=================  ==================================  ====================================  =============

int8: ``bias`` is the row's minimum and ``scale`` its range / 255, so each value is within ``scale / 2`` of its
decoded value and the row's minimum and maximum decode exactly up to float32 rounding; a constant row decodes
exactly. float8: the row's largest magnitude maps to the format's largest finite value; relative error 2^-4 (E4M3)
or 2^-3 (E5M2) of each value. A dim-64 row takes 72 (int8) or 68 bytes, 0.28x or 0.27x its 256 float32 bytes.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["QUANTIZED", "quantized_kind", "packed_width", "encode_rows", "decode_rows"]

QUANTIZED = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
"""The 8-bit kinds of rows, by the name the export's manifest records as the table's ``dtype``."""
_FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def quantized_kind(dtype) -> Optional[str]:
    """The kind (a :data:`QUANTIZED` name) of ``dtype`` (a torch dtype or a manifest's name), or None for a float
    dtype stored as it is."""
    if isinstance(dtype, str):
        return dtype if dtype in QUANTIZED else None
    return next((name for name, d in QUANTIZED.items() if d == dtype), None)


def _params(kind: str) -> int:
    return 2 if kind == "int8" else 1


def packed_width(kind: str, dim: int) -> int:
    """Bytes of one packed row of ``dim`` values (even)."""
    width = dim + 4 * _params(kind)
    return width + (width % 2)


def encode_rows(values: torch.Tensor, kind: str) -> torch.Tensor:
    """``[N, D]`` float rows -> ``uint8 [N, W]`` packed rows of ``kind`` (module docstring), on the CPU."""
    x = values.detach().to("cpu", torch.float32)
    n, dim = x.shape
    if kind not in QUANTIZED:
        raise ValueError(f"kind must be one of {sorted(QUANTIZED)}, got {kind!r}")
    if n == 0 or dim == 0:
        return torch.zeros(n, packed_width(kind, dim), dtype=torch.uint8)
    if kind == "int8":
        lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
        scale = (hi - lo) / 255.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (torch.round((x - lo) / safe) - 128).clamp(-128, 127).to(torch.int8)
        params = torch.cat([scale, lo], 1)
    else:
        amax = x.abs().amax(1, keepdim=True)
        scale = amax / _FP8_MAX[kind]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (x / safe).clamp(-_FP8_MAX[kind], _FP8_MAX[kind]).to(QUANTIZED[kind])
        params = scale
    out = torch.zeros(n, packed_width(kind, dim), dtype=torch.uint8)
    out[:, :dim] = codes.view(torch.uint8)
    out[:, dim:dim + 4 * _params(kind)] = params.contiguous().view(torch.uint8)
    return out


def decode_rows(packed: torch.Tensor, kind: str, dim: int) -> torch.Tensor:
    """Packed rows ``[N, W]`` (``uint8``, or the same bytes as 16-bit words ``[N, W / 2]``) -> ``float32 [N, dim]``,
    on ``packed``'s device. On the CPU one numba pass (:mod:`dynemb.kernels.numba_rows`), bit for bit what the torch
    code below computes."""
    raw = packed.contiguous().view(torch.uint8)
    k = 4 * _params(kind)
    # A copy of its own (offset 0, row stride k): a view of the packed bytes cannot always be read as float32.
    params = torch.empty(raw.shape[0], k, dtype=torch.uint8, device=raw.device).copy_(raw[:, dim:dim + k])
    params = params.view(torch.float32)
    if raw.device.type == "cpu" and raw.shape[0]:
        kernel = _kernel()
        if kernel is not None:
            return kernel.decode(raw, dim, _lut(kind), params, kind == "int8")
    codes = raw[:, :dim].contiguous().view(QUANTIZED[kind]).to(torch.float32)
    if kind == "int8":
        return (codes + 128.0) * params[:, 0:1] + params[:, 1:2]
    return codes * params


_LUTS: dict = {}


def _lut(kind: str) -> torch.Tensor:
    """``float32 [256]``: the value of each code byte (int8: ``q + 128``), by torch's own cast."""
    if kind not in _LUTS:
        codes = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(QUANTIZED[kind]).to(torch.float32)
        _LUTS[kind] = codes + 128.0 if kind == "int8" else codes
    return _LUTS[kind]


def _kernel():
    try:
        from ..kernels import numba_rows
    except ImportError:  # pragma: no cover - numba is a dependency; without it the torch code decodes
        return None
    return numba_rows
