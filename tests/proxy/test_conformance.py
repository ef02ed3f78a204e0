"""Conformance (issue 17): the proxy in front of real servers nobody here wrote.

Each server (uvicorn with an app that reads bodies, Python's http.server speaking HTTP/1.0,
nginx serving static files, and raw servers sending 103 / unsolicited 100 / 101) is the one node
of a cluster published in Redis, with two proxies in front of it, started as a user starts
them: the C fast path and the Python path. A one-node cluster sends every request, keyed or
passthrough, to that server, so what a client gets through the proxy is compared with what it
gets asking the server directly: status and body byte for byte, end-to-end headers equal,
framing valid (the proxy's answer ends exactly where its body does: a follow-up request on the
same connection gets its own answer). Every request carries a unique id that the server echoes
(`x-echo-id`), and every check of concurrency or pipelining asserts that no answer ever
reaches the wrong client.

Run: .venv/bin/python -m pytest tests/proxy/test_conformance.py tests/proxy/test_backpressure.py
(about 2-3 minutes on 2 cores; nginx must be installed: scripts/test installs it).
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kroute.embedded import EmbeddedServices, RedisHandle
from tests.proxy.asgi_app import ETAG, body_for
from tests.proxy.third_party import (
    FILE_SIZES,
    NODE,
    PATHS,
    Proxied,
    RawConnection,
    RawResponse,
    ThirdPartyServer,
    fetch,
    file_body,
    make_files,
    proxied,
    request_bytes,
    start_http10,
    start_nginx,
    start_raw,
    start_uvicorn,
)

pytestmark = pytest.mark.integration

ON_BOTH_PATHS = pytest.mark.parametrize("path", PATHS)
SIZES = pytest.mark.parametrize("size", FILE_SIZES, ids=lambda n: f"{n}B")
BIG_SIZES = (300_000, 1 << 20, 5 << 20)
# Headers a proxy may legitimately change: hop-by-hop ones, framing, and its own provenance.
NOT_END_TO_END = {
    "date",
    "server",
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "content-length",
    "x-request-id",
}


# --- fixtures: each server and its two proxies, once per module ------------------------------


@contextmanager
def _serving(
    embedded: EmbeddedServices, redis_server: RedisHandle, server: ThirdPartyServer
) -> Iterator[Proxied]:
    try:
        with proxied(embedded, redis_server.url, server) as site:
            yield site
    finally:
        server.stop()


@pytest.fixture(scope="module")
def site_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_files(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def uvicorn_site(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[Proxied]:
    with _serving(embedded, redis_server, start_uvicorn(embedded)) as site:
        yield site


@pytest.fixture(scope="module")
def http10_site(
    embedded: EmbeddedServices, redis_server: RedisHandle, site_root: Path
) -> Iterator[Proxied]:
    with _serving(embedded, redis_server, start_http10(embedded, site_root)) as site:
        yield site


@pytest.fixture(scope="module")
def nginx_site(
    embedded: EmbeddedServices,
    redis_server: RedisHandle,
    site_root: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Proxied]:
    server = start_nginx(embedded, site_root, tmp_path_factory.mktemp("nginx"))
    with _serving(embedded, redis_server, server) as site:
        yield site


@pytest.fixture(scope="module")
def early_hints_site(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[Proxied]:
    with _serving(embedded, redis_server, start_raw(embedded, "early-hints")) as site:
        yield site


@pytest.fixture(scope="module")
def continue_site(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[Proxied]:
    with _serving(embedded, redis_server, start_raw(embedded, "continue")) as site:
        yield site


@pytest.fixture(scope="module")
def switch_site(embedded: EmbeddedServices, redis_server: RedisHandle) -> Iterator[Proxied]:
    with _serving(embedded, redis_server, start_raw(embedded, "switch")) as site:
        yield site


# --- requests, answers and what is expected of them ------------------------------------------


def new_id(label: str = "r") -> str:
    return f"{label}-{uuid.uuid4().hex[:12]}"


def describe(answer: RawResponse | httpx.Response | BaseException | str) -> str:
    if isinstance(answer, BaseException | str):
        return f"no answer ({answer!r})"
    body = answer.content if isinstance(answer, httpx.Response) else answer.body
    status = answer.status_code if isinstance(answer, httpx.Response) else answer.status
    echo = answer.headers.get("x-echo-id") if isinstance(answer, httpx.Response) else answer.echo_id
    return f"{status} x-echo-id={echo!r} {len(body)} bytes {body[:60]!r}"


def first_difference(got: bytes, want: bytes) -> str | None:
    """None when equal, else where they part (never dumps megabytes into a report)."""
    if got == want:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    at = min(len(got), len(want)) if at is None else at
    return f"{len(got)} bytes vs {len(want)} expected; first difference at byte {at}"


@dataclass
class Ask:
    """One request with a unique id, and the answer only that request may get."""

    method: str
    target: str
    rid: str
    expected: bytes = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes | None = None
    chunks: list[bytes] | None = None

    def wire(self) -> bytes:
        headers = {"x-request-id": self.rid, **self.headers}
        return request_bytes(self.method, self.target, headers, self.body, self.chunks)

    def verdict(self, status: int, echo: str | None, body: bytes) -> str | None:
        """None if this is this request's answer; else what is wrong, the worst first."""
        what = f"{self.method} {self.target[:60]} (id {self.rid})"
        if echo is not None and echo != self.rid:
            return f"WRONG CLIENT: {what} got the answer meant for {echo!r} ({status})"
        if echo is None and status >= 500:
            return f"FAILED: {what}: the proxy answered {status} {body[:120]!r}"
        if status != self.status or echo != self.rid:
            return f"WRONG ANSWER: {what}: {status} x-echo-id={echo!r}, not {self.status}"
        if difference := first_difference(body, self.expected):
            return f"WRONG BODY: {what}: {difference}"
        return None

    def judge(self, answer: RawResponse | BaseException) -> str | None:
        if isinstance(answer, BaseException):
            return f"FAILED: {self.method} {self.target[:60]} (id {self.rid}): {answer!r}"
        return self.verdict(answer.status, answer.echo_id, answer.body)

    def send_with(self, client: httpx.Client) -> str | None:
        """Through an ordinary HTTP client (httpx), as an application would."""
        content: Any = iter(self.chunks) if self.chunks is not None else self.body
        headers = {"x-request-id": self.rid, **self.headers}
        try:
            response = client.request(self.method, self.target, headers=headers, content=content)
        except httpx.HTTPError as exc:
            return f"FAILED: {self.method} {self.target[:60]} (id {self.rid}): {exc!r}"
        return self.verdict(
            response.status_code, response.headers.get("x-echo-id"), response.content
        )


