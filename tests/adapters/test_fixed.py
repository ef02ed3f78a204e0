"""`kroute adapt fixed` as a real process: a placement file in front of three real HTTP
backends, real redis-server, the embedded broker (lag from a consumer group's commits) and a
real proxy. Also: what it says about bad files."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from confluent_kafka import Consumer, Producer, TopicPartition

from common.contract import Keys, decode_report, lag_field
from kroute.cli import main
from kroute.contract_check import check
from kroute.embedded import BrokerHandle, EmbeddedServices, ManagedProcess, RedisHandle
from kroute.proxies import ProxyHandle, start_proxy
from kroute.topics import create_topics
from partitioner import partition
from tests.proxy.echo_backend import EchoBackend

PARTITIONS = 6
NODES = ("n0", "n1", "n2")
INTERVAL_MS = 200
# Keys whose partitions' consumer group committed these offsets (the others never committed).
COMMITTED = {0: 5, 1: 20}
RECORDS_PER_PARTITION = 20


def placement_for(backends: dict[str, EchoBackend], topic: str, bootstrap: str) -> dict:  # type: ignore[type-arg]
    """Partition p: active n(p % 3), standby the next node."""
    return {
        "nodes": {name: backend.url for name, backend in backends.items()},
        "stores": {
            "customers": {
                "topic": topic,
                "partitions": PARTITIONS,
                "placement": {
                    str(p): {"active": NODES[p % 3], "standbys": [NODES[(p + 1) % 3]]}
                    for p in range(PARTITIONS)
                },
            }
        },
        "health": {"interval_ms": INTERVAL_MS, "timeout_ms": 500, "dead_after": 2},
        "lag": {
            "source": "consumer_group",
            "bootstrap_servers": bootstrap,
            "group": f"group-{topic}",
            "interval_ms": 300,
        },
    }


@dataclass
class Fronted:
    backends: dict[str, EchoBackend]
    adapter: ManagedProcess
    proxy: ProxyHandle
    redis: redis.Redis
    keys: Keys
    topic: str

    def every_partition_placed(self) -> bool:
        keys = {partition(f"p{i}".encode(), PARTITIONS): f"p{i}" for i in range(200)}
        assert len(keys) == PARTITIONS
        return all(
            self.proxy.get(f"/stores/customers/keys/{key}").status_code != 503
            for key in keys.values()
        )

    def alive_in_proxy(self) -> dict[str, bool]:
        return {n: v["alive"] for n, v in self.proxy.status()["nodes"].items()}


def wait_for(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.05)
    return False


def produce_and_commit(bootstrap: str, topic: str) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for p in range(PARTITIONS):
        for i in range(RECORDS_PER_PARTITION):
            producer.produce(topic, key=f"k{i}".encode(), value=b"{}", partition=p)
    assert producer.flush(30) == 0
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"group-{topic}"})
    try:
        offsets = [TopicPartition(topic, p, o) for p, o in COMMITTED.items()]
        consumer.commit(offsets=offsets, asynchronous=False)
    finally:
        consumer.close()


@pytest.fixture(scope="module")
def fronted(
    embedded: EmbeddedServices, broker: BrokerHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Fronted]:
    redis_server: RedisHandle = embedded.start_redis()
    keys = Keys(f"fixed-{uuid.uuid4().hex[:8]}")
    topic = f"fixed-{keys.cluster}"
    create_topics(broker.bootstrap_servers, {topic: PARTITIONS})
    produce_and_commit(broker.bootstrap_servers, topic)
    backends = {name: EchoBackend(name).start() for name in NODES}
    path = tmp_path_factory.mktemp("fixed") / "placement.json"
    path.write_text(json.dumps(placement_for(backends, topic, broker.bootstrap_servers)))
    command = [sys.executable, "-m", "kroute", "adapt", "fixed", "--placement", str(path),
               "--redis", redis_server.url, "--cluster", keys.cluster]  # fmt: skip
    adapter = embedded.start_process(f"adapt-{keys.cluster}", command)
    proxy = start_proxy(
        embedded, redis_server.url, name=f"proxy-{keys.cluster}", cluster=keys.cluster,
        refresh_interval_ms="200", probe_interval_ms="50", eject_ms="300",
    )  # fmt: skip
    built = Fronted(backends, adapter, proxy, redis.Redis.from_url(redis_server.url), keys, topic)
    try:
        assert wait_for(lambda: all(built.alive_in_proxy().values()), 15), adapter.log_tail()
        # Liveness and what each node serves reach the proxy by different reads: wait for a
        # replica of every partition too.
        assert wait_for(built.every_partition_placed, 15), adapter.log_tail()
        yield built
    finally:
        adapter.stop()
        proxy.process.stop()
        proxy.close()
        for backend in backends.values():
            backend.shutdown()
        built.redis.close()
        redis_server.process.stop()


def ask(fronted: Fronted, key: str) -> tuple[str, dict]:  # type: ignore[type-arg]
    request_id = uuid.uuid4().hex
    response = fronted.proxy.get(
        f"/stores/customers/keys/{key}", headers={"x-request-id": request_id}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert ("x-request-id", request_id) in [tuple(h) for h in body["headers"]]  # this request's
    assert body["node"] == response.headers["x-backend"] == response.headers["x-kroute-node"]
    return response.headers["x-kroute-role"], body


@pytest.mark.timeout(120)
def test_every_key_goes_to_the_active_the_file_names(fronted: Fronted) -> None:
    for i in range(60):
        key = f"customer-{i}"
        role, body = ask(fronted, key)
        assert role == "active"
        assert body["node"] == NODES[partition(key.encode(), PARTITIONS) % 3]
        assert body["target"] == f"/stores/customers/keys/{key}"
    report = check(fronted.redis, fronted.keys.cluster)
    assert not report.errors, report.as_text()


@pytest.mark.timeout(120)
def test_lag_is_the_groups_commits_against_the_high_watermarks(fronted: Fronted) -> None:
    def reported(node: str, p: int) -> int | None:
        raw = fronted.redis.hget(fronted.keys.lag(node), lag_field("customers", p))
        return decode_report(raw).lag if raw else None

    expected = {
        p: RECORDS_PER_PARTITION - COMMITTED.get(p, 0) for p in range(PARTITIONS)
    }  # never committed: from 0, an upper bound
    assert wait_for(
        lambda: all(reported(NODES[p % 3], p) == lag for p, lag in expected.items()), 10
    ), {p: reported(NODES[p % 3], p) for p in range(PARTITIONS)}
    # one group for all replicas: its commits are the actives', so standbys have unknown lag
    assert all(reported(NODES[(p + 1) % 3], p) is None for p in range(PARTITIONS))
    caught_up = next(p for p, lag in expected.items() if lag == 0)
    key = next(f"k{i}" for i in range(1000) if partition(b"k%d" % i, PARTITIONS) == caught_up)

    def served_within_lag_0() -> bool:  # the proxy reads the reports on its own schedule
        answer = fronted.proxy.get(
            f"/stores/customers/keys/{key}", headers={"x-kroute-max-lag": "0"}
        )
        return answer.status_code == 200

    assert wait_for(served_within_lag_0, 10)
    behind = next(p for p, lag in expected.items() if lag > 0)
    key = next(f"k{i}" for i in range(1000) if partition(b"k%d" % i, PARTITIONS) == behind)
    response = fronted.proxy.get(f"/stores/customers/keys/{key}", headers={"x-kroute-max-lag": "0"})
    assert response.status_code == 503


@pytest.mark.timeout(120)
def test_liveness_flips_with_a_stopped_backend(fronted: Fronted) -> None:
    stopped = "n1"
    key = next(
        f"c{i}" for i in range(1000) if NODES[partition(b"c%d" % i, PARTITIONS) % 3] == stopped
    )
    fronted.backends[stopped].stop()
    started = time.monotonic()
    assert wait_for(lambda: not fronted.alive_in_proxy()[stopped], 5)
    seen_dead_s = time.monotonic() - started
    assert fronted.redis.exists(fronted.keys.alive(stopped)) == 0  # deleted, not left to expire
    role, body = ask(fronted, key)
    assert (role, body["node"]) == ("standby", NODES[(partition(key.encode(), PARTITIONS) + 1) % 3])

    fronted.backends[stopped].restart()
    started = time.monotonic()
    assert wait_for(lambda: fronted.alive_in_proxy()[stopped], 5)
    back_s = time.monotonic() - started

    def active_again() -> bool:
        return ask(fronted, key)[0] == "active"

    assert wait_for(active_again, 5)  # after the proxy's own ejection ends
    print(f"stopped backend seen dead after {seen_dead_s:.2f} s, alive after {back_s:.2f} s")


GOOD = {
    "nodes": {"a": "http://127.0.0.1:8001", "b": "http://127.0.0.1:8002"},
    "stores": {
        "s": {
            "topic": "t",
            "partitions": 2,
            "placement": {"0": {"active": "a", "standbys": ["b"]}, "1": {"active": "b"}},
        }
    },
}


def _with(change: Callable[[dict], None]) -> dict:  # type: ignore[type-arg]
    spec = json.loads(json.dumps(GOOD))
    change(spec)
    return spec


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{nodes: 1}", "Invalid JSON"),
        (json.dumps(_with(lambda s: s["stores"]["s"]["placement"].pop("1"))),
         "partitions [1] are not placed"),
        (json.dumps(_with(lambda s: s["stores"]["s"]["placement"].update(
            {"7": {"active": "a"}}))), "partitions [7] are outside 0..1"),
        (json.dumps(_with(lambda s: s["stores"]["s"]["placement"]["0"].update(active="z"))),
         "nodes ['z'] are not in \"nodes\""),
        (json.dumps(_with(lambda s: s["nodes"].update(a="https://x:1"))),
         "'https://x:1' is not http://host:port"),
        (json.dumps(_with(lambda s: s["stores"]["s"].update(key_format="yaml"))),
         "stores.s.key_format: 'yaml' is not one of"),
        (json.dumps(_with(lambda s: s["stores"]["s"]["placement"]["0"].update(standbys=["a"]))),
         "names a node twice"),
        (json.dumps(_with(lambda s: s.update(lag={"source": "consumer_group"}))),
         "lag.consumer_group.bootstrap_servers: Field required"),
        (json.dumps(_with(lambda s: s.update(extra=1))), "extra: Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_a_bad_file_is_refused_saying_where_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, words: str
) -> None:
    path = tmp_path / "placement.json"
    path.write_text(content)
    argv = ["adapt", "fixed", "--placement", str(path), "--redis", "redis://127.0.0.1:1", "--check"]
    assert main(argv) == 2  # a usage error
    error = capsys.readouterr().err
    assert str(path) in error
    assert words in error, error


def test_a_good_file_passes_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(GOOD))
    argv = ["adapt", "fixed", "--placement", str(path), "--redis", "redis://127.0.0.1:1", "--check"]
    assert main(argv) == 0
    assert "2 nodes; stores s (2 partitions)" in capsys.readouterr().out
    missing = tmp_path / "missing.json"
    assert main(["adapt", "fixed", "--placement", str(missing), "--redis", "x", "--check"]) == 2
    assert "cannot read" in capsys.readouterr().err
