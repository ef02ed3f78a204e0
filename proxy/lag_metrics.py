"""Each replica's lag as Prometheus gauges, read from the routing table when /metrics is scraped.

Nothing is counted per request: the collector walks the snapshot the watcher last swapped in
(immutable), so the series are exactly the replicas in the table at that moment. A node that
leaves the assignment, or stops reporting that it serves a partition, is gone from the next
scrape; no series outlives its replica. Per store that is partitions times replicas per partition
(the active plus its standbys) series for each gauge, whatever the traffic or the keys.

A value that is not known (no report, or a report with no end offset or caught-up time) is
NaN, not a missing sample: Prometheus's instrumentation practice is to export the series one
knows exists, NaN where 0 would mislead. So a replica's series stays continuous while its lag
is unknown, `lag > N` is false for it, and `lag != lag` selects the unknown ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.choice import Replica
from proxy.routing import RoutingSnapshot

LABELS = ["store", "partition", "node", "role"]
NAN = math.nan


@dataclass(frozen=True)
class _Gauge:
    name: str
    help: str
    value: Callable[[Replica, int], float]  # (replica, now in ms) -> the sample


def _seconds(ms: int | None) -> float:
    return NAN if ms is None else ms / 1000


GAUGES = (
    _Gauge(
        "kroute_proxy_replica_lag_offsets",
        "Offsets the replica is behind its partition's end, as it last reported (NaN: unknown)",
        lambda r, _now: NAN if r.lag is None else float(r.lag),
    ),
    _Gauge(
        "kroute_proxy_replica_time_lag_seconds",
        "Time since the replica was last known caught up: an upper bound on the staleness of "
        "its answers (NaN: unknown, e.g. behind and never caught up since it started)",
        lambda r, now: _seconds(r.time_lag_ms(now)),
    ),
    _Gauge(
        # An age, not a timestamp: report times are Redis time, which the scraping server's
        # clock need not share; the age is computed here on the same clock as the reports.
        "kroute_proxy_replica_report_age_seconds",
        "Age of the replica's last lag report (NaN: none); past KROUTE_LAG_REPORT_STALE_MS "
        "its lag counts as unknown for replica choice",
        lambda r, now: NAN if r.reported_at_ms is None else max(now - r.reported_at_ms, 0) / 1000,
    ),
    _Gauge(
        "kroute_proxy_replica_alive",
        "1 while the replica's node heartbeat is alive, else 0",
        lambda r, _now: 1.0 if r.alive else 0.0,
    ),
)


class ReplicaLagCollector(Collector):
    """The gauges above for every replica in the current routing table."""

    def __init__(self, snapshot: Callable[[], RoutingSnapshot], now_ms: Callable[[], int]) -> None:
        self._snapshot = snapshot
        self._now_ms = now_ms

    def describe(self) -> Iterator[Metric]:
        # Names only, for the registry's duplicate check (without walking the table).
        for gauge in GAUGES:
            yield GaugeMetricFamily(gauge.name, gauge.help, labels=LABELS)

    def collect(self) -> Iterator[Metric]:
        snapshot, now = self._snapshot(), self._now_ms()
        families = [GaugeMetricFamily(g.name, g.help, labels=LABELS) for g in GAUGES]
        for store, route in sorted(snapshot.stores.items()):
            for partition, replicas in enumerate(route.replicas):
                for replica in replicas:
                    labels = [store, str(partition), replica.node_id, replica.role]
                    for gauge, family in zip(GAUGES, families, strict=True):
                        family.add_metric(labels, gauge.value(replica, now))
        yield from families
