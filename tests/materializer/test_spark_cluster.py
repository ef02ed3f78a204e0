"""Materializer nodes on a real Spark standalone cluster (master + worker from the pyspark
package, kroute.spark_cluster), with a real Tansu broker and a real redis-server.

Two nodes share one worker, each application held to one core (spark.cores.max) so neither
starves the other. Checked: the Kafka reads run as tasks on executors (the driver's REST API
counts them per executor), the store stays with the driver (lookups answer while no executor
exists), lookups and Redis lag reports are what local mode gives, and a worker killed with
SIGKILL under writes is noticed, reported, and recovered from when a worker comes back.

Lean on purpose (the machine has 2 shared cores): one cluster and one pair of nodes for the
module, small executors, one core per application. Select with `-k spark_cluster`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from common.contract import Keys, decode_assignment, decode_report
from kroute.cluster_harness import keyed_producer
from kroute.embedded import BrokerHandle, EmbeddedServices, RedisHandle, free_port
from kroute.nodes import NodeHandle, start_node
from kroute.spark_cluster import SparkStandaloneCluster, spark_standalone_cluster
from kroute.topics import create_topics
from materializer.kafka_offsets import end_offsets
from materializer.pipeline import ExecutorWatch, on_this_machine_only
from tests.materializer.node_helpers import assert_serves_truth, ground_truth, produce_customers

pytestmark = [pytest.mark.integration, pytest.mark.spark_cluster, pytest.mark.timeout(900)]

PARTITIONS = 6
NODE_NAMES = ("a", "b")
STORE = "customers"
STALL_TIMEOUT_MS = 8_000


@dataclass
class SharedCluster:
    spark: SparkStandaloneCluster
    bootstrap: str
    topic: str
    redis: redis.Redis
    keys: Keys
    nodes: dict[str, NodeHandle]
    ui_ports: dict[str, int]  # node -> its Spark driver's UI (the REST API)
    run_id: str

    def ends(self) -> dict[int, int]:
        return asyncio.run(end_offsets(self.bootstrap, self.topic, range(PARTITIONS)))

    def hosted(self, name: str) -> list[int]:
        raw = self.redis.get(self.keys.assignment)
        assert raw is not None, "no assignment yet"
        mine = decode_assignment(raw).for_node(name).get(STORE, {})
        return sorted(mine.get("active", []) + mine.get("standby", []))

    def reports(self, name: str) -> dict[int, Any]:
        raw = self.redis.hgetall(self.keys.lag(name))
        return {int(f.decode().split("/")[1]): decode_report(v) for f, v in raw.items()}

    def behind(self) -> str | None:
        """What keeps the nodes' Redis reports from showing every partition at its end."""
        ends = self.ends()
        covered: set[int] = set()
        for name in NODE_NAMES:
            try:
                hosted = self.hosted(name)
            except AssertionError as exc:
                return str(exc)
            if not hosted:
                return f"{name} hosts nothing yet"
            covered.update(hosted)
            reports = self.reports(name)
            for p in hosted:
                report = reports.get(p)
                if report is None or report.current_offset != ends[p]:
                    return f"{name} partition {p}: {report}, end {ends[p]}"
        return None if covered == set(range(PARTITIONS)) else f"assigned: {sorted(covered)}"

    def app_id(self, name: str) -> str:
        apps = rest(self.ui_ports[name], "")
        return str(apps[0]["id"])

    def executors(self, name: str) -> list[dict[str, Any]]:
        return list(rest(self.ui_ports[name], f"/{self.app_id(name)}/allexecutors"))

    def task_executors(self, name: str) -> Counter[str]:
        """How many tasks of the node's application ran on each executor id ("driver": the
        node's own JVM), from every stage's task list."""
        stages = rest(self.ui_ports[name], f"/{self.app_id(name)}/stages?details=true")
        return Counter(
            str(task["executorId"])
            for stage in stages
            for task in (stage.get("tasks") or {}).values()
        )


def rest(ui_port: int, path: str) -> Any:
    """The Spark driver's monitoring REST API (the first call can take seconds: Jetty)."""
    url = f"http://127.0.0.1:{ui_port}/api/v1/applications{path}"
    return httpx.get(url, timeout=60, trust_env=False).json()


def wait_until(check: Callable[[], str | None], timeout_s: float, what: str) -> None:
    """Until `check` returns None (it returns what is still missing)."""
    deadline = time.monotonic() + timeout_s
    missing = check()
    while missing is not None:
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s: {missing}"
        time.sleep(0.5)
        missing = check()


