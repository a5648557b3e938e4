"""Nested optimizer / extra state through JSON and safetensors, without pickle."""

from __future__ import annotations

import math

import pytest
import torch

from dynemb.checkpoint.codec import encode, read_state
from dynemb.checkpoint.tensorfile import write_tensors


def _round_trip(tmp_path, obj):
    tensors, metadata = encode(obj, "state")
    record = write_tensors(tmp_path / "s.safetensors", tensors, metadata)
    return read_state(tmp_path / "s.safetensors", record)


def test_nested_structures_round_trip(tmp_path):
    state = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 2)}, 1: {}},
        "param_groups": [{"params": [0, 1], "betas": (0.9, 0.999), "lr": 1e-3, "foreach": None, "amsgrad": False}],
        "__odd__": {(1, "a"): "tuple key"},
        "inf": math.inf,
        "a/b": torch.ones(1),
        "a": {"b": torch.zeros(1)},
    }
    back = _round_trip(tmp_path, state)
    assert back["param_groups"] == state["param_groups"] and isinstance(back["param_groups"][0]["betas"], tuple)
    assert back["__odd__"] == {(1, "a"): "tuple key"} and back["inf"] == math.inf
    assert torch.equal(back["state"][0]["exp_avg"], state["state"][0]["exp_avg"]) and back["state"][1] == {}
    assert back["state"][0]["step"].shape == () and back["a/b"].item() == 1 and back["a"]["b"].item() == 0


def test_torch_optimizer_state_loads_back(tmp_path):
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    opt = torch.optim.Adam(params, lr=0.1)
    sum(p.sum() for p in params).backward()
    opt.step()
    restored = torch.optim.Adam([torch.nn.Parameter(p.detach().clone()) for p in params], lr=0.5)
    restored.load_state_dict(_round_trip(tmp_path, opt.state_dict()))
    a, b = opt.state_dict(), restored.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_other_objects_are_refused_with_their_path():
    with pytest.raises(TypeError, match=r"opt: cannot save a dtype at state/0/kind"):
        encode({"state": {0: {"kind": torch.float32}}}, "opt")
