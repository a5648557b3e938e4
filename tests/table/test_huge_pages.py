"""Table storage on transparent huge pages (dynemb.table.huge_pages), and a static table's initial rows."""

from __future__ import annotations

import sys

import pytest
import torch

from dynemb.table import KeyValueTable
from dynemb.table import initializers as inits
from dynemb.table.huge_pages import HUGE_PAGE, MIN_BYTES, empty_storage
from dynemb.table.static import StaticTable


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _on_huge_pages(t: torch.Tensor) -> bool:
    """Whether the kernel may back the first whole 2 MiB page of ``t``'s storage with a huge page."""
    start, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    page = -(-start // HUGE_PAGE) * HUGE_PAGE
    assert page + HUGE_PAGE <= start + size, "the storage holds no whole huge page"
    return _eligible(page)


def _eligible(address: int) -> bool:
    """Whether the kernel may back the mapping that holds ``address`` with huge pages (``THPeligible`` in smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    return False


needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() != "madvise",
                               reason="the check reads madvise's effect: Linux with THP in madvise mode")


def test_the_advice_covers_whole_huge_pages_inside_large_tensors_only(monkeypatch):
    """What is advised, whatever the platform: whole 2 MiB pages inside the tensor, and nothing under MIN_BYTES.
    (smaps cannot show that small tensors are left alone: advice stays on heap memory that glibc hands out again.)"""
    from dynemb.table import huge_pages

    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda start, size, advice: calls.append((start, size, advice)) or 0)
    for nbytes in (MIN_BYTES - 4, MIN_BYTES, 3 * MIN_BYTES + 4):
        t = empty_storage((nbytes // 4,), torch.float32, torch.device("cpu"))
        if nbytes < MIN_BYTES:
            assert calls == []
            continue
        start, size, advice = calls.pop()
        lo, hi = t.data_ptr(), t.data_ptr() + t.nbytes
        assert advice == huge_pages._MADV_HUGEPAGE and start % HUGE_PAGE == 0 and size % HUGE_PAGE == 0 and size > 0
        assert lo <= start and start + size <= hi and start - lo < HUGE_PAGE and hi - (start + size) < HUGE_PAGE


@needs_thp
def test_large_storage_is_on_huge_pages():
    if "THP_MEM_ALLOC_ENABLE" in __import__("os").environ:
        pytest.skip("THP_MEM_ALLOC_ENABLE makes torch advise every large tensor itself")
    assert _on_huge_pages(empty_storage((MIN_BYTES // 4 + (4 << 20),), torch.float32, torch.device("cpu")))


@needs_thp
def test_a_tables_values_index_and_slots_are_on_huge_pages():
    if "THP_MEM_ALLOC_ENABLE" in __import__("os").environ:
        pytest.skip("THP_MEM_ALLOC_ENABLE makes torch advise every large tensor itself")
    table = KeyValueTable(16, init_capacity=300_000)  # 19 MB of values, 12 MB of index, 4.8 MB of stamps
    table.add_slot("sum", 16)
    static = StaticTable(100_000, 16)
    stamps = table._cols["score"]
    for t in (table.values, table.slot("sum"), table.index._buckets, static.values, stamps):
        assert t.untyped_storage().nbytes() >= MIN_BYTES and _on_huge_pages(t)
    table.find_or_insert(torch.arange(350_000))  # growth reallocates the columns and rehashes the index
    assert all(_on_huge_pages(t) for t in (table.values, table.slot("sum"), table.index._buckets))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("init", ["uniform", "normal", "truncated_normal", "zeros", 0.25])
def test_a_static_table_holds_its_initializers_rows(init, dtype):
    """A static table's rows come from the initial-rows kernel (float32 uniform and constants) or the initializer a
    chunk of keys at a time: the bits of one call over every id, and of a dynamic table's rows."""
    rows = 2 * (inits._INIT_CHUNK // 3) + 17  # two whole chunks and a part
    table = StaticTable(rows, 3, initializer=init, seed=5, dtype=dtype)
    ids = torch.arange(rows)
    expected = inits.resolve_initializer(init)(ids, 3, dtype, 5)
    assert torch.equal(table.values, expected)
    assert torch.equal(table.initial_rows(ids[-1000:]), expected[-1000:])
    dyn = KeyValueTable(3, initializer=init, seed=5, dtype=dtype)
    found, _ = dyn.find_or_insert(ids[-1000:])
    assert torch.equal(dyn.values[found], expected[-1000:])


def test_a_callable_initializer_is_called_once_for_the_whole_table():
    calls = []

    def init(n, dim):
        calls.append(n)
        return torch.randn(n, dim)

    rows = inits._INIT_CHUNK + 5
    table = StaticTable(rows, 2, initializer=init, seed=3)
    assert calls == [rows]
    torch.manual_seed(3)
    assert torch.equal(table.values, torch.randn(rows, 2))
