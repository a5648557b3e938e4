"""Every Triton kernel compiles for an H100 (sm_90: Triton IR, PTX and ptxas's cubin), without a GPU.

The interpreter runs the kernels' Python, not Triton's compiler: type rules of loop-carried values, pointer casts
or atomics with memory semantics could pass there and fail to compile. Compilation needs no device, so it runs
here, in a subprocess without ``TRITON_INTERPRET`` (the kernels are decorated when first imported). It also checks
that the initializer kernels, launched with ``enable_fp_fusion=False``, contain no fused multiply-add: their rows
stay bit-identical to torch's.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

pytestmark = pytest.mark.triton


def _layout(key64: bool) -> dict:
    """The constexprs ``triton_index`` launches an index of that key dtype with."""
    import torch

    from dynemb.kernels import triton_index as ti
    from dynemb.table.index import HashIndex

    idx = HashIndex(torch.int64 if key64 else torch.int32, "cpu", capacity=16, backend="torch")
    return ti._layout(idx._buckets.view(idx.key_dtype), idx._key_cols)


def _cases(full: bool):
    """``(name, kernel, signature, constexprs, options)`` of the launches to compile; ``full``: every variant."""
    from dynemb.kernels import triton_index as ti
    from dynemb.kernels import triton_init as tn
    from dynemb.kernels import triton_optim as to
    from dynemb.kernels import triton_pool as tp

    index = dict(words="*i32", overflow="*u8", n="i32", nb="i64", C="constexpr", KEY_COLS="constexpr",
                 KEY64="constexpr", W="constexpr", BLOCK="constexpr")
    hashed = dict(index, shift="i32", half="i64")
    for key64 in (True, False) if full else (True,):
        keys, lay = ("*i64" if key64 else "*i32"), _layout(key64)
        probe = dict(hashed, keys=keys, slots_out="*i64", rows_out="*i32", ERASE="constexpr")
        for erase in (False, True):
            yield f"probe erase={erase} key64={key64}", ti._probe_kernel, probe, dict(lay, BLOCK=128, ERASE=erase), {}
        yield (f"place key64={key64}", ti._place_kernel,
               dict(index, bucket_in="*i64", keys=keys, rows="*i64", failed="*i32"), dict(lay, BLOCK=128), {})
        yield (f"find_or_insert key64={key64}", ti._find_or_insert_kernel,
               dict(hashed, keys=keys, slots_out="*i64", rows_out="*i32", inserted="*i8", next_row="*i32"),
               dict(lay, BLOCK=128), {})
        for init in (0, 1, 2) if full else (1,):
            gather = dict(hashed, keys=keys, rows_out="*i32", values="*fp32", out="*fp32", dim="i32",
                          seed_mixed="i64", p0="fp32", p1="fp32", INIT="constexpr", BLOCK_D="constexpr")
            yield (f"find_gather init={init} key64={key64}", ti._find_gather_kernel, gather,
                   dict(lay, INIT=init, BLOCK=32, BLOCK_D=64), dict(enable_fp_fusion=False))
    for out in ("*fp32", "*fp16", "*bf16") if full else ("*bf16",):
        for init in (1, 2):
            yield (f"initial_rows init={init} {out}", tn._init_kernel,
                   dict(keys="*i64", out=out, m="i32", dim="i32", stride="i32", seed_mixed="i64", p0="fp32",
                        p1="fp32", INIT="constexpr", BLOCK="constexpr", BLOCK_D="constexpr"),
                   dict(INIT=init, BLOCK=32, BLOCK_D=64), dict(enable_fp_fusion=False))
    for flag in (False, True) if full else (True,):
        yield (f"pool weighted={flag} inverse={flag}", tp._pool_kernel,
               dict(values="*fp32", rows="*i64", inverse="*i64", offsets="*i64", weights="*fp32", denom="*fp32",
                    out="*fp32", n="i32", nbags="i32", dim="i32", HAS_INV="constexpr", HAS_W="constexpr",
                    HAS_DENOM="constexpr", BLOCK_N="constexpr", BLOCK_D="constexpr"),
               dict(HAS_INV=flag, HAS_W=flag, HAS_DENOM=flag, BLOCK_N=16, BLOCK_D=64), {})
        yield (f"row_grad weighted={flag}, bags={flag}", tp._row_grad_kernel,
               dict(grad="*fp32", order="*i64", starts="*i64", bag="*i64", weights="*fp32", out="*fp32",
                    dim="i32", HAS_BAG="constexpr", HAS_W="constexpr", BLOCK_N="constexpr", BLOCK_D="constexpr"),
               dict(HAS_BAG=flag, HAS_W=flag, BLOCK_N=16, BLOCK_D=64), {})
    update = dict(values="*fp32", s0="*fp32", s1="*fp32", rows="*i64", grad="*fp32", order="*i64", starts="*i64",
                  bag="*i64", weights="*fp32", dim="i32", h0="fp32", h1="fp32", h2="fp32", h3="fp32",
                  **{k: "constexpr" for k in ("KIND", "HAS_ORDER", "HAS_BAG", "HAS_W", "HAS_WD", "HAS_MOM",
                                              "NESTEROV", "BLOCK_N", "BLOCK_D")})
    for kind, name in enumerate(to.KINDS):
        for pooled in (False, True) if full else (True,):
            yield (f"sparse_update {name} pooled={pooled}", to._update_kernel, update,
                   dict(KIND=kind, HAS_ORDER=pooled, HAS_BAG=pooled, HAS_W=pooled, HAS_WD=kind < 3,
                        HAS_MOM=kind == 0, NESTEROV=kind == 0, BLOCK_N=16, BLOCK_D=64), {})


def _compile_all(full: bool) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failed = []
    for name, kernel, signature, constexprs, options in _cases(full):
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                                      options=options or None)
        except Exception as e:  # noqa: BLE001 - report every kernel that fails, then fail once
            failed.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
            continue
        if options.get("enable_fp_fusion") is False and "fma.rn.f32" in compiled.asm["ptx"]:
            failed.append(f"{name}: fused multiply-add despite enable_fp_fusion=False")
    if failed:
        sys.exit("\n".join(failed))


def _run(full: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton 3.9's default, set to silence its warning
    done = subprocess.run([sys.executable, __file__] + (["--full"] if full else []), env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
def test_one_variant_of_every_kernel_compiles_for_sm90():
    _run(full=False)


@pytest.mark.slow
def test_every_variant_compiles_for_sm90():
    _run(full=True)


if __name__ == "__main__":
    _compile_all("--full" in sys.argv)
