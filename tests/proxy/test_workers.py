"""KROUTE_WORKERS: several proxy processes on one port under one parent (proxy/workers.py).

Real proxies (`python -m proxy`, 2 workers) in front of three real uvicorn processes serving
`tests.proxy.slow_app` as nodes n0-n2 of a cluster in real Redis. Every lookup has a unique key
that the node echoes with the request id the proxy gave it; a worker's ids are
`<random>.<worker>-<count>`, so each answer says which worker forwarded it (and which process:
the random part is new when a worker is restarted).

Most clients here open a new connection per request ("connection: close"): SO_REUSEPORT spreads
connections, not requests, over the workers.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.metrics_core import Metric

from common.contract import Keys, StoreInfo
from kroute.embedded import EmbeddedServices, RedisHandle, free_port
from kroute.proxies import ProxyHandle, start_proxy
from kroute.static_cluster import StaticCluster
from proxy.metrics import WorkerMetrics, parsed_exposition
from proxy.workers import (
    WATCHDOG_INTERVAL_S,
    WATCHDOG_MISSES,
    WATCHDOG_START_GRACE_S,
    Backoff,
    merged_readiness,
    merged_status,
)
from tests.prometheus_checks import assert_follows_conventions, sample_values
from tests.proxy.conftest import table_processes
from tests.proxy.third_party import STORE, ThirdPartyServer, start_uvicorn

pytestmark = pytest.mark.integration

NODES = ("n0", "n1", "n2")
PARTITIONS = 6
SETTINGS = {"lag_report_stale_ms": "600000", "refresh_interval_ms": "200", "log_level": "info"}
_REQUEST_ID = re.compile(r"^(?P<process>[0-9a-f]{8})(\.(?P<worker>\d+))?-[0-9a-f]+$")
ONE_PROCESS = -1  # Answer.worker of a proxy without workers
CLOSE = {"connection": "close"}  # one connection per request: spread over the workers


@dataclass(frozen=True)
class Answer:
    key: str
    worker: int  # which worker forwarded the request
    process: str  # the random part of its request ids: one per worker process


@dataclass
class Cluster:
    embedded: EmbeddedServices
    redis_url: str
    cluster: str
    servers: dict[str, ThirdPartyServer]
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10, trust_env=False))

    def control(self, **state: Any) -> None:
        for node, server in self.servers.items():
            self.http.post(
                server.url + "/_control", json={"node": node, **state}
            ).raise_for_status()

    def lookups(self) -> int:
        return sum(
            int(self.http.get(server.url + "/_control").json()["lookups"])
            for server in self.servers.values()
        )

    @contextlib.contextmanager
    def proxy(self, workers: int = 2, **settings: str) -> Iterator[ProxyHandle]:
        handle = start_proxy(
            self.embedded,
            self.redis_url,
            name=f"proxy-workers-{uuid.uuid4().hex[:6]}",
            cluster=self.cluster,
            workers=workers,
            **{**SETTINGS, **settings},
        )
        try:
            yield handle
        finally:
            handle.process.stop(grace_s=20)
            handle.close()


@pytest.fixture(scope="module")
def cluster(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[Cluster]:
    servers = {node: start_uvicorn(embedded, "tests.proxy.slow_app:app") for node in NODES}
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(f"workers-{uuid.uuid4().hex[:8]}")
    static = StaticCluster(keys, {node: server.url for node, server in servers.items()})
    static.add_store(StoreInfo(STORE, STORE, PARTITIONS, "string"), standbys=2)
    static.publish(client)
    running = Cluster(embedded, redis_server.url, keys.cluster, servers)
    try:
        yield running
    finally:
        for server in servers.values():
            server.stop()
        running.http.close()
        client.close()


@pytest.fixture(autouse=True)
def prompt_nodes(cluster: Cluster) -> Iterator[None]:
    cluster.control()
    yield
    cluster.control()


def lookup(client: httpx.Client, proxy: ProxyHandle, headers: dict[str, str] = CLOSE) -> Answer:
    """One lookup of a new key; checks the answer is this request's own."""
    key = f"w-{uuid.uuid4().hex}"
    response = client.get(f"{proxy.url}/stores/{STORE}/keys/{key}", headers=headers)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["key"] == key  # never another request's answer
    match = _REQUEST_ID.match(body["id"])
    assert match, body["id"]
    worker = ONE_PROCESS if match["worker"] is None else int(match["worker"])
    return Answer(key, worker, match["process"])


