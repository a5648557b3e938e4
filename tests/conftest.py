"""Shared fixtures: the device and key-dtype matrices every table test runs over."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dynemb.kernels import numba_available, use_backend

_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, _NO_CUDA])]
KEY_DTYPES = [pytest.param(torch.int32, id="int32"), pytest.param(torch.int64, id="int64")]
VALUE_DTYPES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.float16, id="float16"),
    pytest.param(torch.bfloat16, id="bfloat16"),
]
# HashIndex lookups of CPU keys have two implementations (kernel backends): batched torch ops (the reference, and
# the CUDA path) and numba kernels, used when numba is installed. Index-level tests run both.
PROBE_PATHS = ["torch"] + (["numba"] if numba_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """A device to run on; ``cuda`` is skipped when no GPU is present (the one permitted skip)."""
    return torch.device(request.param)


@pytest.fixture(scope="session")
def probe_paths() -> list[str]:
    return list(PROBE_PATHS)


@pytest.fixture(params=PROBE_PATHS)
def probe_path(request) -> str:
    """Make this backend the process default (``use_backend``) for the duration of a test. numba kernels run on CPU
    only, so a test on another ``device`` runs the torch path under either param."""
    device = request.getfixturevalue("device") if "device" in request.fixturenames else torch.device("cpu")
    with use_backend(request.param if device.type == "cpu" else "torch"):
        yield request.param


@pytest.fixture(params=KEY_DTYPES)
def key_dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(params=VALUE_DTYPES)
def value_dtype(request) -> torch.dtype:
    return request.param


FILL_KEY = 0x5851F42D  # the key value the index writes into free slots; it must still work as a key


@pytest.fixture
def extreme_keys(key_dtype) -> torch.Tensor:
    """Keys other libraries reserve or mishandle: min, max, -1, 0 and the index's free-slot fill value."""
    info = torch.iinfo(key_dtype)
    keys = [info.min, info.max, -1, 0, 1, FILL_KEY, info.min + 1, info.max - 1]
    return torch.tensor(keys, dtype=key_dtype)


def _colliding(key_dtype: torch.dtype, bucket: int, count: int, num_buckets: int = 256) -> torch.Tensor:
    """``count`` distinct keys whose home bucket is ``bucket`` in an index of ``num_buckets`` buckets.

    Homes are taken from the index itself, so the pool follows any change of hash function. With power-of-two
    bucket counts, keys sharing the first or last bucket of a large index share it in every smaller one too.
    """
    from dynemb.table.hashing import key_hash
    from dynemb.table.index import HashIndex

    info = torch.iinfo(key_dtype)
    gen = torch.Generator().manual_seed(bucket * 7919 + info.bits)
    found = torch.empty(0, dtype=key_dtype)
    index = HashIndex(key_dtype, "cpu", capacity=num_buckets * HashIndex.width_for(key_dtype) // 2)
    assert index.num_buckets == num_buckets
    while found.numel() < count:
        cand = torch.randint(info.min, info.max, (1 << 18,), generator=gen, dtype=torch.int64).to(key_dtype)
        found = torch.unique(torch.cat([found, cand[index._home(key_hash(cand)) == bucket]]))
    return found[:count]


@pytest.fixture(scope="session")
def colliding_keys():
    """``colliding_keys(key_dtype, where="first"|"last", count=24)``: keys that share one home bucket.

    ``last`` keys spill past the end of the bucket array and wrap around to bucket 0.
    """
    cache: dict = {}

    def make(key_dtype: torch.dtype, where: str = "last", count: int = 24) -> torch.Tensor:
        if (key_dtype, where, count) not in cache:
            cache[key_dtype, where, count] = _colliding(key_dtype, 0 if where == "first" else 255, count)
        return cache[key_dtype, where, count]

    return make


def table_state(table) -> dict:
    """Everything observable about a table (a KeyValueTable or a module holding one in ``.table``)."""
    t = getattr(table, "table", table)
    rows = t.export()
    return {
        "keys": rows.keys.cpu(),
        "values": rows.values.cpu(),
        "scores": rows.scores.cpu(),
        "slots": {name: s.cpu() for name, s in rows.slots.items()},
        "rows_of_keys": t.find_rows(rows.keys).cpu(),
        "counters": (t.size(), t.epoch, t.inserted, t.removed, t.evicted),
        "clock": t.clock,
    }


def assert_same_state(before: dict, after: dict, *, clock: bool = True) -> None:
    assert before["counters"] == after["counters"]
    assert not clock or before["clock"] == after["clock"]
    for name in ("keys", "values", "scores", "rows_of_keys"):
        assert torch.equal(before[name], after[name]), name
    assert before["slots"].keys() == after["slots"].keys()
    for name, slot in before["slots"].items():
        assert torch.equal(slot, after["slots"][name]), name


@pytest.fixture
def fails_cleanly():
    """``with fails_cleanly(table, TypeError, "keys"): ...``: the block raises, and the table is unchanged.

    ``clock=False`` allows one skipped clock tick: for failures raised by user code (an initializer) in the middle
    of a call that already counted as an access. Rows, scores and counters must still be untouched.
    """

    @contextlib.contextmanager
    def check(table, exc, match, *, clock: bool = True):
        before = table_state(table)
        with pytest.raises(exc, match=match) as info:
            yield info
        assert_same_state(before, table_state(table), clock=clock)

    return check


@pytest.fixture
def leaves_unchanged():
    """``with leaves_unchanged(table, clock=False): ...``: the block runs, and the table is as it was before it
    (``clock=False``: but for the clock, as in :func:`fails_cleanly`)."""

    @contextlib.contextmanager
    def check(table, *, clock: bool = True):
        before = table_state(table)
        yield
        assert_same_state(before, table_state(table), clock=clock)

    return check


@pytest.fixture
def cuda_device() -> torch.device:
    """For tests about CUDA specifically (moves between devices); skipped without a GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")
