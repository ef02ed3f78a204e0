"""Security on real processes: the proxy reaches registered nodes inside the allow-list only,
talks to a password-protected Redis without ever logging the password, and keeps its admin
listener on an address of its own behind a token.

(Absolute-form targets, CONNECT and Host tricks are refused in test_proxy_bad_input.py.)
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from common.contract import Keys, StoreInfo
from kroute.embedded import EmbeddedServices, RedisHandle
from kroute.proxies import ProxyHandle, start_proxy
from kroute.static_cluster import StaticCluster
from partitioner import partition
from tests.proxy.echo_backend import EchoBackend

pytestmark = pytest.mark.integration

PARTITIONS = 12
REDIS_PASSWORD = "redis-pw-7f3a9c"  # must never appear in a log
ADMIN_TOKEN = "admin-token-5e1b2d"
ROGUE_HOST = "127.0.0.2"  # loopback, but outside the allowed 127.0.0.1/32
ADMIN_HOST = "127.0.0.3"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@dataclass
class Guarded:
    services: EmbeddedServices
    redis_server: RedisHandle
    backends: dict[str, EchoBackend]
    cluster: StaticCluster
    proxy: ProxyHandle

    def proxy_log(self) -> str:
        return self.proxy.process.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def guarded(embedded: EmbeddedServices) -> Iterator[Guarded]:
    redis_server = embedded.start_redis(password=REDIS_PASSWORD)
    client = redis.Redis.from_url(redis_server.url)
    backends = {
        "n0": EchoBackend("n0").start(),
        "n1": EchoBackend("n1").start(),
        "rogue": EchoBackend("rogue", host=ROGUE_HOST).start(),
    }
    keys = Keys(f"sec-{uuid.uuid4().hex[:8]}")
    cluster = StaticCluster(keys, {name: b.url for name, b in backends.items()})
    cluster.add_store(StoreInfo("customers", "customers", PARTITIONS, "string"))
    cluster.publish(client)
    proxy = start_proxy(
        embedded,
        redis_server.url,
        name=f"proxy-{keys.cluster}",
        cluster=keys.cluster,
        admin_host=ADMIN_HOST,
        admin_token=ADMIN_TOKEN,
        allowed_networks="127.0.0.1/32",
        lag_report_stale_ms="600000",
        refresh_interval_ms="200",
    )
    try:
        yield Guarded(embedded, redis_server, backends, cluster, proxy)
    finally:
        proxy.process.stop()
        proxy.close()
        for backend in backends.values():
            backend.shutdown()
        client.close()
        redis_server.process.stop()


def keys_per_partition() -> dict[int, str]:
    found: dict[int, str] = {}
    i = 0
    while len(found) < PARTITIONS:
        key = f"customer-{i}"
        found.setdefault(partition(key.encode(), PARTITIONS), key)
        i += 1
    return found


def test_a_node_registered_outside_the_allowed_networks_gets_no_traffic(guarded):
    rogue_partitions = {
        p
        for p, placed in guarded.cluster.placements["customers"].items()
        if placed.active == "rogue"
    }
    assert rogue_partitions, "the rogue node must be active somewhere for this test to mean much"
    for p, key in keys_per_partition().items():
        response = guarded.proxy.get(f"/stores/customers/keys/{key}")
        assert response.status_code == 200, response.text
        assert response.headers["x-backend"] in ("n0", "n1")
        if p in rogue_partitions:  # its standby answers instead
            assert response.headers["x-kroute-role"] == "standby"
    for _ in range(10):  # unkeyed requests go round robin over the allowed nodes only
        assert guarded.proxy.get("/healthz").headers["x-backend"] in ("n0", "n1")
    assert guarded.backends["rogue"].requests == []
    assert guarded.backends["rogue"].connections == 0
    warnings = [
        json.loads(line)
        for line in guarded.proxy_log().splitlines()
        if "ignoring a node outside KROUTE_ALLOWED_NETWORKS" in line
    ]
    assert [(w["node"], w["level"]) for w in warnings] == [("rogue", "warning")]  # once


def test_redis_with_a_password_works_and_the_password_is_never_logged(guarded):
    assert guarded.proxy.is_ready()
    status = guarded.proxy.admin("/cluster/status", headers=AUTH).json()
    assert status["generation"] == guarded.cluster.generation
    assert REDIS_PASSWORD not in guarded.proxy_log()


def test_a_wrong_redis_password_is_reported_without_the_password(guarded):
    wrong = "wrong-pw-0c4d8e"
    url = guarded.redis_server.url.replace(REDIS_PASSWORD, wrong)
    proxy = start_proxy(
        guarded.services, url, name="proxy-wrong-password", wait_ready=False, redis_timeout_ms="500"
    )
    try:
        time.sleep(2)
        assert proxy.is_live()
        assert not proxy.is_ready()
        log = proxy.process.log_path.read_text(errors="replace")
        assert "redis" in log.lower()
        assert wrong not in log
        assert REDIS_PASSWORD not in log
    finally:
        proxy.process.stop()
        proxy.close()


def test_the_admin_listener_has_its_own_address_and_wants_the_token(guarded):
    proxy = guarded.proxy
    admin_port = int(proxy.admin_url.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):  # not on the data address
        socket.create_connection(("127.0.0.1", admin_port), timeout=2).close()
    assert proxy.admin("/health/live").status_code == 200  # probes need no token
    assert proxy.admin("/health/ready").status_code == 200
    for path in ("/metrics", "/cluster/status", "/cluster"):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": ADMIN_TOKEN}):
            refused = proxy.admin(path, headers=headers)
            assert refused.status_code == 401, (path, headers)
            assert refused.json()["error"]
            assert ADMIN_TOKEN not in refused.text
        allowed = proxy.admin(path, headers=AUTH)
        assert allowed.status_code == 200, path
    assert proxy.admin(f"/cluster?token={ADMIN_TOKEN}").status_code == 200  # in a browser
    assert ADMIN_TOKEN not in guarded.proxy_log()


def test_the_data_port_does_not_serve_the_admin_routes(guarded):
    # On the data port /metrics is just an unkeyed request: it goes to a node, never to the
    # proxy's own metrics.
    response = httpx.get(guarded.proxy.url + "/metrics", timeout=5)
    assert response.headers.get("x-backend") in ("n0", "n1")
    assert "kroute_proxy_responses_total" not in response.text