@pytest.fixture(scope="module")
def shared(
    embedded: EmbeddedServices,
    broker: BrokerHandle,
    redis_server: RedisHandle,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SharedCluster]:
    workdir = tmp_path_factory.mktemp("spark-cluster")
    run_id = uuid.uuid4().hex[:8]
    topic = f"spark-cluster-{run_id}"
    create_topics(broker.bootstrap_servers, {topic: PARTITIONS})
    produce_customers(broker.bootstrap_servers, topic, 3_000, keys=400, seed=20)
    # Two cores and ~1 GB offered; each node takes one core and 512 MB, so both fit.
    with spark_standalone_cluster(worker_cores=2, worker_memory="1g", log_dir=workdir) as spark:
        client = redis.Redis.from_url(redis_server.url)
        built = SharedCluster(
            spark, broker.bootstrap_servers, topic, client, Keys(f"sc-{run_id}"), {}, {}, run_id
        )
        try:
            for name in NODE_NAMES:
                built.ui_ports[name] = free_port()
                built.nodes[name] = start_node(
                    embedded,
                    broker.bootstrap_servers,
                    topic,
                    workdir / name,
                    name=name,
                    wait_ready=False,
                    store=STORE,
                    spark_master=spark.master_url,
                    spark_conf=json.dumps(node_spark_conf(built.ui_ports[name])),
                    redis_url=redis_server.url,
                    cluster=f"sc-{run_id}",
                    standbys="1",  # both nodes read every partition (active or standby)
                    stall_timeout_ms=str(STALL_TIMEOUT_MS),
                )
            wait_until(built.behind, 600, "both nodes caught up on the seed records")
            yield built
        finally:
            for node in built.nodes.values():
                node.process.stop()
                node.close()
            client.close()


def node_spark_conf(ui_port: int) -> dict[str, str]:
    return {
        "spark.cores.max": "1",  # its share: without it the first node takes both cores
        "spark.executor.memory": "512m",
        # The driver's UI only for its REST API: which executor ran which task.
        "spark.ui.enabled": "true",
        "spark.ui.port": str(ui_port),
    }


def test_nodes_share_the_cluster_and_read_on_executors(shared: SharedCluster) -> None:
    apps = {app["name"]: app for app in shared.spark.running_apps()}
    for name in NODE_NAMES:
        app = apps[f"kroute-materializer-{name}"]
        assert (app["state"], app["cores"]) == ("RUNNING", 1), app  # a share each, none starved

    [worker] = shared.spark.workers
    for name in NODE_NAMES:
        executors = {e["id"]: e for e in shared.executors(name)}
        tasks = shared.task_executors(name)
        # The only tasks a node runs are the source's reads (and the transform on their rows):
        # all of them ran on the worker's executors, none in the node's own JVM.
        assert tasks, f"node {name}: no tasks at all ({executors})"
        assert "driver" not in tasks, tasks
        assert set(tasks) <= set(executors) - {"driver"}, (tasks, executors)
        assert shared.app_id(name) in worker_app_ids(worker.web_ui_url)

    truth, bad = ground_truth(shared.bootstrap, shared.topic, PARTITIONS)
    assert bad == 0
    keys = [f"customer-{i}" for i in range(400)]
    for node in shared.nodes.values():  # each answers for every key (forwarding the others')
        assert_serves_truth(node, truth, keys)
    for name in NODE_NAMES:
        reports = shared.reports(name)
        assert sorted(reports) == shared.hosted(name)
        for report in reports.values():
            assert report.lag == 0, report
            assert report.caught_up_at_ms is not None, report


