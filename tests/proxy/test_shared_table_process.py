"""KROUTE_WORKERS=2 with KROUTE_TABLE_PROCESS=true: one table process for both workers.

Real proxies (`python -m proxy`, 2 workers) in front of three real uvicorn processes serving
`tests.proxy.slow_app` as nodes n0-n2 of a cluster in real Redis. The supervisor runs the one
table process; each worker connects to it and routes by what it sends. Every lookup has a
unique key that the node echoes with the request id the proxy gave it (`<random>.<worker>-<n>`),
so each answer is checked to be this request's own and says which worker forwarded it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

from common.contract import Keys, PartitionAssignment, ReportBodies, StoreInfo
from kroute.embedded import EmbeddedServices, RedisHandle
from kroute.proxies import ProxyHandle, start_proxy
from kroute.static_cluster import StaticCluster
from partitioner import partition, serialize_key
from proxy.table_process import SILENT_S, TableConfig, TableKeeper, TableStatus
from proxy.workers import WATCHDOG_INTERVAL_S, WATCHDOG_MISSES, WATCHDOG_START_GRACE_S
from tests.prometheus_checks import assert_follows_conventions, sample_values
from tests.proxy.conftest import table_processes, wait_for
from tests.proxy.third_party import STORE, ThirdPartyServer, start_uvicorn

pytestmark = pytest.mark.integration

NODES = ("n0", "n1", "n2")
PARTITIONS = 6
SETTINGS = {
    "lag_report_stale_ms": "600000",
    "refresh_interval_ms": "200",
    "log_level": "info",
    "table_process": "true",
}
CLOSE = {"connection": "close"}  # one connection per request: spread over the workers


@dataclass
class Cluster:
    embedded: EmbeddedServices
    redis_url: str
    static: StaticCluster
    client: redis.Redis
    servers: dict[str, ThirdPartyServer]
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10, trust_env=False))

    @contextlib.contextmanager
    def proxy(self, workers: int = 2, *, wait_ready: bool = True) -> Iterator[ProxyHandle]:
        handle = start_proxy(
            self.embedded,
            self.redis_url,
            name=f"proxy-shared-{uuid.uuid4().hex[:6]}",
            cluster=self.static.keys.cluster,
            workers=workers,
            wait_ready=wait_ready,
            **SETTINGS,
        )
        try:
            yield handle
        finally:
            handle.process.stop(grace_s=20)
            handle.close()

    def owner(self, key: str) -> str:
        return self.static.placements[STORE][_partition(key)].active

    def move(self, key: str) -> str:
        """Give the key's partition another active (published); the new active."""
        chosen = _partition(key)
        placed = self.static.placements[STORE][chosen]
        moved_to = next(n for n in NODES if n not in placed.replicas())
        self.static.placements[STORE][chosen] = PartitionAssignment(moved_to, (placed.active,))
        self.static.generation += 1
        self.static.publish(self.client)
        return moved_to


def _partition(key: str) -> int:
    return partition(serialize_key(key, "string"), PARTITIONS)


