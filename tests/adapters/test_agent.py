"""kroute.agent on a real consumer-group service: three instances of
tests/adapters/consumer_service.py (aiokafka group, in-memory state, uvicorn) on the embedded
broker, real redis-server and a real proxy in front of them."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from common.contract import Keys, StoreInfo, decode_assignment, decode_hosting, decode_report
from kroute.agent import merged_assignment
from kroute.cluster_harness import keyed_producer
from kroute.contract_check import check
from kroute.embedded import BrokerHandle, EmbeddedServices, ManagedProcess, RedisHandle, free_port
from kroute.proxies import ProxyHandle, start_proxy
from kroute.topics import create_topics
from partitioner import partition

pytestmark = pytest.mark.integration

PARTITIONS = 6
INSTANCES = ("a", "b", "c")
STORE = "customers"
REPO = Path(__file__).resolve().parents[2]
TTL_MS = 2000
FORGET_AFTER_MS = 3000  # the grace period after which a departed instance is forgotten


@dataclass
class Deployment:
    services: EmbeddedServices
    bootstrap: str
    topic: str
    redis_server: RedisHandle
    redis: redis.Redis
    keys: Keys
    proxy: ProxyHandle
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, ManagedProcess] = field(default_factory=dict)
    truth: dict[str, int] = field(default_factory=dict)  # key -> latest value produced
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=5, trust_env=False))

    def start(self, name: str) -> None:
        port = free_port()
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "BOOTSTRAP": self.bootstrap,
            "TOPIC": self.topic,
            "GROUP": f"group-{self.topic}",
            "PARTITIONS": str(PARTITIONS),
            "PORT": str(port),
            "NODE_ID": name,
            "REDIS_URL": self.redis_server.url,
            "CLUSTER": self.keys.cluster,
            "STORE": STORE,
            "TIDY_MS": "500",
            "FORGET_AFTER_MS": str(FORGET_AFTER_MS),
        }
        command = [sys.executable, "-m", "tests.adapters.consumer_service"]
        process = self.services.start_process(f"svc-{self.topic}-{name}", command, env=env)
        self.ports[name], self.processes[name] = port, process
        self.services.await_ready(process, lambda: self._live(port), 30)

    def _live(self, port: int) -> bool:
        try:
            return self.client.get(f"http://127.0.0.1:{port}/health/live").status_code == 200
        except httpx.HTTPError:
            return False

    def produce(self, count: int, tag: str, keys: list[str] | None = None) -> None:
        producer = keyed_producer(self.bootstrap, linger_ms=5)
        for i in range(count):
            key = keys[i % len(keys)] if keys else f"{tag}-{i}"
            value = len(self.truth) * 1000 + i
            producer.produce(self.topic, key=key.encode(), value=json.dumps(value).encode())
            self.truth[key] = value
        assert producer.flush(30) == 0

    def owners(self) -> dict[int, str | None]:
        raw = self.redis.get(self.keys.assignment)
        if raw is None:
            return {}
        placed = decode_assignment(raw).stores.get(STORE, {})
        return {p: a.active for p, a in placed.items()}

    def lag(self, name: str) -> dict[int, int | None]:
        reports = self.redis.hgetall(self.keys.lag(name))
        return {int(f.decode().rsplit("/", 1)[1]): decode_report(r).lag for f, r in reports.items()}

    def direct(self, name: str, key: str) -> httpx.Response:
        url = f"http://127.0.0.1:{self.ports[name]}/stores/{STORE}/keys/{key}"
        return self.client.get(url, headers={"x-request-id": f"direct-{uuid.uuid4().hex}"})

    def via_proxy(self, key: str, **headers: str) -> tuple[str, httpx.Response]:
        request_id = uuid.uuid4().hex
        response = self.proxy.get(
            f"/stores/{STORE}/keys/{key}", headers={"x-request-id": request_id, **headers}
        )
        return request_id, response

    def settled(self, alive: set[str]) -> str | None:
        """What is not settled yet (None: every partition owned by a live instance that
        serves it and reports lag 0)."""
        owners = self.owners()
        if sorted(p for p, o in owners.items() if o) != list(range(PARTITIONS)):
            return f"owners {owners}"
        if set(owners.values()) != alive:
            return f"owners {owners}, alive {alive}"
        for name in alive:
            raw = self.redis.get(self.keys.hosting(name))
            served = decode_hosting(raw).stores[STORE]["active"] if raw else ()
            mine = sorted(p for p, o in owners.items() if o == name)
            if sorted(served) != mine:
                return f"{name} serves {served}, assigned {mine}"
            lag = self.lag(name)
            if any(lag.get(p) != 0 for p in mine):
                return f"{name} lag {lag}"
        return None

    def wait_settled(self, alive: set[str], timeout_s: float = 60) -> float:
        started = time.monotonic()
        why = wait_for(lambda: self.settled(alive) is None, timeout_s, lambda: self.settled(alive))
        assert why is None, why
        return time.monotonic() - started


def wait_for(
    done: Callable[[], bool], timeout_s: float, why: Callable[[], Any] = lambda: "timeout"
) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return None
        time.sleep(0.1)
    return why()


@pytest.fixture(scope="module")
def deployment(embedded: EmbeddedServices, broker: BrokerHandle) -> Iterator[Deployment]:
    redis_server = embedded.start_redis()
    keys = Keys(f"agent-{uuid.uuid4().hex[:8]}")
    topic = f"svc-{keys.cluster}"
    create_topics(broker.bootstrap_servers, {topic: PARTITIONS})
    proxy = start_proxy(
        embedded,
        redis_server.url,
        name=f"proxy-{keys.cluster}",
        cluster=keys.cluster,
        refresh_interval_ms="200",
        probe_interval_ms="100",
        eject_ms="300",
        wait_ready=False,
    )
    built = Deployment(
        embedded, broker.bootstrap_servers, topic, redis_server, redis.Redis.from_url(
            redis_server.url
        ), keys, proxy,
    )  # fmt: skip
    built.produce(300, "seed")
    try:
        for name in INSTANCES:
            built.start(name)
        built.wait_settled(set(INSTANCES))
        yield built
    finally:
        for process in built.processes.values():
            process.stop()
        proxy.process.stop()
        proxy.close()
        built.client.close()
        built.redis.close()
        redis_server.process.stop()


def check_every_key(deployment: Deployment, keys: list[str]) -> dict[str, int]:
    """Every key through the proxy: answered by the owner of its partition, with what the
    owner says when asked directly and what was produced last; returns answers per node."""
    owners = deployment.owners()
    per_node: dict[str, int] = {}
    for key in keys:
        request_id, response = deployment.via_proxy(key)
        assert response.status_code == 200, (key, response.status_code, response.text)
        body = response.json()
        owner = owners[partition(key.encode(), PARTITIONS)]
        assert owner is not None
        assert body["id"] == request_id  # this request's answer, not another's
        assert body["node"] == owner == response.headers["x-kroute-node"]
        assert body["value"] == deployment.truth[key]
        direct = deployment.direct(owner, key).json()
        assert (direct["value"], direct["offset"]) == (body["value"], body["offset"])
        per_node[owner] = per_node.get(owner, 0) + 1
    return per_node


@pytest.mark.timeout(180)
def test_every_key_is_answered_by_the_instance_holding_its_partition(
    deployment: Deployment,
) -> None:
    owners = deployment.owners()
    assert set(owners.values()) == set(INSTANCES)  # the group spread the partitions
    per_node = check_every_key(deployment, sorted(deployment.truth))
    assert set(per_node) == set(INSTANCES)
    # A key of a partition an instance does not hold is refused there, never answered wrong.
    key = next(k for k in deployment.truth if owners[partition(k.encode(), PARTITIONS)] != "a")
    assert deployment.direct("a", key).status_code == 421
    # What the agents wrote passes the contract check.
    report = check(deployment.redis, deployment.keys.cluster)
    assert not report.errors, report.as_text()


@pytest.mark.timeout(180)
def test_lag_follows_a_paused_instance(deployment: Deployment) -> None:
    owners = deployment.owners()
    paused = "b"
    mine = sorted(p for p, o in owners.items() if o == paused)
    keys = [k for k in deployment.truth if owners[partition(k.encode(), PARTITIONS)] == paused]
    url = f"http://127.0.0.1:{deployment.ports[paused]}/admin/pause"
    assert deployment.client.post(url).status_code == 200
    deployment.produce(40, "paused", keys=keys[:10])
    # The agent keeps reading the high watermarks itself: lag shows although nothing is fetched.
    why = wait_for(
        lambda: sum(deployment.lag(paused).get(p) or 0 for p in mine) == 40,
        15,
        lambda: deployment.lag(paused),
    )
    assert why is None, why
    behind_partition = partition(keys[0].encode(), PARTITIONS)
    assert (deployment.lag(paused).get(behind_partition) or 0) > 0, "keys[0] was written to"

    def proxy_sees_lag() -> bool:  # the proxy reads Redis on its own schedule (events, timer)
        _, answer = deployment.via_proxy(keys[0])
        return answer.status_code == 200 and int(answer.headers["x-kroute-lag"]) > 0

    assert wait_for(proxy_sees_lag, 10) is None, "the proxy never showed the reported lag"
    _, refused = deployment.via_proxy(keys[0], **{"x-kroute-max-lag": "0"})
    assert refused.status_code == 503  # no standby in a consumer group: refused, not stale

    url = f"http://127.0.0.1:{deployment.ports[paused]}/admin/resume"
    assert deployment.client.post(url).status_code == 200
    why = wait_for(lambda: all(deployment.lag(paused).get(p) == 0 for p in mine), 15)
    assert why is None, deployment.lag(paused)
    check_every_key(deployment, keys[:10])


@pytest.mark.timeout(240)
def test_a_killed_instance_is_seen_dead_within_the_ttl_and_its_partitions_move(
    deployment: Deployment,
) -> None:
    victim = "c"
    owners = deployment.owners()
    victim_keys = [
        k for k in deployment.truth if owners[partition(k.encode(), PARTITIONS)] == victim
    ]
    killed_at = time.monotonic()
    deployment.processes[victim].signal(signal.SIGKILL)

    def proxy_sees_dead() -> bool:
        return not deployment.proxy.status()["nodes"][victim]["alive"]

    assert wait_for(proxy_sees_dead, 10) is None
    seen_dead_s = time.monotonic() - killed_at
    assert seen_dead_s < TTL_MS / 1000 + 1.0  # the TTL plus a table refresh and a poll

    # Until the group rebalances, its keys are refused (no standby), never answered wrongly.
    _, meanwhile = deployment.via_proxy(victim_keys[0])
    assert meanwhile.status_code in (200, 503), meanwhile.text
    if meanwhile.status_code == 200:  # the group was quick: the new owner answered
        assert meanwhile.json()["node"] != victim

    moved_s = deployment.wait_settled({"a", "b"}, timeout_s=90) + seen_dead_s
    check_every_key(deployment, sorted(deployment.truth))

    # Placed nowhere and dead past the grace period: one of the survivors' agents forgets it,
    # so `nodes` does not keep every id that ever registered.
    keys = deployment.keys

    def forgotten() -> str | None:
        left = [k for k in (keys.node(victim), keys.hosting(victim)) if deployment.redis.exists(k)]
        if deployment.redis.sismember(keys.nodes, victim) or left:
            return f"still described: nodes, {left}"
        if victim in deployment.proxy.status()["nodes"]:
            return "the proxy still lists it"
        return None

    why = wait_for(lambda: forgotten() is None, FORGET_AFTER_MS / 1000 + 15, forgotten)
    assert why is None, why
    assert deployment.redis.smembers(keys.nodes) == {b"a", b"b"}
    report = check(deployment.redis, keys.cluster)
    assert not report.errors, report.as_text()
    print(f"victim seen dead by the proxy after {seen_dead_s:.2f} s; partitions re-owned and "
          f"caught up after {moved_s:.1f} s")  # fmt: skip


def test_merging_touches_only_the_writers_own_entries() -> None:
    store = StoreInfo(STORE, "t", 4)
    first = merged_assignment(None, store, "a", {0, 1}, 10, take=True)
    assert first is not None
    second = merged_assignment(first, store, "b", {2, 3}, 11, take=True)
    assert second is not None
    assert second.generation == first.generation + 1
    assert {p: a.active for p, a in second.stores[STORE].items()} == {
        0: "a", 1: "a", 2: "b", 3: "b"
    }  # fmt: skip
    # "a" gives up 1; a repair by a resuming "b" does not take 0 back from "a".
    third = merged_assignment(second, store, "a", {0}, 12, take=True)
    assert third is not None
    assert third.stores[STORE][1].active is None
    assert merged_assignment(third, store, "b", {0, 2, 3}, 13, take=False) is None
    assert merged_assignment(third, store, "a", {0}, 14, take=True) is None  # nothing changes
