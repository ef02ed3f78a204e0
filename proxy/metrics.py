"""What the proxy counts, kept as plain integers on the hot path and turned into Prometheus
families only when /metrics is scraped (a prometheus_client Counter takes a lock per `inc`).

The C path (`proxy._hotpath`) counts its own responses and latencies in the Hub, and bumps
the same per-choice and per-node Tally objects the Python path uses; the collector adds the
two up at scrape time.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from proxy._hotpath import Tally
from proxy.exposition import LabelValues, counter_lines, header, sample_value

LATENCY_BUCKETS_S = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass
class ProxyMetrics:
    responses: dict[tuple[str, int], int] = field(default_factory=dict)  # (kind, status)
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    latency_sum_s: float = 0.0
    # Filled by `choice_tally` only (not given at construction): the two stay in step.
    choices: dict[tuple[str, int, str, str], Tally] = field(default_factory=dict, init=False)
    # The keys of `choices` by node: forgetting a node drops its own, not a pass over all.
    choice_keys: dict[str, list[tuple[str, int, str, str]]] = field(
        default_factory=dict, init=False
    )
    node_requests: dict[str, Tally] = field(default_factory=dict)
    node_failures: dict[tuple[str, str], int] = field(default_factory=dict)  # (node, kind)
    failovers: int = 0
    resent_after_kept_close: int = 0
    streamed: int = 0  # answers longer than the buffer, passed on as they arrived
    cut_short: int = 0  # streamed answers whose node failed midway (client connection reset)
    retry_budget_exhausted: int = 0
    hedges_sent: int = 0
    hedges_won: int = 0  # the hedge's answer went to the client (the first try was closed)
    hedges_cancelled: int = 0  # the first try answered first (the hedge was closed)
    outlier_ejections: int = 0  # nodes ejected for consecutive 5xx
    outlier_ejections_capped: int = 0  # such ejections refused by KROUTE_MAX_EJECTION_PERCENT
    no_replica: dict[str, int] = field(default_factory=dict)  # store
    misdirected: dict[str, int] = field(default_factory=dict)  # node
    rejected: dict[str, int] = field(default_factory=dict)  # error code

    def observe(self, kind: str, status: int, seconds: float) -> None:
        key = (kind, status)
        self.responses[key] = self.responses.get(key, 0) + 1
        self.latency_counts[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.latency_sum_s += seconds

    def choice_tally(self, store: str, partition: int, node: str, role: str) -> Tally:
        """The counter of keyed requests sent to this replica (kept across table changes)."""
        key = (store, partition, node, role)
        tally = self.choices.get(key)
        if tally is None:
            tally = self.choices[key] = Tally()
            self.choice_keys.setdefault(node, []).append(key)
        return tally

    def forget_nodes(self, registered: Collection[str]) -> None:
        """Drop the per-replica and per-node series of nodes no longer registered (the
        cluster forgets a departed node after its grace period): with node ids that change
        (pods), they would otherwise grow for as long as the proxy runs. A table change that
        changes the nodes' URLs calls this; a node that comes back counts from 0 again."""
        counted = {*self.choice_keys, *self.node_requests, *self.misdirected}
        counted.update(node for node, _ in self.node_failures)
        gone = counted.difference(registered)
        if not gone:
            return  # a node joined or moved: nothing to drop (at 1,000 nodes, a pass over
            # every per-replica series took 5 ms of the loop)
        for node in gone:
            for key in self.choice_keys.pop(node, ()):
                del self.choices[key]
            self.node_requests.pop(node, None)
            self.misdirected.pop(node, None)
        self.node_failures = {k: n for k, n in self.node_failures.items() if k[0] not in gone}

    def node_tally(self, node: str) -> Tally:
        tally = self.node_requests.get(node)
        if tally is None:
            tally = self.node_requests[node] = Tally()
        return tally

    def requests_to(self, node: str) -> int:
        tally = self.node_requests.get(node)
        return 0 if tally is None else tally.value

    def failed(self, node: str, kind: str) -> None:
        key = (node, kind)
        self.node_failures[key] = self.node_failures.get(key, 0) + 1

    @staticmethod
    def bump(counts: dict[str, int], key: str) -> None:
        counts[key] = counts.get(key, 0) + 1


