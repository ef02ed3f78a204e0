"""The series that grow with the table or the cluster as prometheus_client's registry writes
them: what the proxy rendered before it wrote them directly (`proxy.exposition`). The oracle
of tests/proxy/test_exposition.py and the "before" of benchmarks/metrics_render_bench.py."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.lag_metrics import GAUGES
from proxy.metrics import (
    CHOICES_HELP,
    MISDIRECTED_HELP,
    NODE_FAILURES_HELP,
    NODE_REQUESTS_HELP,
    ProxyMetrics,
)
from proxy.routing import RoutingSnapshot

LABELS = ["store", "partition", "node", "role"]


def gauges_by_prometheus_client(snapshot: RoutingSnapshot, now_ms: int) -> str:
    return _rendered(_LagReference(snapshot, now_ms))


def choices_by_prometheus_client(metrics: ProxyMetrics) -> str:
    return _rendered(_ChoicesReference(metrics))


def nodes_by_prometheus_client(metrics: ProxyMetrics) -> str:
    return _rendered(_NodesReference(metrics))


def _rendered(collector: Collector) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


class _LagReference(Collector):
    """The replicas' gauges, a GaugeMetricFamily each."""

    def __init__(self, snapshot: RoutingSnapshot, now_ms: int) -> None:
        self._snapshot, self._now_ms = snapshot, now_ms

    def collect(self) -> Iterator[Metric]:
        families = [GaugeMetricFamily(g.name, g.help, labels=LABELS) for g in GAUGES]
        for store, route in sorted(self._snapshot.stores.items()):
            for partition, replicas in enumerate(route.replicas):
                for replica in replicas:
                    labels = [store, str(partition), replica.node_id, replica.role]
                    for gauge, family in zip(GAUGES, families, strict=True):
                        family.add_metric(labels, gauge.value(replica, self._now_ms))
        yield from families


class _ChoicesReference(Collector):
    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("kroute_proxy_replica_choices", CHOICES_HELP, labels=LABELS)
        for (store, partition, node, role), tally in self._metrics.choices.items():
            family.add_metric([store, str(partition), node, role], tally.value)
        yield family


class _NodesReference(Collector):
    """The families with a series per node, as MetricsCollector wrote them on the loop."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        per_node = CounterMetricFamily(
            "kroute_proxy_node_requests", NODE_REQUESTS_HELP, labels=["node"]
        )
        for node, tally in sorted(m.node_requests.items()):
            per_node.add_metric([node], tally.value)
        yield per_node
        failures = CounterMetricFamily(
            "kroute_proxy_upstream_failures", NODE_FAILURES_HELP, labels=["node", "kind"]
        )
        for (node, kind), count in sorted(m.node_failures.items()):
            failures.add_metric([node, kind], count)
        yield failures
        misdirected = CounterMetricFamily(
            "kroute_proxy_misdirected", MISDIRECTED_HELP, labels=["node"]
        )
        for node, count in sorted(m.misdirected.items()):
            misdirected.add_metric([node], count)
        yield misdirected
