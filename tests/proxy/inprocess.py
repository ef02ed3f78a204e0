"""The proxy's protocols driven in-process: fake transports instead of sockets (issue 21 item 3).

The way uvicorn tests its protocols with a mock transport: the whole proxy is built by its own
composition root (`proxy.main.Proxy`, so the C path, the handler, the exchange and the pool are
wired exactly as in production), but no socket is opened anywhere:

- a client is a `ClientConnection` on a `FakeTransport`; what the test sends goes straight to
  its `data_received` (the C half's, so the C path serves it when the hub is on), and what the
  proxy writes back is parsed into `Answer`s;
- the pool's connections to nodes are made by a `FakeNetwork` that stands in for the pool's
  event loop (`UpstreamPool.loop`) and gives each new `UpstreamConnection` a `FakeTransport`
  wired to a scripted `FakeNode`: it answers (200, 421, 1xx first), closes unanswered, refuses
  to connect, or holds the request for the test to answer by hand (a long, streamed answer);
- the routing table is a `RoutingSnapshot` built in-process (`build_snapshot`) and handed to
  the handler as the watcher would, so each key's partition has a known active and standby.

What needs sockets (the kernel's buffers, uvloop's reads, real servers) stays in the
real-socket tests; these run in milliseconds. Internals are touched here only: `Proxy.pool.loop`
(the one seam to the network) and the listener the client connections belong to.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import httptools
from pydantic import SecretStr

from common.clock import now_ms
from common.contract import (
    Assignment,
    Hosting,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
)
from partitioner import KeyPartitioner
from proxy.listener import ClientConnection
from proxy.main import Proxy
from proxy.metrics import ProxyMetrics
from proxy.routing import RoutingSnapshot, build_snapshot
from proxy.settings import ProxySettings
from tests.proxy.third_party import PATHS

# PATHS: "c" (Hub.enabled 1: the C path serves what it can) and "python" (0), as the
# real-socket tests run them.
STORE = StoreInfo("customers", "customers", 3, "string", "murmur2", "json")
# Partition p: active NODES[p], the other two its standbys (tried in node order: in sync alike).
NODES = ("a", "b", "c")
WAIT_S = 2.0  # the longest any condition may take to come true (they take milliseconds)


def owners(partition: int) -> tuple[str, ...]:
    """The partition's replicas in the order the proxy tries them: active first."""
    active = NODES[partition % len(NODES)]
    return (active, *sorted(node for node in NODES if node != active))


def key_in(partition: int, label: str = "key") -> str:
    """A fresh key (unique per call) whose partition is `partition`."""
    partitioner = KeyPartitioner(STORE.key_format, STORE.partitioner, STORE.partitions)
    for _ in range(10_000):
        key = f"{label}-{uuid.uuid4().hex[:12]}"
        if partitioner.partition_of(key) == partition:
            return key
    raise AssertionError("no key found for the partition")


def unique_id(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:12]}"


def get(key: str, request_id: str, *, extra: str = "") -> bytes:
    """A keyed GET the C path can serve (whole, no body, no budget headers)."""
    return (
        f"GET /stores/{STORE.name}/keys/{key} HTTP/1.1\r\nhost: proxy.test\r\n"
        f"x-request-id: {request_id}\r\n{extra}\r\n"
    ).encode()


# -- transports ----------------------------------------------------------------------------------


