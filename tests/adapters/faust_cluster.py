"""A real Faust app (tests/adapters/faust_app.py) on the embedded broker, with kroute in front.

Workers, the adapter (`kroute adapt faust`, as a process) and the proxy all run under the
embedded-services launcher: loopback, free ports, stopped by PID. Used by the tests and by
benchmarks/front_existing.py.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx
from confluent_kafka import Producer

from kroute.embedded import (
    BrokerHandle,
    EmbeddedServices,
    ManagedProcess,
    RedisHandle,
    free_port,
    kroute_environment,
)
from kroute.proxies import ProxyHandle, start_proxy
from kroute.topics import create_topics
from partitioner import partition, serialize_key

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 6
TABLE = "counts"
STORE = "counts"
# Faust's view is /count/<key>/: the trailing slash is an empty last segment, matched by `*`.
PROXY_ROUTES = json.dumps([{"path": "/count/{key}/*", "store": STORE}])


@dataclass
class FaustCluster:
    services: EmbeddedServices
    broker: BrokerHandle
    redis_server: RedisHandle
    app_id: str
    topic: str
    workdir: Path
    workers: dict[str, ManagedProcess] = field(default_factory=dict)  # canonical URL -> process
    adapter: ManagedProcess | None = None
    proxy: ProxyHandle | None = None
    expected: Counter[str] = field(default_factory=Counter)  # key -> records produced

    @property
    def cluster(self) -> str:
        return self.app_id

    def start_worker(self) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = kroute_environment()
        env.update(
            {
                "PYTHONPATH": str(ROOT),
                "FAUST_APP_ID": self.app_id,
                "FAUST_BROKER": self.broker.bootstrap_servers,
                "FAUST_TOPIC": self.topic,
                "FAUST_PARTITIONS": str(PARTITIONS),
                "FAUST_WEB_PORT": str(port),
                "FAUST_DATADIR": str(self.workdir / f"worker-{port}"),
            }
        )
        command = [sys.executable, "-m", "tests.adapters.faust_app"]
        self.workers[url] = self.services.start_process(
            f"faust-{port}", command, env=env, ready=lambda: _answers(url + "/router/")
        )
        return url

    def start_adapter(self, *extra: str) -> ManagedProcess:
        command = [
            sys.executable, "-m", "kroute", "adapt", "faust",
            *(arg for url in self.workers for arg in ("--worker", url)),
            "--table", TABLE, "--store", STORE,
            "--redis", self.redis_server.url, "--bootstrap", self.broker.bootstrap_servers,
            "--cluster", self.cluster, "--interval-ms", "250", "--alive-ttl-ms", "1500",
            "--timeout-ms", "500", *extra,
        ]  # fmt: skip
        self.adapter = self.services.start_process("faust-adapter", command)
        return self.adapter

    def start_proxy(self, **settings: str) -> ProxyHandle:
        self.proxy = start_proxy(
            self.services,
            self.redis_server.url,
            name=f"proxy-{self.cluster}",
            cluster=self.cluster,
            routes=PROXY_ROUTES,
            refresh_interval_ms="200",
            eject_ms="300",
            probe_interval_ms="100",
            **settings,
        )
        return self.proxy

    def produce(self, keys: list[str], times: int = 1) -> None:
        """Each key `times` times, keyed as Faust keys tables (JSON), by librdkafka."""
        producer = Producer(
            {
                "bootstrap.servers": self.broker.bootstrap_servers,
                "partitioner": "murmur2_random",  # Java's (and aiokafka's) partitioner
                "linger.ms": 5,
            }
        )
        for _ in range(times):
            for key in keys:
                # orjson's bytes, as Faust writes and hashes them
                producer.produce(self.topic, key=serialize_key(key, "json"), value=b'"seen"')
                self.expected[key] += 1
        assert producer.flush(30) == 0

    def owner_partition(self, key: str) -> int:
        return partition(serialize_key(key, "json"), PARTITIONS)

    def stop(self) -> None:
        for process in [self.adapter, *self.workers.values()]:
            if process is not None:
                process.stop()
        if self.proxy is not None:
            self.proxy.process.stop()
            self.proxy.close()


def start_faust_cluster(
    services: EmbeddedServices,
    broker: BrokerHandle,
    redis_server: RedisHandle,
    workdir: Path,
    workers: int = 2,
) -> FaustCluster:
    app_id = f"faust-{uuid.uuid4().hex[:8]}"
    topic = f"{app_id}-events"
    create_topics(broker.bootstrap_servers, {topic: PARTITIONS})
    cluster = FaustCluster(services, broker, redis_server, app_id, topic, workdir)
    for _ in range(workers):
        cluster.start_worker()
    return cluster


def wait_until_placed(cluster: FaustCluster, timeout_s: float = 90) -> None:
    """Until every running worker's router agrees that each running worker owns partitions.

    Produce only after this: once, a worker that joined later restored partitions from the
    changelog one update short on Tansu (docs/faust.md, "Tansu"), through Faust alike.
    """
    running = sorted(url for url, process in cluster.workers.items() if process.is_running())
    deadline = time.monotonic() + timeout_s
    views: list[object] = []
    while time.monotonic() < deadline:
        try:
            views = [httpx.get(f"{url}/router/", timeout=2).json() for url in running]
        except httpx.HTTPError:
            views = []
        if views and all(v == views[0] for v in views):
            owners = {url for url, topics in views[0].items() if any(topics.values())}
            if owners == set(running):
                return
        time.sleep(0.3)
    raise AssertionError(f"Faust's workers did not settle: {views}")


def wait_until_counted(cluster: FaustCluster, keys: list[str], timeout_s: float = 90) -> None:
    """Until Faust itself answers every key's expected count (asking any worker)."""
    deadline = time.monotonic() + timeout_s
    worker = next(iter(cluster.workers))
    pending = list(keys)
    with httpx.Client(timeout=2, trust_env=False) as client:
        while pending and time.monotonic() < deadline:
            try:
                answered = client.get(f"{worker}/count/{quote(pending[0], safe='')}/")
            except httpx.HTTPError:
                answered = None
            counted = answered.json()["count"] if answered and answered.status_code == 200 else None
            if counted == cluster.expected[pending[0]]:
                pending.pop(0)
                continue
            time.sleep(0.2)
    assert not pending, f"Faust did not count {len(pending)} keys, e.g. {pending[:3]}"


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False