def attempt(conn: RawConnection, method: str = "GET") -> RawResponse | Exception:
    """The final answer, or the exception reading it raised (reported, not raised)."""
    try:
        return conn.read_final(method)[1]
    except (OSError, AssertionError) as exc:
        return exc


def end_to_end(answer: RawResponse) -> list[tuple[str, str]]:
    """Headers that must arrive unchanged, in order within each name."""
    kept = [
        (k, v)
        for k, v in answer.headers
        if k not in NOT_END_TO_END and not k.startswith("x-kroute-")
    ]
    return sorted(kept, key=lambda kv: kv[0])


def header_difference(direct: RawResponse, answer: RawResponse) -> str | None:
    want, got = end_to_end(direct), end_to_end(answer)
    if want == got:
        return None
    missing = [h for h in want if h not in got]
    added = [h for h in got if h not in want]
    return f"end-to-end headers differ: missing {missing}, added {added}"


def has_body(method: str, status: int) -> bool:
    return method != "HEAD" and status >= 200 and status not in (204, 304)


def follow_up(conn: RawConnection, site: Proxied) -> None:
    """The previous answer must have ended exactly where its framing said: no stray bytes, and
    the next request on the connection gets its own answer."""
    stray = conn.extra_bytes(0.05)
    assert stray == b"", f"bytes after the answer: {stray[:100]!r}"
    if conn.eof:  # closed without saying so: allowed (HTTP lets a server close idle ones)
        return
    rid = new_id("follow")
    conn.send(request_bytes("GET", site.server.probe.format(id=rid), {"x-request-id": rid}))
    _, answer = conn.read_final()
    assert (answer.status, answer.echo_id) == (200, rid), f"follow-up got {describe(answer)}"


