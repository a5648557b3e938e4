"""Arithmetic helpers shared by the numba kernels.

Numba caches a kernel against its own file's stamp, not this one's: after changing a helper here, delete the
kernels' caches (``find src -name '*.nb[ic]' -delete``) or they keep the old code.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["rows_within", "bits_float", "cell_bits", "float_bits", "fma", "prefetch_row", "prefetch_row_for_write",
           "acc_new", "acc_add", "acc_fma", "acc_store"]


@numba.njit(inline="always")
def rows_within(rows, count, limit):
    """Whether ``rows[:count]`` all lie in ``[0, limit)``: the range check a kernel makes before it writes anything
    (all or nothing; numba does not check bounds)."""
    for i in range(count):
        if rows[i] < 0 or rows[i] >= limit:
            return False
    return True


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


@intrinsic
def cell_bits(typingctx, row, column):
    """The initializer's 24 random bits of ``column`` of a row hashed to ``row`` (a 64-bit integer), as an int32:
    :func:`dynemb.table.initializers._unit_uniform`'s ``x >> 8``. In LLVM's i32: numba widens integer arithmetic to
    64 bits, which puts 4 lanes in a vector instead of 8 and emulates the 32-bit multiplies with 64-bit ones."""
    if not (isinstance(row, types.Integer) and row.bitwidth == 64 and isinstance(column, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        lo, hi = builder.trunc(args[0], i32), builder.trunc(builder.lshr(args[0], args[0].type(32)), i32)
        c, width = args[1], args[1].type.width
        if width > 32:
            c = builder.trunc(c, i32)
        elif width < 32:
            c = builder.sext(c, i32) if column.signed else builder.zext(c, i32)
        x = builder.xor(builder.add(lo, builder.mul(builder.add(c, i32(1)), i32(0x9E3779B9))), hi)
        for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):  # lowbias32
            x = builder.xor(x, builder.lshr(x, i32(shift)))
            x = builder.mul(x, i32(factor)) if factor is not None else x
        return builder.lshr(x, i32(8))

    return types.int32(row, column), codegen


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


# Row accumulators in vector registers. A sum over many rows kept in an np.empty buffer stores and reloads the
# buffer per term (LLVM cannot tell it from the rows read); an array on the stack indexed in constant loops is split
# into scalars before the loops vectorize. These intrinsics speak LLVM's <8 x float> directly, at constant offsets
# of a stack slot, which SROA turns into registers: one load and one add per 8 columns and term, and lane for lane
# the same float operations (so the same bits) as the scalar loops.
_LANES = 8


def _lanes(width):
    """Vectors of ``_LANES`` floats in an accumulator of ``len(width)`` floats, or None (not a multiple)."""
    if not isinstance(width, types.BaseTuple) or len(width) == 0 or len(width) % _LANES:
        return None
    return len(width) // _LANES


_VEC = ir.VectorType(ir.FloatType(), _LANES)


def _vector_at(builder, base, k):
    """Pointer to the ``k``-th ``<8 x float>`` from float pointer ``base``."""
    return builder.bitcast(builder.gep(base, [ir.IntType(64)(k * _LANES)]), _VEC.as_pointer())


def _row_pointer(context, builder, aryty, ary, row, col, signature, i_row, i_col):
    row_ = context.cast(builder, row, signature.args[i_row], types.intp)
    col_ = context.cast(builder, col, signature.args[i_col], types.intp)
    array = context.make_array(aryty)(context, builder, ary)
    return cgutils.get_item_pointer(context, builder, aryty, array, [row_, col_], wraparound=False)


def _is_rows(array):
    # C order only: a row's columns are then adjacent floats, loaded 8 at a time
    return isinstance(array, types.Array) and array.ndim == 2 and array.dtype == types.float32 and array.layout == "C"


@intrinsic
def acc_new(typingctx, width):
    """``acc_new(width)``: a zeroed accumulator of ``len(width)`` float32 (a multiple of 8) on the stack."""
    n = _lanes(width)
    if n is None:
        return None

    def codegen(context, builder, signature, args):
        slot = cgutils.alloca_once(builder, ir.ArrayType(_VEC, n))  # entry block: SROA promotes it
        base = builder.bitcast(slot, ir.FloatType().as_pointer())
        for k in range(n):
            builder.store(ir.Constant(_VEC, None), _vector_at(builder, base, k), align=4)
        return base

    return types.CPointer(types.float32)(width), codegen


def _accumulate(context, builder, signature, args, weight):
    """``acc += weight * array[row, col:...]`` (``weight`` None: plain add) as vector code; ``args``: acc, width,
    array, row, col."""
    base, n = args[0], len(signature.args[1])
    src = _row_pointer(context, builder, signature.args[2], args[2], args[3], args[4], signature, 3, 4)
    if weight is not None:
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v8f32")
        splat = builder.insert_element(ir.Constant(_VEC, None), weight, ir.IntType(32)(0))
        splat = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(ir.IntType(32), _LANES), None))
    for k in range(n // _LANES):
        at = _vector_at(builder, base, k)
        total, term = builder.load(at, align=4), builder.load(_vector_at(builder, src, k), align=4)
        builder.store(builder.fadd(total, term) if weight is None else builder.call(fma, [splat, term, total]), at,
                      align=4)
    return context.get_dummy_value()


@intrinsic
def acc_add(typingctx, acc, width, array, row, col):
    """``acc_add(acc, width, array, row, col)``: ``acc += array[row, col:col + len(width)]``, lane by lane."""
    if _lanes(width) is None or not _is_rows(array):
        return None

    def codegen(context, builder, signature, args):
        return _accumulate(context, builder, signature, args, None)

    return types.void(acc, width, array, row, col), codegen


@intrinsic
def acc_fma(typingctx, acc, width, array, row, col, weight):
    """``acc_fma(acc, width, array, row, col, w)``: ``acc = fma(w, array[row, col:...], acc)`` lane by lane (float32
    ``w``, rounded once as torch's weighted ``embedding_bag``)."""
    if _lanes(width) is None or not _is_rows(array) or weight != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return _accumulate(context, builder, signature, args, args[5])

    return types.void(acc, width, array, row, col, weight), codegen


@intrinsic
def acc_store(typingctx, acc, width, array, row, col):
    """``acc_store(acc, width, array, row, col)``: ``array[row, col:col + len(width)] = acc``."""
    n = _lanes(width)
    if n is None or not _is_rows(array):
        return None

    def codegen(context, builder, signature, args):
        dst = _row_pointer(context, builder, signature.args[2], args[2], args[3], args[4], signature, 3, 4)
        for k in range(n):
            builder.store(builder.load(_vector_at(builder, args[0], k), align=4), _vector_at(builder, dst, k),
                          align=4)
        return context.get_dummy_value()

    return types.void(acc, width, array, row, col), codegen
