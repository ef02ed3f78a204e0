"""A node's /metrics: in-process over a real store (stand-in pipeline state), then a real node
process against the real broker, whose lag gauges follow its pipeline as it falls behind and
catches up. Read with Prometheus's own parser and checked with its linter."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from common.clock import now_ms
from kroute.embedded import BrokerHandle, EmbeddedServices
from kroute.nodes import NodeHandle, start_node
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from materializer.lag import LagTracker
from materializer.pipeline import Stall
from materializer.server import NodeApp, NodeState
from materializer.sink import IngestStats
from materializer.store import Row, Store
from partitioner import KeyPartitioner
from tests.materializer.node_helpers import produce_customers
from tests.prometheus_checks import assert_follows_conventions, families, sample_values
from tests.served_nodes import StandInNode, hosting

LAG = "kroute_node_partition_lag_offsets"
TIME_LAG = "kroute_node_partition_time_lag_seconds"
STALLED = "kroute_node_partition_stalled"
OUTSIDE = "kroute_node_partition_outside_log"
SKIPPED = "kroute_node_skipped_records_total"
BATCHES = "kroute_node_batch_duration_seconds_count"
RECORDS = "kroute_node_records_read_total"


def series(partition: int, role: str = "active", **more: str) -> tuple:
    labels = {"store": "customers", "partition": str(partition), "role": role, **more}
    return tuple(sorted(labels.items()))


# -- in-process: the node's state as the collector reads it -------------------------------------


@pytest.fixture
def state(tmp_path: Path) -> Iterator[NodeState]:
    store = Store(tmp_path / "store")
    hosted = (0, 1, 2)
    for partition in hosted:
        store.add_partition(partition)
        store.apply(partition, [Row(b"k", b"{}", 7, 1_000)], 8, 1_000)
    node = NodeState(
        node_id="node-a",
        store_name="customers",
        topic="bookings",
        value_format="json",
        store=store,
        lag=LagTracker(store, "bookings", lambda: hosted),
        stats=IngestStats(),
        hosting=hosting(hosted, roles={1: "standby"}),
        node=StandInNode(
            KeyPartitioner("string", "murmur2", 6), status={"running": True, "restarts": 2}
        ),
    )
    yield node
    store.close()


def scrape(state: NodeState, app: NodeApp | None = None) -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=app or NodeApp(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            return await client.get("/metrics")

    return asyncio.run(call())


def test_metrics_say_each_partitions_lag_and_the_pipelines_counts(state: NodeState):
    at = now_ms()
    state.lag.apply_ends({0: 8, 1: 8, 2: 8}, at - 3_000)  # all caught up 3 s ago...
    state.lag.apply_ends({0: 8, 1: 50, 2: 8}, at)  # ...then 42 records arrived on partition 1
    with state.stats.lock:
        state.stats.records, state.stats.changes_written = 120, 100
        state.stats.problems_by_partition[1] = 4
        for seconds in (0.07, 0.3, 12.0):
            state.stats.observe_batch(seconds)
    response = scrape(state)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert sample_values(text, LAG) == {series(0): 0, series(1, "standby"): 42, series(2): 0}
    assert sample_values(text, TIME_LAG)[series(1, "standby")] >= 3.0
    assert sample_values(text, SKIPPED) == {
        (("partition", "0"),): 0,
        (("partition", "1"),): 4,
        (("partition", "2"),): 0,
    }
    assert sample_values(text, RECORDS) == {(): 120}
    assert sample_values(text, "kroute_node_changes_written_total") == {(): 100}
    assert sample_values(text, "kroute_node_pipeline_restarts_total") == {(): 2}
    assert sample_values(text, "kroute_node_pipeline_running") == {(): 1}
    assert sample_values(text, BATCHES) == {(): 3}
    buckets = sample_values(text, "kroute_node_batch_duration_seconds_bucket")
    assert buckets[(("le", "0.1"),)] == 1
    assert buckets[(("le", "0.5"),)] == 2
    assert buckets[(("le", "+Inf"),)] == 3
    info = sample_values(text, "kroute_node_info")
    assert info == {(("node", "node-a"), ("store", "customers"), ("topic", "bookings")): 1}
    assert_follows_conventions(text)


# Every family's Prometheus type: cumulative counts are counters (rate() and increase() work on
# them, and a restart's reset to 0 is understood), levels that go up and down are gauges. A new
# metric must be added here, so its type is a decision.
TYPES = {
    "kroute_node_info": "gauge",  # an info metric: a gauge of 1 in the text format
    "kroute_node_batch_duration_seconds": "histogram",
    "kroute_node_records_read": "counter",
    "kroute_node_changes_written": "counter",
    "kroute_node_skipped_records": "counter",
    "kroute_node_pipeline_restarts": "counter",
    "kroute_node_forwarded_lookups": "counter",
    "kroute_node_pipeline_running": "gauge",
    LAG: "gauge",
    TIME_LAG: "gauge",
    STALLED: "gauge",
    OUTSIDE: "gauge",
}


def test_cumulative_counts_are_counters_and_levels_gauges(state: NodeState):
    state.lag.apply_ends({0: 8, 1: 8, 2: 8}, now_ms())
    app = NodeApp(state)
    before = families(scrape(state, app).text)
    assert {name: family.type for name, family in before.items()} == TYPES
    with state.stats.lock:  # more of everything: every counter's samples grow, none falls
        state.stats.records, state.stats.changes_written = 50, 40
        state.stats.problems_by_partition[2] = 1
        state.stats.observe_batch(0.2)
    app.forwarded += 3
    state.node.status = {"running": False, "restarts": 3}
    after = families(scrape(state, app).text)
    for name, family in after.items():
        if family.type != "counter":
            continue
        old = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in before[name].samples}
        new = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
        assert all(new[k] >= old[k] for k in old), name
        assert any(new[k] > old[k] for k in old), f"{name} did not count what happened"


def test_unknown_lag_is_nan_and_stalled_and_outside_log_partitions_are_flagged(
    state: NodeState,
):
    state.lag.refresh_offsets_only()  # as at start: the broker not read yet
    text = scrape(state).text
    assert all(math.isnan(v) for v in sample_values(text, LAG).values())
    assert all(math.isnan(v) for v in sample_values(text, TIME_LAG).values())

    at = now_ms()
    state.lag.apply_ends({0: 8, 1: 8, 2: 8}, at)
    state.lag.apply_ends({0: 3, 1: 20, 2: 8}, at + 1)  # partition 0's log now ends before 8
    state.node.stalled = {1: Stall(1, 12, at - 60_000, "stuck")}
    text = scrape(state).text
    assert math.isnan(sample_values(text, LAG)[series(0)]), "past the end: unknown"
    assert sample_values(text, OUTSIDE)[series(0, where="past_end")] == 1
    assert sample_values(text, OUTSIDE)[series(0, where="below_start")] == 0
    assert sample_values(text, OUTSIDE)[series(2, where="past_end")] == 0
    assert sample_values(text, STALLED) == {series(0): 0, series(1, "standby"): 1, series(2): 0}
    assert_follows_conventions(text)


def test_an_end_offset_not_read_for_a_while_makes_lag_unknown(state: NodeState):
    # The broker unreachable: a frozen end must not read as lag 0 while the store falls behind.
    state.lag.apply_ends({0: 8, 1: 8, 2: 8}, now_ms() - 60_000)
    assert all(math.isnan(v) for v in sample_values(scrape(state).text, LAG).values())


def test_only_hosted_partitions_have_lag_series(state: NodeState):
    state.lag.apply_ends({0: 8, 1: 8, 2: 8}, now_ms())
    state.hosting.assign({0: "active", 2: "active"}, now_ms())  # partition 1 was moved away
    names = families(scrape(state).text)
    assert {dict(s.labels)["partition"] for s in names[LAG].samples} == {"0", "2"}


# -- a real node process, real Spark, the real broker --------------------------------------------

PARTITIONS = 2
PER_BATCH = 5  # records per partition per micro-batch: catching up takes many batches


def node_metrics(node: NodeHandle) -> str:
    response = node.get("/metrics")
    assert response.status_code == 200
    return response.text


def metrics_until(node: NodeHandle, done: Callable[[str], bool], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = node_metrics(node)
        if done(text):
            return text
        assert time.monotonic() < deadline, f"metrics never got there:\n{text}"
        assert node.process.is_running(), node.process.log_tail(40)
        time.sleep(0.05)


def lags(text: str) -> list[float]:
    return list(sample_values(text, LAG).values())


@pytest.mark.integration
def test_a_real_nodes_lag_gauges_follow_its_pipeline_behind_then_caught_up(
    embedded: EmbeddedServices, broker: BrokerHandle, tmp_path: Path
):
    bootstrap, topic = broker.bootstrap_servers, "node-metrics"
    create_topics(bootstrap, {topic: PARTITIONS})
    node = start_node(
        embedded,
        bootstrap,
        topic,
        tmp_path / "data",
        store="customers",
        spark_master="local[1]",
        max_records_per_partition=str(PER_BATCH),
    )
    try:
        text = node_metrics(node)
        assert lags(text) == [0.0] * PARTITIONS, "an empty topic: caught up"
        assert_follows_conventions(text)

        produce_customers(bootstrap, topic, 80, keys=40, seed=7, malformed=3)
        behind = metrics_until(node, lambda t: max(lags(t)) > 0, timeout_s=30)
        assert all(v >= 0 for v in lags(behind))

        ends = asyncio.run(end_offsets(bootstrap, topic, range(PARTITIONS)))
        caught_up = metrics_until(
            node,
            lambda t: (
                lags(t) == [0.0] * PARTITIONS
                and sample_values(t, RECORDS).get((), 0) >= sum(ends.values())
            ),
            timeout_s=120,
        )
        assert sum(sample_values(caught_up, SKIPPED).values()) == 3
        # 40 records a partition on average, 5 a batch: many batches, each timed.
        assert sample_values(caught_up, BATCHES)[()] >= 80 / (PER_BATCH * PARTITIONS)
        assert sample_values(caught_up, "kroute_node_batch_duration_seconds_sum")[()] > 0
        assert all(v < 60 for v in sample_values(caught_up, TIME_LAG).values())
        assert set(sample_values(caught_up, STALLED).values()) == {0.0}
        assert_follows_conventions(caught_up)
    finally:
        node.process.stop()
        node.close()
