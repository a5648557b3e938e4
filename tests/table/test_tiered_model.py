"""Model-based property test of TieredTable: the dict model of ``test_model_based`` drives a tiered table whose
fast tier holds 1..6 rows, so nearly every call moves rows between the tiers.

Tiering must be invisible: every result, counter, score and exported row equals what the model (the documented
semantics of one untiered table) predicts. Runs with the slow tier in host memory and in row files on disk, and with
three levels: a fast tier of 1..6 rows (moving rows through the device link's CPU stand-in) over host memory of
1..6 rows over row files.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, run_state_machine_as_test

from dynemb.table import TieredTable, Tiers
from dynemb.table.tier_moves import StagedLink

from test_model_based import KeyInit, TableModel, pools  # noqa: F401 (pools is a fixture)


class TieredModel(TableModel):
    slow = "host"
    three = False  # a host level between the fast tier and the row files under ``slow``

    @initialize(
        policy=st.sampled_from(["lru", "lfu", "custom"]),
        dim=st.integers(1, 3),
        fast_capacity=st.integers(1, 6),
        seed=st.integers(0, 1000),
        data=st.data(),
    )
    def build(self, policy, dim, fast_capacity, seed, data):
        path = data.draw(st.sampled_from(self.paths), label="probe path")
        self.policy, self.dim, self.max_capacity, self.seed = policy, dim, None, seed
        self.fast_capacity = fast_capacity
        self.reported = []
        host = {"host_capacity": data.draw(st.integers(1, 6), label="host_capacity")} if self.three else {}
        self.table = TieredTable(
            dim,
            tiers=Tiers(fast_capacity=fast_capacity, slow=self.slow, **host),
            key_dtype=self.key_dtype,
            device=self.device,
            eviction=policy,
            initializer=KeyInit(),
            seed=seed,
            on_evict=self._on_evict,
            backend=path if self.device.type == "cpu" else "torch",
        )
        if self.three:
            self.table.link = StagedLink(torch.device("cpu"), stand_in=True)
        self.values, self.scores = {}, {}
        self.inserted = self.removed = self.evicted = 0
        self.clock = self.table.clock

    reached_disk = 0  # examples whose calls found keys in the row files (three levels)

    def teardown(self):
        if self.table.disk is not None and self.table.hits["disk"]:
            type(self).reached_disk += 1
        for level in self.table.levels:
            level.close()

    def _check_positions(self, keys: torch.Tensor) -> None:
        """Both tiers together hold every row, and every key is reachable: ``find_rows`` brings it into the fast
        tier, at a row holding that key."""
        tiers = self.table.stats()["tiers"]
        assert tiers["fast"]["rows"] + tiers["slow"]["rows"] + tiers.get("disk", {"rows": 0})["rows"] == keys.numel()
        if self.three:
            assert tiers["slow"]["rows"] <= self.table.host_capacity
        found = self.table.find_rows(keys)
        assert bool((found >= 0).all()) and torch.equal(self.table.row_keys[found], keys)


@pytest.mark.parametrize("slow", ["host", "disk", "three"])
@pytest.mark.slow
def test_tiered_table_matches_dict_model(slow, key_dtype, device, pools, probe_paths, tmp_path):  # noqa: F811
    where = "host" if slow == "host" else str(tmp_path)
    model = type("Model", (TieredModel,), {"slow": where, "three": slow == "three"})
    run_state_machine_as_test(
        lambda: model(key_dtype, device, pools[key_dtype], probe_paths),
        settings=settings(max_examples=60 if slow == "host" else 25, stateful_step_count=20, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much]),
    )
    if slow == "three":
        assert model.reached_disk > 0, "the test must bring rows up from the row files"
