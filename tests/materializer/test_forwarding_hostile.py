"""The node's forwarder against a hostile "owner" (raw asyncio socket servers): heads that stop
or never end, bodies that drip, lie about their length, never end or are far too big, interim
and switching answers, redirects, encoded bodies, late bytes on a kept-alive connection. Each
forward ends within its timeout with the owner's own answer or a clear error, never with
another request's answer and never by buffering whatever the owner sends."""

from __future__ import annotations

import asyncio
import gzip
import json
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx
import pytest

from common.clock import now_ms
from materializer.forwarding import (
    Forwarded,
    Forwarder,
    OwnerBadAnswer,
    OwnerUnreachable,
    answer_limit,
)
from materializer.lag import LagTracker
from materializer.server import NodeApp, NodeState
from materializer.sink import IngestStats
from materializer.store import Store
from partitioner import KeyPartitioner, partition
from tests.materializer.test_forwarding import _answer, _read_head  # one owner's helpers
from tests.served_nodes import ServedNode, StandInNode, hosting

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
TIMEOUT_S = 0.6


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    async def closing_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the forwarder gave up on this owner: what these tests provoke
        finally:
            writer.close()

    server = await asyncio.start_server(closing_after, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _forward_to(
    handler: Handler, path: str = "/stores/s/keys/k", **forwarder_args: int | float
) -> tuple[Forwarded | Exception, float]:
    """One forward to an owner served by `handler`: its result (or error) and how long it took."""

    async def scenario() -> tuple[Forwarded | Exception, float]:
        server, url = await _serve(handler)
        forwarder = Forwarder("node-a", **{"timeout_s": TIMEOUT_S, **forwarder_args})
        began = time.monotonic()
        try:
            result: Forwarded | Exception = await forwarder.forward(url, path)
        except (OwnerUnreachable, OwnerBadAnswer) as exc:
            result = exc
        finally:
            await forwarder.close()
            server.close()
        return result, time.monotonic() - began

    return asyncio.run(scenario())


def _fails_within_timeout(outcome: tuple[Forwarded | Exception, float], error: type) -> None:
    result, took = outcome
    assert isinstance(result, error), result
    assert took < TIMEOUT_S + 1.0, took


def test_a_head_cut_short_is_unreachable():
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
        await writer.drain()

    _fails_within_timeout(_forward_to(owner), OwnerUnreachable)


def test_a_head_that_never_ends_times_out():
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(1000):
            writer.write(f"x-h{i}: v\r\n".encode())
            await writer.drain()
            await asyncio.sleep(0.05)

    _fails_within_timeout(_forward_to(owner), OwnerUnreachable)


def test_a_body_that_drips_past_the_timeout_times_out():
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        for _ in range(1000):
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.05)

    _fails_within_timeout(_forward_to(owner), OwnerUnreachable)


def test_a_close_mid_body_is_unreachable():
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"value":')
        await writer.drain()

    _fails_within_timeout(_forward_to(owner), OwnerUnreachable)


def test_bad_chunked_framing_is_not_passed_on():
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    _fails_within_timeout(_forward_to(owner), OwnerUnreachable)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_huge_body_is_refused_once_past_the_limit_not_buffered(framing: str):
    """An owner streaming hundreds of MB: the forwarder stops reading at its limit and says so,
    quickly, instead of holding it all in the node's memory (or timing out after buffering)."""
    limit = 1 << 20
    sent = 0
    block = b"x" * (1 << 16)

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await _read_head(reader)
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (400 << 20))
        while sent < 400 << 20:
            chunk = b"%x\r\n%s\r\n" % (len(block), block) if framing == "chunked" else block
            writer.write(chunk)
            await writer.drain()
            sent += len(block)

    result, took = _forward_to(owner, max_body_bytes=limit)
    assert isinstance(result, OwnerBadAnswer), result
    assert "too large" in str(result)
    assert took < TIMEOUT_S, took  # refused at the limit, not at the timeout
    assert sent < 100 << 20  # the owner was stopped long before it could send it all


