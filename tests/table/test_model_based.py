"""Model-based property test: random call sequences on KeyValueTable against a plain-dict reference.

The reference keeps ``key -> (values, score)`` in Python and derives every expected result from the documented
semantics (see ``dynemb/table/kv.py`` and ``policy.py``). After every step the whole table is exported and
compared exactly: keys, values, scores, counters, and the index's key -> row mapping.

Values are small integers (exact in float32 whatever the summation order), so accum is compared exactly too.
Tables start tiny (init_capacity 1..16) so that growth and rehash happen within a few steps; bounded tables
(max_capacity 1..40) evict on most inserts. Keys mix a small pool (hits), extreme values, the index's fill value,
keys sharing one home bucket (spills, wrap-around) and arbitrary values.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from dynemb.table import Initializer, KeyValueTable

MAX_EXAMPLES = 200
STEPS = 20
INT64 = torch.iinfo(torch.int64)


class KeyInit(Initializer):
    """Integer-valued rows that are a pure function of (key, column, seed): exact under float32 sums."""

    def __call__(self, keys, dim, dtype, seed):
        cols = torch.arange(1, dim + 1, device=keys.device)
        mixed = keys.to(torch.int64).unsqueeze(1) * 0x9E3779B1 + cols * 0x85EBCA77 + seed
        return (mixed.remainder(4099) - 2049).to(dtype)

    def describe(self) -> dict:
        return {"type": "KeyInit"}


def _scores(n: int):
    score = st.one_of(st.integers(-3, 3), st.sampled_from([INT64.min, INT64.max]), st.integers(INT64.min, INT64.max))
    return st.lists(score, min_size=n, max_size=n)


class TableModel(RuleBasedStateMachine):
    def __init__(self, key_dtype: torch.dtype, device: torch.device, pools: list[int], paths: list[str]) -> None:
        super().__init__()
        self.key_dtype, self.device, self.paths = key_dtype, device, paths
        info = torch.iinfo(key_dtype)
        self.info = info
        self.key = st.one_of(
            st.integers(-6, 6),
            st.sampled_from([info.min, info.max, -1, 0, 0x5851F42D, info.min + 1, info.max - 1]),
            st.sampled_from(pools),
            st.integers(info.min, info.max),
        )
        self.batch = st.lists(self.key, max_size=10)

    # ------------------------------------------------------------------ set-up
    @initialize(
        policy=st.sampled_from(["lru", "lfu", "custom"]),
        dim=st.integers(1, 3),
        init_capacity=st.integers(1, 16),
        max_capacity=st.one_of(st.none(), st.integers(1, 40)),
        seed=st.integers(0, 1000),
        data=st.data(),
    )
    def build(self, policy, dim, init_capacity, max_capacity, seed, data):
        # Each example picks one CPU lookup implementation of the index (see PROBE_PATHS in conftest).
        path = data.draw(st.sampled_from(self.paths), label="probe path")
        self.policy, self.dim, self.max_capacity, self.seed = policy, dim, max_capacity, seed
        self.reported: list[tuple[list, torch.Tensor, list]] = []
        self.table = KeyValueTable(
            dim,
            key_dtype=self.key_dtype,
            device=self.device,
            init_capacity=init_capacity,
            max_capacity=max_capacity,
            eviction=policy,
            initializer=KeyInit(),
            seed=seed,
            on_evict=self._on_evict,
            backend=path if self.device.type == "cpu" else "torch",
        )
        self.values: dict[int, tuple] = {}
        self.scores: dict[int, int] = {}
        self.inserted = self.removed = self.evicted = 0
        self.clock = self.table.clock

    def _on_evict(self, keys, values, scores):
        assert keys.dtype == self.key_dtype and scores.dtype == torch.int64
        assert keys.numel() > 0 and values.shape == (keys.numel(), self.dim) and scores.shape == keys.shape
        self.reported.append((keys.tolist(), values.cpu(), scores.tolist()))

    # ------------------------------------------------------------------ helpers
    def _keys(self, keys: list[int]) -> torch.Tensor:
        return torch.tensor(keys, dtype=self.key_dtype, device=self.device)

    def _init(self, keys: list[int]) -> list[tuple]:
        rows = KeyInit()(torch.tensor(keys, dtype=torch.int64), self.dim, torch.float32, self.seed)
        return [tuple(r) for r in rows.tolist()]

    def _draw_values(self, data, n: int) -> list[list[float]]:
        # One drawn seed per batch keeps hypothesis' per-step cost low; keys are what shrinking should act on.
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1)))
        return torch.randint(-16, 17, (n, self.dim), generator=gen).float().tolist()

    def _values_tensor(self, rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.float32, device=self.device).reshape(len(rows), self.dim)

    def _draw_custom(self, data, n: int):
        if self.policy != "custom" or not data.draw(st.booleans()):
            return None
        return data.draw(_scores(n))

    def _drain(self) -> dict[int, tuple[tuple, int]]:
        out: dict[int, tuple[tuple, int]] = {}
        for keys, values, scores in self.reported:
            for key, value, score in zip(keys, values.tolist(), scores):
                assert key not in out, f"key {key} reported evicted twice in one call"
                out[key] = (tuple(value), score)
        self.reported.clear()
        return out

    def _check_lowest(self, victims: set, candidates: set) -> None:
        """Victims were candidates, and none scores above a candidate that survived (ties go either way)."""
        assert victims <= candidates, f"evicted {victims - candidates}, which were pinned or absent"
        if victims and candidates - victims:
            top = max(self.scores[k] for k in victims)
            low = min(self.scores[k] for k in candidates - victims)
            assert top <= low, f"evicted score {top} while score {low} survived"

    def _apply_inserts(self, pinned: set, new: dict[int, tuple]) -> set[int]:
        """Check what one call evicted while bringing the ``new`` keys; update the model; return dropped keys."""
        reported = self._drain()
        need = max(0, len(self.values) + len(new) - self.max_capacity) if self.max_capacity else 0
        candidates = set(self.values) - pinned
        victims = {k for k in reported if k in self.values}
        dropped = {k for k in reported if k in new}
        assert victims | dropped == set(reported), f"evicted keys {set(reported) - victims - dropped} were absent"
        assert len(victims) == min(need, len(candidates))
        assert len(dropped) == need - len(victims)
        self._check_lowest(victims, candidates)
        for key in victims:
            assert reported[key] == (self.values[key], self.scores[key]), f"victim {key} reported wrong row"
        for key in dropped:
            assert reported[key] == (new[key], 0), f"dropped new key {key} reported wrong row"
        self._forget(victims)
        self.evicted += len(reported)
        self.inserted += len(new)
        for key, value in new.items():
            if key not in dropped:
                self.values[key], self.scores[key] = value, 0
        return dropped

    def _forget(self, keys) -> None:
        for key in keys:
            del self.values[key], self.scores[key]

    def _touch(self, keys: list[int], custom: list[int] | None = None) -> None:
        """One access of each occurrence of ``keys`` (all stored now)."""
        clock = self.table.clock
        if keys:
            assert clock > self.clock, "an access must advance the clock"
        self.clock = clock
        for i, key in enumerate(keys):
            if self.policy == "lru":
                self.scores[key] = clock
            elif self.policy == "lfu":
                self.scores[key] += 1
            elif custom is not None:
                self.scores[key] = custom[i]

    def _check_rows(self, keys: list[int], rows: torch.Tensor, dropped: set) -> None:
        for key, row in zip(keys, rows.tolist()):
            if key in dropped:
                assert row == -1
            else:
                assert row >= 0 and self.table.row_keys[row].item() == key

    def _check_evict(self, result, victims_wanted: int) -> None:
        reported = self._drain()
        assert sorted(result.keys.tolist()) == sorted(reported)
        assert len(reported) == victims_wanted
        self._check_lowest(set(reported), set(self.values))
        for key, (value, score) in reported.items():
            assert (value, score) == (self.values[key], self.scores[key])
        self._forget(reported)
        self.evicted += len(reported)

    # ------------------------------------------------------------------ rules
    def _find_or_insert(self, keys: list[int], custom) -> None:
        present = set(self.values)
        new_keys = sorted({k for k in keys if k not in present})
        rows, found = self.table.find_or_insert(
            self._keys(keys), None if custom is None else torch.tensor(custom, dtype=torch.int64, device=self.device)
        )
        assert found.tolist() == [k in present for k in keys]
        new = dict(zip(new_keys, self._init(new_keys))) if new_keys else {}
        dropped = self._apply_inserts({k for k in keys if k in present}, new)
        self._check_rows(keys, rows, dropped)
        live = [i for i, k in enumerate(keys) if k not in dropped]
        self._touch([keys[i] for i in live], None if custom is None else [custom[i] for i in live])

    @rule(data=st.data())
    def find_or_insert(self, data):
        keys = data.draw(self.batch)
        self._find_or_insert(keys, self._draw_custom(data, len(keys)))

    @rule(seed=st.integers(0, 2**31), n=st.integers(16, 64), wide=st.booleans())
    def grow(self, seed, n, wide):
        gen = torch.Generator().manual_seed(seed)
        low, high = (self.info.min, self.info.max) if wide else (-200, 200)
        keys = torch.randint(low, high, (n,), generator=gen, dtype=torch.int64).tolist()
        self._find_or_insert(keys, None)

    @rule(data=st.data(), update_scores=st.booleans(), use_out=st.booleans())
    def find(self, data, update_scores, use_out):
        keys = data.draw(self.batch)
        out = torch.full((len(keys), self.dim), math.nan, device=self.device) if use_out else None
        values, found = self.table.find(self._keys(keys), out=out, update_scores=update_scores)
        expected = [self.values[k] if k in self.values else v for k, v in zip(keys, self._init(keys))]
        assert torch.equal(values.cpu(), torch.tensor(expected, dtype=torch.float32).reshape(len(keys), self.dim))
        assert found.tolist() == [k in self.values for k in keys]
        assert self.table.contains(self._keys(keys)).tolist() == found.tolist()
        if use_out:
            assert torch.equal(out, values)
        if update_scores:
            self._touch([k for k in keys if k in self.values])

    @rule(data=st.data())
    def insert_or_assign(self, data):
        keys = data.draw(self.batch)
        vals = self._draw_values(data, len(keys))
        custom = self._draw_custom(data, len(keys))
        present = set(self.values)
        last = {k: tuple(v) for k, v in zip(keys, vals)}  # the last occurrence wins
        self.table.insert_or_assign(
            self._keys(keys),
            self._values_tensor(vals),
            None if custom is None else torch.tensor(custom, dtype=torch.int64, device=self.device),
        )
        for key in present & set(keys):
            self.values[key] = last[key]
        dropped = self._apply_inserts(present & set(keys), {k: v for k, v in last.items() if k not in present})
        live = [i for i, k in enumerate(keys) if k not in dropped]
        self._touch([keys[i] for i in live], None if custom is None else [custom[i] for i in live])

    @rule(data=st.data())
    def accum(self, data):
        keys = data.draw(self.batch)
        old, new = self._draw_values(data, len(keys)), self._draw_values(data, len(keys))
        exists = [k in self.values if data.draw(st.integers(0, 3)) else k not in self.values for k in keys]
        present = set(self.values)
        self.table.accum(
            self._keys(keys),
            self._values_tensor(old),
            self._values_tensor(new),
            torch.tensor(exists, dtype=torch.bool, device=self.device),
        )
        # TFRA's truth table, one occurrence after the other: (read as existing, present) adds the delta; (read as
        # absent, absent) inserts new; the other two change nothing.
        firsts: dict[int, tuple] = {}
        deltas, touched = [], []
        for key, o, n, e in zip(keys, old, new, exists):
            if key in present or key in firsts:
                if e:
                    deltas.append((key, [b - a for a, b in zip(o, n)]))
                    touched.append(key)
            elif not e:
                firsts[key] = tuple(n)
                touched.append(key)
        dropped = self._apply_inserts(present & set(keys), firsts)
        for key, delta in deltas:
            if key not in dropped:
                self.values[key] = tuple(v + d for v, d in zip(self.values[key], delta))
        self._touch([k for k in touched if k not in dropped])

    @rule(data=st.data())
    def erase(self, data):
        keys = data.draw(self.batch)
        gone = set(keys) & set(self.values)
        assert self.table.erase(self._keys(keys)) == len(gone)
        assert not self.reported, "erase must not report evictions"
        self._forget(gone)
        self.removed += len(gone)

    @rule(data=st.data())
    def evict(self, data):
        n = data.draw(st.integers(0, len(self.values) + 2))
        self._check_evict(self.table.evict(n), min(n, len(self.values)))

    @rule(data=st.data())
    def restrict(self, data):
        size = len(self.values)
        num_reserved = data.draw(st.integers(0, size + 2))
        trigger = data.draw(st.one_of(st.none(), st.integers(num_reserved, num_reserved + 3)))
        limit = num_reserved if trigger is None else trigger
        result = self.table.restrict(num_reserved, trigger)
        self._check_evict(result, size - num_reserved if size > limit else 0)

    @rule(data=st.data())
    def clear(self, data):
        if data.draw(st.integers(0, 9)) != 0:  # rare: it wipes the state the other rules build up
            return
        self.table.clear()
        self.removed += len(self.values)
        self._forget(list(self.values))

    # ------------------------------------------------------------------ invariant
    @invariant()
    def table_matches_model(self):
        t = self.table
        assert not self.reported, "on_evict was called outside a checked call"
        assert t.size() == len(t) == len(self.values)
        assert (t.inserted, t.removed, t.evicted) == (self.inserted, self.removed, self.evicted)
        assert t.size() == t.inserted - t.removed - t.evicted
        if self.max_capacity is not None:
            assert t.size() <= self.max_capacity
        assert t.clock >= self.clock
        rows = t.export()
        keys = rows.keys.tolist()
        assert sorted(keys) == sorted(self.values)
        expected = torch.tensor([self.values[k] for k in keys], dtype=torch.float32).reshape(len(keys), self.dim)
        assert torch.equal(rows.values.cpu(), expected)
        assert rows.scores.tolist() == [self.scores[k] for k in keys]
        self._check_positions(rows.keys)

    def _check_positions(self, keys: torch.Tensor) -> None:
        """Exported rows are the live rows in row order."""
        assert torch.equal(self.table.find_rows(keys).cpu(), torch.arange(keys.numel()))


@pytest.fixture(scope="module")
def pools(colliding_keys):
    return {
        dtype: colliding_keys(dtype, "first", 12).tolist() + colliding_keys(dtype, "last", 12).tolist()
        for dtype in (torch.int32, torch.int64)
    }


@pytest.mark.slow
def test_table_matches_dict_model(key_dtype, device, pools, probe_paths):
    run_state_machine_as_test(
        lambda: TableModel(key_dtype, device, pools[key_dtype], probe_paths),
        settings=settings(
            max_examples=MAX_EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        ),
    )