def metric(proxy: ProxyHandle, sample: str, **labels: str) -> float:
    values = sample_values(proxy.admin("/metrics").text, sample)
    return values.get(tuple(sorted(labels.items())), 0.0)


def keyed_200s(proxy: ProxyHandle) -> float:
    return metric(proxy, "kroute_proxy_responses_total", kind="keyed", status="200")


def worker_pid(proxy: ProxyHandle, worker: int) -> int | None:
    """The pid of that worker's process now (None while it is being restarted)."""
    return next(w["pid"] for w in proxy.status()["workers"] if w["worker"] == worker)


def replaced(proxy: ProxyHandle, worker: int, old_pid: int) -> bool:
    pid = worker_pid(proxy, worker)
    return pid is not None and pid != old_pid


def running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def wait_for(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# -- spread and one scrape -----------------------------------------------------------------------


def test_requests_spread_over_both_workers_and_one_scrape_sums_their_counters(cluster):
    with cluster.proxy() as proxy:
        pids = proxy.worker_pids()
        assert len(pids) == 2
        # KROUTE_TABLE_PROCESS unset: one table process for both workers, the parent's child.
        tables = table_processes(proxy.process.pid)
        assert len(tables) == 1
        assert sorted(children(proxy.process.pid)) == sorted([*pids, *tables])
        with concurrent.futures.ThreadPoolExecutor(8) as pool:

            def client_run(_: int) -> list[Answer]:
                with httpx.Client(timeout=10, trust_env=False) as client:
                    return [lookup(client, proxy) for _ in range(25)]

            answers = [a for batch in pool.map(client_run, range(8)) for a in batch]
        by_worker = Counter(answer.worker for answer in answers)
        assert set(by_worker) == {0, 1}, by_worker  # both workers served
        assert len({answer.key for answer in answers}) == 200
        # One process each: one random id prefix per worker.
        assert len({(answer.worker, answer.process) for answer in answers}) == 2

        text = proxy.admin("/metrics").text
        # The parent's one scrape counts every worker's answers: the sum, not one worker's.
        assert keyed_200s(proxy) == 200 == sum(by_worker.values())
        assert sum(sample_values(text, "kroute_proxy_node_requests_total").values()) >= 200
        assert sample_values(text, "kroute_proxy_request_duration_seconds_count")[()] >= 200
        # Per-process gauges carry the worker; the replicas' lag comes once, not twice.
        connections = sample_values(text, "kroute_proxy_client_connections")
        assert {dict(labels)["worker"] for labels in connections} == {"0", "1"}
        lag = sample_values(text, "kroute_proxy_replica_lag_offsets")
        assert len(lag) == PARTITIONS * len(NODES)
        assert sample_values(text, "kroute_proxy_workers_running")[()] == 2
        assert_follows_conventions(text)

        status = proxy.status()
        assert sum(node["requests"] for node in status["nodes"].values()) >= 200
        assert [w["worker"] for w in status["workers"]] == [0, 1]
        ready = proxy.admin("/health/ready")
        assert ready.status_code == 200
        assert [w["status"] for w in ready.json()["workers"]] == ["ready", "ready"]


# -- a worker killed -----------------------------------------------------------------------------


@dataclass
class Load:
    """Client threads, each sending one lookup at a time on a new connection, recording
    every answer and every failure with its time."""

    proxy: ProxyHandle
    threads: int
    stop: threading.Event = field(default_factory=threading.Event)
    answers: list[tuple[float, Answer]] = field(default_factory=list)
    failures: list[tuple[float, int, str]] = field(default_factory=list)  # (time, thread, error)

    def run(self, thread: int) -> None:
        with httpx.Client(timeout=5, trust_env=False) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    self.answers.append((started, lookup(client, self.proxy)))
                except (httpx.HTTPError, AssertionError) as exc:
                    self.failures.append((started, thread, repr(exc)))


def test_a_killed_worker_is_restarted_and_requests_keep_being_answered(cluster):
    """Each client thread has at most one request in flight, and a connection belongs to the
    worker that accepted it (or holds it in its accept queue). kill -9 can fail only those:
    at most one request per thread, plus one more per thread in the moment the kernel takes to
    close the dead process's listening socket. New connections go to the listening worker
    meanwhile, so nothing else fails, and the restarted worker takes connections again."""
    threads = 6
    with cluster.proxy() as proxy:
        old_pids = proxy.worker_pids()
        load = Load(proxy, threads)
        workers = [threading.Thread(target=load.run, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        try:
            wait_for(lambda: len(load.answers) >= 100, 30, "answers before the kill")
            killed_at = time.monotonic()
            os.kill(old_pids[0], signal.SIGKILL)
            wait_for(lambda: replaced(proxy, 0, old_pids[0]), 20, "the parent to restart worker 0")
            restarted = worker_pid(proxy, 0)
            # the new worker 0 serves: an answer from a process worker 0 never had before
            before = {a.process for t, a in load.answers if a.worker == 0 and t < killed_at}
            wait_for(
                lambda: any(a.worker == 0 and a.process not in before for _, a in load.answers),
                20,
                "the restarted worker to answer",
            )
            answered_after = sum(1 for t, _ in load.answers if t > killed_at)
            back_after_s = min(
                t - killed_at for t, a in load.answers if a.worker == 0 and a.process not in before
            )
        finally:
            load.stop.set()
            for worker in workers:
                worker.join(10)
        failures_by_thread = Counter(thread for _, thread, _ in load.failures)
        print(
            f"kill -9 of worker 0: {len(load.failures)} failed requests "
            f"({dict(failures_by_thread)} by client thread), {answered_after} answered after, "
            f"the restarted worker answering {back_after_s:.2f} s after the kill"
        )
        assert all(count <= 2 for count in failures_by_thread.values()), load.failures
        assert all(t < killed_at + 1.0 for t, _, _ in load.failures), load.failures
        assert answered_after > 20
        assert running(old_pids[1])
        assert worker_pid(proxy, 1) == old_pids[1]
        assert restarted in children(proxy.process.pid)
        assert metric(proxy, "kroute_proxy_worker_restarts_total", worker="0") == 1
        assert metric(proxy, "kroute_proxy_worker_restarts_total", worker="1") == 0


def test_a_worker_that_stops_answering_is_killed_and_replaced(cluster):
    """A SIGSTOPped worker keeps its listening socket, so the kernel goes on handing it new
    connections, which would hang: the parent's watchdog must replace it."""
    with cluster.proxy() as proxy:
        old_pids = proxy.worker_pids()
        time.sleep(WATCHDOG_START_GRACE_S)  # past the start-up grace the watchdog allows
        os.kill(old_pids[1], signal.SIGSTOP)
        try:
            limit = WATCHDOG_INTERVAL_S * (WATCHDOG_MISSES + 2) + 10  # + a busy machine's slack
            wait_for(lambda: replaced(proxy, 1, old_pids[1]), limit, "the hung worker replaced")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old_pids[1], signal.SIGCONT)
        assert not running(old_pids[1])
        assert worker_pid(proxy, 0) == old_pids[0]  # the answering one was left alone
        answers = [lookup(cluster.http, proxy) for _ in range(30)]  # a new connection each
        assert {a.worker for a in answers} <= {0, 1}
        assert metric(proxy, "kroute_proxy_worker_restarts_total", worker="1") == 1
        assert metric(proxy, "kroute_proxy_worker_restarts_total", worker="0") == 0


def test_counters_never_go_down_when_a_worker_is_replaced(cluster):
    """The dead worker's last scraped counts stay in the sums (its replacement starts at 0)."""
    with cluster.proxy() as proxy, httpx.Client(timeout=10, trust_env=False) as client:
        answers = [lookup(client, proxy) for _ in range(40)]
        assert set(Counter(a.worker for a in answers)) == {0, 1}
        assert keyed_200s(proxy) == 40
        old = proxy.worker_pids()
        os.kill(old[1], signal.SIGKILL)
        wait_for(lambda: running(old[1]) is False, 10, "worker 1 to die")
        assert keyed_200s(proxy) == 40  # worker 1's count kept after it died
        wait_for(lambda: replaced(proxy, 1, old[1]), 20, "the parent to restart worker 1")
        wait_for(proxy.is_ready, 20, "the proxy to be ready again")
        more = [lookup(client, proxy) for _ in range(40)]
        assert keyed_200s(proxy) == 80, Counter(a.worker for a in more)


# -- stopping ------------------------------------------------------------------------------------


def test_sigterm_to_the_parent_drains_in_flight_requests_in_every_worker_and_exits_0(cluster):
    in_flight = 16
    with cluster.proxy() as proxy:
        pids = proxy.worker_pids()
        cluster.control(delay_ms=1500)
        lookups_before = cluster.lookups()
        with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:

            def one(_: int) -> Answer:
                with httpx.Client(timeout=10, trust_env=False) as client:
                    return lookup(client, proxy)

            futures = [pool.submit(one, i) for i in range(in_flight)]
            wait_for(
                lambda: cluster.lookups() - lookups_before >= in_flight,
                10,
                "every request to reach its node",
            )
            proxy.process.signal(signal.SIGTERM)
            answers = [future.result(timeout=20) for future in futures]
        # every in-flight request was answered, by both workers: each drained its own
        assert len({a.key for a in answers}) == in_flight
        assert {a.worker for a in answers} == {0, 1}
        assert proxy.process.popen.wait(timeout=20) == 0
        wait_for(lambda: not any(running(pid) for pid in pids), 10, "the workers to exit")
        port = int(proxy.url.rsplit(":", 1)[1])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_no_worker_outlives_a_parent_killed_with_sigkill(cluster):
    with cluster.proxy() as proxy:
        pids = proxy.worker_pids()
        assert len(pids) == 2
        assert all(running(pid) for pid in pids)
        proxy.process.signal(signal.SIGKILL)
        proxy.process.popen.wait(timeout=10)
        # PR_SET_PDEATHSIG: each worker gets SIGTERM when the parent dies, drains, exits.
        wait_for(lambda: not any(running(pid) for pid in pids), 15, "the orphaned workers to exit")
        port = int(proxy.url.rsplit(":", 1)[1])
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_ctrl_c_to_the_process_group_stops_every_worker_once_and_none_is_restarted(cluster):
    """A terminal's Ctrl-C goes to the parent's process group: the workers have groups of
    their own (one still starting would die of it mid-import), and the parent stops them
    (SIGTERM) and restarts none."""
    with cluster.proxy() as proxy:
        pids = proxy.worker_pids()
        os.killpg(proxy.process.pid, signal.SIGINT)  # the parent leads its process group
        assert proxy.process.popen.wait(timeout=20) == 0
        wait_for(lambda: not any(running(pid) for pid in pids), 10, "the workers to exit")
        events = [line.get("event", "") for line in log_lines(proxy)]
        assert "proxy supervisor stopped" in events
        assert not any("restarting" in event for event in events), events


def test_a_crash_loop_is_logged_and_restarts_back_off(cluster):
    """A worker that keeps dying soon after it starts is restarted at once the first time,
    then after delays that double; from the third quick exit on the parent logs a crash loop."""
    with cluster.proxy() as proxy:
        for _ in range(4):
            pid = worker_pid(proxy, 0)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda old=pid: replaced(proxy, 0, old), 20, "worker 0 to be restarted")
        exits = [line for line in log_lines(proxy) if line.get("worker") == 0 and "pid" in line]
        exits = [line for line in exits if "restart" in line.get("event", "")]
        # The first run may have lasted past HEALTHY_RUN_S on a busy machine (then it does not
        # count as quick); every later one was killed within seconds of starting.
        quick = [line["quick_exits_in_a_row"] for line in exits]
        assert quick[1:] == list(range(quick[0] + 1, quick[0] + 4)), quick
        for line in exits:
            q = line["quick_exits_in_a_row"]
            assert line["restart_in_s"] == (0.0 if q <= 1 else 0.25 * 2 ** (q - 2)), line
            assert ("crash loop" in line["event"]) == (q >= 3) == (line["level"] == "error")
        assert quick[-1] >= 3
        assert metric(proxy, "kroute_proxy_worker_restarts_total", worker="0") == 4


def log_lines(proxy: ProxyHandle) -> list[dict[str, Any]]:
    """The proxy's JSON log lines (the parent's and the workers')."""
    lines = []
    for text in proxy.process.log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(text))
    return lines


