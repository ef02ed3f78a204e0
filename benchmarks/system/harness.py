"""The system benchmark's cluster: services, three nodes, two proxies, a writer that remembers.

One Tansu broker, one redis-server, three materializer nodes (Spark local[1] each, 12
partitions, one standby per partition, a 45 s grace period: Kafka's default consumer session
timeout) started by kroute.cluster_harness, and two kroute proxies in front of them: the
product as configured by default and one restricted to actives (`KROUTE_STANDBY_READS=false`).
Every experiment module takes the `Bench` this starts.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.loadgen import Request, SteadyLoad
from benchmarks.sampling import ProcessSampler
from kroute.cluster_harness import (
    NodeCluster,
    keyed_producer,
    proxy_partition_map,
    replicas_in_role,
    wait_steady,
)
from kroute.demo import customer_id, popular_customers
from kroute.embedded import EmbeddedServices
from kroute.nodes import NodeHandle
from kroute.proxies import ProxyHandle, start_proxy
from kroute.topics import create_topics
from partitioner import partition

PARTITIONS = 12

CUSTOMERS = 20_000

NODE_NAMES = ("a", "b", "c")

STORE = "customers"

TOPIC = "customers"

GRACE_S = 45  # Kafka's default consumer session.timeout.ms: when Kafka Streams would move them

UPSTREAM_TIMEOUT_MS = 2000  # the proxy's default


def key_path(key: str) -> str:
    return f"/stores/{STORE}/keys/{key}"


def node_settings(redis_url: str) -> dict[str, str]:
    """Every node's settings (KROUTE_* names without the prefix)."""
    return {
        "store": STORE,
        "spark_master": "local[1]",
        "redis_url": redis_url,
        "cluster": "bench",
        "standbys": "1",
        "grace_period_s": str(GRACE_S),
        "log_level": "warning",
    }


def partition_of(key: str) -> int:
    return partition(key.encode(), PARTITIONS)


class Writer:
    """Produces JSON records and remembers when each key was written (before produce())."""

    def __init__(self, bootstrap: str) -> None:
        self._producer = keyed_producer(bootstrap, linger_ms=0)
        self._lock = threading.Lock()
        self.written: dict[str, list[tuple[int, float]]] = defaultdict(list)  # key -> (n, at)
        self._count = itertools.count()
        self._acked: dict[str, list[tuple[int, int]]] = defaultdict(list)  # key -> (n, offset)

    def write(self, key: str) -> None:
        n = next(self._count)
        at = time.time()
        value = json.dumps({"customer": key, "n": n, "written_ms": int(at * 1000)})

        def acked(err: Any, msg: Any, key: str = key, n: int = n) -> None:
            if err is None:
                with self._lock:
                    self._acked[key].append((n, msg.offset()))

        with self._lock:
            self.written[key].append((n, at))
        self._producer.produce(TOPIC, key=key.encode(), value=value.encode(), on_delivery=acked)
        self._producer.poll(0)

    def flush(self) -> None:
        if self._producer.flush(60) != 0:
            raise RuntimeError("records were not delivered within 60 s")

    def oldest_unseen_write(self, key: str, seen_n: int) -> float | None:
        """Write time of the oldest write to `key` after record n == seen_n; None if none."""
        with self._lock:
            later = [at for n, at in self.written.get(key, []) if n > seen_n]
        return min(later) if later else None


class SteadyWriter:
    """Writes to `keys` at `rate` per second from a thread until stopped."""

    def __init__(self, writer: Writer, keys: list[str], rate: float) -> None:
        self._writer, self._keys, self._rate = writer, keys, rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def start(self) -> SteadyWriter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._writer.flush()

    def _run(self) -> None:
        rng = random.Random(7)
        next_at = time.monotonic()
        while not self._stop.is_set():
            self._writer.write(rng.choice(self._keys))
            next_at += 1 / self._rate
            self._stop.wait(max(0.0, next_at - time.monotonic()))