def through_proxy(site: Proxied, path: str, ask: Ask) -> RawResponse:
    """`ask` through the proxy on a raw connection, its framing checked."""
    with RawConnection(site.port(path)) as conn:
        conn.send(ask.wire())
        interims, answer = conn.read_final(ask.method)
        assert all(100 <= i.status < 200 for i in interims)
        if has_body(ask.method, answer.status):
            assert answer.framing in ("content-length", "chunked"), (
                f"the proxy's answer is {answer.framing}-delimited, not re-framed"
            )
        if answer.closes:
            assert conn.extra_bytes(0.2) == b"", "bytes after an answer that closes"
        else:
            follow_up(conn, site)
    return answer


def assert_same_as_direct(site: Proxied, path: str, ask: Ask) -> RawResponse:
    """Ask the server directly and through the proxy: the same answer, byte for byte."""
    with RawConnection(site.server.port) as conn:
        conn.send(ask.wire())
        _, direct = conn.read_final(ask.method)
    assert ask.judge(direct) is None, f"the server itself: {ask.judge(direct)}"
    answer = through_proxy(site, path, ask)
    assert answer.status == direct.status, describe(answer)
    difference = first_difference(answer.body, direct.body)
    assert difference is None, difference
    assert header_difference(direct, answer) is None, header_difference(direct, answer)
    if not has_body(ask.method, direct.status):
        # 204 and 304 carry no length the server did not send (RFC 9110 8.6: a 304's must be
        # the 200's); a HEAD answer carries the server's, where the server sent one.
        length = answer.header("content-length")
        if direct.status in (204, 304) or direct.header("content-length") is not None:
            assert length == direct.header("content-length"), f"content-length {length}"
        assert answer.header("transfer-encoding") is None
    return answer


def ejections(site: Proxied, path: str) -> int:
    """How many times the proxy logged ejecting a node: the status shows only current
    ejections, and with a short eject_ms a probe may have ended one before we look."""
    return site.proxy(path).process.log_path.read_text(errors="replace").count("node ejected")


def node_snapshot(site: Proxied, path: str) -> dict[str, Any]:
    return {**site.node(path), "ejections": ejections(site, path)}


def assert_node_kept(
    site: Proxied, path: str, before: dict[str, Any], failures_ok: bool = False
) -> None:
    """The node was not ejected since `before` and (unless `failures_ok`: a bad answer may be
    counted, but never as the node being down) not charged with a failure."""
    after = node_snapshot(site, path)
    assert after["ejected_since_ms"] is None, f"the node is ejected: {after}"
    assert after["ejections"] == before["ejections"], f"the node was ejected: {before} -> {after}"
    if not failures_ok:
        assert after["failures"] == before["failures"], f"failures counted: {before} -> {after}"


@contextmanager
def client_for(site: Proxied, path: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=site.proxy(path).url, timeout=30, trust_env=False) as client:
        yield client


# --- uvicorn: content-length and chunked answers, request bodies, HEAD, 204, 304 -------------


def uvicorn_bytes(size: int, kind: str = "bytes") -> Ask:
    rid = new_id(kind)
    return Ask("GET", f"/{kind}/{size}?id={rid}", rid, body_for(size, rid))


def uvicorn_keyed(key: str | None = None) -> Ask:
    rid = new_id("key")
    key = key or rid
    expected = json.dumps({"store": "customers", "key": key, "id": rid}).encode()
    return Ask("GET", f"/stores/customers/keys/{key}", rid, expected)


def uvicorn_post(size: int, chunked: bool = False) -> Ask:
    rid = new_id("post")
    body = body_for(size, rid)
    if not chunked:
        return Ask("POST", "/echo", rid, body, body=body)
    pieces = [body[i : i + 7919] for i in range(0, len(body), 7919)]
    return Ask("POST", "/echo", rid, body, chunks=pieces)


@ON_BOTH_PATHS
@SIZES
def test_uvicorn_content_length_answers(uvicorn_site: Proxied, path: str, size: int) -> None:
    assert_same_as_direct(uvicorn_site, path, uvicorn_bytes(size))


