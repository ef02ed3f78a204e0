"""The whole product on one machine, as `kroute run` starts it.

Embedded Kafka broker and redis-server, a `bookings` topic, the demo producer, three
materializer nodes (one standby per partition, the bookings summary transform; started by
kroute.cluster_harness, as the tests and benchmarks start theirs) and the proxy in front of
them, all on 127.0.0.1 and all stopped by PID with the launcher. `failover_demo` kills
the node that is active for the most partitions and keeps looking keys up through the proxy.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from common.java import JavaRuntime
from kroute.cluster_harness import (
    NodeCluster,
    proxy_partition_map,
    replicas_in_role,
    wait_steady,
)
from kroute.demo import customer_id
from kroute.embedded import (
    BrokerHandle,
    EmbeddedServices,
    ManagedProcess,
    RedisHandle,
    kroute_environment,
    port_open,
)
from kroute.errors import KrouteError
from kroute.nodes import NodeHandle
from kroute.proxies import ProxyHandle, start_proxy
from kroute.settings import RunSettings
from kroute.topics import create_topics

CLUSTER = "demo"
TOPIC = "bookings"
NODE_NAMES = ("a", "b", "c")
SAMPLE_CUSTOMERS = tuple(customer_id(n) for n in (1, 2, 3, 7, 42))
# The demo proxy's budget: a replica more than this far behind (in time) is not read from, so a
# reader gets a 503 naming the reason rather than a silently stale (or missing) answer.
DEMO_MAX_LAG_MS = 10_000
# One proxy process (KROUTE_WORKERS=1), not one per core: here the proxy shares the machine
# with three Spark nodes, the broker and Redis, which keep the cores busy while the proxy's C
# path serves the demo's lookups with one core mostly idle. A second worker would buy no
# throughput the demo asks for, cost its memory (a routing table and pools of its own) and
# split what the failover demo shows: each worker ejects a dead node on what it saw itself.
PRODUCT_PROXY_WORKERS = 1

Say = Callable[[str], None]


@dataclass
class Product:
    services: EmbeddedServices
    broker: BrokerHandle
    redis_server: RedisHandle
    producer: ManagedProcess
    cluster: NodeCluster
    proxy: ProxyHandle
    killed: set[str] = field(default_factory=set)

    @property
    def nodes(self) -> dict[str, NodeHandle]:
        return self.cluster.nodes

    @property
    def status_page(self) -> str:
        return f"{self.proxy.admin_url}/cluster"

    def lookup_url(self, customer: str) -> str:
        return f"{self.proxy.url}/stores/{TOPIC}/keys/{customer}"

    def check_running(self) -> None:
        """KrouteError naming the first started process (other than killed nodes) that exited."""
        killed = {self.nodes[name].process.pid for name in self.killed}
        for process in self.services.processes:
            if process.pid not in killed and not process.is_running():
                raise KrouteError(
                    f"{process.name} (pid {process.pid}) exited with code "
                    f"{process.popen.returncode}; its log ends with:\n{process.log_tail()}"
                )


def check_ports_free(settings: RunSettings) -> None:
    for port, variable in (
        (settings.proxy_port, "KROUTE_PROXY_PORT"),
        (settings.admin_port, "KROUTE_ADMIN_PORT"),
    ):
        if port_open(port):
            raise KrouteError(
                f"port {port} on 127.0.0.1 is taken (another kroute run?): stop what uses it, "
                f"or choose another port with {variable}=<port>"
            )


def node_settings(redis_url: str) -> dict[str, str]:
    return {
        "store": TOPIC,
        "transform": "materializer.examples.bookings:booking_summary",
        "merge": "materializer.examples.bookings:merge_summary",
        "spark_master": "local[1]",
        "redis_url": redis_url,
        "cluster": CLUSTER,
        "standbys": "1",
        "log_level": "warning",
    }


def start_product(
    services: EmbeddedServices, settings: RunSettings, java: JavaRuntime, say: Say
) -> Product:
    check_ports_free(settings)
    say("kroute: starting the Kafka broker (Tansu) ...")
    broker = services.start_broker(settings.broker_storage)
    say("kroute: starting redis-server ...")
    redis_server = services.start_redis()
    say(f"kroute: creating topic {TOPIC!r} with {settings.partitions} partitions ...")
    create_topics(broker.bootstrap_servers, {TOPIC: settings.partitions})
    say("kroute: starting the demo producer (railway bookings keyed by customer id) ...")
    producer = services.start_process(
        "demo-producer",
        [sys.executable, "-m", "kroute.demo"],
        env=kroute_environment(
            bootstrap_servers=broker.bootstrap_servers,
            topic=TOPIC,
            demo_rate=f"{settings.demo_rate:g}",
        ),
    )
    say(
        "kroute: starting 3 materializer nodes (each starts Spark on Java "
        f"{java.major}: this takes 15-60 s) ..."
    )
    cluster = NodeCluster(
        services, broker.bootstrap_servers, TOPIC, settings.workdir, node_settings(redis_server.url)
    )
    cluster.start_all(NODE_NAMES)
    cluster.wait_ready(
        timeout_s=max(settings.startup_timeout_s, 180),
        on_ready=lambda name, node: say(f"  node {name} ready at {node.url}"),
    )
    say("kroute: starting the proxy ...")
    proxy = start_proxy(
        services,
        redis_server.url,
        name="proxy",
        port=settings.proxy_port,
        admin_port=settings.admin_port,
        cluster=CLUSTER,
        max_lag_ms=str(DEMO_MAX_LAG_MS),
        log_level="warning",
        workers=PRODUCT_PROXY_WORKERS,
    )
    product = Product(services, broker, redis_server, producer, cluster, proxy)
    say("kroute: waiting for the first bookings to be materialized ...")
    wait_answering(product, timeout_s=max(settings.startup_timeout_s, 120))
    return product


def wait_answering(product: Product, timeout_s: float) -> None:
    """Until every sample customer's lookup through the proxy answers 200."""
    statuses: list[int] = []

    def answering() -> bool | None:
        statuses[:] = [_status(product.proxy, product.lookup_url(c)) for c in SAMPLE_CUSTOMERS]
        return all(status == 200 for status in statuses) or None

    wait_steady(
        answering,
        hold_s=0,
        poll_s=0.5,
        timeout_s=timeout_s,
        check=product.check_running,
        timeout_error=lambda: KrouteError(
            f"lookups still fail after {timeout_s:.0f} s (statuses {statuses}); "
            f"see the logs in {product.services.workdir}/"
        ),
    )


