"""Table storage on transparent huge pages (dynemb.table.memory), and tables filled chunk by chunk."""

from __future__ import annotations

import sys

import pytest
import torch

import dynemb
from dynemb.table import KeyValueTable
from dynemb.table import initializers as inits
from dynemb.table.memory import HUGE_PAGE, MIN_BYTES, empty_storage
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


@needs_thp
def test_large_storage_is_on_huge_pages_and_small_tensors_are_left_alone():
    # A plain torch.empty here is not eligible (madvise mode: only advised ranges are), so this fails without the
    # advice; THP_MEM_ALLOC_ENABLE would advise both, and the test would then say nothing: it must be unset.
    if "THP_MEM_ALLOC_ENABLE" in __import__("os").environ:
        pytest.skip("THP_MEM_ALLOC_ENABLE makes torch advise every large tensor itself")
    big = empty_storage((MIN_BYTES // 4 + (4 << 20),), torch.float32, torch.device("cpu"))
    assert _on_huge_pages(big)
    assert not _on_huge_pages(torch.empty(big.numel()))


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


@pytest.mark.parametrize("init", ["uniform", "normal", "truncated_normal", "zeros", 0.25])
def test_a_static_table_filled_in_chunks_holds_the_initializers_rows(init):
    rows = inits._FILL_ROWS * 2 + 17  # two whole chunks and a part
    table = StaticTable(rows, 3, initializer=init, seed=5)
    ids = torch.arange(rows)
    expected = inits.resolve_initializer(init)(ids, 3, torch.float32, 5)
    assert torch.equal(table.values, expected)
    # the same rows as a dynamic table's for the same ids and seed
    dyn = KeyValueTable(3, initializer=init, seed=5)
    found, _ = dyn.find_or_insert(ids[-1000:])
    assert torch.equal(dyn.values[found], expected[-1000:])


def test_a_callable_initializer_is_called_once_for_the_whole_table():
    calls = []

    def init(n, dim):
        calls.append(n)
        return torch.randn(n, dim)

    rows = inits._FILL_ROWS + 5
    table = StaticTable(rows, 2, initializer=init, seed=3)
    assert calls == [rows]
    torch.manual_seed(3)
    assert torch.equal(table.values, torch.randn(rows, 2))


def test_collection_results_do_not_depend_on_huge_pages(monkeypatch):
    """The advice changes where pages come from, never a value: the same training with and without it."""
    from dynemb.table import memory

    def train():
        torch.manual_seed(0)
        ec = dynemb.EmbeddingCollection(
            [dynemb.TableConfig(name="t", dim=8, optimizer=dynemb.optim.Adagrad(lr=0.1), init_capacity=300_000),
             dynemb.TableConfig(name="s", dim=8, vocabulary_size=300_000, optimizer=dynemb.optim.SGD(lr=0.1))],
            [dynemb.FeatureConfig(name="f", table="t"), dynemb.FeatureConfig(name="g", table="s")])
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids = torch.randint(0, 300_000, (64, 3), generator=g)
            out = ec({"f": ids, "g": ids})
            (out["f"] * out["g"]).sum().backward()
        return {k: v.clone() for k, v in ec.state_dict().items() if isinstance(v, torch.Tensor)}

    advised = train()
    monkeypatch.setattr(memory, "_madvise", None)
    plain = train()
    assert advised.keys() == plain.keys()
    assert all(torch.equal(advised[k], plain[k]) for k in advised)
