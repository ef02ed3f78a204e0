"""SIGTERM drains a real proxy process: requests in flight finish, new connections are refused.

A real uvicorn process serves `tests.proxy.slow_app` as the one node of a cluster in real
Redis; it answers lookups after a delay set through its control endpoint, echoing each
request's `x-request-id`. Each test starts its own proxy (C path on and off, `PATHS`), puts
requests in flight (each on its own connection, each with a unique id), waits until the node
holds all of them, and sends the proxy SIGTERM:

  - the listening socket closes at once: a new connection is refused;
  - an idle kept-alive client connection is closed;
  - every request in flight gets its own answer, saying `connection: close`, then its
    connection is closed;
  - the process exits 0 once they are answered, and logs that none was left unfinished;
  - requests still running when KROUTE_SHUTDOWN_TIMEOUT_S runs out are cut (the client sees
    its connection end without an answer, never someone else's), the process exits 0 on time
    and logs how many were cut.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import re
import signal
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
from tests.proxy.third_party import (
    NODE,
    PATHS,
    STORE,
    FramingError,
    RawConnection,
    RawResponse,
    ThirdPartyServer,
    request_bytes,
    start_uvicorn,
    until,
)

pytestmark = pytest.mark.integration

ON_BOTH_PATHS = pytest.mark.parametrize("path", PATHS)
IN_FLIGHT = 6
SETTINGS = {
    "upstream_timeout_ms": "10000",
    "request_timeout_ms": "10000",
    "refresh_interval_ms": "200",
    "lag_report_stale_ms": "600000",
    "log_level": "info",  # the "proxy stopped" line, with unfinished_requests
    # One process: its own drain is what is tested (with KROUTE_WORKERS each worker drains
    # so, and logs its own unfinished count).
    "workers": "1",
}


@dataclass
class SlowNode:
    embedded: EmbeddedServices
    redis_url: str
    cluster: str
    server: ThirdPartyServer
    http: httpx.Client

    def control(self, **state: int) -> None:
        response = self.http.post(f"{self.server.url}/_control", json={"node": NODE, **state})
        response.raise_for_status()

    def lookups(self) -> int:
        """Lookups the node has started since the last control call."""
        return int(self.http.get(f"{self.server.url}/_control").json()["lookups"])

    @contextlib.contextmanager
    def proxy(self, path: str, **settings: str) -> Iterator[ProxyHandle]:
        handle = start_proxy(
            self.embedded,
            self.redis_url,
            name=f"proxy-draining-{path}-{uuid.uuid4().hex[:6]}",
            cluster=self.cluster,
            hot_path="true" if path == "c" else "false",
            **{**SETTINGS, **settings},
        )
        try:
            yield handle
        finally:
            handle.process.stop()  # a no-op once it exited
            handle.close()


@pytest.fixture(scope="module")
def node(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[SlowNode]:
    server = start_uvicorn(embedded, "tests.proxy.slow_app:app")
    client = redis.Redis.from_url(redis_server.url)
    keys = Keys(f"draining-{uuid.uuid4().hex[:8]}")
    static = StaticCluster(keys, {NODE: server.url})
    static.add_store(StoreInfo(STORE, STORE, 4, "string"))
    static.publish(client)
    http = httpx.Client(timeout=10, trust_env=False)
    try:
        yield SlowNode(embedded, redis_server.url, keys.cluster, server, http)
    finally:
        server.stop()
        http.close()
        client.close()


def port_of(proxy: ProxyHandle) -> int:
    return int(proxy.url.rsplit(":", 1)[1])


def lookup_bytes(rid: str) -> bytes:
    return request_bytes("GET", f"/stores/{STORE}/keys/k-{rid}", {"x-request-id": rid})


def unique_id(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:12]}"


@dataclass
class Sent:
    rid: str
    response: RawResponse | None  # None: the connection ended without an answer
    answered_at: float
    closed_after: bool  # the proxy closed the connection after the answer (if watched: 2 s)


def send_and_wait(port: int, rid: str, *, watch_close: bool = False) -> Sent:
    with RawConnection(port, timeout_s=20) as conn:
        conn.send(lookup_bytes(rid))
        try:
            response: RawResponse | None = conn.read_final()[1]
        except FramingError:
            return Sent(rid, None, time.monotonic(), closed_after=True)
        answered_at = time.monotonic()
        closed = watch_close and conn.extra_bytes(2.0) == b"" and conn.eof
        return Sent(rid, response, answered_at, closed_after=closed)


def warm_up(port: int, count: int) -> None:
    """`count` lookups at once, so the proxy holds that many idle node connections and a
    cached choice: requests that follow can take the C path."""
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        ids = [unique_id("warm") for _ in range(count)]
        for sent in pool.map(lambda r: send_and_wait(port, r), ids):
            assert sent.response is not None
            assert (sent.response.status, sent.response.echo_id) == (200, sent.rid)


def hot_path_count(proxy: ProxyHandle) -> float:
    found = re.search(
        r"^kroute_proxy_hot_path_requests_total (\S+)$", proxy.admin("/metrics").text, re.M
    )
    assert found is not None
    return float(found.group(1))


def refused(port: int) -> bool:
    """Whether a new connection to `port` is refused (the listening socket is closed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def stopped_line(proxy: ProxyHandle) -> dict[str, object]:
    """The proxy's last log line: `proxy stopped`, with how many requests it cut."""
    stopped = []
    for line in proxy.process.log_path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line that is not JSON is not this one
            if (event := json.loads(line)).get("event") == "proxy stopped":
                stopped.append(event)
    assert stopped, proxy.process.log_tail(20)
    return stopped[-1]


@dataclass
class InFlight:
    pool: concurrent.futures.ThreadPoolExecutor
    futures: list[concurrent.futures.Future[Sent]]
    ids: list[str]

    def results(self) -> list[Sent]:
        sent = [f.result(timeout=30) for f in self.futures]
        self.pool.shutdown()
        return sent


def put_in_flight(node: SlowNode, port: int, count: int) -> InFlight:
    """`count` lookups on connections of their own, returned once the node holds them all."""
    pool = concurrent.futures.ThreadPoolExecutor(count)
    ids = [unique_id(f"flight{i}") for i in range(count)]
    futures = [pool.submit(send_and_wait, port, rid, watch_close=True) for rid in ids]
    assert until(lambda: node.lookups() >= count, timeout_s=10), node.lookups()
    return InFlight(pool, futures, ids)


@ON_BOTH_PATHS
def test_sigterm_answers_requests_in_flight_refuses_new_ones_and_exits_0(
    node: SlowNode, path: str
) -> None:
    delay_s = 2.0
    with node.proxy(path, shutdown_timeout_s="15") as proxy:
        port = port_of(proxy)
        node.control(delay_ms=0)
        warm_up(port, IN_FLIGHT)
        idle = RawConnection(port)  # served once, then kept alive and idle
        idle_id = unique_id("idle")
        idle.send(lookup_bytes(idle_id))
        assert idle.read_final()[1].echo_id == idle_id
        node.control(delay_ms=int(delay_s * 1000))
        forwarded_in_c = hot_path_count(proxy)
        flight = put_in_flight(node, port, IN_FLIGHT)
        forwarded_in_c = hot_path_count(proxy) - forwarded_in_c
        proxy.process.signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert until(lambda: refused(port), timeout_s=delay_s / 2), "still accepting"
        assert idle.extra_bytes(delay_s / 2) == b""
        assert idle.eof, "an idle kept-alive connection was left open"
        idle.close()
        exit_code = proxy.process.popen.wait(20)
        exited = time.monotonic()
        sent = flight.results()
    node.control(delay_ms=0)
    assert exit_code == 0, proxy.process.log_tail(20)
    for one in sent:
        assert one.response is not None, f"{one.rid}: cut off while draining"
        assert (one.response.status, one.response.echo_id) == (200, one.rid)
        assert json.loads(one.response.body)["id"] == one.rid
        assert one.closed_after, f"{one.rid}: kept alive by a proxy that is stopping"
        # ... and it said so: a client that read no `connection: close` may send its next
        # request on a connection that is about to end.
        assert one.response.header("connection") == "close", (one.rid, one.response.headers)
        assert one.answered_at <= exited
    # It waited for them (the node held each for delay_s) and no longer than it had to.
    assert exited - signalled >= delay_s / 2, exited - signalled
    assert stopped_line(proxy)["unfinished_requests"] == 0
    if path == "c":
        assert forwarded_in_c > 0, "no request in flight was the C path's"


@ON_BOTH_PATHS
def test_requests_still_running_at_the_shutdown_timeout_are_cut_and_counted(
    node: SlowNode, path: str
) -> None:
    delay_s, timeout_s = 6.0, 0.5
    with node.proxy(path, shutdown_timeout_s=str(timeout_s)) as proxy:
        port = port_of(proxy)
        node.control(delay_ms=0)
        warm_up(port, 3)
        node.control(delay_ms=int(delay_s * 1000))
        flight = put_in_flight(node, port, 3)
        proxy.process.signal(signal.SIGTERM)
        signalled = time.monotonic()
        exit_code = proxy.process.popen.wait(20)
        exited = time.monotonic()
        sent = flight.results()
    node.control(delay_ms=0)
    assert exit_code == 0, proxy.process.log_tail(20)
    assert exited - signalled < delay_s - 2, "it waited for the node, not its timeout"
    for one in sent:
        # Cut: no answer at all, never a made-up or someone else's one.
        assert one.response is None or one.response.echo_id == one.rid, one
        assert one.response is None, f"{one.rid} answered {one.response.status}"
    assert stopped_line(proxy)["unfinished_requests"] == 3