def test_a_declared_length_over_the_limit_is_refused_before_reading():
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 999999999\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    result, took = _forward_to(owner, max_body_bytes=1 << 20)
    assert isinstance(result, OwnerBadAnswer), result
    assert took < TIMEOUT_S, took


def test_the_default_limit_fits_the_largest_answer_a_node_can_give():
    """A string value of only control characters is escaped six-fold in the JSON answer."""
    value = 8 << 20
    assert answer_limit(value) >= 6 * value + 4096
    assert answer_limit(value) < 64 << 20


def test_an_answer_at_the_limit_passes():
    body = json.dumps({"value": "v" * ((1 << 20) - 20)}).encode()[: 1 << 20]

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(_answer(200, body))
        await writer.drain()

    result, _ = _forward_to(owner, max_body_bytes=1 << 20)
    assert isinstance(result, Forwarded), result
    assert result.body == body


@pytest.mark.parametrize("status", [101, 301, 302, 307])
def test_switching_and_redirect_answers_are_bad_answers_not_passed_on(status: int):
    """A node never switches protocols or redirects; passing a 101 on would tell the client
    the connection is now something else, and a redirect would lose its Location."""

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        extra = "upgrade: websocket\r\nconnection: upgrade\r\n" if status == 101 else ""
        writer.write(_answer(status, b"", extra + "location: http://evil/\r\n"))
        await writer.drain()
        await asyncio.sleep(5)

    result, took = _forward_to(owner)
    assert isinstance(result, OwnerBadAnswer), result
    assert str(status) in str(result)
    assert took < TIMEOUT_S + 1.0


def test_interim_answers_are_absorbed():
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
        writer.write(_answer(200, b'{"value":1}', "x-kroute-node: owner\r\n"))
        await writer.drain()

    result, _ = _forward_to(owner)
    assert isinstance(result, Forwarded), result
    assert (result.status, result.body) == (200, b'{"value":1}')


def test_an_encoded_body_keeps_the_headers_that_say_how_to_read_it():
    """auto_decompress is off: the body is passed on as sent, so its content-encoding (and
    type) must be passed on with it, or the client reads gzip bytes as JSON."""
    plain = b'{"value":"' + b"a" * 2000 + b'"}'
    packed = gzip.compress(plain)

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        extra = "content-encoding: gzip\r\ncontent-type: application/json\r\nvary: x\r\n"
        writer.write(_answer(200, packed, extra))
        await writer.drain()

    result, _ = _forward_to(owner)
    assert isinstance(result, Forwarded), result
    assert result.body == packed
    headers = dict(result.headers)
    assert headers[b"content-encoding"] == b"gzip"
    assert headers[b"content-type"] == b"application/json"
    assert b"vary" not in headers  # only what describes the body, not the owner's other fields


async def _forward_many(url: str, forwarder: Forwarder, count: int) -> list[tuple[str, Forwarded]]:
    ids = [uuid.uuid4().hex for _ in range(count)]
    results = await asyncio.gather(
        *(forwarder.forward(url, f"/stores/s/keys/{i}") for i in ids), return_exceptions=True
    )
    return [(i, r) for i, r in zip(ids, results, strict=True) if isinstance(r, Forwarded)]


def _echo_path(head: dict[str, str]) -> str:
    return head["request-line"].split()[1].rsplit("/", 1)[1]


def test_a_length_that_lies_never_gives_a_request_another_ones_answer():
    """The owner's first answer carries more bytes than its content-length: a whole second
    answer, for a key nobody asked about yet. A pooled connection must not hand it to the
    next request sent on it."""

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await _read_head(reader)
            key = _echo_path(head)
            smuggled = _answer(200, b'{"key":"smuggled"}', "x-kroute-key: smuggled\r\n")
            writer.write(_answer(200, b'{"key":"%s"}' % key.encode(), f"x-kroute-key: {key}\r\n"))
            writer.write(smuggled)
            await writer.drain()

    async def scenario() -> list[tuple[str, Forwarded]]:
        server, url = await _serve(owner)
        forwarder = Forwarder("node-a", timeout_s=TIMEOUT_S)
        try:
            answered = []
            for _ in range(10):  # one after the other: each may reuse the previous connection
                answered += await _forward_many(url, forwarder, 1)
            return answered
        finally:
            await forwarder.close()
            server.close()

    answered = asyncio.run(scenario())
    assert answered
    for key, result in answered:
        assert dict(result.headers)[b"x-kroute-key"] == key.encode()
        assert result.body == b'{"key":"%s"}' % key.encode()