class MetricsCollector(Collector):
    """The families that do not grow with the table or the cluster (those with a series per
    node do, and are written in a thread: `node_lines`). `gauges` are values that go up and
    down (connections now); `counts` are cumulative counts kept outside ProxyMetrics (refresh
    failures, connections opened): counters, with `_total` added to their names, never gauges
    (rate() needs to see their resets)."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        gauges: Callable[[], dict[str, float]],
        hot_path_stats: Callable[[], dict[str, Any]],
        counts: Callable[[], dict[str, tuple[str, float]]] = dict,
    ) -> None:
        self._metrics = metrics
        self._gauges = gauges
        self._hot_path_stats = hot_path_stats
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        hot = self._hot_path_stats()
        by_kind_status = dict(m.responses)
        for status, count in hot["responses"].items():
            by_kind_status[("keyed", status)] = by_kind_status.get(("keyed", status), 0) + count
        responses = CounterMetricFamily(
            "kroute_proxy_responses",
            "Responses sent, by request kind and status",
            labels=["kind", "status"],
        )
        for (kind, status), count in sorted(by_kind_status.items()):
            responses.add_metric([kind, str(status)], count)
        yield responses

        hot_counts = hot["latency_counts"]
        latency_counts = [a + b for a, b in zip(m.latency_counts, hot_counts, strict=True)]
        cumulative, buckets = 0, []
        for bound, count in zip(LATENCY_BUCKETS_S, latency_counts, strict=False):
            cumulative += count
            buckets.append((repr(bound), cumulative))
        cumulative += latency_counts[-1]
        buckets.append(("+Inf", cumulative))
        yield HistogramMetricFamily(
            "kroute_proxy_request_duration_seconds",
            "From a whole request received to its response written",
            buckets=buckets,
            sum_value=m.latency_sum_s + hot["latency_sum_s"],
        )

        yield CounterMetricFamily(
            "kroute_proxy_hot_path_requests",
            "Keyed requests forwarded by the C path (the rest took the Python path)",
            value=hot["forwarded"],
        )
        yield CounterMetricFamily(
            "kroute_proxy_failovers", "Attempts retried on the next candidate", value=m.failovers
        )
        yield CounterMetricFamily(
            "kroute_proxy_resent_after_kept_close",
            "Requests resent on a new connection to the same node after it closed a kept-alive "
            "connection before answering (keep-alive timeout race; the node was not ejected)",
            value=m.resent_after_kept_close,
        )
        yield CounterMetricFamily(
            "kroute_proxy_streamed_answers",
            "Answers longer than the proxy's buffer, streamed to the client as they arrived",
            value=m.streamed,
        )
        yield CounterMetricFamily(
            "kroute_proxy_answers_cut_short",
            "Streamed answers whose node failed midway: the client's connection was reset",
            value=m.cut_short,
        )
        yield CounterMetricFamily(
            "kroute_proxy_retry_budget_exhausted",
            "Failovers refused because the retry budget was spent",
            value=m.retry_budget_exhausted,
        )
        for name, help_text, total in (
            ("kroute_proxy_hedges_sent", "Keyed reads sent to the next replica too", m.hedges_sent),
            (
                "kroute_proxy_hedges_won",
                "Hedges whose answer went to the client (the first try was closed)",
                m.hedges_won,
            ),
            (
                "kroute_proxy_hedges_cancelled",
                "Hedges closed because the first try answered first",
                m.hedges_cancelled,
            ),
            (
                "kroute_proxy_outlier_ejections",
                "Nodes ejected after KROUTE_EJECT_CONSECUTIVE_5XX 5xx answers in a row",
                m.outlier_ejections,
            ),
            (
                "kroute_proxy_outlier_ejections_capped",
                "Consecutive-5xx ejections refused by KROUTE_MAX_EJECTION_PERCENT",
                m.outlier_ejections_capped,
            ),
        ):
            yield CounterMetricFamily(name, help_text, value=total)
        for name, help_text, label, counts in (
            ("kroute_proxy_no_replica", "503s: no replica qualified", "store", m.no_replica),
            ("kroute_proxy_rejected", "Requests refused before forwarding", "error", m.rejected),
        ):
            family = CounterMetricFamily(name, help_text, labels=[label])
            for key, count in sorted(counts.items()):
                family.add_metric([key], count)
            yield family

        for suffix, (text, amount) in sorted(self._counts().items()):
            yield CounterMetricFamily(f"kroute_proxy_{suffix}", text, value=amount)
        for name, value in sorted(self._gauges().items()):
            yield GaugeMetricFamily(f"kroute_proxy_{name}", name.replace("_", " "), value=value)


# Families whose samples are added up across worker processes: every sample of a counter or a
# histogram (buckets, _count and _sum) is a count or a sum of observations.
SUMMED_TYPES = frozenset({"counter", "histogram"})
WORKER_LABEL = "worker"
_SampleKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


CHOICES = "kroute_proxy_replica_choices_total"
CHOICES_HELP = "Keyed requests sent, by store, partition, node and role"
NODE_REQUESTS_HELP = "Attempts sent to each node"
NODE_FAILURES_HELP = "Failed attempts, by node and kind"
MISDIRECTED_HELP = (
    "Answers with a retry status (KROUTE_RETRY_STATUSES, e.g. 421) from nodes to keyed "
    "requests (table refreshed; the next replica, if any, is asked)"
)


def replica_choice_lines(metrics: ProxyMetrics) -> list[str]:
    """Keyed requests sent to each replica, in the text format, a line each: a series per (store,
    partition, node, role) the proxy ever sent to, so it grows with the table (40,000 series
    at 20,000 partitions with a standby each). Written directly (`proxy.exposition`) and made
    to be rendered in a thread: it copies the counters' dict with `dict.copy` (its table cloned
    in one C call that allocates no collectable object, so no garbage collection, and no
    finalizer that could hand the GIL to the loop, runs in the middle of it, while the loop may
    add a key), and a counter's value is one integer the C path increments under the GIL."""
    # Not list(choices.items()): that allocates a tuple per series, and on 3.11 a garbage
    # collection can run inside it, with finalizers (Python code) that let the loop add a
    # series mid-copy ("dictionary changed size during iteration"). Unsorted: a C sort of
    # 40,000 keys would hold the GIL (the loop) for milliseconds.
    counters = metrics.choices.copy()
    escaped = LabelValues()
    lines = [header(CHOICES, CHOICES_HELP, "counter")]
    lines.extend(
        f'{CHOICES}{{node="{escaped(node)}",partition="{partition}",role="{escaped(role)}",'
        f'store="{escaped(store)}"}} {sample_value(tally.value)}\n'
        for (store, partition, node, role), tally in counters.items()
    )
    return lines


