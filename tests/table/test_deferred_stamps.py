"""Deferred stamps (``RowStore._defer_stamps``): a CPU table's lookups may leave their score and version stamps as a
byte tag a row, written into the stamp columns only when something reads or moves them. Nothing may see the
difference: a table that defers and one that stamps at once (``_DEFERS_STAMPS = False``) go through the same
random calls, and every score, version stamp, ``changes_since`` answer, eviction and export must be identical.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from dynemb.kernels import numba_pool
from dynemb.table import KeyValueTable
from dynemb.table import rows as rows_module
from dynemb.table.ops import stamp_kernels

INT64 = torch.iinfo(torch.int64)
KEYS = st.one_of(st.integers(-40, 40), st.sampled_from([INT64.min, INT64.max, -1, 0]))


def _pair(**kwargs) -> tuple[KeyValueTable, KeyValueTable]:
    deferred = KeyValueTable(2, initializer="zeros", **kwargs)
    eager = KeyValueTable(2, initializer="zeros", **kwargs)
    eager._DEFERS_STAMPS = False
    return deferred, eager


def _stamps(table: KeyValueTable) -> dict:
    """Every key's (score, version), read as a user or a checkpoint would."""
    n = table.size()
    keys = table.row_keys[:n].tolist()
    return dict(zip(keys, zip(table.scores[:n].tolist(), table._cols["version"][:n].tolist())))


class DeferredMatchesEager(RuleBasedStateMachine):
    """Calls that stamp (lookups, writes), that read stamps (evict, changes_since, export) and that move rows
    (erase, growth, clear), in any order; stamps are compared only when a rule reads them, so deferred tags pile up
    across many calls, several pairs at once, the way a training loop leaves them."""

    @initialize(policy=st.sampled_from(["lru", "epoch_lru", "lfu"]), bound=st.sampled_from([None, 24]),
                admission=st.sampled_from([None, 2]))
    def start(self, policy, bound, admission):
        self.evicted = ([], [])  # what on_evict saw, per table: keys and scores handed out before the rows go
        self.tables = tuple(KeyValueTable(2, initializer="zeros", eviction=policy, max_capacity=bound,
                                          init_capacity=4, admission=admission,
                                          on_evict=lambda k, v, sc, seen=seen: seen.append((k.tolist(), sc.tolist())))
                            for seen in self.evicted)
        self.tables[1]._DEFERS_STAMPS = False

    def _both(self, method: str, *args) -> list:
        return [getattr(t, method)(*args) for t in self.tables]

    @rule(keys=st.lists(KEYS, max_size=30))
    def lookup(self, keys):
        rows = self._both("find_or_insert", torch.tensor(keys, dtype=torch.int64))
        assert torch.equal(rows[0][0], rows[1][0])

    @rule(keys=st.lists(KEYS, max_size=10))
    def find_counting(self, keys):
        a, b = (t.find(torch.tensor(keys, dtype=torch.int64), update_scores=True) for t in self.tables)
        assert torch.equal(a[0], b[0])

    @rule(keys=st.lists(KEYS, max_size=10))
    def assign(self, keys):
        values = torch.arange(2 * len(keys), dtype=torch.float32).view(-1, 2)
        self._both("insert_or_assign", torch.tensor(keys, dtype=torch.int64), values)

    @rule(keys=st.lists(KEYS, max_size=10), exists=st.lists(st.booleans(), min_size=10, max_size=10))
    def accum(self, keys, exists):
        ids = torch.tensor(keys, dtype=torch.int64)
        old = torch.zeros(len(keys), 2)
        self._both("accum", ids, old, old + 1, torch.tensor(exists[: len(keys)], dtype=torch.bool))

    @rule()
    def save_tick(self):
        for t in self.tables:  # what a checkpoint save does to the clocks: scores never see the tick
            t.clock += 1
            t.save_ticks += 1

    @rule(keys=st.lists(KEYS, max_size=6))
    def erase(self, keys):
        assert len(set(self._both("erase", torch.tensor(keys, dtype=torch.int64)))) == 1

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        a, b = self._both("evict", n)
        assert a.keys.tolist() == b.keys.tolist() and a.scores.tolist() == b.scores.tolist()

    @rule()
    def optimizer_wrote(self):
        for t in self.tables:  # an unfused optimizer stamps the rows it updated
            t.mark_updated(torch.arange(t.size()))

    @rule()
    def next_epoch(self):
        for t in self.tables:
            t.epoch += 1

    @rule(back=st.integers(0, 6))
    def changes_since(self, back):
        a, b = (t.changes_since(max(t.clock - back, 0))[0] for t in self.tables)
        assert torch.equal(a, b)

    @rule()
    def export(self):
        a, b = self._both("export")
        assert a.keys.tolist() == b.keys.tolist() and a.scores.tolist() == b.scores.tolist()
        assert _stamps(self.tables[0]) == _stamps(self.tables[1])

    @rule()
    def clear(self):
        self._both("clear")

    @rule()
    def replace(self):
        for t in self.tables:  # a load: every row rewritten, stamped with the clock
            t.replace(t.export())
        assert _stamps(self.tables[0]) == _stamps(self.tables[1])

    @rule()
    def snapshot(self):
        self.saved = [(t.export(), t.clock) for t in self.tables]

    @rule()
    def roll_back(self):
        for t, (rows, clock) in zip(self.tables, getattr(self, "saved", [])):  # a load of an older state
            t.replace(rows)
            t.clock = clock

    @rule()
    def evictions_seen(self):
        assert self.evicted[0] == self.evicted[1]


