"""The data port: HTTP/1.1 client connections parsed with httptools on uvloop.

Each connection is an asyncio Protocol. Requests are handled one at a time per connection, in
order (pipelined requests wait their turn; reading pauses when too many wait). Limits are
enforced while parsing, before anything is forwarded: request line plus headers, header count,
body size, and two deadlines kept by one sweeper instead of a timer per request — a whole
request must arrive within `request_timeout` (a slow client cannot hold a connection), and an
idle keep-alive connection is closed after `idle_timeout`. A request the proxy refuses gets a
JSON 4xx and is never forwarded.

`ClientConnection` extends the C half from `proxy._hotpath`, whose data_received forwards the
common case itself (a whole keyed GET/HEAD in one read, with a cached choice and an idle node
connection) and hands everything else, unchanged, to `slow_data_received` here.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import httptools
import structlog

from proxy._hotpath import ClientBase, Hub
from proxy.errors import BadRequest, MethodNotAllowed, RequestRejected, TooLarge
from proxy.handler import RequestHandler
from proxy.http import ClientRequest, json_response
from proxy.metrics import ProxyMetrics

log = structlog.get_logger("kroute.proxy.listener")

_VALID_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")
_MAX_QUEUED = 16  # pipelined requests waiting on one connection before reading pauses


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int
    max_headers: int
    max_body_bytes: int
    request_timeout_s: float
    idle_timeout_s: float
    max_connections: int


class ClientConnection(ClientBase, asyncio.Protocol):
    """One client connection. From the C half: transport, closed, busy, reading (inside a
    message the Python parser is reading), attention (the Python side must see each response
    end: requests are queued or the proxy is stopping), deadline, hub, client_ip_bytes."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._limits = listener.limits
        self._handler = listener.handler
        self.hub = listener.hub
        self._parser = httptools.HttpRequestParser(self)
        self._client_ip = "unknown"
        self._queue: deque[ClientRequest] = deque()
        self._paused = False
        # A refusal waiting for the requests before it to be answered (pipelining).
        self._refusal: tuple[RequestRejected, bool] | None = None
        self._reset_message()

    def _reset_message(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0  # bytes read while the head was incomplete
        self._head_size = 0  # request target plus headers as parsed
        self._body: list[bytes] = []
        self._body_size = 0
        self._headers_done = False
        self._rejection: RequestRejected | None = None

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if peer:
            self._client_ip = str(peer[0])
        self.client_ip_bytes = self._client_ip.encode()
        listener = self._listener
        if len(listener.connections) >= self._limits.max_connections or listener.closing:
            self._refuse_and_close(
                503,
                {"error": "overloaded", "detail": "the proxy holds its maximum of connections"}
                if not listener.closing
                else {"error": "shutting_down", "detail": "the proxy is stopping"},
            )
            return
        listener.connections.add(self)
        self.deadline = listener.clock() + self._limits.idle_timeout_s

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._listener.connections.discard(self)

    def slow_data_received(self, data: bytes) -> None:
        if self.closed or self._refusal is not None:
            return
        if not self._headers_done:
            self._head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject_and_close(BadRequest("protocol upgrades are not supported"))
            return
        except httptools.HttpParserError as exc:
            rejection = self._rejection or _parse_error(exc)
            method_known = not isinstance(exc, httptools.HttpParserInvalidMethodError)
            self._reject_and_close(rejection, method_known=method_known)
            return
        if not self._headers_done and self._head_bytes > self._limits.max_header_bytes:
            self._reject_and_close(
                TooLarge(
                    f"request line and headers over {self._limits.max_header_bytes} bytes",
                    status=431,
                )
            )

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset_message()
        self.reading = True
        self.deadline = self._listener.clock() + self._limits.request_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # The exact size, for heads that arrive whole in one read (checked after each read
        # too, for a head that trickles in and has not been parsed to the end yet).
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self._limits.max_header_bytes:
            self._rejection = TooLarge(
                f"request line and headers over {self._limits.max_header_bytes} bytes", status=431
            )
            raise self._rejection
        if len(self._headers) >= self._limits.max_headers:
            self._rejection = TooLarge(f"more than {self._limits.max_headers} headers", status=431)
            raise self._rejection
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._headers_done = True
        method = self._parser.get_method()
        if method == b"CONNECT":
            self._rejection = MethodNotAllowed(
                "CONNECT is not supported: this is a reverse proxy", method="CONNECT"
            )
            raise self._rejection
        if self._parser.should_upgrade():
            self._rejection = BadRequest("protocol upgrades are not supported")
            raise self._rejection
        for name, value in self._headers:
            too_long = value.isdigit() and int(value) > self._limits.max_body_bytes
            if name == b"content-length" and too_long:
                self._rejection = TooLarge(
                    f"body over {self._limits.max_body_bytes} bytes",
                    max_body_bytes=self._limits.max_body_bytes,
                )
                raise self._rejection

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._limits.max_body_bytes:
            self._rejection = TooLarge(
                f"body over {self._limits.max_body_bytes} bytes",
                max_body_bytes=self._limits.max_body_bytes,
            )
            raise self._rejection
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.reading = False
        parser = self._parser
        method = parser.get_method().decode("ascii", "replace")
        request_id = None
        for name, value in self._headers:
            if name == b"x-request-id" and _VALID_REQUEST_ID.match(value):
                request_id = value
        try:
            target = self._url.decode("ascii")
        except UnicodeDecodeError:
            target = ""
        path, _, query = target.partition("?")
        request = ClientRequest(
            method=method,
            target=target,
            path=path,
            query=query or None,
            headers=self._headers,
            body=b"".join(self._body),
            client_ip=self._client_ip,
            keep_alive=parser.should_keep_alive(),
            request_id=request_id or self._listener.hub.next_request_id(),
            received_at=time.perf_counter(),
        )
        self._headers_done = False  # the rest is reset when the next message begins
        if self.busy:
            self._queue.append(request)
            self.attention = True
            if len(self._queue) >= _MAX_QUEUED and self.transport is not None:
                self.transport.pause_reading()
                self._paused = True
            return
        self._dispatch(request)

    # -- requests and responses -------------------------------------------------------------

    def _dispatch(self, request: ClientRequest) -> None:
        self.busy = True
        target = request.target
        if not target.startswith("/"):
            if not target:
                rejection: RequestRejected = BadRequest("the request target is not ASCII")
            elif target == "*":
                rejection = BadRequest("asterisk-form targets are not supported")
            else:
                rejection = BadRequest(
                    "absolute-form targets are refused: this is a reverse proxy, not a forward "
                    "proxy; send origin-form such as /stores/s/keys/k",
                    target=target[:200],
                )
            self._handler.reject(request, rejection, self.respond)
            return
        self._handler.handle(request, self.respond)

    def respond(self, message: bytes, keep_alive: bool) -> None:
        """Called once per dispatched request, by the handler or its exchange."""
        if self.closed or self.transport is None:
            return
        self.transport.write(message)
        self.busy = False
        self.after_fast_response(keep_alive)

    def after_fast_response(self, keep_alive: bool) -> None:
        """After a response is written (by respond, or by the C path when attention is set):
        close, serve the next queued request, or wait for the next one."""
        if not keep_alive or self._listener.closing:
            self._close()
            return
        if self._queue:
            refusing = self._refusal is not None  # then nothing more is read
            if self._paused and not refusing and len(self._queue) < _MAX_QUEUED and self.transport:
                self.transport.resume_reading()
                self._paused = False
            request = self._queue.popleft()
            self.attention = bool(self._queue) or refusing
            self._dispatch(request)
            return
        if self._refusal is not None:
            self._respond_and_close(*self._refusal)
            return
        self.attention = False
        if not self.reading:
            self.deadline = self._listener.clock() + self._limits.idle_timeout_s

    def _reject_and_close(self, rejection: RequestRejected, *, method_known: bool = True) -> None:
        """A request that cannot be parsed or is over a limit: answer it, then close. Requests
        pipelined before it are answered first, in order; nothing after it is read."""
        ProxyMetrics.bump(self._handler.metrics.rejected, rejection.code)
        # A HEAD request's answer has no body, even a refusal (a partly read method reads as
        # method 0, DELETE, so only a whole "HEAD" counts).
        head_only = bool(method_known and self.reading) and self._parser.get_method() == b"HEAD"
        self.reading = False
        if not self.busy:
            self._respond_and_close(rejection, head_only)
            return
        self._refusal = (rejection, head_only)
        self.attention = True  # after_fast_response must see the answers before it end
        if self.transport is not None and not self._paused:
            self.transport.pause_reading()
            self._paused = True

    def _respond_and_close(self, rejection: RequestRejected, head_only: bool) -> None:
        self._refuse_and_close(rejection.status, rejection.payload(), head_only=head_only)

    def _refuse_and_close(
        self, status: int, payload: dict[str, Any], *, head_only: bool = False
    ) -> None:
        if self.transport is not None and not self.transport.is_closing():
            response = json_response(status, payload, keep_alive=False, head_only=head_only)
            self.transport.write(response)
        self._close()

    def expire(self, now: float) -> None:
        """The sweeper found this connection past its deadline."""
        if self.busy:
            return  # waiting on a node: the upstream timeout bounds it
        if self.reading:
            self._refuse_and_close(
                408,
                {
                    "error": "request_timeout",
                    "detail": "the whole request did not arrive within "
                    f"{self._limits.request_timeout_s * 1000:.0f} ms",
                },
                head_only=self._parser.get_method() == b"HEAD",
            )
        else:
            self._close()

    def close_if_idle(self) -> None:
        if not self.busy and not self.reading:
            self._close()

    def _close(self) -> None:
        self.closed = True
        self._listener.connections.discard(self)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


def _parse_error(exc: httptools.HttpParserError) -> RequestRejected:
    context = exc.__context__
    if isinstance(context, RequestRejected):
        return context
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httptools.HttpParserInvalidMethodError):
        return BadRequest(f"invalid method: {reason}")
    if isinstance(exc, httptools.HttpParserInvalidURLError):
        return BadRequest(f"invalid request target: {reason}")
    return BadRequest(f"malformed HTTP request: {reason}")