@ON_BOTH_PATHS
@SIZES
def test_uvicorn_chunked_answers(uvicorn_site: Proxied, path: str, size: int) -> None:
    assert_same_as_direct(uvicorn_site, path, uvicorn_bytes(size, "chunked"))


@ON_BOTH_PATHS
def test_uvicorn_keyed_answer(uvicorn_site: Proxied, path: str) -> None:
    answer = assert_same_as_direct(uvicorn_site, path, uvicorn_keyed())
    assert answer.header("x-kroute-node") == NODE


@ON_BOTH_PATHS
def test_request_headers_reach_the_server_unchanged(uvicorn_site: Proxied, path: str) -> None:
    sent = {
        "x-request-id": new_id("hdr"),
        "x-custom-request": "value, with a comma",
        "accept": "application/json",
        "user-agent": "conformance/1.0",
        "cookie": "a=1; b=2",
    }
    response = uvicorn_site.proxy(path).get("/headers", headers=sent)
    assert response.status_code == 200
    received: dict[str, list[str]] = {}
    for name, value in response.json()["headers"]:
        received.setdefault(name, []).append(value)
    for name, value in sent.items():
        assert received.get(name) == [value], (name, received.get(name))


@ON_BOTH_PATHS
@pytest.mark.parametrize("size", [0, 1, 1000, 64 * 1024 + 1, 300_000, 1 << 20], ids=str)
def test_content_length_request_bodies_reach_the_server(
    uvicorn_site: Proxied, path: str, size: int
) -> None:
    assert_same_as_direct(uvicorn_site, path, uvicorn_post(size))


@ON_BOTH_PATHS
@pytest.mark.parametrize("size", [1, 70_000, 300_000], ids=str)
def test_chunked_request_bodies_reach_the_server(
    uvicorn_site: Proxied, path: str, size: int
) -> None:
    assert_same_as_direct(uvicorn_site, path, uvicorn_post(size, chunked=True))


@ON_BOTH_PATHS
@pytest.mark.parametrize(
    "target",
    ["/bytes/1000", "/bytes/300000", "/chunked/1000", "/stores/customers/keys/head", "/etag"],
)
def test_head_has_no_body_and_the_servers_length(
    uvicorn_site: Proxied, path: str, target: str
) -> None:
    rid = new_id("head")
    assert_same_as_direct(uvicorn_site, path, Ask("HEAD", target, rid))


@ON_BOTH_PATHS
def test_204_has_no_body_and_no_length(uvicorn_site: Proxied, path: str) -> None:
    rid = new_id("204")
    answer = assert_same_as_direct(uvicorn_site, path, Ask("GET", "/status/204", rid, status=204))
    assert answer.header("content-length") is None


@ON_BOTH_PATHS
def test_304_to_a_matching_etag(uvicorn_site: Proxied, path: str) -> None:
    rid = new_id("304")
    ask = Ask("GET", "/etag", rid, status=304, headers={"if-none-match": ETAG.decode()})
    answer = assert_same_as_direct(uvicorn_site, path, ask)
    assert answer.header("etag") == ETAG.decode()


# --- Expect: 100-continue (issue 17 item 1: one client received another's answer) ------------


def send_expecting(
    conn: RawConnection, rid: str, body: bytes, wait_s: float, target: str | None = None
) -> None:
    """A client that says Expect: 100-continue, waits for the 100 (or `wait_s`, as curl does),
    then sends its body."""
    head = {"x-request-id": rid, "expect": "100-continue", "content-length": str(len(body))}
    conn.send(request_bytes("POST", target or f"/echo?id={rid}", head))
    if wait_s > 0:
        conn.wait_for_bytes(wait_s)
    conn.send(body)


