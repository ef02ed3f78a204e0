"""KROUTE_MAX_CONNECTIONS and KROUTE_MAX_RESPONSE_BYTES enforced on a real proxy process.

nginx serves static files as the one node of a cluster in real Redis (keyed lookups and plain
paths alike); each test runs against a proxy with the C path on and one with it off (`PATHS`),
over real sockets. Every request carries a unique id that nginx echoes (`x-echo-id`), and every
answer is checked to be its own request's.

  max connections  N connections are held and served; the N+1th is answered 503 "overloaded"
                   and closed at once (the proxy never queues it); the held ones are still
                   served, and once one closes a new connection is served again.
  max response     an answer of exactly the limit passes whole; one byte more is a 502
                   (bad_gateway) for that request only: the node is not ejected for it and the
                   answers around it, concurrent ones included, are unaffected.
"""

from __future__ import annotations

import concurrent.futures
import json
import uuid
from collections.abc import Iterator

import pytest

from kroute.embedded import EmbeddedServices, RedisHandle
from tests.proxy.third_party import (
    PATHS,
    STORE,
    Proxied,
    RawConnection,
    RawResponse,
    ThirdPartyServer,
    file_body,
    make_files,
    proxied,
    request_bytes,
    start_nginx,
    until,
)

pytestmark = pytest.mark.integration

ON_BOTH_PATHS = pytest.mark.parametrize("path", PATHS)
MAX_CONNECTIONS = 4
MAX_RESPONSE = 4096  # KROUTE_MAX_RESPONSE_BYTES
SIZES = (1000, MAX_RESPONSE, MAX_RESPONSE + 1, 300_000)


