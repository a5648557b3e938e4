"""``GET /metrics``: the endpoint's operational signals in Prometheus' text format (``prometheus_client``).

=========================================  =========  ======================================================
metric                                     type       labels, meaning
=========================================  =========  ======================================================
``dynemb_requests_total``                  counter    model, route, protocol: requests answered
``dynemb_request_failures_total``          counter    model, route, protocol: answered with an error
``dynemb_request_duration_seconds``        histogram  model, route, protocol: time to answer
``dynemb_request_rows``                    histogram  model, protocol: rows of each infer request
``dynemb_forward_rows``                    histogram  model: rows of each forward pass (requests batched)
``dynemb_forward_duration_seconds``        histogram  model: time of each forward pass
``dynemb_rows_looked_up_total``            counter    model, table, tier: ids answered by each tier of the
                                                      parameter server (cache, volatile, persistent, default)
``dynemb_tier_hit_rate``                   gauge      model, tier: share of all looked-up ids answered there
``dynemb_model_ready``                     gauge      model: 1 while ready (a version served, its store tiers up)
``dynemb_tier_up``                         gauge      model, tier: 1 while the store tier answers (volatile,
                                                      persistent), 0 while it failed (down, or lost its rows)
``dynemb_tier_errors_total``               counter    model, tier: store errors of the tier
``dynemb_model_version``                   gauge      model: the version served
``dynemb_newest_version``                  gauge      model: the newest version in the export (``latest``)
``dynemb_newest_version_age_seconds``      gauge      model: seconds since the newest version appeared
=========================================  =========  ======================================================

Each app has its own registry, so two apps in one process (tests) count apart.
"""

from __future__ import annotations

import time

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"dynemb serve's /metrics needs prometheus_client: pip install 'dynemb[serving]' ({exc})") \
        from exc

__all__ = ["Metrics", "METRIC_NAMES"]

METRIC_NAMES = ("dynemb_requests_total", "dynemb_request_failures_total", "dynemb_request_duration_seconds",
                "dynemb_request_rows", "dynemb_forward_rows", "dynemb_forward_duration_seconds",
                "dynemb_rows_looked_up_total", "dynemb_tier_hit_rate", "dynemb_model_ready", "dynemb_tier_up",
                "dynemb_tier_errors_total", "dynemb_model_version",
                "dynemb_newest_version", "dynemb_newest_version_age_seconds")

# 0.5 ms .. 10 s: a request of one row to a cold Redis tier
_LATENCY = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_ROWS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 16384)
_TIERS = ("cache", "volatile", "persistent", "default")


class Metrics:
    """The metrics of one :class:`~dynemb.endpoint.service.InferenceService` (module docstring).

    Example:
        >>> from dynemb.endpoint.service import InferenceService
        >>> m = Metrics(InferenceService("ctr"))
        >>> m.request("infer", "http", True, 0.002, 256)
        >>> b"dynemb_requests_total" in m.render()
        True
    """

    def __init__(self, service) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model", "route", "protocol")
        self._requests = Counter("dynemb_requests", "Requests answered", labels, registry=self.registry)
        self._failures = Counter("dynemb_request_failures", "Requests answered with an error", labels,
                                 registry=self.registry)
        self._latency = Histogram("dynemb_request_duration_seconds", "Time to answer a request", labels,
                                  buckets=_LATENCY, registry=self.registry)
        self._rows = Histogram("dynemb_request_rows", "Rows of an infer request", ("model", "protocol"),
                               buckets=_ROWS, registry=self.registry)
        self._forward_rows = Histogram("dynemb_forward_rows", "Rows of a forward pass (requests batched)", ("model",),
                                       buckets=_ROWS, registry=self.registry)
        self._forward_time = Histogram("dynemb_forward_duration_seconds", "Time of a forward pass", ("model",),
                                       buckets=_LATENCY, registry=self.registry)
        self.registry.register(_ServedState(service))

    def request(self, route: str, protocol: str, ok: bool, seconds: float, rows: int) -> None:
        """Count one answered request of ``route`` (``infer``, ``metadata``, ...)."""
        labels = (self.service.name, route, protocol)
        self._requests.labels(*labels).inc()
        if not ok:
            self._failures.labels(*labels).inc()
        self._latency.labels(*labels).observe(seconds)
        if route == "infer" and ok:
            self._rows.labels(self.service.name, protocol).observe(rows)

    def forward(self, rows: int, seconds: float) -> None:
        """Count one forward pass of ``rows`` rows."""
        self._forward_rows.labels(self.service.name).observe(rows)
        self._forward_time.labels(self.service.name).observe(seconds)

    def render(self) -> bytes:
        """The text exposition format (version 0.0.4)."""
        return generate_latest(self.registry)


class _ServedState:
    """Read at each scrape: the parameter server's counts per tier, the versions served and published."""

    def __init__(self, service) -> None:
        self.service = service

    def describe(self):
        return []

    def collect(self):
        name, model = self.service.name, self.service.model
        ready = GaugeMetricFamily("dynemb_model_ready", "1 while a version is served and its store tiers are up",
                                  labels=["model"])
        ready.add_metric([name], 1 if self.service.ready else 0)
        yield ready
        if model is None:
            return
        version = GaugeMetricFamily("dynemb_model_version", "The version served", labels=["model"])
        version.add_metric([name], model.version)
        yield version
        newest = getattr(model, "newest_version", None)
        found = newest() if newest is not None else None
        if found is not None:
            number, since = found
            latest = GaugeMetricFamily("dynemb_newest_version", "The newest version in the export", labels=["model"])
            latest.add_metric([name], number)
            yield latest
            age = GaugeMetricFamily("dynemb_newest_version_age_seconds", "Seconds since the newest version appeared",
                                    labels=["model"])
            age.add_metric([name], max(0.0, time.time() - since))
            yield age
        stats = getattr(model, "table_stats", None)
        stats = stats() if stats is not None else {}
        tables = stats.get("tables", {})
        tiers = stats.get("tiers", {})
        if tiers:
            up = GaugeMetricFamily("dynemb_tier_up", "1 while the store tier answers, 0 while it failed",
                                   labels=["model", "tier"])
            errors = CounterMetricFamily("dynemb_tier_errors", "Store errors of the tier", labels=["model", "tier"])
            for tier, state in tiers.items():
                up.add_metric([name, tier], 1 if state["up"] else 0)
                errors.add_metric([name, tier], state["errors"])
            yield up
            yield errors
        looked = CounterMetricFamily("dynemb_rows_looked_up", "Ids answered by each parameter-server tier",
                                     labels=["model", "table", "tier"])
        totals = dict.fromkeys(_TIERS, 0)
        lookups = 0
        for table, counts in tables.items():
            lookups += counts["lookups"]
            for tier in _TIERS:
                looked.add_metric([name, table, tier], counts[tier])
                totals[tier] += counts[tier]
        yield looked
        rate = GaugeMetricFamily("dynemb_tier_hit_rate", "Share of looked-up ids answered by each tier",
                                 labels=["model", "tier"])
        for tier in _TIERS:
            rate.add_metric([name, tier], totals[tier] / lookups if lookups else 0.0)
        yield rate