@ON_BOTH_PATHS
@pytest.mark.parametrize("wait_s", [0.0, 1.0], ids=["body-at-once", "body-after-1s"])
def test_expect_100_continue_answers_reach_their_own_clients(
    uvicorn_site: Proxied, path: str, wait_s: float
) -> None:
    """Client A posts with Expect: 100-continue (its body at once, as clients with a short
    wait do, or after waiting 1 s for the 100) to an app that answers 200 ms after reading
    the body (so after its 100); client B asks for a key 20 ms later on its own connection.
    Each gets its own answer, and A's next request too."""
    port = uvicorn_site.port(path)
    a_id = new_id("a")
    a_body = f"body of {a_id}".encode()
    victim = uvicorn_keyed(new_id("victim-account"))
    with RawConnection(port, timeout_s=3) as a:
        send_expecting(a, a_id, a_body, wait_s, target=f"/echo?id={a_id}&delay_ms=200")
        time.sleep(0.02)  # B arrives 20 ms later, on a connection of its own
        with RawConnection(port, timeout_s=3) as b:
            b.send(victim.wire())
            b_answer = attempt(b)
        a_answer = attempt(a, "POST")
        a_next = uvicorn_keyed()
        if isinstance(a_answer, RawResponse) and not a_answer.closes:
            a.send(a_next.wire())
            a_next_answer = attempt(a)
        else:
            a_next_answer = a_answer
    problems = [
        victim.judge(b_answer) and f"client B: {victim.judge(b_answer)}: {describe(b_answer)}",
        Ask("POST", "/echo", a_id, a_body).judge(a_answer) and f"client A: {describe(a_answer)}",
        a_next.judge(a_next_answer) and f"client A's next request: {describe(a_next_answer)}",
    ]
    assert not any(problems), "\n".join(p for p in problems if p)


@ON_BOTH_PATHS
def test_expect_100_continue_keeps_a_connection_in_step(uvicorn_site: Proxied, path: str) -> None:
    """On one keep-alive connection: after a POST with Expect, each later request gets its
    own answer (a 100 taken for the final answer shifts every later answer by one)."""
    problems = []
    with RawConnection(uvicorn_site.port(path), timeout_s=3) as conn:
        post = uvicorn_post(20)
        assert post.body is not None
        post.target = f"/echo?id={post.rid}&delay_ms=100"
        send_expecting(conn, post.rid, post.body, wait_s=1.0, target=post.target)
        problems.append(post.judge(attempt(conn, "POST")))
        for ask in (uvicorn_keyed(), uvicorn_bytes(100), uvicorn_post(10)):
            conn.send(ask.wire())
            problems.append(ask.judge(attempt(conn, ask.method)))
    assert not any(problems), "\n".join(p for p in problems if p)


# --- pipelining and many concurrent clients ---------------------------------------------------


def uvicorn_mix(rng: random.Random) -> Ask:
    """A random request of any kind the app serves, with its unique id."""
    size = rng.choice((0, 10, 1000, 20_000, 70_000, 300_000))
    kind = rng.choice(("keyed", "bytes", "chunked", "post", "post-chunked", "head", "204", "304"))
    if kind == "keyed":
        return uvicorn_keyed()
    if kind in ("bytes", "chunked"):
        return uvicorn_bytes(size, kind)
    if kind.startswith("post"):
        return uvicorn_post(size, chunked=kind == "post-chunked")
    rid = new_id(kind)
    if kind == "head":
        return Ask("HEAD", f"/bytes/{size}?id={rid}", rid)
    if kind == "204":
        return Ask("GET", "/status/204", rid, status=204)
    return Ask("GET", "/etag", rid, status=304, headers={"if-none-match": ETAG.decode()})


def pipelined(port: int, asks: list[Ask]) -> list[str]:
    """All requests written at once on one connection; the answers read in order."""
    problems = []
    with RawConnection(port) as conn:
        conn.send(b"".join(ask.wire() for ask in asks))
        for ask in asks:
            answer = attempt(conn, ask.method)
            if problem := ask.judge(answer):
                problems.append(f"{problem}: {describe(answer)}")
                break  # the connection is out of step; the rest cannot be attributed
    return problems


@ON_BOTH_PATHS
def test_pipelined_requests_are_answered_in_order(uvicorn_site: Proxied, path: str) -> None:
    rng = random.Random(17)
    asks = [uvicorn_keyed(), uvicorn_post(5, chunked=True), uvicorn_bytes(70_000)]
    asks += [uvicorn_mix(rng) for _ in range(12)]
    problems = pipelined(uvicorn_site.port(path), asks)
    assert not problems, "\n".join(problems)


