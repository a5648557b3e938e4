"""Fixtures shared by the Triton kernel tests."""

import pytest
import torch


@pytest.fixture(scope="session")
def pools(colliding_keys):
    """Per key dtype (on CPU): extremes, the index's fill key, 24 keys homed in the first bucket and 24 in the last
    (they spill and wrap around), and ordinary keys; sorted, unique."""
    out = {}
    for dtype in (torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        extremes = torch.tensor([info.min, info.max, -1, 0, 1, 0x5851F42D, info.min + 1, info.max - 1], dtype=dtype)
        plain = torch.randint(info.min, info.max, (40,), generator=torch.Generator().manual_seed(1), dtype=dtype)
        out[dtype] = torch.unique(torch.cat([extremes, colliding_keys(dtype, "first"), colliding_keys(dtype, "last"),
                                             plain]))
    return out