def _status(proxy: ProxyHandle, url: str) -> int:
    try:
        return proxy.client.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def partition_map(product: Product) -> list[dict[str, Any]]:
    """The proxy's view of who holds each partition, with lag (its /cluster/status)."""
    return proxy_partition_map(product.proxy, TOPIC)


def active_counts(product: Product) -> Counter[str]:
    """How many partitions each node is active for."""
    return Counter(node for _, node in replicas_in_role(partition_map(product), "active"))


def standbys_in_budget(product: Product) -> bool:
    """Every partition has a live standby whose time lag is within the demo's budget."""
    entries = partition_map(product)
    return bool(entries) and all(any(_fresh_standby(r) for r in e["replicas"]) for e in entries)


def _fresh_standby(replica: dict[str, Any]) -> bool:
    time_lag = replica["time_lag_ms"]
    return (
        replica["role"] == "standby"
        and replica["alive"]
        and time_lag is not None
        and time_lag <= DEMO_MAX_LAG_MS / 2
    )


def failover_demo(product: Product, say: Say, seconds: float = 20.0) -> tuple[int, int]:
    """Kill -9 the node active for the most partitions; look keys up meanwhile.

    Returns (lookups, failed)."""
    say("")
    say("kroute: failover demo — waiting until every partition has a fresh standby ...")
    deadline = time.monotonic() + 120
    while not standbys_in_budget(product):
        if time.monotonic() > deadline:
            raise KrouteError("standbys did not catch up within 120 s; see /cluster/status")
        time.sleep(1)
    victim, partitions = active_counts(product).most_common(1)[0]
    say(f"kroute: kill -9 node {victim} (active for {partitions} partitions) ...")
    product.killed.add(victim)
    product.nodes[victim].process.signal(9)
    lookups = failed = 0
    by_source: Counter[str] = Counter()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for customer in SAMPLE_CUSTOMERS:
            lookups += 1
            try:
                response = product.proxy.client.get(product.lookup_url(customer), timeout=5)
            except httpx.HTTPError as exc:
                failed += 1
                say(f"  {customer}: failed ({exc})")
                continue
            if response.status_code != 200:
                failed += 1
                say(f"  {customer}: {response.status_code} {response.text[:200]}")
                continue
            headers = response.headers
            by_source[f"node {headers['x-kroute-node']} ({headers['x-kroute-role']})"] += 1
            if lookups <= len(SAMPLE_CUSTOMERS) * 2:
                say(
                    f"  {customer}: 200 from node {headers['x-kroute-node']} "
                    f"({headers['x-kroute-role']}, partition {headers['x-kroute-partition']}, "
                    f"lag {headers['x-kroute-lag']}, "
                    f"time lag {headers.get('x-kroute-time-lag-ms', '?')} ms)"
                )
        time.sleep(0.2)
    say(f"  {lookups} lookups in {seconds:.0f} s after the kill, {failed} failed; answered by:")
    for source, count in by_source.most_common():
        say(f"    {source}: {count}")
    return lookups, failed