def test_late_bytes_on_an_idle_connection_never_reach_the_next_request():
    """The owner answers, then, while the connection idles in the pool, writes an answer
    nobody asked for. The next forward on that connection must not take it as its own."""

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await _read_head(reader)
            key = _echo_path(head)
            writer.write(_answer(200, b"{}", f"x-kroute-key: {key}\r\n"))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(_answer(200, b"{}", "x-kroute-key: late\r\n"))
            await writer.drain()

    async def scenario() -> list[tuple[str, Forwarded]]:
        server, url = await _serve(owner)
        forwarder = Forwarder("node-a", timeout_s=TIMEOUT_S)
        try:
            answered = []
            for _ in range(6):
                answered += await _forward_many(url, forwarder, 1)
                await asyncio.sleep(0.15)  # the late answer arrives while the connection idles
            return answered
        finally:
            await forwarder.close()
            server.close()

    answered = asyncio.run(scenario())
    assert answered
    for key, result in answered:
        assert dict(result.headers)[b"x-kroute-key"] == key.encode()


def test_many_concurrent_forwards_each_get_their_own_answer_while_the_owner_drops_connections():
    """Answers in a shuffled order of delays, and every third connection closed by the owner
    after its answer (as an idle timeout would): no forward gets another one's answer."""
    served = 0

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            head = await _read_head(reader)
            key = _echo_path(head)
            served += 1
            await asyncio.sleep((hash(key) % 7) / 1000)
            writer.write(_answer(200, b'{"key":"%s"}' % key.encode(), f"x-kroute-key: {key}\r\n"))
            await writer.drain()
            if served % 3 == 0:
                return

    async def scenario() -> list[tuple[str, Forwarded]]:
        server, url = await _serve(owner)
        forwarder = Forwarder("node-a", timeout_s=5.0)
        try:
            answered = []
            for _ in range(5):
                answered += await _forward_many(url, forwarder, 60)
            return answered
        finally:
            await forwarder.close()
            server.close()

    answered = asyncio.run(scenario())
    assert len(answered) >= 290  # a request sent as the owner closes may fail, rarely
    for key, result in answered:
        assert dict(result.headers)[b"x-kroute-key"] == key.encode()
        assert result.body == b'{"key":"%s"}' % key.encode()


# The node's answer to its client when the owner misbehaves.

NUM_PARTITIONS = 6


@pytest.fixture
def lone_node(tmp_path):
    store = Store(tmp_path / "store")
    store.add_partition(0)
    state = NodeState(
        node_id="node-a",
        store_name="customers",
        topic="bookings",
        value_format="json",
        store=store,
        lag=LagTracker(store, "bookings", lambda: (0,)),
        stats=IngestStats(),
        hosting=hosting((0,)),
        node=StandInNode(KeyPartitioner("string", "murmur2", NUM_PARTITIONS)),
    )
    state.lag.apply_ends({0: 0}, now_ms())
    yield state
    store.close()


def _ask_node(state: NodeState, owner: Handler, max_body_bytes: int = 1 << 20) -> httpx.Response:
    key = next(f"k{i}" for i in range(1000) if partition(f"k{i}".encode(), NUM_PARTITIONS) != 0)

    async def call() -> httpx.Response:
        server, url = await _serve(owner)
        state.node.owner = url
        state.node.forwarder = Forwarder(
            "node-a", timeout_s=TIMEOUT_S, max_body_bytes=max_body_bytes
        )
        transport = httpx.ASGITransport(app=NodeApp(state))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                return await client.get(f"/stores/customers/keys/{key}")
        finally:
            await state.node.forwarder.close()
            server.close()

    return asyncio.run(call())