@pytest.mark.parametrize("max_deferred", [255, 2])
@pytest.mark.slow
def test_deferred_stamps_match_eager(monkeypatch, max_deferred):
    """A small ``_MAX_DEFERRED`` makes the tag space run out, and settle mid-stream, within a few calls."""
    assert stamp_kernels(torch.device("cpu")) is not None, "numba kernels absent: nothing here defers"
    monkeypatch.setattr(rows_module, "_MAX_DEFERRED", max_deferred)
    run_state_machine_as_test(DeferredMatchesEager, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)))


def test_lookups_defer_and_reads_settle():
    """A training-style loop leaves its stamps deferred (one pair a call), and the first read writes them all; past
    255 distinct pairs the table settles by itself. The stamps then equal a table's that stamped at once."""
    deferred, eager = _pair(init_capacity=1 << 13)  # room for every key: no growth, which settles
    gen = torch.Generator().manual_seed(0)
    for step in range(300):
        keys = torch.randint(-3000, 3000, (5000,), generator=gen)
        for t in (deferred, eager):
            t.find_or_insert(keys)
        if step == 100:
            assert len(deferred._pending) == 101 and int((deferred._marks > 0).sum()) > 0
    assert 0 < len(deferred._pending) < 255  # settled once on its own, at the 256th pair
    assert _stamps(deferred) == _stamps(eager)
    assert len(deferred._pending) == 0 and int(deferred._marks.sum()) == 0


def test_rarely_touched_rows_keep_stamps_past_255_pairs():
    """Rows touched once, then left while more than 255 pairs go by (the tags wrap around a uint8 otherwise), and
    a few rows touched at every call."""
    deferred, eager = _pair(init_capacity=1024)
    for step in range(300):
        keys = torch.tensor([step % 7, 500 + step])
        for t in (deferred, eager):
            t.find_or_insert(keys)
    assert _stamps(deferred) == _stamps(eager)


def test_optimizer_marks_rows_a_later_clock_than_their_lookup():
    """Gradient accumulation: two lookups, then an unfused optimizer marks the rows of both. The version it writes
    at once is newer than the first lookup's deferred one, and wins when they settle."""
    deferred, eager = _pair()
    for t in (deferred, eager):
        t.find_or_insert(torch.arange(50))
        t.find_or_insert(torch.arange(40, 90))
        t.mark_updated(torch.arange(60))
    assert deferred._pending
    assert torch.equal(deferred.changes_since(1)[0], eager.changes_since(1)[0])
    assert _stamps(deferred) == _stamps(eager)


@pytest.mark.parametrize("how", ["state_dict", "replace"])
def test_a_clock_set_back_leaves_newer_versions(how):
    """Loading an older state into a used table sets its clock back below the versions the load wrote: later
    lookups must still write their own (lower) versions, as stamping at once does, not the larger one."""
    import dynemb

    older = dynemb.DynamicEmbedding(2, initializer="zeros")
    older.table.find_or_insert(torch.arange(10))
    state, snapshot = older.state_dict(), older.table.export()
    tables = []
    for defer in (True, False):
        emb = dynemb.DynamicEmbedding(2, initializer="zeros")
        emb.table._DEFERS_STAMPS = defer
        for _ in range(20):
            emb.table.find_or_insert(torch.arange(10))
        if how == "state_dict":
            emb.load_state_dict(state)
        else:
            emb.table.replace(snapshot)
            emb.table.clock = older.table.clock
        emb.table.find_or_insert(torch.arange(5))
        tables.append(emb.table)
    assert torch.equal(tables[0].changes_since(2)[0], tables[1].changes_since(2)[0])
    assert _stamps(tables[0]) == _stamps(tables[1])