@dataclass
class Bench:
    services: EmbeddedServices
    workdir: Path
    redis_url: str
    sampler: ProcessSampler
    writer: Writer
    cluster: NodeCluster
    proxy: ProxyHandle | None = None
    actives_only: ProxyHandle | None = None
    service_pids: list[int] = field(default_factory=list)  # the broker's and redis-server's

    @property
    def kroute(self) -> ProxyHandle:
        assert self.proxy is not None
        return self.proxy

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    @property
    def nodes(self) -> dict[str, NodeHandle]:
        return self.cluster.nodes

    def start_node(self, name: str, *, wipe: bool = False) -> NodeHandle:
        node = self.cluster.start(name, wipe=wipe)
        self.sampler.watch(f"node-{name}", node.process.pid)
        return node

    def partition_map(self) -> list[dict[str, Any]]:
        return proxy_partition_map(self.kroute, STORE)

    def actives(self) -> dict[int, str]:
        return dict(replicas_in_role(self.partition_map(), "active"))

    def standbys(self) -> dict[int, str]:
        return dict(replicas_in_role(self.partition_map(), "standby"))

    def settled(self) -> bool:
        """Every partition has a live active and a live standby, both with lag under 50."""
        entries = self.partition_map()
        if len(entries) != PARTITIONS:
            return False
        for entry in entries:
            replicas = entry["replicas"]
            roles = sorted(r["role"] for r in replicas)
            if roles != ["active", "standby"]:
                return False
            if not all(r["alive"] and r["lag"] is not None and r["lag"] < 50 for r in replicas):
                return False
        return len({r["node"] for e in entries for r in e["replicas"]}) == len(NODE_NAMES)

    def wait_settled(self, timeout_s: float = 240) -> None:
        wait_steady(
            lambda: self.settled() or None,
            hold_s=3,
            poll_s=0.5,
            timeout_s=timeout_s,
            check=self.cluster.check_running,
            timeout_error=lambda: TimeoutError(f"cluster did not settle: {self.partition_map()}"),
        )


def say(text: str) -> None:
    print(text, flush=True)


def start_bench(services: EmbeddedServices, workdir: Path) -> Bench:
    sampler = ProcessSampler().start()
    say("starting the broker and redis-server ...")
    broker = services.start_broker()
    redis_server = services.start_redis()
    sampler.watch("broker", broker.process.pid)
    sampler.watch("redis", redis_server.process.pid)
    create_topics(broker.bootstrap_servers, {TOPIC: PARTITIONS})
    writer = Writer(broker.bootstrap_servers)
    say(f"writing {CUSTOMERS:,} customers ...")
    for number in range(CUSTOMERS):
        writer.write(customer_id(number))
    writer.flush()
    cluster = NodeCluster(
        services, broker.bootstrap_servers, TOPIC, workdir, node_settings(redis_server.url)
    )
    bench = Bench(services, workdir, redis_server.url, sampler, writer, cluster)
    bench.service_pids = [broker.process.pid, redis_server.process.pid]
    say("starting three materializer nodes (Spark) ...")
    for name in NODE_NAMES:
        bench.start_node(name)
    cluster.wait_ready(timeout_s=240)
    bench.proxy = start_proxy(services, redis_server.url, name="proxy", cluster="bench")
    bench.actives_only = start_proxy(
        services,
        redis_server.url,
        name="proxy-actives-only",
        cluster="bench",
        standby_reads="false",
    )
    sampler.watch("proxy", bench.proxy.process.pid)
    sampler.watch("proxy-actives-only", bench.actives_only.process.pid)
    say("waiting until every partition has a caught-up active and standby ...")
    bench.wait_settled()
    return bench


def key_samples(distribution: str, count: int = 200_000) -> list[str]:
    rng = random.Random(11)
    if distribution == "zipf":
        return list(itertools.islice(popular_customers(rng, CUSTOMERS), count))
    return [customer_id(rng.randrange(CUSTOMERS)) for _ in range(count)]


def lookups(keys: list[str], headers: tuple[tuple[str, str], ...] = ()) -> Iterator[Request]:
    return (Request(key_path(k), headers) for k in itertools.cycle(keys))


def steady_load(proxy: ProxyHandle, keys: list[str], rate: float, **kwargs: Any) -> SteadyLoad:
    port = int(proxy.url.rsplit(":", 1)[1])
    return SteadyLoad("127.0.0.1", port, lookups(keys), rate=rate, **kwargs).start()


def most_active(bench: Bench) -> tuple[str, list[int]]:
    by_node: dict[str, list[int]] = defaultdict(list)
    for p, node in bench.actives().items():
        by_node[node].append(p)
    name = max(sorted(by_node), key=lambda n: len(by_node[n]))
    return name, sorted(by_node[name])
