"""Pooled keep-alive HTTP/1.1 connections to nodes: the forwarding half of the hot path.

Measured here (DESIGN.md): forwarding through httpx.AsyncClient tops out under 1,000 req/s on
one core, while asyncio Protocols with httptools parsing and a hand-written pool reach ~60,000.
So this module speaks HTTP/1.1 to nodes itself, callback style (no task or future per request):
`UpstreamPool.send(origin, request_bytes, on_done)` calls `on_done(response, None)` or
`on_done(None, UpstreamFailure)` exactly once.

One request at a time per connection (no upstream pipelining); a connection goes back to the
idle list only when its response was complete and both sides allow keep-alive. A kept
connection the node closed meanwhile fails with UpstreamReset, which the caller may retry.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import httptools

from proxy.errors import (
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


@dataclass(slots=True)
class UpstreamResponse:
    status: int
    head_lines: bytes  # header lines to pass on (hop-by-hop and provenance removed), CRLF each
    body: bytes


class UpstreamConnection(asyncio.Protocol):
    """One connection to a node; the pool hands it one request at a time."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self._pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpResponseParser(self)
        self._on_done: Done | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._raw_head = b""  # bytes received until the headers are complete
        self._head_lines = b""
        self._in_head = True
        self._body: list[bytes] = []
        self._size = 0

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
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
        if self._on_done is not None:
            self._fail(UpstreamReset(f"connection closed by the node ({exc or 'EOF'})"))

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
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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

    def send(self, request: bytes, on_done: Done, timeout_s: float) -> None:
        assert self.transport is not None
        self._on_done = on_done
        self._timer = self._pool.loop.call_later(timeout_s, self._timed_out, timeout_s)
        self.transport.write(request)

    def _timed_out(self, timeout_s: float) -> None:
        self._timer = None
        self._fail(UpstreamTimeout(f"no whole response within {timeout_s * 1000:.0f} ms"))

    def _fail(self, failure: UpstreamFailure) -> None:
        on_done = self._on_done
        self._on_done = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
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
        connect_timeout_s: float,
        response_timeout_s: float,
        idle_per_origin: int,
        max_response_bytes: int,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.connect_timeout_s = connect_timeout_s
        self.response_timeout_s = response_timeout_s
        self.idle_per_origin = idle_per_origin
        self.max_response_bytes = max_response_bytes
        self._idle: dict[Origin, deque[UpstreamConnection]] = {}
        self._busy: set[UpstreamConnection] = set()
        self._connecting: set[asyncio.Task[None]] = set()
        self.opened = 0

    def send(self, origin: Origin, request: bytes, on_done: Done) -> None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed and not connection.transport.is_closing():  # type: ignore[union-attr]
                self._busy.add(connection)
                connection.send(request, on_done, self.response_timeout_s)
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
        self._busy.add(connection)
        connection.send(request, on_done, self.response_timeout_s)

    def release(self, connection: UpstreamConnection) -> None:
        self._busy.discard(connection)
        idle = self._idle.setdefault(connection.origin, deque())
        if len(idle) >= self.idle_per_origin:
            connection.transport.close()  # type: ignore[union-attr]
            return
        idle.append(connection)

    def forget(self, connection: UpstreamConnection) -> None:
        self._busy.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    def drop_origin(self, origin: Origin) -> None:
        """Close idle connections to a node that failed: they would likely fail too."""
        for connection in self._idle.pop(origin, ()):
            if connection.transport is not None:
                connection.transport.close()

    def idle_count(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    def busy_count(self) -> int:
        return len(self._busy)

    def close(self) -> None:
        for task in self._connecting:
            task.cancel()
        for idle in self._idle.values():
            for connection in idle:
                if connection.transport is not None:
                    connection.transport.close()
        self._idle.clear()
        for connection in list(self._busy):
            connection._fail(UpstreamReset("proxy shutting down"))
