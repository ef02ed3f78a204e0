"""A node whose pipeline freezes while everything else about it stays healthy: its process,
HTTP server, heartbeat and lag reports go on, its store stops moving.

The freeze is real and needs no hook in the product: SIGSTOP of the node's Spark Python
processes (the streaming-source runner that plans each micro-batch, and the workers that read
Kafka), as a wedged worker or a read stuck in a client library would. A writer keeps
producing; readers ask through a proxy, some under a time budget and some without.

The smallest honest cluster for the claim: redis-server, the embedded broker, two Spark nodes
(every partition has an active on one and a standby on the other), one proxy. With three nodes
(test_faults.py's cluster) the test would show the same thing in a minute more.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kroute.cluster_harness import spark_jvm_pid
from kroute.proxies import ProxyHandle
from partitioner import partition
from tests.cluster_helpers import PARTITIONS, Cluster, cluster_proxy, running_cluster
from tests.reliability.traffic import Outcome, Readers, Writer, failures

pytestmark = pytest.mark.integration

NODES = ("a", "b")
KEYS = [f"seed-{i}" for i in range(600)]
STALL_TIMEOUT_MS = 4000
BUDGET_MS = 2500
# A frozen node is stalled after the timeout; its next lag report (every 250 ms) says so, and
# the proxy's next refresh (events, or every 500 ms) routes by it.
ROUTED_AROUND_S = STALL_TIMEOUT_MS / 1000 + 2.0


@pytest.fixture(scope="module")
def cluster(embedded, broker, tmp_path_factory) -> Iterator[Cluster]:
    with running_cluster(
        embedded,
        broker,
        tmp_path_factory.mktemp("frozen"),
        300,  # nothing moves: the standby must take the reads as it is
        names=NODES,
        seed=len(KEYS),
        prefix="frozen",
        stall_timeout_ms=str(STALL_TIMEOUT_MS),
    ) as started:
        started.wait_settled(set(NODES))
        yield started


@pytest.fixture(scope="module")
def proxy(embedded, cluster) -> Iterator[ProxyHandle]:
    with cluster_proxy(
        embedded,
        cluster,
        name="proxy",
        refresh_interval_ms="500",
        eject_ms="500",
        probe_interval_ms="100",
        upstream_timeout_ms="1000",
    ) as handle:
        yield handle


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def spark_python_processes(cluster: Cluster, name: str) -> list[int]:
    """The node's Spark Python processes: children of its JVM (the node's own Python, which
    serves HTTP and reports lag, is the JVM's parent and is left alone)."""
    pids = []
    for pid in descendants(spark_jvm_pid(cluster.nodes[name])):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"python" in command:
            pids.append(pid)
    return pids


def send(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue  # gone already (Spark replaced a worker)


def active_partitions(cluster: Cluster, name: str) -> set[int]:
    placements = cluster.assignment().stores["customers"]
    return {p for p, placed in placements.items() if placed.active == name}


def beyond_the_budget(outcome: Outcome) -> bool:
    """An answer older than the budget allowed when the proxy chose (the data keeps ageing
    while the request travels), or of unknown age."""
    time_lag = outcome.answer.get("time_lag_ms")
    return time_lag is None or time_lag > BUDGET_MS + outcome.latency_s * 1000


def test_a_frozen_pipeline_serves_nothing_beyond_the_budget_and_loses_its_reads(cluster, proxy):
    frozen, standby = "a", "b"
    frozen_partitions = active_partitions(cluster, frozen)
    assert frozen_partitions, "the frozen node is active for some partitions"
    writer = Writer(cluster.bootstrap, cluster.topic, KEYS, rate=20)
    try:
        writer.resume()
        budgeted, unbudgeted, frozen_at, ready, pipeline = freeze_while_reading(
            cluster, proxy, frozen
        )

        # The node says it is not ready, and why.
        assert ready.status_code == 503, ready.text
        assert ready.json()["reason"].startswith("pipeline stalled"), ready.json()
        assert pipeline["stalled"] is True
        assert pipeline["stalled_since_ms"] is not None

        # Under a budget nothing older than the budget is served; what cannot be is refused.
        answered = [o for o in budgeted if o.status == 200]
        assert answered
        late = [o for o in answered if beyond_the_budget(o)]
        assert not late, late[:3]
        refused = [o for o in budgeted if o.status not in (200, 404)]
        assert all(o.status == 503 for o in refused), refused[:3]

        # Without a budget every read is answered, and once the stall is known the frozen
        # node's partitions are read from their caught-up standby, not from the frozen store.
        assert not failures(unbudgeted), failures(unbudgeted)[:3]
        settled = [
            o
            for o in unbudgeted
            if o.at > frozen_at + ROUTED_AROUND_S
            and o.status == 200
            and partition(o.key.encode(), PARTITIONS) in frozen_partitions
        ]
        assert settled, "reads of the frozen node's partitions after the stall was known"
        from_frozen = [o for o in settled if o.answer["node"] == frozen]
        assert not from_frozen, (len(from_frozen), len(settled), from_frozen[:2])
        assert {o.answer["node"] for o in settled} == {standby}

        # Thawed, it catches up and is ready again.
        writer.pause()
        deadline = time.monotonic() + 90
        while not cluster.nodes[frozen].is_ready():
            assert time.monotonic() < deadline, cluster.nodes[frozen].get("/health/ready").text
            time.sleep(0.5)
        assert cluster.nodes[frozen].metadata()["pipeline"]["stalled"] is False
    finally:
        writer.close()


def freeze_while_reading(
    cluster: Cluster, proxy: ProxyHandle, name: str
) -> tuple[list[Outcome], list[Outcome], float, httpx.Response, dict[str, Any]]:
    """Freeze a node's pipeline while readers ask, with a budget and without; thaw it.
    (budgeted outcomes, unbudgeted outcomes, when it froze, its readiness and pipeline
    state while frozen)."""
    pids = spark_python_processes(cluster, name)
    assert pids, "the node's Spark Python processes"
    node = cluster.nodes[name]
    budgeted = Readers(proxy.url, KEYS, headers={"x-kroute-max-lag-ms": str(BUDGET_MS)})
    unbudgeted = Readers(proxy.url, KEYS)
    try:
        time.sleep(2)
        frozen_at = time.monotonic()
        send(pids, signal.SIGSTOP)
        time.sleep(ROUTED_AROUND_S + 6)
        assert node.get("/health/live").status_code == 200, "alive: only its pipeline froze"
        ready, pipeline = node.get("/health/ready"), node.metadata()["pipeline"]
    finally:
        try:
            outcomes = budgeted.stop(), unbudgeted.stop()  # all of them asked while frozen
        finally:
            send(pids, signal.SIGCONT)
    return outcomes[0], outcomes[1], frozen_at, ready, pipeline