def test_lookups_then_replace():
    """A load over rows whose stamps are still deferred: the load's stamps win."""
    deferred, eager = _pair()
    saved = {}
    for t in (deferred, eager):
        t.find_or_insert(torch.arange(100))
        saved[t] = t.export()
        t.find_or_insert(torch.arange(50, 160))
    assert deferred._pending
    for t in (deferred, eager):
        t.replace(saved[t])
        t.find_or_insert(torch.arange(5))
    assert _stamps(deferred) == _stamps(eager)


def test_settles_under_another_backend():
    """Stamps deferred under the numba kernels settle with them even when the torch backend is the default by the
    time they are read (and lookups under it stamp at once)."""
    from dynemb.kernels import use_backend

    deferred, eager = _pair()
    for t in (deferred, eager):
        t.find_or_insert(torch.arange(100))
    with use_backend("torch"):
        for t in (deferred, eager):
            t.find_or_insert(torch.arange(90, 120))
        assert _stamps(deferred) == _stamps(eager)
        deferred.export()


def test_byte_budgets_hold_no_tags():
    """A table under ``max_bytes`` stamps at once: its budget has no byte for tags (and checkpoints of full
    byte-budget tables saved before tags existed still fit)."""
    t = KeyValueTable(8, max_bytes=1 << 16, init_capacity=16)
    for step in range(20):
        t.find_or_insert(torch.arange(step * 100, step * 100 + 300))
        assert t.nbytes() <= 1 << 16
    assert t._marks is None and not t._pending


def test_copies_and_pickles_carry_deferred_stamps():
    import copy
    import pickle

    deferred, eager = _pair()
    for t in (deferred, eager):
        t.find_or_insert(torch.arange(100))
    assert deferred._pending
    for twin in (copy.deepcopy(deferred), pickle.loads(pickle.dumps(deferred))):
        assert _stamps(twin) == _stamps(eager)
    assert deferred._pending  # the copies settled their own tags


def test_a_full_bounded_table_stamps_at_once():
    """Full, a bounded table evicts on most calls, reading its scores each time: it does not defer."""
    deferred, eager = _pair(max_capacity=100, init_capacity=16)
    for step in range(30):
        for t in (deferred, eager):
            t.find_or_insert(torch.arange(step * 10, step * 10 + 60))
        if step == 3:
            assert deferred._pending  # not full yet
    assert deferred.size() == 100 and not deferred._pending
    assert _stamps(deferred) == _stamps(eager)


def test_growth_and_moves_keep_deferred_stamps():
    """Rows marked before the columns grow, or before erase fills holes with rows from the end, keep their stamps."""
    deferred, eager = _pair(init_capacity=8)
    for step in range(40):
        keys = torch.arange(step * 7, step * 7 + 50) % 300 - 150
        for t in (deferred, eager):
            t.find_or_insert(keys)
            if step % 9 == 4:
                t.erase(keys[::3])
    assert deferred.capacity > 8
    assert _stamps(deferred) == _stamps(eager)
    assert torch.equal(deferred.changes_since(10)[0], eager.changes_since(10)[0])


def test_nbytes_counts_the_tags():
    t = KeyValueTable(8, init_capacity=64)
    t.insert_or_assign(torch.arange(10), torch.zeros(10, 8))  # a write: its stamps too are deferred
    _ = t._cols  # settle: the tags stay allocated
    before = t.nbytes()
    t._marks = None
    assert before - t.nbytes() == t.capacity


def test_mark_rows_is_all_or_nothing():
    marks = torch.zeros(10, dtype=torch.uint8)
    assert not numba_pool.mark_rows(marks, torch.tensor([1, 10]), 3)
    assert not numba_pool.mark_rows(marks, torch.tensor([-1, 2]), 3)
    assert int(marks.sum()) == 0
    assert numba_pool.mark_rows(marks, torch.tensor([9, 1, 9]), 2)
    assert marks.tolist() == [0, 2, 0, 0, 0, 0, 0, 0, 0, 2]


def test_settle_marks_writes_each_tag_and_clears():
    marks = torch.tensor([0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 2], dtype=torch.uint8)  # a word, a partial tail
    pair = torch.zeros(11, 2, dtype=torch.int64)
    numba_pool.settle_marks(marks, pair[:, 0], pair[:, 1], torch.tensor([INT64.min, 5]), torch.tensor([7, INT64.max]))
    assert pair[:, 0].tolist() == [0, INT64.min, 5] + [0] * 7 + [5]
    assert pair[:, 1].tolist() == [0, 7, INT64.max] + [0] * 7 + [INT64.max]
    assert int(marks.sum()) == 0
