"""A real proxy process in front of stand-in nodes (echo backends) published in real Redis."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    @property
    def proxy_port(self) -> int:
        return int(self.proxy.url.rsplit(":", 1)[1])

    def send_raw(self, raw: bytes, quiet_s: float, limit_s: float = 10.0) -> bytes:
        """Write `raw` on a new connection to the proxy; what comes back until the proxy
        closes (or resets) the connection or says nothing for `quiet_s`."""
        received = b""
        with socket.create_connection(("127.0.0.1", self.proxy_port), timeout=quiet_s) as sock:
            sock.sendall(raw)
            deadline = time.monotonic() + limit_s
            while time.monotonic() < deadline:
                try:
                    chunk = sock.recv(65536)
                except (TimeoutError, ConnectionResetError):
                    break
                if not chunk:
                    break
                received += chunk
        return received


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
    # The stand-ins answer generated 5xx on purpose: no node is ejected for them here (the
    # C path then answers them itself, and the differential test compares that with Python).
    # Ejection on 5xx is tested in tests/proxy/test_hedging.py.
    "eject_consecutive_5xx": "0",
    "request_timeout_ms": "1500",
    "upstream_timeout_ms": "1000",
    "upstream_idle_timeout_ms": "1000",
    "connect_timeout_ms": "300",
    "refresh_interval_ms": "200",
    "max_header_bytes": "4096",
    "max_headers": "20",
    "max_body_bytes": "1000",
    "lag_report_stale_ms": "600000",
}


@contextmanager
def running_stand_ins(
    embedded: EmbeddedServices,
    redis_server: RedisHandle,
    backends: dict[str, EchoBackend],
    **proxy_settings: str,
) -> Iterator[StandIns]:
    """`backends` published as a cluster in `redis_server`, a proxy before them; everything
    (backends and redis-server included) stopped afterwards."""
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")
    published_at_ms = int(time.time() * 1000)
    cluster = publish_stand_ins(client, keys, backends)
    proxy = start_proxy(
        embedded,
        redis_server.url,
        name=f"proxy-{keys.cluster}",
        cluster=keys.cluster,
        **proxy_settings,
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


@pytest.fixture(scope="module")
def stand_ins(embedded: EmbeddedServices) -> Iterator[StandIns]:
    redis_server = embedded.start_redis()  # its own: a test restarts it
    backends = {f"n{i}": EchoBackend(f"n{i}").start() for i in range(3)}
    with running_stand_ins(embedded, redis_server, backends, **PROXY_SETTINGS) as running:
        yield running


def table_processes(pid: int) -> list[int]:
    """`pid`'s children running the table process (by their command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if int(parent) == pid and b"proxy.table_process" in command and state != "Z":
            found.append(int(entry.name))
    return found


def wait_for(check: Any, what: str, limit_s: float = 10.0) -> Any:
    """`check()` once it is true (polled every 50 ms), or a failed assertion naming `what`."""
    deadline = time.monotonic() + limit_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
