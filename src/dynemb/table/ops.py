"""Small tensor helpers shared by the table layer."""

from __future__ import annotations

import torch

__all__ = ["gather_rows"]

# torch's index_select has a vectorized copy path for floating dtypes only; integer rows are gathered through a
# same-width float view, which copies the bits unchanged and runs several times faster on CPU.
_FLOAT_VIEW = {torch.int64: torch.float64, torch.int32: torch.float32, torch.int16: torch.float16}


def gather_rows(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src.index_select(0, index)``, bit-exact for every dtype; writes into ``out`` when given."""
    view = _FLOAT_VIEW.get(src.dtype)
    if view is None:
        return torch.index_select(src, 0, index, out=out) if out is not None else src.index_select(0, index)
    if out is not None:
        torch.index_select(src.view(view), 0, index, out=out.view(view))
        return out
    return src.view(view).index_select(0, index).view(src.dtype)
