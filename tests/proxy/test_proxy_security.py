"""Security on real processes: the proxy reaches registered nodes inside the allow-list only,
talks to a password-protected Redis without ever logging the password, and keeps its admin
listener on an address of its own behind a token.

(Absolute-form targets, CONNECT and Host tricks are refused in test_proxy_bad_input.py.)
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from kroute.embedded import EmbeddedServices
from kroute.proxies import start_proxy
from partitioner import partition
from tests.proxy.conftest import PARTITIONS, StandIns, running_stand_ins
from tests.proxy.echo_backend import EchoBackend

pytestmark = pytest.mark.integration

REDIS_PASSWORD = "redis-pw-7f3a9c"  # must never appear in a log
ADMIN_TOKEN = "admin-token-5e1b2d"
ROGUE_HOST = "127.0.0.2"  # loopback, but outside the allowed 127.0.0.1/32
ADMIN_HOST = "127.0.0.3"
AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def guarded(embedded: EmbeddedServices) -> Iterator[StandIns]:
    backends = {
        "n0": EchoBackend("n0").start(),
        "n1": EchoBackend("n1").start(),
        "rogue": EchoBackend("rogue", host=ROGUE_HOST).start(),
    }
    with running_stand_ins(
        embedded,
        embedded.start_redis(password=REDIS_PASSWORD),
        backends,
        admin_host=ADMIN_HOST,
        admin_token=ADMIN_TOKEN,
        allowed_networks="127.0.0.1/32",
        lag_report_stale_ms="600000",
        refresh_interval_ms="200",
    ) as running:
        yield running


def proxy_log(guarded: StandIns) -> str:
    return guarded.proxy.process.log_path.read_text(errors="replace")


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
        for line in proxy_log(guarded).splitlines()
        if "ignoring a node outside KROUTE_ALLOWED_NETWORKS" in line
    ]
    assert [(w["node"], w["level"]) for w in warnings] == [("rogue", "warning")]  # once


def test_redis_with_a_password_works_and_the_password_is_never_logged(guarded):
    assert guarded.proxy.is_ready()
    status = guarded.proxy.admin("/cluster/status", headers=AUTH).json()
    assert status["generation"] == guarded.cluster.generation
    assert REDIS_PASSWORD not in proxy_log(guarded)


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
    assert ADMIN_TOKEN not in proxy_log(guarded)


def test_the_data_port_does_not_serve_the_admin_routes(guarded):
    # On the data port /metrics is just an unkeyed request: it goes to a node, never to the
    # proxy's own metrics.
    response = httpx.get(guarded.proxy.url + "/metrics", timeout=5)
    assert response.headers.get("x-backend") in ("n0", "n1")
    assert "kroute_proxy_responses_total" not in response.text
