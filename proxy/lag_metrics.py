"""Each replica's lag as Prometheus gauges, read from the routing table when /metrics is scraped.

Nothing is counted per request: the scrape walks the snapshot the watcher last swapped in
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
from collections.abc import Callable
from dataclasses import dataclass

from proxy.choice import Replica
from proxy.exposition import LabelValues, header, release, sample_value
from proxy.routing import RoutingSnapshot

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


def replica_gauge_lines(snapshot: RoutingSnapshot, now_ms: int) -> list[str]:
    """The gauges above for every replica in `snapshot`, in the text format, a line each (one
    family after the other, stores in name order, then partitions, then replicas as the table
    holds them). Written directly (`proxy.exposition`): 160,000 lines at 20,000 partitions."""
    escaped = LabelValues()
    labels: list[str] = []  # each replica's label set, shared by the four families
    replicas: list[Replica] = []
    for store, route in sorted(snapshot.stores.items()):
        store_label = escaped(store)
        for partition, row in enumerate(route.replicas):
            for replica in row:
                labels.append(
                    f'{{node="{escaped(replica.node_id)}",partition="{partition}",'
                    f'role="{escaped(replica.role)}",store="{store_label}"}} '
                )
                replicas.append(replica)
    lines: list[str] = []
    for gauge in GAUGES:
        name, value = gauge.name, gauge.value
        lines.append(header(name, gauge.help, "gauge"))
        lines.extend(
            f"{name}{label}{sample_value(value(replica, now_ms))}\n"
            for label, replica in zip(labels, replicas, strict=True)
        )
    release(labels)
    return lines
