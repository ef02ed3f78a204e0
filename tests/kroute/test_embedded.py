"""The embedded-services launcher starts real services on loopback and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from confluent_kafka.admin import AdminClient

from kroute.embedded import LOOPBACK, EmbeddedServices, free_port
from kroute.errors import ServiceStartError

pytestmark = pytest.mark.integration


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still has a PID until its parent reaps it; it is not running.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_until_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if pid_alive(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if pid_alive(pid)]


def test_services_answer_on_loopback_and_stop_by_pid(tmp_path):
    with EmbeddedServices(tmp_path) as services:
        broker = services.start_broker()
        redis_server = services.start_redis()
        pids = [p.pid for p in services.processes]

        assert broker.bootstrap_servers == f"{LOOPBACK}:{broker.port}"
        metadata = AdminClient({"bootstrap.servers": broker.bootstrap_servers}).list_topics(
            timeout=5
        )
        assert metadata.brokers  # the broker speaks Kafka, not just TCP
        client = redis.Redis.from_url(redis_server.url)
        assert client.ping()
        client.close()
        assert all(pid_alive(pid) for pid in pids)

    assert wait_until_gone(pids) == []
    assert services.processes == []


def test_a_service_that_exits_at_once_is_reported_with_its_log(tmp_path):
    services = EmbeddedServices(tmp_path, startup_timeout_s=5)
    with pytest.raises(ServiceStartError, match=r"exited with code 3") as caught:
        services._start_on_free_port(  # the shared start path, with a command that fails
            "doomed",
            lambda port: [sys.executable, "-c", "print('no such flag'); raise SystemExit(3)"],
            lambda port: False,
        )
    assert "no such flag" in str(caught.value)
    assert services.processes == []  # nothing left registered, nothing left running


def test_children_die_when_their_owner_is_killed(tmp_path):
    """kill -9 of the process that started the services (a test run, the run command)."""
    script = (
        "import json, sys, time\n"
        "from pathlib import Path\n"
        "from kroute.embedded import EmbeddedServices\n"
        "s = EmbeddedServices(Path(sys.argv[1]))\n"
        "s.start_broker(); s.start_redis()\n"
        "print(json.dumps([p.pid for p in s.processes]), flush=True)\n"
        "time.sleep(600)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as owner:
        try:
            assert owner.stdout is not None
            child_pids = json.loads(owner.stdout.readline())
            assert len(child_pids) == 2
            assert all(pid_alive(pid) for pid in child_pids)
        finally:
            owner.kill()
    assert wait_until_gone(child_pids) == []


def test_stop_also_ends_a_stopped_process(tmp_path):
    import signal  # noqa: PLC0415

    with EmbeddedServices(tmp_path) as services:
        redis_server = services.start_redis()
        redis_server.process.signal(signal.SIGSTOP)
        pid = redis_server.process.pid
    assert wait_until_gone([pid]) == []


def test_free_ports_come_from_below_the_ephemeral_range_and_are_not_repeated():
    """A port in the kernel's ephemeral range can be taken, between the probe and the
    service's bind, by any outgoing connection's source port; one below it cannot."""
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    if ephemeral_start < 2048:
        pytest.skip(f"no room below an ephemeral range from {ephemeral_start}")
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= port < min(ephemeral_start, 30_000) for port in ports), ports
    assert len(set(ports)) == len(ports), "a port handed out twice"
