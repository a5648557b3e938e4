"""Arithmetic helpers shared by the numba kernels."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["fma"]


@intrinsic
def fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (LLVM's ``llvm.fma``), as torch's CPU kernels compute a weighted sum
    (``embedding_bag`` with ``per_sample_weights``) and ``add(..., alpha=)``: using it keeps those results
    bit-identical. All three arguments share one float type."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        t = args[0].type
        name = "llvm.fma.f32" if t == ir.FloatType() else "llvm.fma.f64"
        return builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), name), args)

    return a(a, b, c), codegen
