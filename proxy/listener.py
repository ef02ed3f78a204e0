"""The data port: HTTP/1.1 client connections parsed with httptools on uvloop.

Each connection is an asyncio Protocol. Requests are handled one at a time per connection, in
order (pipelined requests wait their turn). Limits are enforced while parsing, before
anything is forwarded: request line plus headers (the target included, counted as it arrives),
header count, body size, transfer coding (`chunked` alone; trailers are dropped, never merged
into the headers), and deadlines kept by one sweeper instead of a timer per request — a whole
request must arrive within `request_timeout`, an idle keep-alive connection is closed after
`idle_timeout`. A request the proxy refuses gets a JSON error (a 4xx, a 501, or a 503 while it
has no routing table) and is never forwarded.

Memory per connection is bounded by back-pressure: when the client's unsent answers pass
WRITE_HIGH_WATER the client is no longer read and a node streaming to it is paused, until
they drain below WRITE_LOW_WATER; a client that takes nothing for `send_timeout` is reset. So
a connection holds at most the high-water mark of answers, one node read (uvloop reads up to
256 KiB at a time), the exchange's buffer (`proxy.upstream.STREAM_AFTER_BYTES`), and up to
_MAX_QUEUED pipelined requests (their bodies at most _MAX_QUEUED_BYTES beyond the one being
read). A connection the proxy closes sends FIN after its last answer and is reset if the
client has not closed within `close_timeout`; it counts against `max_connections` until then.

`ClientConnection` extends the C half from `proxy._hotpath`, whose data_received forwards the
common case itself (a whole keyed GET/HEAD in one read, with a cached choice and an idle node
connection) and hands everything else, unchanged, to `slow_data_received` here.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import re
import socket
import struct
import termios
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

import httptools
import structlog

from proxy._hotpath import ClientBase, Hub
from proxy.errors import (
    BadRequest,
    ExpectationFailed,
    MethodNotAllowed,
    RequestRejected,
    TooLarge,
    UnsupportedCoding,
)
from proxy.exchange import Producer
from proxy.handler import RequestHandler
from proxy.http import ClientRequest, json_response
from proxy.metrics import ProxyMetrics

log = structlog.get_logger("kroute.proxy.listener")

_VALID_REQUEST_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,64}$")
# Pipelined requests (and their bodies' bytes) waiting on one connection before reading pauses.
_MAX_QUEUED = 16
_MAX_QUEUED_BYTES = 1 << 20
# A client's unsent answers: above the high mark the client is no longer read and a node
# streaming to it is paused; both resume below the low mark (asyncio's own defaults).
WRITE_HIGH_WATER = 65_536
WRITE_LOW_WATER = 16_384
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_MAX_DISCARDED_BYTES = 65_536
_LINGER_RESET = struct.pack("ii", 1, 0)
_INT_BUFFER = struct.pack("i", 0)


@dataclass(frozen=True)
class Limits:
    max_header_bytes: int
    max_headers: int
    max_body_bytes: int
    request_timeout_s: float
    idle_timeout_s: float
    max_connections: int
    send_timeout_s: float = 30.0
    close_timeout_s: float = 5.0


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
        self._current: ClientRequest | None = None  # dispatched, not yet answered
        self._queued_bytes = 0
        self._read_paused = False  # the transport's reading is paused (for any reason below)
        self._write_blocked = False  # the client is not taking its answers (back-pressure)
        self._producer: Producer | None = None  # the node connection streaming an answer here
        # A refusal waiting for the requests before it to be answered (pipelining).
        self._refusal: tuple[RequestRejected, bool] | None = None
        self._trickled = 0  # bytes of reads that continued an unfinished head
        self._discarded = 0  # bytes read after the proxy began to close
        self._client_done = False  # the client half-closed: close once its answers are sent
        self._blocked_at_bytes = 0  # the transport's buffer when the send deadline was set
        self._reset_message()

    def _reset_message(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_size = 0  # request line and headers as parsed
        self._body: list[bytes] = []
        self._body_size = 0
        self._headers_done = False
        self._rejection: RequestRejected | None = None

    @property
    def client_ip(self) -> str:
        return self._client_ip

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
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER, low=WRITE_LOW_WATER)
        self.deadline = listener.clock() + self._limits.idle_timeout_s

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._listener.connections.discard(self)
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.cancel()  # the answer it was streaming has nobody to go to

    def eof_received(self) -> bool:
        """The client is done sending (a half-close is legal HTTP/1.1): answer what it sent,
        then close. A request it cut short can never complete, so nothing waits for it."""
        if self.closed or not (self.busy or self._queue):
            return False  # nothing to answer: close (after what is being written)
        self._client_done = True
        self.attention = True  # the C path must hand each answer's end to after_fast_response
        return True  # keep the connection open for the answers

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark: the client is behind."""
        self._write_blocked = True
        self._renew_send_deadline()
        if self._producer is not None:
            self._producer.pause()
        self._update_reading()

    def _renew_send_deadline(self) -> None:
        self.deadline = self._listener.clock() + self._limits.send_timeout_s
        self._blocked_at_bytes = self._unsent_bytes()

    def resume_writing(self) -> None:
        self._write_blocked = False
        limits = self._limits
        self.deadline = self._listener.clock() + (
            limits.request_timeout_s if self.reading else limits.idle_timeout_s
        )
        if self._producer is not None:
            self._producer.resume()
        self._update_reading()
        if self._queue and not self.busy and not self.closed:
            self._dispatch_next()

    def _update_reading(self) -> None:
        """Read the client only while its answers are being taken and few requests wait."""
        if self.closed or self.transport is None:
            return
        wait = (
            self._write_blocked
            or self._refusal is not None
            or len(self._queue) >= _MAX_QUEUED
            or self._queued_bytes >= _MAX_QUEUED_BYTES
        )
        if wait and not self._read_paused:
            self.transport.pause_reading()
            self._read_paused = True
        elif not wait and self._read_paused:
            self.transport.resume_reading()
            self._read_paused = False

    def slow_data_received(self, data: bytes) -> None:
        if self.closed:
            # Closing: read only to see the client's close, and not for long (a client that
            # keeps sending after a refusal is reset rather than read for the close timeout).
            self._discarded += len(data)
            if self._discarded > _MAX_DISCARDED_BYTES:
                self.abort_response()
            return
        if self._refusal is not None:
            return
        if self.reading and not self._headers_done:
            self._trickled += len(data)  # this read continues a head not parsed to its end
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject_and_close(BadRequest("protocol upgrades are not supported"))
            return
        except httptools.HttpParserError as exc:
            # Raised in a parser callback, the rejection's traceback holds that frame and so
            # this connection: a cycle only a full collection frees (the proxy freezes its heap).
            rejection = (self._rejection or _parse_error(exc)).with_traceback(None)
            self._rejection = None
            method_known = not isinstance(exc, httptools.HttpParserInvalidMethodError)
            self._reject_and_close(rejection, method_known=method_known)
            return
        # A head that trickles in is bounded before it completes: httptools keeps a header
        # it has not finished in memory, so the bytes that went into it are counted too.
        unfinished = self.reading and not self._headers_done
        if unfinished and max(self._head_size, self._trickled) > self._limits.max_header_bytes:
            self._reject_and_close(self._head_too_large())

    def _head_too_large(self) -> TooLarge:
        return TooLarge(
            f"request line and headers over {self._limits.max_header_bytes} bytes", status=431
        )

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset_message()
        self._trickled = 0
        self.reading = True
        self.deadline = self._listener.clock() + self._limits.request_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)
        if self._head_size > self._limits.max_header_bytes:
            self._rejection = self._head_too_large()
            raise self._rejection

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._headers_done:
            # A chunked body's trailer: never merged into the headers that were checked and
            # forwarded (the body is forwarded with a Content-Length, without trailers).
            self._count_body(len(name) + len(value))
            return
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self._limits.max_header_bytes:
            self._rejection = self._head_too_large()
            raise self._rejection
        if len(self._headers) >= self._limits.max_headers:
            self._rejection = TooLarge(f"more than {self._limits.max_headers} headers", status=431)
            raise self._rejection
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._headers_done = True
        try:
            self._check_head()
        except RequestRejected as exc:
            self._rejection = exc
            raise

    def _check_head(self) -> None:
        parser = self._parser
        method = parser.get_method()
        self._head_size += len(method) + 12  # " ", " HTTP/1.1", CRLF
        if self._head_size > self._limits.max_header_bytes:
            raise self._head_too_large()
        if method == b"CONNECT":
            raise MethodNotAllowed(
                "CONNECT is not supported: this is a reverse proxy", method="CONNECT"
            )
        if parser.should_upgrade():
            raise BadRequest("protocol upgrades are not supported")
        http11 = parser.get_http_version() != "1.0"
        codings = [v for n, v in self._headers if n == b"transfer-encoding"]
        if codings:
            _check_transfer_coding(codings, http11=http11)
        for name, value in self._headers:
            too_long = value.isdigit() and int(value) > self._limits.max_body_bytes
            if name == b"content-length" and too_long:
                raise TooLarge(
                    f"body over {self._limits.max_body_bytes} bytes",
                    max_body_bytes=self._limits.max_body_bytes,
                )
        expectations = [v.strip().lower() for n, v in self._headers if n == b"expect"]
        if expectations and http11:  # RFC 9110 10.1.1: an HTTP/1.0 request's is ignored
            self._answer_expectation(expectations, chunked=bool(codings))

    def _answer_expectation(self, expectations: list[bytes], *, chunked: bool) -> None:
        """`Expect: 100-continue` is answered here (the whole body is read before anything
        is forwarded, so no node ever sees the expectation); any other is refused (417)."""
        if any(value != b"100-continue" for value in expectations):
            raise ExpectationFailed(
                "only the expectation 100-continue is supported",
                expect=b", ".join(expectations).decode("latin-1"),
            )
        length = next((v for n, v in self._headers if n == b"content-length"), b"0")
        has_body = chunked or (length.strip().isdigit() and int(length) > 0)
        # While an earlier answer is still being written, a 100 would land inside it: the
        # client then sends its body when its own wait for the 100 ends (RFC 9110 10.1.1).
        if has_body and not self.busy and self.transport is not None:
            self.transport.write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._count_body(len(body))
        self._body.append(body)

    def _count_body(self, size: int) -> None:
        self._body_size += size
        if self._body_size > self._limits.max_body_bytes:
            self._rejection = TooLarge(
                f"body over {self._limits.max_body_bytes} bytes",
                max_body_bytes=self._limits.max_body_bytes,
            )
            raise self._rejection

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
            client_ip=self.client_ip,
            keep_alive=parser.should_keep_alive() and not self._listener.closing,
            request_id=request_id or self._listener.hub.next_request_id(),
            received_at=time.perf_counter(),
            http11=parser.get_http_version() != "1.0",
        )
        self._headers_done = False  # the rest is reset when the next message begins
        if self.busy or self._write_blocked:
            self._queue.append(request)
            self._queued_bytes += len(request.body)
            self.attention = True
            self._update_reading()
            return
        self._dispatch(request)

    # -- requests and responses -------------------------------------------------------------

    def _dispatch(self, request: ClientRequest) -> None:
        self.busy = True
        self._current = request
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
            self._handler.reject(request, rejection, self)
            return
        self._handler.handle(request, self)

    def _dispatch_next(self) -> None:
        request = self._queue.popleft()
        self._queued_bytes = max(self._queued_bytes - len(request.body), 0) if self._queue else 0
        self.attention = bool(self._queue) or self._refusal is not None
        self._update_reading()
        self._dispatch(request)

    def respond(self, message: bytes, keep_alive: bool) -> None:
        """The whole answer, or the last bytes of a streamed one; once per dispatched
        request, by the handler or its exchange."""
        self._producer = None
        self._current = None
        if self.closed or self.transport is None:
            return
        if message:
            self.transport.write(message)
        self.busy = False
        self.after_fast_response(keep_alive)

    def send_part(self, data: bytes, producer: Producer) -> None:
        """Part of an answer that goes on; `producer` pauses while the client is behind."""
        if self.closed or self.transport is None:
            return
        self._producer = producer
        if self._write_blocked:
            producer.pause()
        self.transport.write(data)

    def abort_response(self) -> None:
        """An answer already begun cannot be completed: the client must not mistake what it
        got for a whole answer, so the connection is reset, not closed cleanly."""
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.cancel()  # a node still streaming to it stops (and its connection closes)
        self.busy = False
        self.closed = True
        if self.transport is not None:
            _reset_on_close(self.transport)
            self.transport.abort()

    def adopted(self, request: ClientRequest) -> None:
        """A request the C path forwarded is now answered the Python way (proxy.exchange)."""
        self._current = request
        if self._listener.closing:
            request.keep_alive = False

    def end_after_this_answer(self) -> None:
        """The proxy is stopping: the answer being prepared says `connection: close`, so the
        client does not send its next request on a connection about to end."""
        if self._current is not None:
            self._current.keep_alive = False

    def after_fast_response(self, keep_alive: bool) -> None:
        """After a response is written (by respond, or by the C path when attention is set):
        close, serve the next queued request, or wait for the next one."""
        if not keep_alive or self._listener.closing:
            self.start_closing()
            return
        if self._client_done and not self._queue:
            self.start_closing()  # it half-closed: everything it sent is answered
            return
        if self._queue:
            if self._write_blocked:
                self.attention = True  # resume_writing serves the next one
                return
            self._dispatch_next()
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
        if not self.busy and not self._queue:
            self._respond_and_close(rejection, head_only)
            return
        self._refusal = (rejection, head_only)
        self.attention = True  # after_fast_response must see the answers before it end
        self._update_reading()

    def _respond_and_close(self, rejection: RequestRejected, head_only: bool) -> None:
        self._refuse_and_close(rejection.status, rejection.payload(), head_only=head_only)

    def _refuse_and_close(
        self, status: int, payload: dict[str, Any], *, head_only: bool = False
    ) -> None:
        if self.transport is not None and not self.transport.is_closing():
            response = json_response(status, payload, keep_alive=False, head_only=head_only)
            self.transport.write(response)
        self.start_closing()

    def expire(self, now: float) -> None:
        """The sweeper found this connection past its deadline."""
        if self._write_blocked and not self.closed and self._still_draining():
            self._renew_send_deadline()  # slow, but taking its answer: not a stuck client
            return
        if self.closed or self._write_blocked:
            # A closing connection that has not flushed in time, or a client that took none
            # of its answer for the send timeout: reset, so the socket and what the kernel
            # still holds for it are released now.
            log.info(
                "client connection reset",
                client=self.client_ip,
                reason="not closed within the close timeout"
                if self.closed
                else "took none of its answer within the send timeout",
            )
            self.abort_response()
            return
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
            self.start_closing()

    def _still_draining(self) -> bool:
        """Bytes left the transport's buffer since the send deadline was set (the kernel only
        reports a socket writable once much of its queue drained, so a slow reader can stay
        above the high-water mark for long while taking its answer steadily)."""
        return self._unsent_bytes() < self._blocked_at_bytes

    def _unsent_bytes(self) -> int:
        """What the client has not taken yet: the transport's buffer and the kernel's send
        queue (SIOCOUTQ), which holds megabytes and drains while the buffer stands still."""
        transport = self.transport
        if transport is None:
            return 0
        unsent = int(transport.get_write_buffer_size())
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, _INT_BUFFER)
                unsent += int(struct.unpack("i", queued)[0])
        return unsent

    def close_if_idle(self) -> None:
        if not self.busy and not self.reading:
            self.start_closing()

    def start_closing(self) -> None:
        """Close after what was written is flushed: FIN after the last answer, then wait for
        the client to close its side (read and discarded), at most the close timeout; it
        counts as a connection until its socket is gone (connection_lost)."""
        if self.closed:
            return
        self.closed = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self not in self._listener.connections:
            transport.close()  # refused before it was counted: nothing to wait for
            return
        self.deadline = self._listener.clock() + self._limits.close_timeout_s
        if self._client_done:
            transport.close()  # it closed its side already: nothing to wait for
        elif transport.can_write_eof():
            transport.write_eof()
            if self._read_paused:
                transport.resume_reading()  # to see the client's close
                self._read_paused = False
        else:
            transport.close()