class FakeTransport:
    """An asyncio transport in memory: records what is written and how it is closed, pauses
    and resumes reading, and models a peer that stops reading (`stall`): its unsent bytes
    grow, and past the high-water mark the protocol is told `pause_writing`, as asyncio does;
    `drain` is the peer taking everything (`resume_writing`)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        protocol: asyncio.Protocol,
        peer: tuple[str, int],
        on_write: Callable[[bytes], None] | None = None,
    ) -> None:
        self._loop = loop
        self.protocol = protocol
        self._peer = peer
        self._on_write = on_write
        self.written = bytearray()
        self.closing = False
        self.aborted = False
        self.eof_written = False
        self.reading = True
        self.high_water = 65_536
        self.low_water = 16_384
        self._held_reads: list[bytes] = []
        self._peer_reads = True
        self._unsent = 0
        self._writing_paused = False
        self._lost = False

    # -- what the protocol calls ---------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.closing:
            return  # asyncio drops writes after close too
        self.written += data
        if not self._peer_reads:
            self._unsent += len(data)
            if self._unsent > self.high_water and not self._writing_paused:
                self._writing_paused = True
                self.protocol.pause_writing()
        if self._on_write is not None:
            self._on_write(bytes(data))

    def get_write_buffer_size(self) -> int:
        return self._unsent

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if high is not None:
            self.high_water = high
        if low is not None:
            self.low_water = low

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        if not self.reading:
            self.reading = True
            self._loop.call_soon(self._deliver_held)  # later, as a real transport reads

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            self._loop.call_soon(self._connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self._peer}.get(name, default)  # no "socket": nothing to ioctl

    # -- what the peer does --------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Bytes from the peer, in one read; held while reading is paused (as the kernel
        holds them for a real transport), and always after bytes held before them."""
        if self.closing:
            return
        self._held_reads.append(data)
        self._deliver_held()

    def _deliver_held(self) -> None:
        while self._held_reads and self.reading and not self.closing:
            self.protocol.data_received(self._held_reads.pop(0))

    def peer_closes(self) -> None:
        """The peer closed the connection (EOF)."""
        if not self.closing:
            self.closing = True
            self._connection_lost(None)

    def stall(self) -> None:
        """The peer stops reading: what is written from now on stays unsent."""
        self._peer_reads = False

    def drain(self) -> None:
        """The peer reads everything unsent and goes on reading."""
        self._peer_reads = True
        self._unsent = 0
        if self._writing_paused:
            self._writing_paused = False
            self.protocol.resume_writing()

    @property
    def writing_paused(self) -> bool:
        return self._writing_paused

    def _connection_lost(self, exc: Exception | None) -> None:
        if not self._lost:
            self._lost = True
            self.protocol.connection_lost(exc)


# -- nodes ---------------------------------------------------------------------------------------


@dataclass
class NodeRequest:
    """One request as a node received it."""

    node: str
    request_id: str
    target: str
    headers: dict[str, str]
    connection: NodeConnection