@pytest.fixture(scope="module")
def nginx(
    embedded: EmbeddedServices, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThirdPartyServer]:
    root = make_files(tmp_path_factory.mktemp("limits-site"), SIZES)
    server = start_nginx(embedded, root, tmp_path_factory.mktemp("limits-nginx"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def connection_limited(
    embedded: EmbeddedServices, redis_server: RedisHandle, nginx: ThirdPartyServer
) -> Iterator[Proxied]:
    # One process: KROUTE_MAX_CONNECTIONS is what one proxy process holds (with KROUTE_WORKERS
    # the kernel spreads connections over the workers, each with its own limit).
    settings = {"max_connections": str(MAX_CONNECTIONS), "workers": "1"}
    with proxied(embedded, redis_server.url, nginx, **settings) as site:
        yield site


@pytest.fixture(scope="module")
def response_limited(
    embedded: EmbeddedServices, redis_server: RedisHandle, nginx: ThirdPartyServer
) -> Iterator[Proxied]:
    # Consecutive-5xx ejection at its default (5): answers over the limit come many in a row
    # here, and must not count towards it (a big value says nothing of the node's health).
    settings = {"max_response_bytes": str(MAX_RESPONSE)}
    with proxied(embedded, redis_server.url, nginx, **settings) as site:
        yield site


def unique_id(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:12]}"


def keyed(size: int, rid: str) -> bytes:
    """A keyed lookup (the C path's kind of request) of nginx's file of `size` bytes."""
    return request_bytes("GET", f"/stores/{STORE}/keys/size-{size}?id={rid}", {"x-request-id": rid})


def plain(size: int, rid: str) -> bytes:
    """The same file by a path no route matches (forwarded round robin, by Python)."""
    return request_bytes("GET", f"/files/size-{size}?id={rid}", {"x-request-id": rid})


def ask(conn: RawConnection, request: bytes) -> RawResponse:
    conn.send(request)
    return conn.read_final()[1]


def assert_whole_answer(response: RawResponse, size: int, rid: str) -> None:
    assert response.status == 200, (response.status, response.body[:200])
    assert response.echo_id == rid, (response.echo_id, rid)
    assert response.body == file_body(size), f"{len(response.body)} bytes, not the file"


def served(port: int, label: str) -> bool:
    rid = unique_id(label)
    with RawConnection(port, timeout_s=3) as conn:
        response = ask(conn, keyed(1000, rid))
    return response.status == 200 and response.echo_id == rid


# --- KROUTE_MAX_CONNECTIONS --------------------------------------------------------------------


def refused_at_once(port: int) -> RawResponse:
    """A new connection that sends nothing: what the proxy says before closing it."""
    with RawConnection(port, timeout_s=5) as conn:
        response = conn.read_response()
        assert response.closes, response.headers
        assert conn.extra_bytes(0.5) == b""
        assert conn.eof, "the refused connection stayed open"
    return response


@ON_BOTH_PATHS
def test_the_connection_beyond_the_limit_is_refused_and_the_held_ones_served(
    connection_limited: Proxied, path: str
) -> None:
    port = connection_limited.port(path)
    assert until(lambda: served(port, "warm-up"), timeout_s=10)  # earlier sockets are gone
    held = [RawConnection(port) for _ in range(MAX_CONNECTIONS)]
    try:
        # All N at once, each on its own connection: each gets its own answer.
        with concurrent.futures.ThreadPoolExecutor(MAX_CONNECTIONS) as pool:
            ids = [unique_id(f"held{i}") for i in range(MAX_CONNECTIONS)]
            answers = list(pool.map(lambda c, r: ask(c, keyed(1000, r)), held, ids))
        for response, rid in zip(answers, ids, strict=True):
            assert_whole_answer(response, 1000, rid)
        refusal = refused_at_once(port)
        assert refusal.status == 503, refusal.status
        assert json.loads(refusal.body)["error"] == "overloaded", refusal.body
        # Refusing the extra connection cost the held ones nothing.
        for i, conn in enumerate(held):
            rid = unique_id(f"again{i}")
            assert_whole_answer(ask(conn, keyed(1000, rid)), 1000, rid)
        held.pop().close()
        assert until(lambda: served(port, "freed"), timeout_s=10), "a freed slot was not reused"
    finally:
        for conn in held:
            conn.close()


# --- KROUTE_MAX_RESPONSE_BYTES -----------------------------------------------------------------


def fetch_one(port: int, size: int, *, keyed_route: bool) -> tuple[int, str, RawResponse]:
    rid = unique_id(f"size{size}")
    with RawConnection(port) as conn:
        response = ask(conn, keyed(size, rid) if keyed_route else plain(size, rid))
    return size, rid, response


def assert_bad_gateway(response: RawResponse) -> None:
    assert response.status == 502, (response.status, len(response.body))
    assert json.loads(response.body)["error"] == "bad_gateway", response.body[:300]


@ON_BOTH_PATHS
@pytest.mark.parametrize("keyed_route", [True, False], ids=["keyed", "unkeyed"])
def test_an_answer_over_the_response_limit_is_a_502_and_nothing_else_suffers(
    response_limited: Proxied, path: str, keyed_route: bool
) -> None:
    port = response_limited.port(path)
    sizes = [size for size in SIZES for _ in range(6)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: fetch_one(port, s, keyed_route=keyed_route), sizes))
    for size, rid, response in results:
        if size <= MAX_RESPONSE:
            assert_whole_answer(response, size, rid)
        else:
            assert_bad_gateway(response)
    # A node answering too much is not a node that is down: it stays in, and keeps answering.
    assert response_limited.node(path)["ejected_since_ms"] is None
    for size in (1000, MAX_RESPONSE):
        _, rid, response = fetch_one(port, size, keyed_route=keyed_route)
        assert_whole_answer(response, size, rid)


@ON_BOTH_PATHS
def test_a_kept_alive_connection_goes_on_after_a_502_for_size(
    response_limited: Proxied, path: str
) -> None:
    port = response_limited.port(path)
    conn = RawConnection(port)
    try:
        for size in (1000, MAX_RESPONSE + 1, MAX_RESPONSE, 300_000, 1000):
            rid = unique_id(f"kept{size}")
            response = ask(conn, keyed(size, rid))
            if size <= MAX_RESPONSE:
                assert_whole_answer(response, size, rid)
                continue
            assert_bad_gateway(response)
            if response.closes:  # said so: the next request goes on a new connection
                conn.close()
                conn = RawConnection(port)
            else:  # kept alive: nothing of the refused answer may follow on it
                assert conn.extra_bytes(0.2) == b""
    finally:
        conn.close()