def _reset_on_close(transport: asyncio.Transport) -> None:
    """Make the close a reset (SO_LINGER 0): a plain close leaves what the client has not
    read in the kernel's send queue, up to megabytes per socket, until the client reads it."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)


def _check_transfer_coding(codings: list[bytes], *, http11: bool) -> None:
    """Only `chunked` alone is a request transfer coding the proxy reads (RFC 9112 6.1)."""
    if not http11:
        raise BadRequest("Transfer-Encoding in an HTTP/1.0 request")
    tokens = [t.strip().lower() for value in codings for t in value.split(b",") if t.strip()]
    if tokens != [b"chunked"]:
        raise UnsupportedCoding(
            "only the transfer coding chunked (alone) is supported",
            transfer_encoding=b", ".join(codings).decode("latin-1"),
        )


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

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> tuple[str, int]:
        """Listen on host:port. With `reuse_port` (SO_REUSEPORT, one proxy worker of several)
        the kernel spreads new connections over every process listening on the port; without
        it a port someone else listens on is refused, so two proxies never share one by
        mistake."""
        self._server = await self._loop.create_server(
            lambda: ClientConnection(self),
            host,
            port,
            backlog=2048,
            reuse_address=True,
            reuse_port=reuse_port,
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
        self.hub.draining = 1  # answers the C path has in flight say connection: close too
        for connection in list(self.connections):
            connection.attention = True  # each response end closes its connection
            connection.end_after_this_answer()
            connection.close_if_idle()
        deadline = self.clock() + timeout_s
        while any(c.busy for c in self.connections) and self.clock() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # polling: "no request in flight" has no event of its own
        unfinished = sum(1 for c in self.connections if c.busy)
        for connection in list(self.connections):
            connection.start_closing()
        if self._sweeper is not None:
            self._sweeper.cancel()
        return unfinished
