"""A real proxy process in front of stand-in nodes (echo backends) published in real Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from common.contract import Keys, StoreInfo
from kroute.embedded import EmbeddedServices, RedisHandle
from kroute.proxies import ProxyHandle, start_proxy
from kroute.static_cluster import StaticCluster
from tests.proxy.echo_backend import EchoBackend

PARTITIONS = 12


@dataclass
class StandIns:
    """Three echo backends as nodes n0..n2, their cluster in Redis, and a proxy before them."""

    services: EmbeddedServices
    redis_server: RedisHandle
    redis: redis.Redis
    backends: dict[str, EchoBackend]
    cluster: StaticCluster
    proxy: ProxyHandle

    published_at_ms: int = 0

    def publish(self) -> None:
        self.published_at_ms = int(time.time() * 1000)
        self.cluster.publish(self.redis)

    def received(self) -> int:
        return sum(len(b.requests) for b in self.backends.values())


def publish_stand_ins(
    client: redis.Redis, keys: Keys, backends: dict[str, EchoBackend]
) -> StaticCluster:
    cluster = StaticCluster(keys, {name: backend.url for name, backend in backends.items()})
    for name, key_format in (("customers", "string"), ("cards", "int64"), ("devices", "uuid")):
        cluster.add_store(StoreInfo(name, name, PARTITIONS, key_format))
    cluster.publish(client)
    return cluster


# The stand-in proxy's settings (KROUTE_* without the prefix); short timeouts keep tests quick.
PROXY_SETTINGS = {
    "routes": '[{"path": "/stores/{store}/keys/{key}"},'
    ' {"path": "/lookup", "store": "customers", "key": "query:id"},'
    ' {"path": "/check", "store": "cards", "key": "header:x-card"}]',
    "eject_ms": "300",
    "probe_interval_ms": "50",
    "request_timeout_ms": "1500",
    "upstream_timeout_ms": "1000",
    "connect_timeout_ms": "300",
    "refresh_interval_ms": "200",
    "max_header_bytes": "4096",
    "max_headers": "20",
    "max_body_bytes": "1000",
    "lag_report_stale_ms": "600000",
}


@pytest.fixture(scope="module")
def stand_ins(embedded: EmbeddedServices) -> Iterator[StandIns]:
    redis_server = embedded.start_redis()  # its own: a test restarts it
    client = redis.Redis.from_url(redis_server.url)
    backends = {f"n{i}": EchoBackend(f"n{i}").start() for i in range(3)}
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")
    published_at_ms = int(time.time() * 1000)
    cluster = publish_stand_ins(client, keys, backends)
    proxy = start_proxy(
        embedded,
        redis_server.url,
        name=f"proxy-{keys.cluster}",
        cluster=keys.cluster,
        **PROXY_SETTINGS,
    )
    try:
        yield StandIns(embedded, redis_server, client, backends, cluster, proxy, published_at_ms)
    finally:
        proxy.process.stop()
        proxy.close()
        for backend in backends.values():
            backend.shutdown()
        client.close()
        redis_server.process.stop()