class Listener:
    """The data port's server: accepts connections, sweeps deadlines, shuts down gracefully."""

    def __init__(self, handler: RequestHandler, limits: Limits, hub: Hub) -> None:
        self.handler = handler
        self.limits = limits
        self.hub = hub
        self.connections: set[ClientConnection] = set()
        self.closing = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.clock = time.monotonic  # the clock of the C half's deadlines too

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self._server = await self._loop.create_server(
            lambda: ClientConnection(self), host, port, backlog=2048, reuse_address=True
        )
        self._sweeper = self._loop.create_task(self._sweep())
        address = self._server.sockets[0].getsockname()
        return str(address[0]), int(address[1])

    async def _sweep(self) -> None:
        tick = min(
            max(min(self.limits.request_timeout_s, self.limits.idle_timeout_s) / 4, 0.01), 1.0
        )
        while True:
            await asyncio.sleep(tick)
            now = self.clock()
            for connection in [c for c in self.connections if c.deadline < now]:
                connection.expire(now)

    async def shutdown(self, timeout_s: float) -> int:
        """Stop accepting, let in-flight requests finish within timeout_s; returns how many
        connections were still busy when time ran out."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.attention = True  # each response end closes its connection
            connection.close_if_idle()
        deadline = self.clock() + timeout_s
        while any(c.busy for c in self.connections) and self.clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # polling: "no request in flight" has no event of its own
        unfinished = sum(1 for c in self.connections if c.busy)
        for connection in list(self.connections):
            connection._close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        return unfinished