@pytest.fixture(scope="module")
def cluster(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[Cluster]:
    servers = {node: start_uvicorn(embedded, "tests.proxy.slow_app:app") for node in NODES}
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(f"shared-{uuid.uuid4().hex[:8]}")
    static = StaticCluster(keys, {node: server.url for node, server in servers.items()})
    static.add_store(StoreInfo(STORE, STORE, PARTITIONS, "string"), standbys=1)
    static.publish(client)
    running = Cluster(embedded, redis_server.url, static, client, servers)
    for node, server in servers.items():  # each answers with its node's name
        running.http.post(server.url + "/_control", json={"node": node}).raise_for_status()
    try:
        yield running
    finally:
        for server in servers.values():
            server.stop()
        running.http.close()
        client.close()


@dataclass(frozen=True)
class Answer:
    node: str
    worker: int


def lookup(cluster: Cluster, proxy: ProxyHandle, key: str | None = None) -> Answer:
    """One lookup (a new key unless given): checks the answer is this request's own."""
    key = key or f"s-{uuid.uuid4().hex}"
    response = cluster.http.get(f"{proxy.url}/stores/{STORE}/keys/{key}", headers=CLOSE)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["key"] == key  # never another request's answer
    assert response.headers["x-kroute-node"] == body["node"]
    worker = int(body["id"].split("-")[0].split(".")[1])
    return Answer(body["node"], worker)


def assert_both_workers_route_new_keys_to_their_owners(
    cluster: Cluster, proxy: ProxyHandle, reads: int
) -> None:
    """`reads` lookups of new keys, each answered by its partition's active, through both
    workers (one connection per request: the kernel spreads them)."""
    workers = set()
    for _ in range(reads):
        key = f"s-{uuid.uuid4().hex}"
        answer = lookup(cluster, proxy, key)
        assert answer.node == cluster.owner(key)
        workers.add(answer.worker)
    assert workers == {0, 1}


def worker_pids(proxy: ProxyHandle) -> list[int]:
    return [w["pid"] for w in proxy.status()["workers"] if w["pid"] is not None]


def both_workers_route_to(cluster: Cluster, proxy: ProxyHandle, key: str, node: str) -> bool:
    """Whether a read of `key` went to `node` through each worker (connections spread by
    the kernel: up to 40 tries for both to answer)."""
    seen: set[int] = set()
    for _ in range(40):
        answer = lookup(cluster, proxy, key)
        if answer.node != node:
            return False
        seen.add(answer.worker)
        if seen == {0, 1}:
            return True
    return False


def test_one_table_process_serves_both_workers_and_their_reads_go_where_redis_says(cluster):
    with cluster.proxy() as proxy:
        supervisor = proxy.process.pid
        assert len(table_processes(supervisor)) == 1, "the supervisor runs one table process"
        for worker in worker_pids(proxy):
            assert table_processes(worker) == [], "no worker runs its own"
        assert_both_workers_route_new_keys_to_their_owners(cluster, proxy, 60)
        key = "moved-1"
        moved_to = cluster.move(key)
        wait_for(
            lambda: both_workers_route_to(cluster, proxy, key, moved_to),
            "both workers route by the new active",
        )
        status = proxy.status()
        assert status["proxy"]["degraded"] is False
        assert status["table_process"]["pid"] == table_processes(supervisor)[0]
        assert status["table_process"]["restarts"] == 0
        assert status["table_process"]["loaded"] is True
        text = proxy.admin("/metrics").text
        # Counted once for the host (by the supervisor), not once per worker.
        assert text.count("# TYPE kroute_proxy_table_refresh_failures_total counter") == 1
        assert sample_values(text, "kroute_proxy_table_process_restarts_total")[()] == 0
        assert_follows_conventions(text)


def test_a_killed_table_process_is_replaced_and_both_workers_serve_meanwhile(cluster):
    with cluster.proxy() as proxy:
        supervisor = proxy.process.pid
        (first,) = table_processes(supervisor)
        os.kill(first, signal.SIGKILL)
        # Served from each worker's last table while no process builds one.
        assert_both_workers_route_new_keys_to_their_owners(cluster, proxy, 40)
        (second,) = wait_for(
            lambda: [p for p in table_processes(supervisor) if p != first], "another one"
        )
        assert second != first
        # Both workers follow the new one: a change read by it reaches each of them.
        key = "moved-2"
        moved_to = cluster.move(key)
        wait_for(
            lambda: both_workers_route_to(cluster, proxy, key, moved_to),
            "both workers route by the new process's table",
        )
        wait_for(lambda: proxy.status()["proxy"]["degraded"] is False, "degraded cleared")
        assert proxy.status()["table_process"] | {"last_error": None} == {
            "pid": second,
            "restarts": 1,
            "loaded": True,
            "degraded": False,
            "last_error": None,
            "refresh_failures": 0,
        }
        text = proxy.admin("/metrics").text
        assert sample_values(text, "kroute_proxy_table_process_restarts_total")[()] == 1
        log = proxy.process.log_path.read_text()
        assert "the workers' table process ended: starting another" in log
        assert "the line to the table process ended: routing on the last table" in log


def test_a_silent_table_process_is_killed_and_replaced(cluster):
    with cluster.proxy() as proxy:
        supervisor = proxy.process.pid
        (first,) = table_processes(supervisor)
        os.kill(first, signal.SIGSTOP)
        try:
            (_second,) = wait_for(
                lambda: [p for p in table_processes(supervisor) if p != first],
                "a replacement for the stopped process",
                limit_s=SILENT_S + 10,
            )
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(first, signal.SIGCONT)
        assert first not in table_processes(supervisor), "the silent one was killed"
        key = "moved-3"
        moved_to = cluster.move(key)
        wait_for(
            lambda: both_workers_route_to(cluster, proxy, key, moved_to),
            "both workers route by the replacement's table",
        )
        log = proxy.process.log_path.read_text()
        assert "the workers' table process is silent: replacing it" in log
        assert "the table process is silent on this worker's line: replacing it" in log


def test_a_new_table_process_holds_a_smaller_table_back_as_the_workers_would(cluster):
    """Redis restarted empty (this cluster's keys gone), then a new table process: the
    supervisor tells it what the last one's table placed, so it holds back the smaller table
    it reads (for 10 s) and both workers go on serving the one they have."""
    with cluster.proxy() as proxy:
        supervisor = proxy.process.pid
        (first,) = table_processes(supervisor)
        prefix = cluster.static.keys.prefix
        try:
            cluster.client.delete(*cluster.client.keys(f"{prefix}*"))
            os.kill(first, signal.SIGKILL)
            log_path = proxy.process.log_path
            wait_for(
                lambda: "redis describes less than the last table" in log_path.read_text(),
                "the new table process holding the smaller table back",
            )
            assert_both_workers_route_new_keys_to_their_owners(cluster, proxy, 40)
            assert proxy.status()["proxy"]["degraded"] is True
        finally:  # written again whole (its bodies included) for the tests after this one
            cluster.static.report_bodies = ReportBodies()
            cluster.static.publish(cluster.client)


def test_the_table_process_stops_with_the_supervisor(cluster):
    with cluster.proxy() as proxy:
        supervisor = proxy.process.pid
        (table,) = table_processes(supervisor)
        proxy.process.stop(grace_s=20)
        wait_for(lambda: not Path(f"/proc/{table}").exists() or _zombie(table), "it exits")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# Loaded by every Python process started with it on PYTHONPATH: the table process (started as
# `python -m proxy.table_process <fd> <pid> <listening fd>`: only numbers after "-m") exits
# at once, as one that cannot start would.
CRASHING_TABLE_PROCESS = """
import os, sys
if sys.argv[:1] == ["-m"] and len(sys.argv) == 4 and all(a.isdigit() for a in sys.argv[1:]):
    os._exit(7)
"""


def test_workers_serve_on_when_the_table_process_cannot_start_and_are_not_killed_as_hung(
    cluster, tmp_path, monkeypatch
):
    """A worker waits a few seconds for its first table, then serves without one (not
    ready) while the supervisor keeps starting table processes: waiting longer, it would not
    answer the supervisor's watchdog, and be killed as hung, again and again."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CRASHING_TABLE_PROCESS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    with cluster.proxy(wait_ready=False) as proxy:
        # Past the watchdog's grace for starting workers and the misses that kill one.
        time.sleep(WATCHDOG_START_GRACE_S + WATCHDOG_MISSES * WATCHDOG_INTERVAL_S + 3)
        status = proxy.status()
        assert [w["restarts"] for w in status["workers"]] == [0, 0]
        assert status["table_process"]["restarts"] >= 2
        assert status["table_process"]["pid"] is None or status["table_process"]["loaded"] is False
        assert proxy.admin("/health/ready").status_code == 503
        key = f"s-{uuid.uuid4().hex}"
        response = cluster.http.get(f"{proxy.url}/stores/{STORE}/keys/{key}", headers=CLOSE)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "no_routing_table"
        proxy.process.stop(grace_s=20)
        assert proxy.process.popen.returncode == 0, "every worker drained and stopped"
    log = proxy.process.log_path.read_text()
    assert "proxy worker stopped answering" not in log
    assert "no table from the table process yet: serving without one until it comes" in log


def test_the_failures_of_a_replaced_table_process_count_once(tmp_path, monkeypatch):
    """The supervisor adds the last process's refresh failures to its total when it starts
    the next: once, however many starts fail before a new process says anything."""
    keeper = TableKeeper(
        TableConfig("redis://127.0.0.1:1", 100, None, "c", 1000, None, "info", None),
        tmp_path / "t.sock",
    )
    keeper.listen()
    keeper.status = TableStatus(True, True, "gone", None, 9, 5, {}, pid=1, placed=12)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python-here"))

    async def starts() -> list[int]:
        counts = []
        for _ in range(3):
            assert await keeper._run_guarded() is None  # cannot start
            counts.append(keeper.refresh_failures)
        return counts

    try:
        assert asyncio.run(starts()) == [5, 5, 5]
    finally:
        assert keeper.listening is not None
        keeper.listening.close()