def test_the_node_answers_502_with_the_reason_for_a_too_large_owner_answer(lone_node):
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (300 << 20))
        while True:
            writer.write(b"x" * (1 << 16))
            await writer.drain()

    response = _ask_node(lone_node, owner)
    assert response.status_code == 502
    payload = response.json()
    assert payload["error"] == "owner_bad_answer"
    assert "too large" in payload["detail"]
    assert response.headers["x-kroute-forwarded-by"] == "node-a"


def test_the_node_passes_an_encoded_answer_with_its_encoding(lone_node):
    plain = b'{"value":"' + b"a" * 500 + b'"}'

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        extra = "content-encoding: gzip\r\ncontent-type: application/json\r\n"
        writer.write(_answer(200, gzip.compress(plain), extra))
        await writer.drain()

    response = _ask_node(lone_node, owner)  # httpx decodes what content-encoding names
    assert response.status_code == 200
    assert response.content == plain
    assert response.headers.get_list("content-type") == ["application/json"]


def test_the_node_answers_502_for_a_redirecting_owner(lone_node):
    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        writer.write(_answer(302, b"", "location: http://elsewhere/\r\n"))
        await writer.drain()

    response = _ask_node(lone_node, owner)
    assert response.status_code == 502
    assert response.json()["error"] == "owner_bad_answer"


@pytest.mark.parametrize(
    "key", ["..", ".", "%2E%2E", "%2e", "a%2Fb", "%41", "%zz", "%25", "a%20b", "~", "%7E"]
)
def test_the_path_reaches_the_owner_exactly_as_the_client_sent_it(key: str):
    """Dot segments resolved or escapes requoted, the owner would read another key (or no
    key: ".." asked for /stores/s/, a 404 the client takes for an absent key)."""
    targets: list[str] = []

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        targets.append((await _read_head(reader))["request-line"])
        writer.write(_answer(200, b"{}"))
        await writer.drain()

    result, _ = _forward_to(owner, f"/stores/s/keys/{key}")
    assert isinstance(result, Forwarded), result
    assert targets == [f"GET /stores/s/keys/{key} HTTP/1.1"]


def test_what_may_not_stand_in_a_request_line_is_escaped():
    targets: list[str] = []

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        targets.append((await _read_head(reader))["request-line"])
        writer.write(_answer(200, b"{}"))
        await writer.drain()

    result, _ = _forward_to(owner, "/stores/s/keys/a b\r\nx-injected: 1")
    assert isinstance(result, Forwarded), result
    assert targets == ["GET /stores/s/keys/a%20b%0D%0Ax-injected:%201 HTTP/1.1"]


def test_a_dot_key_is_answered_by_its_real_owner(lone_node, tmp_path):
    """End to end: a client asks a node (which does not host it) for the key "..", sent
    encoded; the owner, a real node served by uvicorn, has it and must be asked for it."""
    owner = ServedNode("owner", tmp_path, NUM_PARTITIONS).start()
    p = partition(b"..", NUM_PARTITIONS)
    owner.write(p, "..", {"who": "dots"}, 3)
    owner.set_end(p, 4)
    lone_node.hosting.assign({q: "active" for q in range(NUM_PARTITIONS) if q != p}, now_ms())
    lone_node.node.owner = owner.url

    async def call() -> httpx.Response:
        lone_node.node.forwarder = Forwarder("node-a", timeout_s=5.0)
        transport = httpx.ASGITransport(app=NodeApp(lone_node))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                return await client.get("/stores/customers/keys/%2E%2E")
        finally:
            await lone_node.node.forwarder.close()

    try:
        response = asyncio.run(call())
    finally:
        owner.stop()
    assert response.status_code == 200, response.text
    assert response.json()["value"] == {"who": "dots"}
    assert response.headers["x-kroute-node"] == "owner"