def node_lines(metrics: ProxyMetrics) -> list[str]:
    """The families with a series per node, in the text format: attempts sent to each node,
    failed attempts by node and kind, answers with a retry status by node (1,000 lines and
    more at 1,000 nodes: 11-17 ms through prometheus_client on the event loop for the attempts
    alone). Copied as `replica_choice_lines` copies its counters, to be rendered in a thread."""
    requests = metrics.node_requests.copy()
    failures = metrics.node_failures.copy()
    misdirected = metrics.misdirected.copy()
    return [
        *counter_lines(
            "kroute_proxy_node_requests",
            NODE_REQUESTS_HELP,
            ("node",),
            {(node,): tally.value for node, tally in requests.items()},
        ),
        *counter_lines(
            "kroute_proxy_upstream_failures", NODE_FAILURES_HELP, ("node", "kind"), failures
        ),
        *counter_lines(
            "kroute_proxy_misdirected",
            MISDIRECTED_HELP,
            ("node",),
            {(node,): count for node, count in misdirected.items()},
        ),
    ]


@dataclass(frozen=True)
class _Family:
    name: str
    documentation: str
    type: str


class WorkerMetrics:
    """The proxy's metrics when KROUTE_WORKERS processes serve it: one exposition made, at
    scrape time, from every worker's own /metrics.

    Counters and histograms are summed per series, so a dashboard sees the same names and
    labels as with one process. Gauges describe one process each (its connections, its table,
    its ejections) and get a `worker` label, except `shared_gauges`, which describe the cluster
    as every worker reads it from Redis (the replicas' lag): those come once, from the worker
    with the freshest table. The sums never go down while the proxy runs: a worker that does
    not answer a scrape counts with its last scraped values, and a worker that exits leaves
    its last scraped values behind (its replacement counts from zero on top of them); only what
    a dead worker counted after its last scrape is lost.
    """

    def __init__(self, shared_gauges: Iterable[str]) -> None:
        self._shared = frozenset(shared_gauges)
        self._families: dict[str, _Family] = {}  # every family seen, in first-seen order
        self._last: dict[int, tuple[int, list[Metric]]] = {}  # pid -> (worker, families)
        self._retired: dict[str, dict[_SampleKey, float]] = {}  # family -> sample -> total

    # `scraped` and `exited` run on the event loop while `merged` may run in a thread: they
    # replace the dicts `merged` reads (never change one in place), so it reads them whole.

    def scraped(self, pid: int, worker: int, families: list[Metric]) -> None:
        """A worker's /metrics answer, parsed (`parsed_exposition`)."""
        known = dict(self._families)
        for family in families:
            known.setdefault(family.name, _Family(family.name, family.documentation, family.type))
        self._families = known
        self._last = {**self._last, pid: (worker, families)}

    def exited(self, pid: int) -> None:
        """The worker with this pid is gone: keep its counts in the sums."""
        last = dict(self._last)
        _, families = last.pop(pid, (0, []))
        retired = dict(self._retired)
        for family in families:
            if family.type in SUMMED_TYPES:
                totals = retired[family.name] = dict(retired.get(family.name, {}))
                _add_samples(totals, family.samples)
        self._last, self._retired = last, retired

    def merged(self, live_pids: Iterable[int]) -> list[Metric]:
        last, retired, known = self._last, self._retired, self._families
        live = [last[pid] for pid in live_pids if pid in last]
        summed = {name: dict(samples) for name, samples in retired.items()}
        gauges: dict[str, list[Sample]] = {}
        freshest = _freshest(live)
        for worker, families in live:
            for family in families:
                if family.type in SUMMED_TYPES:
                    _add_samples(summed.setdefault(family.name, {}), family.samples)
                elif family.name in self._shared:
                    if worker == freshest:
                        gauges.setdefault(family.name, []).extend(family.samples)
                else:
                    gauges.setdefault(family.name, []).extend(
                        s._replace(labels={**s.labels, WORKER_LABEL: str(worker)})
                        for s in family.samples
                    )
        merged = []
        for name, meta in known.items():
            metric = Metric(name, meta.documentation, meta.type)
            if meta.type in SUMMED_TYPES:
                metric.samples = [
                    Sample(sample, dict(labels), value)
                    for (sample, labels), value in summed.get(name, {}).items()
                ]
            else:
                metric.samples = gauges.get(name, [])
            merged.append(metric)
        return merged


def parsed_exposition(text: str) -> list[Metric] | None:
    """A worker's /metrics answer as families (None: not a valid exposition). Megabytes at
    thousands of partitions, seconds to parse: run in a thread."""
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:
        return None


def _add_samples(totals: dict[_SampleKey, float], samples: Iterable[Sample]) -> None:
    for sample in samples:
        key = (sample.name, tuple(sorted(sample.labels.items())))
        totals[key] = totals.get(key, 0.0) + sample.value


def _freshest(live: list[tuple[int, list[Metric]]]) -> int | None:
    """The worker whose routing table was built last (smallest known table age)."""
    ages: Mapping[int, float] = {
        worker: sample.value
        for worker, families in live
        for family in families
        if family.name == "kroute_proxy_table_age_seconds"
        for sample in family.samples
        if sample.value >= 0
    }
    if ages:
        return min(ages, key=lambda worker: (ages[worker], worker))
    return min((worker for worker, _ in live), default=None)