def test_one_worker_is_one_process_without_a_parent(cluster):
    with cluster.proxy(workers=1) as proxy, httpx.Client(timeout=10, trust_env=False) as client:
        answers = [lookup(client, proxy) for _ in range(5)]
        assert {a.worker for a in answers} == {ONE_PROCESS}
        assert children(proxy.process.pid) == []
        assert "workers" not in proxy.status()


def test_a_taken_port_stops_the_parent_before_any_worker_starts(cluster, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = cluster.embedded.start_process(
            "proxy-taken-port",
            [sys.executable, "-m", "proxy"],
            env={
                **os.environ,
                "KROUTE_REDIS_URL": cluster.redis_url,
                "KROUTE_PORT": str(port),
                "KROUTE_ADMIN_PORT": str(free_port()),
                "KROUTE_WORKERS": "2",
            },
        )
        assert process.popen.wait(timeout=20) == 3
        assert "cannot listen on the data port" in process.log_tail()
        assert "proxy supervisor started" not in process.log_tail()


def test_a_taken_admin_port_stops_the_parent_before_any_worker_starts(cluster, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        process = cluster.embedded.start_process(
            "proxy-taken-admin-port",
            [sys.executable, "-m", "proxy"],
            env={
                **os.environ,
                "KROUTE_REDIS_URL": cluster.redis_url,
                "KROUTE_PORT": str(free_port()),
                "KROUTE_ADMIN_PORT": str(taken.getsockname()[1]),
                "KROUTE_WORKERS": "2",
            },
        )
        assert process.popen.wait(timeout=20) == 3
        log_tail = process.log_tail(40)
        assert "cannot listen on the admin port" in log_tail
        assert "proxy supervisor started" not in log_tail
        assert "proxy listening" not in log_tail, "a worker was started"


# -- the parts, without processes ----------------------------------------------------------------


def test_backoff_restarts_at_once_then_doubles_while_a_worker_keeps_crashing():
    backoff = Backoff(healthy_run_s=10, first_delay_s=0.25, max_delay_s=2)
    delays = [backoff.after_exit(ran_for_s=0.5) for _ in range(7)]
    assert delays == [0.0, 0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    assert backoff.crash_loop
    assert backoff.after_exit(ran_for_s=60) == 0.0  # a long run resets it
    assert not backoff.crash_loop


def _exposition(worker_connections: int, responses: int, age: float, lag: float) -> str:
    return f"""# HELP kroute_proxy_responses_total Responses
# TYPE kroute_proxy_responses_total counter
kroute_proxy_responses_total{{kind="keyed",status="200"}} {responses}
# HELP kroute_proxy_request_duration_seconds Durations
# TYPE kroute_proxy_request_duration_seconds histogram
kroute_proxy_request_duration_seconds_bucket{{le="0.1"}} {responses}
kroute_proxy_request_duration_seconds_bucket{{le="+Inf"}} {responses}
kroute_proxy_request_duration_seconds_count {responses}
kroute_proxy_request_duration_seconds_sum {responses / 100}
# HELP kroute_proxy_client_connections client connections
# TYPE kroute_proxy_client_connections gauge
kroute_proxy_client_connections {worker_connections}
# HELP kroute_proxy_table_age_seconds table age
# TYPE kroute_proxy_table_age_seconds gauge
kroute_proxy_table_age_seconds {age}
# HELP kroute_proxy_replica_lag_offsets lag
# TYPE kroute_proxy_replica_lag_offsets gauge
kroute_proxy_replica_lag_offsets{{node="n0",partition="0",role="active",store="s"}} {lag}
"""


def parsed(text: str) -> list[Metric]:
    families = parsed_exposition(text)
    assert families is not None
    return families


def _samples(merger: WorkerMetrics, pids: list[int]) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in merger.merged(pids)
        for s in family.samples
    }


def test_worker_metrics_sum_counters_label_gauges_and_take_shared_gauges_once():
    merger = WorkerMetrics(["kroute_proxy_replica_lag_offsets"])
    merger.scraped(101, 0, parsed(_exposition(3, 10, age=0.8, lag=7)))
    merger.scraped(102, 1, parsed(_exposition(4, 5, age=0.2, lag=9)))
    samples = _samples(merger, [101, 102])
    assert samples[("kroute_proxy_responses_total", (("kind", "keyed"), ("status", "200")))] == 15
    assert samples[("kroute_proxy_request_duration_seconds_bucket", (("le", "0.1"),))] == 15
    assert math.isclose(samples[("kroute_proxy_request_duration_seconds_sum", ())], 0.15)
    assert samples[("kroute_proxy_client_connections", (("worker", "0"),))] == 3
    assert samples[("kroute_proxy_client_connections", (("worker", "1"),))] == 4
    lag = [v for (name, _), v in samples.items() if name == "kroute_proxy_replica_lag_offsets"]
    assert lag == [9]  # once, from worker 1: its table is the freshest

    merger.exited(102)  # worker 1 died after counting 5; its replacement starts from 0
    merger.scraped(103, 1, parsed(_exposition(0, 0, age=0.1, lag=9)))
    samples = _samples(merger, [101, 103])
    assert samples[("kroute_proxy_responses_total", (("kind", "keyed"), ("status", "200")))] == 15
    assert samples[("kroute_proxy_request_duration_seconds_count", ())] == 15


def test_merged_status_and_readiness_speak_for_every_worker():
    def status(worker: int, built: int, requests: int, ejected: int | None) -> dict[str, Any]:
        return {
            "proxy": {"degraded": worker == 1, "table_loaded": True, "failovers": 2},
            "generation": 1,
            "table_built_at_ms": built,
            "nodes": {"n0": {"requests": requests, "failures": 1, "ejected_since_ms": ejected}},
            "stores": {"s": {"from": worker}},
        }

    workers = [{"worker": 0, "pid": 1, "restarts": 0}, {"worker": 1, "pid": 2, "restarts": 0}]
    merged = merged_status({0: status(0, 100, 3, None), 1: status(1, 200, 4, 50)}, workers)
    assert merged["stores"] == {"s": {"from": 1}}  # the newest table
    assert merged["nodes"]["n0"] == {"requests": 7, "failures": 2, "ejected_since_ms": 50}
    assert merged["proxy"]["failovers"] == 4
    assert merged["proxy"]["degraded"] is True
    assert merged["workers"] == workers

    ready = {"status": "ready", "table_loaded": True, "nodes_alive": 3}
    assert merged_readiness({0: ready, 1: ready}, workers, stopping=False)[0]
    assert not merged_readiness({0: ready}, workers, stopping=False)[0]  # 1 is starting
    restarting = [workers[0], {**workers[1], "pid": None, "restarts": 1}]
    assert merged_readiness({0: ready}, restarting, stopping=False)[0]
    assert not merged_readiness({0: ready, 1: {"status": "not_ready"}}, workers, False)[0]
    assert not merged_readiness({}, workers, stopping=False)[0]
    assert not merged_readiness({0: ready, 1: ready}, workers, stopping=True)[0]