def expect_ask(size: int) -> Callable[[int], str | None]:
    """A POST with Expect: 100-continue on a connection of its own (waits briefly for the 100)."""

    def run(port: int) -> str | None:
        ask = uvicorn_post(size)
        assert ask.body is not None
        # The app answers 50 ms after reading the body, so well after uvicorn's 100.
        ask.target = f"/echo?id={ask.rid}&delay_ms=50"
        with RawConnection(port, timeout_s=5) as conn:
            send_expecting(conn, ask.rid, ask.body, wait_s=0.3, target=ask.target)
            answer = attempt(conn, "POST")
        problem = ask.judge(answer)
        return problem and f"{problem} (Expect): {describe(answer)}"

    return run


def client_session(base_url: str, port: int, seed: int, requests: int) -> list[str]:
    """One client: an httpx connection pool of its own, requests of every kind in turn."""
    rng = random.Random(seed)
    problems = []
    with httpx.Client(base_url=base_url, timeout=20, trust_env=False) as client:
        for _ in range(requests):
            if rng.random() < 0.2:
                problem = expect_ask(rng.choice((5, 2000)))(port)
            else:
                problem = uvicorn_mix(rng).send_with(client)
            if problem:
                problems.append(problem)
    return problems


def run_clients(session: Callable[[int], list[str]], clients: int) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(session, range(clients)))
    return [problem for problems in results for problem in problems]


def assert_no_wrong_client(problems: list[str], total: int) -> None:
    wrong = [p for p in problems if not p.startswith("FAILED")]
    failed = [p for p in problems if p.startswith("FAILED")]
    summary = f"{len(wrong)} wrong answers and {len(failed)} failures in {total} requests"
    assert not wrong, summary + ":\n" + "\n".join(wrong[:15])
    assert not failed, summary + ":\n" + "\n".join(failed[:15])


@ON_BOTH_PATHS
def test_concurrent_clients_each_get_their_own_answers(uvicorn_site: Proxied, path: str) -> None:
    clients, requests = 50, 6
    url, port = uvicorn_site.proxy(path).url, uvicorn_site.port(path)
    problems = run_clients(lambda i: client_session(url, port, i, requests), clients)
    assert_no_wrong_client(problems, clients * requests)


@ON_BOTH_PATHS
def test_uvicorn_big_answers_keep_the_node(uvicorn_site: Proxied, path: str) -> None:
    before = node_snapshot(uvicorn_site, path)
    with client_for(uvicorn_site, path) as client:
        asks = [uvicorn_bytes(size, kind) for size in BIG_SIZES for kind in ("bytes", "chunked")]
        problems = [ask.send_with(client) for ask in asks]
    assert not any(problems), "\n".join(p for p in problems if p)
    assert_node_kept(uvicorn_site, path, before)
    for _ in range(5):
        ask = uvicorn_keyed()
        answer = through_proxy(uvicorn_site, path, ask)
        assert ask.judge(answer) is None
        assert answer.header("x-kroute-node") == NODE


# --- http.server, HTTP/1.0: close-delimited answers (issue 17 item 4) ------------------------


@ON_BOTH_PATHS
@SIZES
def test_close_delimited_answers_are_reframed(http10_site: Proxied, path: str, size: int) -> None:
    before = node_snapshot(http10_site, path)
    rid = new_id("close")
    assert_same_as_direct(
        http10_site, path, Ask("GET", f"/close/{size}?id={rid}", rid, body_for(size, rid))
    )
    assert_node_kept(http10_site, path, before)


@ON_BOTH_PATHS
@SIZES
def test_http10_static_files(http10_site: Proxied, path: str, size: int) -> None:
    rid = new_id("file")
    assert_same_as_direct(
        http10_site, path, Ask("GET", f"/files/size-{size}?id={rid}", rid, file_body(size))
    )


