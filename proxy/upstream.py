"""Pooled keep-alive HTTP/1.1 connections to nodes: the forwarding half of the hot path.

Measured here (DESIGN.md): forwarding through httpx.AsyncClient tops out under 1,000 req/s on
one core, while asyncio Protocols with httptools parsing and a hand-written pool reach ~60,000.
So this module speaks HTTP/1.1 to nodes itself, callback style (no task or future per request):
`UpstreamPool.send(origin, request_bytes, on_done)` calls `on_done(response, None)` or
`on_done(None, UpstreamFailure)` exactly once.

One request at a time per connection (no upstream pipelining); a connection goes back to the
idle list only when its response was complete and both sides allow keep-alive. A kept
connection the node closes before any byte of the answer fails with UpstreamClosedKept (the
node's keep-alive timeout racing the request; the caller resends on a new connection), and the
pool closes connections idle for `idle_timeout_s` itself, before a node's keep-alive timeout
(uvicorn's is 5 s) makes that race likely. Response deadlines and idle limits are kept by one
sweeper per pool, not a timer per request.

`UpstreamConnection` extends the C half from `proxy._hotpath`: for requests the C path
forwarded, it answers the client itself when the response is whole and simple, and otherwise
hands the request to a Python exchange (`adopt`) and continues here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import httptools

from proxy._hotpath import Hub, UpstreamBase
from proxy.errors import (
    UpstreamClosedKept,
    UpstreamFailure,
    UpstreamProtocol,
    UpstreamRefused,
    UpstreamReset,
    UpstreamTimeout,
)
from proxy.http import filter_response_head

Origin = tuple[str, int]
_MAX_HEAD_BYTES = 65_536
Done = Callable[["UpstreamResponse | None", "UpstreamFailure | None"], None]
Adopt = Callable[["UpstreamConnection"], Done]


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    head_lines: bytes  # header lines to pass on (hop-by-hop and provenance removed), CRLF each
    body: bytes


class UpstreamConnection(UpstreamBase, asyncio.Protocol):
    """One connection to a node; the pool hands it one request at a time.

    From the C half: transport, closed, busy, deadline, idle (the pool's list for this
    node), hub, and data_received (which calls slow_data_received when C does not answer).
    """

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.hub = pool.hub
        self.idle = pool.idle_list(origin)
        self._parser = httptools.HttpResponseParser(self)
        self._on_done: Done | None = None
        self._raw_head = b""  # bytes received until the headers are complete
        self._head_lines = b""
        self._in_head = True
        self._body: list[bytes] = []
        self._size = 0

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def adopt(self) -> None:
        """The C path forwarded the request but cannot finish it: a Python exchange takes it."""
        self._on_done = self._pool.adopt(self)

    def slow_data_received(self, data: bytes) -> None:
        if self._on_done is None:
            self._close()  # bytes nobody asked for: the connection cannot be trusted any more
            return
        if self._in_head:
            self._raw_head += data
            if len(self._raw_head) > _MAX_HEAD_BYTES:
                self._fail(UpstreamProtocol(f"response head over {_MAX_HEAD_BYTES} bytes"))
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            context = exc.__context__
            self._fail(
                context
                if isinstance(context, UpstreamProtocol)
                else UpstreamProtocol(f"unparsable response: {exc}")
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        if not self.waiting:
            return
        reason = f"connection closed by the node ({exc or 'EOF'})"
        if self.idle_since and self._in_head and not self._raw_head:
            self._fail(UpstreamClosedKept(f"kept-alive {reason} before answering"))
        else:
            self._fail(UpstreamReset(reason))

    # -- httptools callbacks ----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        # Header names and values are not needed one by one (that costs a Python call per
        # header): the raw head is filtered in one pass instead.
        raw = self._raw_head
        end = raw.find(b"\r\n\r\n")
        start = raw.find(b"\r\n")
        if end < 0:
            raise UpstreamProtocol("response head not delimited by CRLF")
        self._head_lines = filter_response_head(raw[start + 2 : end + 2])
        self._in_head = False
        self._raw_head = b""

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > self._pool.max_response_bytes:
            raise UpstreamProtocol(f"response over {self._pool.max_response_bytes} bytes")
        self._body.append(body)

    def on_message_complete(self) -> None:
        on_done = self._on_done
        self._on_done = None
        self.busy = False
        response = UpstreamResponse(
            self._parser.get_status_code(), self._head_lines, b"".join(self._body)
        )
        reusable = self._parser.should_keep_alive()
        self._head_lines, self._body, self._size, self._in_head = b"", [], 0, True
        if reusable:
            self._pool.release(self)
        else:
            self._close()
        if on_done is not None:
            on_done(response, None)

    # -- the pool's side --------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """A request (the Python path's or the C path's) awaits its response here."""
        return self._on_done is not None or self.fast_client is not None

    def send(self, request: bytes, on_done: Done) -> None:
        assert self.transport is not None
        self._on_done = on_done
        self.busy = True
        self.deadline = time.monotonic() + self._pool.response_timeout_s
        self.transport.write(request)

    def expire(self) -> None:
        """The sweeper found this connection past its response deadline."""
        if self.waiting:
            timeout_ms = self._pool.response_timeout_s * 1000
            self._fail(UpstreamTimeout(f"no whole response within {timeout_ms:.0f} ms"))

    def _fail(self, failure: UpstreamFailure) -> None:
        if self.fast_client is not None:
            self.adopt()  # the exchange the C path never built takes the failure (and fails over)
        on_done = self._on_done
        self._on_done = None
        self.busy = False
        self._close()
        if on_done is not None:
            on_done(None, failure)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self._pool.forget(self)


class UpstreamPool:
    """Idle keep-alive connections per node origin, and how new ones are opened."""

    def __init__(
        self,
        *,
        hub: Hub,
        connect_timeout_s: float,
        response_timeout_s: float,
        idle_per_origin: int,
        max_response_bytes: int,
        idle_timeout_s: float = 4.0,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.hub = hub
        self.connect_timeout_s = connect_timeout_s
        self.response_timeout_s = response_timeout_s
        self.idle_per_origin = idle_per_origin
        self.idle_timeout_s = idle_timeout_s
        self.max_response_bytes = max_response_bytes
        # Lists, never replaced: the C path pops from and appends to them too.
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        self._connecting: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self.opened = 0
        self.adopt: Adopt = _no_adopter

    def idle_list(self, origin: Origin) -> list[UpstreamConnection]:
        return self._idle.setdefault(origin, [])

    def start(self) -> None:
        self._sweeper = self.loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        tick = min(max(min(self.response_timeout_s, self.idle_timeout_s) / 8, 0.005), 0.25)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for connection in [c for c in self._open if c.busy and c.deadline < now]:
                connection.expire()
            self._close_long_idle(now - self.idle_timeout_s)

    def _close_long_idle(self, idle_before: float) -> None:
        for idle in self._idle.values():
            # Oldest first: the C path and release() append, and sends pop from the end.
            while idle and idle[0].idle_since < idle_before:
                idle.pop(0)._close()

    def send(self, origin: Origin, request: bytes, on_done: Done, *, fresh: bool = False) -> None:
        """Over an idle connection to origin, or a new one (always, with `fresh`)."""
        idle = None if fresh else self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed and not connection.transport.is_closing():
                connection.send(request, on_done)
                return
        task = self.loop.create_task(self._connect_and_send(origin, request, on_done))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect_and_send(self, origin: Origin, request: bytes, on_done: Done) -> None:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await self.loop.create_connection(
                    lambda: UpstreamConnection(self, origin), *origin
                )
        except TimeoutError:
            on_done(None, UpstreamRefused(f"connect timed out after {self.connect_timeout_s}s"))
            return
        except OSError as exc:
            on_done(None, UpstreamRefused(f"connect failed: {exc.strerror or exc}"))
            return
        self.opened += 1
        self._open.add(connection)
        connection.send(request, on_done)

    def release(self, connection: UpstreamConnection) -> None:
        idle = self.idle_list(connection.origin)
        if len(idle) >= self.idle_per_origin:
            connection._close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    def forget(self, connection: UpstreamConnection) -> None:
        self._open.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    def drop_origin(self, origin: Origin) -> None:
        """Close idle connections to a node that failed: they would likely fail too."""
        idle = self._idle.get(origin)
        if idle:
            dropped = list(idle)
            idle.clear()
            for connection in dropped:
                connection._close()

    def idle_count(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    def busy_count(self) -> int:
        return sum(1 for connection in self._open if connection.busy)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in self._connecting:
            task.cancel()
        for idle in self._idle.values():
            for connection in list(idle):
                connection._close()
            idle.clear()
        for connection in [c for c in self._open if c.busy]:
            connection._fail(UpstreamReset("proxy shutting down"))


def _no_adopter(connection: UpstreamConnection) -> Done:
    raise RuntimeError("the C path forwarded a request but no exchange can adopt it")