def test_worker_killed_under_writes_is_reported_and_recovered(shared: SharedCluster) -> None:
    writer = Writer(shared.bootstrap, shared.topic, tag=f"outage-{shared.run_id}")
    writer.start()
    try:
        wait_until(lambda: None if writer.sent >= 100 else "writes", 60, "writes flowing")
        before = writer.sent
        sample = range(0, before, max(before // 10, 1))
        wait_until(lambda: unserved(shared, writer, sample), 120, "early writes materialized")
        [worker] = shared.spark.workers
        killed_at_ms = int(time.time() * 1000)
        shared.spark.kill_worker(worker)  # SIGKILL of the worker and its executors
        killed_at = time.monotonic()

        # Each node notices it has no executors and says so, then stops calling itself ready.
        wait_until(
            lambda: missing_error(shared, "no Spark executors", killed_at_ms),
            60,
            "no-executor error",
        )
        wait_until(lambda: not_ready(shared), 60, "nodes not ready while no executor runs")
        # The store is the driver's: keys materialized before the kill are still served.
        assert unserved(shared, writer, sample) is None
        # Lag reports keep coming, with true offsets and the growing lag.
        assert_reports_show_lag(shared, since_s=time.monotonic() - killed_at)

        shared.spark.start_worker()
    finally:
        writer.stop()
    wait_until(shared.behind, 300, "both nodes caught up after a worker came back")
    wait_until(lambda: not_ready(shared, want_ready=True), 60, "nodes ready again")
    assert unserved(shared, writer, range(0, writer.sent, max(writer.sent // 20, 1))) is None
    for name in NODE_NAMES:
        live = [e for e in shared.executors(name) if e["id"] != "driver" and e["isActive"]]
        assert live, f"node {name}: no executor after the worker came back"
        assert all(e["id"] != "0" for e in live)  # a new executor, on the new worker


class Writer:
    """Writes keyed records (unique tag, numbered) every few milliseconds until stopped."""

    def __init__(self, bootstrap: str, topic: str, tag: str) -> None:
        self.tag = tag
        self.sent = 0
        self._producer = keyed_producer(bootstrap, linger_ms=5)
        self._topic = topic
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def key(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert self._producer.flush(30) == 0

    def _run(self) -> None:
        while not self._stop.is_set():
            value = json.dumps({"tag": self.tag, "n": self.sent}).encode()
            self._producer.produce(self._topic, key=self.key(self.sent).encode(), value=value)
            self._producer.poll(0)
            self.sent += 1
            time.sleep(0.01)


def unserved(shared: SharedCluster, writer: Writer, numbers: range) -> str | None:
    """The first of the writer's records (by number) some node does not serve as written."""
    for name, node in shared.nodes.items():
        for i in numbers:
            response = node.get(f"/stores/{STORE}/keys/{writer.key(i)}")
            if response.status_code != 200:
                return f"{name}: record {i}: {response.status_code} {response.text[:200]}"
            assert response.json()["value"] == {"tag": writer.tag, "n": i}, response.text
    return None


def missing_error(shared: SharedCluster, text: str, since_ms: int) -> str | None:
    """None once every node's pipeline reported an error with `text` after `since_ms`."""
    for name, node in shared.nodes.items():
        pipeline = node.metadata()["pipeline"]
        error, at_ms = pipeline.get("last_error") or "", pipeline.get("last_error_at_ms") or 0
        if text not in error or at_ms < since_ms:
            return f"{name}: last_error {error!r} at {at_ms}"
    return None


def not_ready(shared: SharedCluster, want_ready: bool = False) -> str | None:
    for name, node in shared.nodes.items():
        if node.is_ready() != want_ready:
            return f"{name} ready: {not want_ready}"
    return None


def assert_reports_show_lag(shared: SharedCluster, since_s: float) -> None:
    """Every hosted partition's Redis report is fresh and shows the store behind its end."""
    ends = shared.ends()
    at_ms = int(time.time() * 1000)
    for name in NODE_NAMES:
        for p, report in shared.reports(name).items():
            assert at_ms - report.updated_at_ms < 5_000, (name, p, report)
            assert report.end_offset is not None
            assert report.end_offset <= ends[p]
            assert report.current_offset <= report.end_offset
        behind = [r for r in shared.reports(name).values() if (r.lag or 0) > 0]
        assert behind, f"{name}: no partition reported behind {since_s:.0f} s after the kill"


def worker_app_ids(worker_ui: str) -> set[str]:
    """Applications with executors on the worker (its web UI's /json/)."""
    state = httpx.get(f"{worker_ui}/json/", timeout=30, trust_env=False).json()
    return {e["appid"] for e in state.get("executors", [])}


def test_executor_watch_reports_a_lasting_loss_once_per_loss() -> None:
    """No Spark needed: the watch's judgement over a made-up executor count."""
    said: list[str] = []
    watch = ExecutorWatch(None, "spark://10.0.0.5:7077", said.append)  # type: ignore[arg-type]
    for at, count in [(0.0, 0), (29.0, 0)]:  # a new application waits for its first executor
        watch.count = count
        watch._judge(at)
    assert said == []
    for at, count in [(30.0, 1), (31.0, 0), (34.0, 0)]:  # a moment without one: not yet
        watch.count = count
        watch._judge(at)
    assert said == []
    for at in (35.5, 40.0):
        watch._judge(at)
    assert len(said) == 1
    assert "no Spark executors" in said[0]
    assert "spark://10.0.0.5:7077" in said[0]
    for at, count in [(41.0, 1), (42.0, 0), (47.0, 0)]:  # back, then lost again: said again
        watch.count = count
        watch._judge(at)
    assert len(said) == 2


def test_a_loopback_master_keeps_the_driver_on_loopback() -> None:
    assert on_this_machine_only("local[*]")
    assert on_this_machine_only("spark://127.0.0.1:7077")
    assert on_this_machine_only("spark://localhost:7077")
    assert not on_this_machine_only("spark://spark-master:7077")
    assert not on_this_machine_only("spark://10.0.0.5:7077")