@ON_BOTH_PATHS
def test_http10_head_and_not_modified(http10_site: Proxied, path: str) -> None:
    rid = new_id("head")
    head = assert_same_as_direct(
        http10_site, path, Ask("HEAD", f"/files/size-300000?id={rid}", rid)
    )
    assert head.header("content-length") == "300000"
    modified = head.header("last-modified")
    assert modified is not None
    rid = new_id("304")
    ask = Ask(
        "GET",
        f"/files/size-1000?id={rid}",
        rid,
        status=304,
        headers={"if-modified-since": modified},
    )
    assert_same_as_direct(http10_site, path, ask)


# --- nginx: static files of every size, keyed and passthrough --------------------------------


def nginx_file(size: int, keyed: bool = False) -> Ask:
    rid = new_id("file")
    folder = "stores/customers/keys" if keyed else "files"
    return Ask("GET", f"/{folder}/size-{size}?id={rid}", rid, file_body(size))


@ON_BOTH_PATHS
@SIZES
def test_nginx_files(nginx_site: Proxied, path: str, size: int) -> None:
    assert_same_as_direct(nginx_site, path, nginx_file(size))


@ON_BOTH_PATHS
@SIZES
def test_nginx_files_by_key(nginx_site: Proxied, path: str, size: int) -> None:
    answer = assert_same_as_direct(nginx_site, path, nginx_file(size, keyed=True))
    assert answer.header("x-kroute-node") == NODE


@ON_BOTH_PATHS
@pytest.mark.parametrize("size", [0, 300_000, 5 << 20], ids=str)
def test_nginx_head(nginx_site: Proxied, path: str, size: int) -> None:
    rid = new_id("head")
    answer = assert_same_as_direct(
        nginx_site, path, Ask("HEAD", f"/files/size-{size}?id={rid}", rid)
    )
    assert answer.header("content-length") == str(size)


@ON_BOTH_PATHS
def test_nginx_not_modified_and_range(nginx_site: Proxied, path: str) -> None:
    _, first = fetch(nginx_site.server.port, "GET", "/files/size-1000")
    etag = first.header("etag")
    assert etag is not None
    rid = new_id("304")
    ask = Ask("GET", f"/files/size-1000?id={rid}", rid, status=304, headers={"if-none-match": etag})
    assert_same_as_direct(nginx_site, path, ask)
    rid = new_id("206")
    ranged = Ask(
        "GET", f"/files/size-300000?id={rid}", rid, file_body(300_000)[1000:71000], 206,
        {"range": "bytes=1000-70999"},
    )  # fmt: skip
    answer = assert_same_as_direct(nginx_site, path, ranged)
    assert answer.header("content-range") == "bytes 1000-70999/300000"


@ON_BOTH_PATHS
def test_nginx_pipelined_files(nginx_site: Proxied, path: str) -> None:
    sizes = (1000, 0, 300_000, 1, 64 * 1024 + 1, 16 * 1024, 1 << 20, 1000)
    asks = [nginx_file(size, keyed=i % 2 == 0) for i, size in enumerate(sizes)]
    problems = pipelined(nginx_site.port(path), asks)
    assert not problems, "\n".join(problems)


@ON_BOTH_PATHS
def test_nginx_concurrent_clients_each_get_their_own_files(nginx_site: Proxied, path: str) -> None:
    clients, requests = 30, 5
    url = nginx_site.proxy(path).url

    def session(seed: int) -> list[str]:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=20, trust_env=False) as client:
            asks = [
                nginx_file(rng.choice((0, 1000, 16 * 1024, 300_000)), rng.random() < 0.5)
                for _ in range(requests)
            ]
            return [p for ask in asks if (p := ask.send_with(client))]

    assert_no_wrong_client(run_clients(session, clients), clients * requests)


@ON_BOTH_PATHS
def test_nginx_big_answers_keep_the_node(nginx_site: Proxied, path: str) -> None:
    before = node_snapshot(nginx_site, path)
    with client_for(nginx_site, path) as client:
        asks = [nginx_file(size, keyed) for size in BIG_SIZES for keyed in (True, False)]
        problems = [ask.send_with(client) for ask in asks]
    assert not any(problems), "\n".join(p for p in problems if p)
    assert_node_kept(nginx_site, path, before)
    for _ in range(5):
        ask = nginx_file(1000, keyed=True)
        answer = through_proxy(nginx_site, path, ask)
        assert ask.judge(answer) is None
        assert answer.header("x-kroute-node") == NODE


