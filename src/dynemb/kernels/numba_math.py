"""Arithmetic helpers shared by the numba kernels."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["bits_float", "float_bits", "fma", "prefetch_row", "prefetch_row_for_write"]


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


def _bitcaster(src, dst):
    def cast(typingctx, x):
        if x != src:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(dst))

        return dst(src), codegen

    return intrinsic(cast)


#: ``float_bits(x)``: the bits of a float64 as an int64, and ``bits_float(i)`` back (what ``view`` does to arrays);
#: exact, and unlike ``math.frexp``/``math.ldexp`` (libm calls) they leave a loop free to vectorize.
float_bits = _bitcaster(types.float64, types.int64)
bits_float = _bitcaster(types.int64, types.float64)


def _prefetcher(write: int):
    def prefetch(typingctx, array, row):
        if not (isinstance(array, types.Array) and array.ndim == 2 and isinstance(row, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            aryty = signature.args[0]
            ary = context.make_array(aryty)(context, builder, args[0])
            row_ = context.cast(builder, args[1], signature.args[1], types.intp)
            zero = context.get_constant(types.intp, 0)
            base = cgutils.get_item_pointer(context, builder, aryty, ary, [row_, zero], wraparound=False)
            byte = builder.bitcast(base, ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [byte.type, i32, i32, i32]), "llvm.prefetch.p0")
            width = cgutils.unpack_tuple(builder, ary.strides, 2)[0]  # bytes per row
            with cgutils.for_range_slice(builder, zero, width, context.get_constant(types.intp, 64)) as (at, _):
                builder.call(fn, [builder.gep(byte, [at]), i32(write), i32(3), i32(1)])
            return context.get_dummy_value()

        return types.void(array, row), codegen

    return intrinsic(prefetch)


#: ``prefetch_row(array, row)``: ask the CPU to start loading every cache line of ``array[row]`` (a 2-D
#: C-contiguous array) without waiting for it (``llvm.prefetch``). Issued a few rows ahead, many row misses overlap
#: instead of coming one at a time. ``prefetch_row_for_write`` also claims the lines for writing (rows updated in
#: place), which saves the later upgrade of each line from shared to exclusive.
prefetch_row = _prefetcher(0)
prefetch_row_for_write = _prefetcher(1)