class NodeConnection:
    """The node's end of one pooled connection."""

    def __init__(self, node: FakeNode, number: int) -> None:
        self.node = node
        self.number = number  # this node's n-th connection, from 1
        self.answered = 0
        self.transport: FakeTransport | None = None

    def received(self, data: bytes) -> None:
        head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
        request_line, *lines = head.split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        request = NodeRequest(
            self.node.node_id,
            headers.get("x-request-id", ""),
            request_line.split(" ")[1],
            headers,
            self,
        )
        self.node.requests.append(request)
        self.node.loop.call_soon(self.node.react, request)

    def send(self, data: bytes) -> None:
        """Bytes of an answer (or of part of one), read by the proxy in one read."""
        assert self.transport is not None
        self.transport.feed(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.peer_closes()


def answer(
    node: str,
    request_id: str,
    status: int = 200,
    *,
    body: bytes | None = None,
    extra: str = "",
    interim: str = "",
) -> bytes:
    """A node's answer: names the node and echoes the request id; `interim` goes first (1xx)."""
    payload = body if body is not None else f'{{"node": "{node}", "id": "{request_id}"}}'.encode()
    head = (
        f"{interim}HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\nx-backend: {node}\r\nx-echo-id: {request_id}\r\n"
        f"{extra}\r\n"
    )
    return head.encode() + payload


def refused(node: str, request_id: str) -> bytes:
    """A node's 421 refusing the request's freshness bounds (not "not mine")."""
    return answer(node, request_id, 421, extra="x-kroute-refused: lag 500 over budget 10\r\n")


EARLY_HINTS = "HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
CONTINUE = "HTTP/1.1 100 Continue\r\n\r\n"


class FakeNode:
    """A scripted node. `mode`:
    "ok"         answers 200 naming itself and echoing the request id
    "421"        answers 421 ("not mine or not ready")
    "refuse"     answers 421 with x-kroute-refused (the request's bounds are not met)
    "reset"      closes the connection without answering
    "close-kept" answers a connection's first request, closes it unanswered on the next one
                 (its keep-alive timeout firing as the request arrives)
    "interim"    answers 103 Early Hints and 100 Continue, then 200
    "down"       refuses connections
    "hold"       keeps the request (in `held`) for the test to answer by hand
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, node_id: str) -> None:
        self.loop = loop
        self.node_id = node_id
        self.mode = "ok"
        self.requests: list[NodeRequest] = []
        self.connections: list[NodeConnection] = []
        self.held: list[NodeRequest] = []

    def connect(self) -> NodeConnection:
        if self.mode == "down":
            raise ConnectionRefusedError(111, "Connection refused")
        connection = NodeConnection(self, len(self.connections) + 1)
        self.connections.append(connection)
        return connection

    def kill(self) -> None:
        """The node's process is gone: its connections close, new ones are refused."""
        self.mode = "down"
        for connection in self.connections:
            connection.close()

    def react(self, request: NodeRequest) -> None:
        connection, mode = request.connection, self.mode
        if mode == "hold":
            self.held.append(request)
            return
        if mode == "reset" or (mode == "close-kept" and connection.answered > 0):
            connection.close()
            return
        connection.answered += 1
        if mode == "421":
            connection.send(answer(self.node_id, request.request_id, 421))
        elif mode == "refuse":
            connection.send(refused(self.node_id, request.request_id))
        elif mode == "interim":
            interim = EARLY_HINTS + CONTINUE
            connection.send(answer(self.node_id, request.request_id, interim=interim))
        else:
            connection.send(answer(self.node_id, request.request_id))

    def ids(self) -> list[str]:
        return [request.request_id for request in self.requests]


class FakeNetwork:
    """Stands in for the pool's event loop: tasks run on the real loop, connections are made
    to fake nodes by address. The pool's own connect path (`_connect_and_send`) runs as is."""

    def __init__(self, loop: asyncio.AbstractEventLoop, nodes: dict[tuple[str, int], FakeNode]):
        self._loop = loop
        self.nodes = nodes

    def create_task(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return self._loop.create_task(coroutine)

    async def create_connection(
        self, factory: Callable[[], asyncio.Protocol], host: str, port: int
    ) -> tuple[FakeTransport, asyncio.Protocol]:
        await asyncio.sleep(0)  # a connect is never instant
        node_end = self.nodes[(host, port)].connect()
        protocol = factory()
        transport = FakeTransport(self._loop, protocol, (host, port), on_write=node_end.received)
        node_end.transport = transport
        protocol.connection_made(transport)  # type: ignore[arg-type]
        return transport, protocol


# -- clients -------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


class _AnswerReader:
    """Parses what the proxy wrote to a client into answers, incrementally."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.interim: list[int] = []
        self._parser = httptools.HttpResponseParser(self)
        self._headers: dict[str, str] = {}
        self._body = bytearray()

    def feed(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            self.interim.append(status)

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        status = self._parser.get_status_code()
        if status >= 200:
            self.answers.append(Answer(status, self._headers, bytes(self._body)))
        self._headers, self._body = {}, bytearray()


class Client:
    """One client connection to the proxy."""

    def __init__(self, protocol: ClientConnection, transport: FakeTransport) -> None:
        self.protocol = protocol
        self.transport = transport
        self._read = 0
        self._reader = _AnswerReader()

    def send(self, data: bytes) -> None:
        self.protocol.data_received(data)  # the C half's: the C path sees it first

    @property
    def answers(self) -> list[Answer]:
        """The whole answers the proxy wrote so far, in order."""
        return self._parsed().answers

    @property
    def interim(self) -> list[int]:
        """The statuses of interim (1xx) answers the proxy wrote (it should write none)."""
        return self._parsed().interim

    def _parsed(self) -> _AnswerReader:
        written = self.transport.written
        if len(written) > self._read:
            self._reader.feed(bytes(written[self._read :]))
            self._read = len(written)
        return self._reader

    @property
    def received_bytes(self) -> int:
        return len(self.transport.written)


# -- the proxy -----------------------------------------------------------------------------------


@dataclass
class InProcessProxy:
    proxy: Proxy
    nodes: dict[str, FakeNode]
    errors: list[str] = field(default_factory=list)  # exceptions raised inside callbacks
    table_refreshes: int = 0  # times a node's answer made the proxy re-read its table
    _ports: itertools.count[int] = field(default_factory=lambda: itertools.count(40_000))

    def count_refreshes(self) -> None:
        """The watcher is never run here: a refresh asked of it is counted instead."""
        self.table_refreshes += 1

    def connect(self) -> Client:
        loop = asyncio.get_running_loop()
        protocol = ClientConnection(self.proxy.listener)
        transport = FakeTransport(loop, protocol, ("127.0.0.1", next(self._ports)))
        protocol.connection_made(transport)  # type: ignore[arg-type]
        return Client(protocol, transport)

    async def until(self, condition: Callable[[], object], what: str = "condition") -> None:
        """Run the loop until `condition()` holds (milliseconds), at most WAIT_S."""
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not condition():
            assert not self.errors, self.errors
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"not within {WAIT_S}s: {what}")
            await asyncio.sleep(0.0005)
        assert not self.errors, self.errors

    async def settle(self) -> None:
        """Let everything already scheduled run (for asserting that nothing more happens)."""
        for _ in range(20):
            await asyncio.sleep(0)
        await asyncio.sleep(0.002)
        assert not self.errors, self.errors

    async def answers(self, client: Client, count: int) -> list[Answer]:
        await self.until(lambda: len(client.answers) >= count, f"{count} answers")
        return client.answers

    async def warm(self, partition: int) -> int:
        """One answered read of the partition: the choice is cached and its active node has an
        idle pooled connection, so the next read is one the C path can serve (when it is on).
        Returns how many requests the C path has forwarded so far."""
        client = self.connect()
        rid = unique_id("warm")
        client.send(get(key_in(partition, "warm"), rid))
        [reply] = await self.answers(client, 1)
        assert reply.status == 200, reply
        assert reply.header("x-request-id") == rid, reply
        return self.forwarded_in_c

    @property
    def forwarded_in_c(self) -> int:
        """Requests the C path forwarded (the hub's count)."""
        return int(self.proxy.hub.stats()["forwarded"])

    @property
    def metrics(self) -> ProxyMetrics:
        return self.proxy.metrics

    @property
    def ejected(self) -> frozenset[str]:
        return self.proxy.ejections.ejected


def snapshot() -> RoutingSnapshot:
    """Every partition placed on and served by all three nodes, in sync, just reported, all
    alive: the routing table the watcher would build from Redis."""
    now = now_ms()
    partitions = range(STORE.partitions)
    placements = {p: PartitionAssignment(owners(p)[0], owners(p)[1:]) for p in partitions}
    hostings = {
        node: Hosting(
            node,
            1,
            {
                STORE.name: {
                    "active": tuple(p for p in partitions if owners(p)[0] == node),
                    "standby": tuple(p for p in partitions if owners(p)[0] != node),
                }
            },
            now,
        )
        for node in NODES
    }
    report = PartitionReport(100, 100, now, now, now)
    return build_snapshot(
        stores={STORE.name: STORE},
        assignment=Assignment(1, NODES[0], now, {STORE.name: placements}),
        hostings=hostings,
        reports={(node, STORE.name, p): report for node in NODES for p in partitions},
        nodes={node: NodeInfo(node, url_of(node), now) for node in NODES},
        alive=frozenset(NODES),
        built_at_ms=now,
    )


def url_of(node: str) -> str:
    return f"http://10.0.0.{NODES.index(node) + 1}:8081"


def origin_of(node: str) -> tuple[str, int]:
    return (f"10.0.0.{NODES.index(node) + 1}", 8081)


@asynccontextmanager
async def in_process_proxy(path: str, **settings: Any) -> AsyncIterator[InProcessProxy]:
    """A whole proxy (`proxy.main.Proxy`) with fake nodes a, b, c and no sockets; `path` is
    "c" (the hub on) or "python"; `settings` are ProxySettings fields."""
    assert path in PATHS
    loop = asyncio.get_running_loop()
    config = ProxySettings(
        # never connected: the table is handed over below
        redis_url=SecretStr("redis://127.0.0.1:1/0"),
        hot_path=path == "c",
        log_level="warning",
        **settings,
    )
    proxy = Proxy(config)
    assert proxy.hub.enabled == (path == "c")
    nodes = {node: FakeNode(loop, node) for node in NODES}
    proxy.pool.loop = FakeNetwork(loop, {origin_of(n): nodes[n] for n in NODES})  # type: ignore[assignment]
    proxy.pool.start()  # its sweeper keeps the upstream deadlines (a hung node times out)
    harness = InProcessProxy(proxy, nodes)
    proxy.context.refresh_table = harness.count_refreshes
    previous_handler = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: harness.errors.append(str(context)))
    proxy.handler.use_snapshot(snapshot())
    try:
        yield harness
        assert not harness.errors, harness.errors
    finally:
        loop.set_exception_handler(previous_handler)
        proxy.pool.close()
        await proxy.ejections.close()
        await proxy.redis.aclose()
        with suppress(asyncio.CancelledError):
            await asyncio.sleep(0)  # the cancelled sweeper ends before the loop closes


def run(path: str, scenario: Callable[[InProcessProxy], Awaitable[None]], **settings: Any) -> None:
    """Run one scenario against a fresh in-process proxy on its own event loop."""

    async def main() -> None:
        async with in_process_proxy(path, **settings) as harness:
            await scenario(harness)

    asyncio.run(main())