# --- interim answers: 103 Early Hints, an unsolicited 100, and 101 ---------------------------


def raw_ask(method: str = "GET", keyed: bool = False) -> Ask:
    rid = new_id("raw")
    where = f"/stores/customers/keys/{rid}" if keyed else "/plain"
    body = f'{{"id": "{rid}", "path": "{where}", "method": "{method}"}}'.encode()
    return Ask(method, f"{where}?id={rid}", rid, b"" if method == "HEAD" else body)


def interim_problems(interims: list[RawResponse], mode: str) -> list[str]:
    """Interim answers passed on must be the server's own (or none: absorbing is fine too)."""
    want = {"early-hints": 103, "continue": 100}.get(mode)  # None: the server sends none
    problems = [
        f"interim {i.status} passed on, the server sent {want}"
        for i in interims
        if i.status != want
    ]
    if mode == "early-hints":
        problems += [
            "103 passed on without its link header" for i in interims if not i.header("link")
        ]
    return problems


def interim_round(port: int, mode: str, asks: list[Ask]) -> list[str]:
    """`asks` one after another on one keep-alive connection."""
    problems = []
    with RawConnection(port, timeout_s=3) as conn:
        for ask in asks:
            conn.send(ask.wire())
            try:
                interims, answer = conn.read_final(ask.method)
            except (OSError, AssertionError) as exc:
                problems.append(ask.judge(exc) or "")
                break
            problems += interim_problems(interims, mode)
            if problem := ask.judge(answer):
                problems.append(f"{problem}: {describe(answer)}")
                break
    return problems


@ON_BOTH_PATHS
@pytest.mark.parametrize("mode", ["early-hints", "continue"])
def test_interim_answers_come_before_the_right_final_answer(
    request: pytest.FixtureRequest, path: str, mode: str
) -> None:
    site: Proxied = request.getfixturevalue(
        "early_hints_site" if mode == "early-hints" else "continue_site"
    )
    port = site.port(path)
    problems = []
    for keyed in (True, False, True, False):  # each on a new connection
        problems += interim_round(port, mode, [raw_ask(keyed=keyed)])
    asks = [raw_ask(), raw_ask(keyed=True), raw_ask("HEAD"), raw_ask(), raw_ask(keyed=True)]
    problems += interim_round(port, mode, asks)  # one keep-alive connection
    assert not problems, "\n".join(problems)


@ON_BOTH_PATHS
@pytest.mark.parametrize("mode", ["early-hints", "continue"])
def test_interim_answers_under_concurrency(
    request: pytest.FixtureRequest, path: str, mode: str
) -> None:
    site: Proxied = request.getfixturevalue(
        "early_hints_site" if mode == "early-hints" else "continue_site"
    )
    clients, requests = 20, 5
    port = site.port(path)

    def session(seed: int) -> list[str]:
        rng = random.Random(seed)
        asks = [
            raw_ask(rng.choice(("GET", "GET", "HEAD")), rng.random() < 0.5) for _ in range(requests)
        ]
        return interim_round(port, mode, asks)

    assert_no_wrong_client(run_clients(session, clients), clients * requests)


@ON_BOTH_PATHS
def test_switching_protocols_to_a_plain_get_is_a_502(switch_site: Proxied, path: str) -> None:
    port = switch_site.port(path)
    before = node_snapshot(switch_site, path)
    rid = new_id("switch")
    with RawConnection(port, timeout_s=5) as conn:
        conn.send(request_bytes("GET", f"/switch/ws?id={rid}", {"x-request-id": rid}))
        answer = attempt(conn)
        assert isinstance(answer, RawResponse), describe(answer)
        assert answer.status == 502, describe(answer)
        if not answer.closes:
            follow_up(conn, switch_site)
    # The switched connection must not go back to the pool: later requests get their own answers.
    problems = []
    for _ in range(4):
        problems += interim_round(port, "none", [raw_ask(keyed=True)])
    problems += interim_round(port, "none", [raw_ask(), raw_ask(keyed=True), raw_ask()])
    assert not problems, "\n".join(problems)
    assert_node_kept(switch_site, path, before, failures_ok=True)
