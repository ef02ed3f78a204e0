"""The node's /metrics (Prometheus text exposition), collected when scraped.

Lookups count nothing: every value here is kept anyway, by the sink once per micro-batch
(IngestStats) or for /metadata (the lag snapshot, the pipeline's state, the stall check), and
is read only when /metrics is asked. Labels are bounded: the store and role are one of a few,
a partition one of the topic's; no key, offset or error text is ever a label.

Micro-batch times are a histogram, not a summary of the last batches: buckets add up across
nodes and give quantiles over whatever window a query asks (histogram_quantile over rate()),
while a summary's quantiles are fixed in the process and cannot be aggregated.

Unknown lag (the broker not read for a while, a store outside its partition's log; for time
lag also a partition behind and never caught up since the node started) is NaN rather than a
missing sample, as Prometheus's
instrumentation practice asks for series known to exist: `lag > N` stays false for it and
`lag != lag` finds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, get_args

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from common.clock import now_ms
from materializer.lag import OutsideLog, PartitionLag
from materializer.sink import BATCH_BUCKETS_S, IngestStats

if TYPE_CHECKING:  # server.py imports this module; the state is only read here
    from materializer.server import NodeState, Send

PARTITION_LABELS = ["store", "partition", "role"]
OUTSIDE_LOG_REASONS: tuple[OutsideLog, ...] = get_args(OutsideLog)
NAN = math.nan


class NodeCollector(Collector):
    """Everything the node exposes, read from its state at scrape time."""

    def __init__(self, state: NodeState, forwarded: Callable[[], int]) -> None:
        self._state = state
        self._forwarded = forwarded  # the app's count of lookups passed on to their owner

    def collect(self) -> Iterator[Metric]:
        state = self._state
        info = InfoMetricFamily("kroute_node", "The node, its store and its topic")
        info.add_metric(
            [], {"node": state.node_id, "store": state.store_name, "topic": state.topic}
        )
        yield info
        yield from _ingest(state.stats, state.hosted)
        yield from _pipeline(state, self._forwarded())
        yield from _partitions(state)


def _ingest(stats: IngestStats, hosted: tuple[int, ...]) -> Iterator[Metric]:
    with stats.lock:  # the sink thread updates them together, under this lock
        records, changes = stats.records, stats.changes_written
        skipped = dict(stats.problems_by_partition)
        counts, total_s = list(stats.batch_duration_counts), stats.batch_duration_sum_s
    cumulative, buckets = 0, []
    for bound, count in zip(BATCH_BUCKETS_S, counts, strict=False):
        cumulative += count
        buckets.append((repr(bound), float(cumulative)))
    buckets.append(("+Inf", float(cumulative + counts[-1])))
    yield HistogramMetricFamily(
        "kroute_node_batch_duration_seconds",
        "Time to apply a micro-batch: read its range, check and transform it, write the store "
        "(_count: micro-batches applied)",
        buckets=buckets,
        sum_value=total_s,
    )
    yield CounterMetricFamily(
        "kroute_node_records_read",
        "Records read by applied micro-batches, skipped ones included",
        value=records,
    )
    yield CounterMetricFamily(
        "kroute_node_changes_written",
        "Changes (puts and deletes) written to the store",
        value=changes,
    )
    family = CounterMetricFamily(
        "kroute_node_skipped_records",
        "Records that could not be materialized (malformed, refused by the transform or the "
        "merge), by partition",
        labels=["partition"],
    )
    for partition in sorted(set(skipped) | set(hosted)):  # 0 for hosted ones: no gaps
        family.add_metric([str(partition)], skipped.get(partition, 0))
    yield family


def _pipeline(state: NodeState, forwarded: int) -> Iterator[Metric]:
    status = state.pipeline_status()
    yield CounterMetricFamily(
        "kroute_node_pipeline_restarts",
        "Restarts of the streaming query after a failure",
        value=int(status.get("restarts") or 0),
    )
    yield GaugeMetricFamily(
        "kroute_node_pipeline_running",
        "1 while the streaming query runs, else 0 (starting, or restarting after a failure)",
        value=1.0 if status.get("running") else 0.0,
    )
    yield CounterMetricFamily(
        "kroute_node_forwarded_lookups",
        "Lookups passed on to the partition's owner (an extra hop)",
        value=forwarded,
    )


def _partitions(state: NodeState) -> Iterator[Metric]:
    at = now_ms()
    snapshot, stalls = state.lag.snapshot, state.stalls()
    lag = GaugeMetricFamily(
        "kroute_node_partition_lag_offsets",
        "Offsets the store is behind the partition's end (NaN: unknown: end offset not read "
        "recently, or the store outside the log)",
        labels=PARTITION_LABELS,
    )
    time_lag = GaugeMetricFamily(
        "kroute_node_partition_time_lag_seconds",
        "Time since the partition was last known caught up: an upper bound on the staleness "
        "of its answers (NaN: not caught up since the node started)",
        labels=PARTITION_LABELS,
    )
    stalled = GaugeMetricFamily(
        "kroute_node_partition_stalled",
        "1 while the partition has unread records and its store has not moved for "
        "KROUTE_STALL_TIMEOUT_MS, else 0",
        labels=PARTITION_LABELS,
    )
    outside = GaugeMetricFamily(
        "kroute_node_partition_outside_log",
        "1 while the store's position is outside the partition's log, by where (past_end: "
        "topic recreated or truncated; below_start: records deleted unread), else 0",
        labels=[*PARTITION_LABELS, "where"],
    )
    for partition in state.hosted:
        labels = [state.store_name, str(partition), state.role_of(partition)]
        known = snapshot.get(partition)
        lag.add_metric(labels, _lag(known, at))
        time_lag.add_metric(labels, _time_lag_s(known, at))
        stalled.add_metric(labels, 1.0 if partition in stalls else 0.0)
        for where in OUTSIDE_LOG_REASONS:
            value = 1.0 if known is not None and known.outside_log == where else 0.0
            outside.add_metric([*labels, where], value)
    yield from (lag, time_lag, stalled, outside)


def _lag(known: PartitionLag | None, at_ms: int) -> float:
    """As the node reports it to proxies: unknown once the end offset is old (the broker is
    not being read), so a frozen end never shows 0 while the store falls behind."""
    end = known.known_end(at_ms) if known is not None else None
    if known is None or end is None:
        return NAN
    return float(max(end - known.current_offset, 0))


def _time_lag_s(known: PartitionLag | None, at_ms: int) -> float:
    ms = known.time_lag_ms(at_ms) if known is not None else None
    return NAN if ms is None else ms / 1000


class NodeMetrics:
    """The registry behind GET /metrics and the answer to it."""

    def __init__(self, state: NodeState, forwarded: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()  # no describe: nothing is read until scraped
        self.registry.register(NodeCollector(state, forwarded))

    async def respond(self, send: Send) -> None:
        body = generate_latest(self.registry)
        headers = [
            (b"content-type", CONTENT_TYPE_LATEST.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"cache-control", b"no-store"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
