"""The kernel switch: explicit backends, the process default, and what each resolves to per device."""

from __future__ import annotations

import pytest
import torch

from dynemb.kernels import (
    Backend,
    dispatch,
    get_default_backend,
    index_kernels,
    init_kernels,
    numba_available,
    optim_kernels,
    pool_kernels,
    resolve_backend,
    set_default_backend,
    use_backend,
)
from dynemb.table import HashIndex, KeyValueTable

NUMBA = pytest.mark.skipif(not numba_available(), reason="numba is an optional kernel backend")


def test_auto_picks_numba_on_cpu_only_when_installed(monkeypatch):
    assert resolve_backend("auto", "cuda") is (Backend.TRITON if dispatch.triton_available() else Backend.TORCH)
    assert resolve_backend(Backend.AUTO, torch.device("cpu")) is (Backend.NUMBA if numba_available() else Backend.TORCH)
    monkeypatch.setattr(dispatch, "numba_available", lambda: False)
    assert resolve_backend("auto", "cpu") is Backend.TORCH
    with pytest.raises(ValueError, match="needs the numba package"):
        resolve_backend("numba", "cpu")
    with pytest.raises(ValueError, match="needs the numba package"):
        set_default_backend("numba")


def test_torch_runs_everywhere():
    for device in ("cpu", "cuda", torch.device("cuda", 1), None):
        assert resolve_backend("torch", device) is Backend.TORCH


@NUMBA
def test_numba_is_cpu_only():
    assert resolve_backend("numba", None) is Backend.NUMBA
    with pytest.raises(ValueError, match="runs on CPU only, got device cuda"):
        resolve_backend("numba", "cuda")
    with pytest.raises(ValueError, match="CPU only"):
        HashIndex(torch.int64, "cuda", capacity=8, backend="numba")  # refused before any CUDA memory is touched
    assert index_kernels("numba", "cpu").__name__ == "dynemb.kernels.numba_index"
    assert index_kernels("torch", "cpu") is None


def test_triton_is_cuda_or_the_interpreter_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    assert resolve_backend("auto", "cuda") is Backend.TRITON
    assert resolve_backend("triton", "cuda") is Backend.TRITON
    assert resolve_backend("triton", "cpu") is Backend.TRITON  # runs under TRITON_INTERPRET=1 (the tests)
    with pytest.raises(ValueError, match="backend 'triton' runs on CUDA"):
        resolve_backend("triton", "meta")
    expected = {"index": "triton_index", "pool": "triton_pool", "optim": "triton_optim", "init": "triton_init"}
    assert {f: dispatch._MODULES[f, Backend.TRITON] for f in expected} == expected
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert resolve_backend("auto", "cuda") is Backend.TORCH
    with pytest.raises(ValueError, match="needs the triton package"):
        resolve_backend("triton", "cuda")
    assert resolve_backend("auto", "cpu") in (Backend.NUMBA, Backend.TORCH)  # triton is never picked for CPU


@pytest.mark.slow
def test_the_package_imports_without_loading_triton():
    import subprocess
    import sys

    code = "import sys, dynemb, dynemb.kernels; sys.exit('triton' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


@NUMBA
@pytest.mark.parametrize("family, module, names", [
    (pool_kernels, "numba_pool", ["dedup", "pool", "row_grad", "gather"]),
    (optim_kernels, "numba_optim", ["sparse_update"]),
    (init_kernels, "numba_init", ["initial_rows"]),
])
def test_each_family_resolves_to_its_module_or_to_torch(family, module, names):
    kernels = family("numba", "cpu")
    assert kernels.__name__ == f"dynemb.kernels.{module}" and all(callable(getattr(kernels, n)) for n in names)
    assert family("auto", "cpu") is kernels
    assert family("torch", "cpu") is None and family("torch", "cuda") is None
    with use_backend("torch"):
        assert family(None, "cpu") is None


def test_bad_names_are_value_errors():
    with pytest.raises(ValueError, match=r"backend must be one of 'auto', 'torch', 'numba', 'triton' or a Backend, "
                                         r"got 'cuda'"):
        resolve_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        KeyValueTable(2, backend="gpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        set_default_backend(None)


def test_default_is_auto_and_set_only_explicitly():
    assert get_default_backend() is Backend.AUTO
    previous = set_default_backend("torch")
    try:
        assert previous is Backend.AUTO and get_default_backend() is Backend.TORCH
        assert resolve_backend(None, "cpu") is Backend.TORCH
    finally:
        set_default_backend(previous)
    assert get_default_backend() is Backend.AUTO


def test_use_backend_restores_the_default_even_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with use_backend("torch") as chosen:
            assert chosen is Backend.TORCH and get_default_backend() is Backend.TORCH
            raise RuntimeError("boom")
    assert get_default_backend() is Backend.AUTO


@NUMBA
def test_none_follows_the_default_at_each_call_and_explicit_wins(monkeypatch):
    calls = []
    from dynemb.kernels import numba_index

    for name in ("probe", "find"):  # the index's lookups: all slots and rows, or rows only
        real = getattr(numba_index, name)
        monkeypatch.setattr(numba_index, name, lambda *a, real=real: calls.append(1) or real(*a))
    follows = KeyValueTable(2)
    pinned = KeyValueTable(2, backend="torch")
    keys = torch.tensor([1, 2, 3])
    for table in (follows, pinned):
        table.find_or_insert(keys)
    assert calls and pinned.index.backend is Backend.TORCH and follows.index.backend is None
    calls.clear()
    with use_backend("torch"):
        follows.find(keys)
    pinned.find(keys)
    assert not calls
    follows.find(keys)
    assert calls


def test_a_table_keeps_its_backend_through_growth_moves_and_admission():
    t = KeyValueTable(2, init_capacity=2, backend="torch", admission=2)
    t.find_or_insert(torch.arange(100).repeat(2))  # grows and rehashes; the admission counter is built
    assert t.index.backend is Backend.TORCH and t.admission.counter.index.backend is Backend.TORCH
    assert t.to("cpu").index.backend is Backend.TORCH


@pytest.mark.skipif(not dispatch.triton_available(), reason="needs triton")
@pytest.mark.slow
def test_triton_on_cpu_without_the_interpreter_is_a_clear_error():
    import os
    import subprocess
    import sys

    code = ("import torch, dynemb\nfrom dynemb.kernels import set_default_backend\nset_default_backend('triton')\n"
            "try:\n    dynemb.KeyValueTable(4).find_or_insert(torch.tensor([1, 2]))\n"
            "except ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "only under Triton's interpreter" in out.stdout, out.stderr[-2000:]


def test_the_interpreter_switch_is_read_at_every_resolve(monkeypatch):
    # Answers are remembered, but whether Triton interprets may change at run time: it is read each time it matters.
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "_triton_interprets", lambda: True)
    assert resolve_backend("triton", "cpu") is Backend.TRITON
    monkeypatch.setattr(dispatch, "_triton_interprets", lambda: False)
    with pytest.raises(ValueError, match="only under Triton's interpreter"):
        resolve_backend("triton", "cpu")
    assert resolve_backend("triton", "cuda") is Backend.TRITON  # CUDA never asks
