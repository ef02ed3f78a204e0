"""Pooled keep-alive HTTP/1.1 connections to nodes: the forwarding half of the hot path.

Measured here: forwarding through httpx.AsyncClient tops out under 1,000 req/s on one core,
while asyncio Protocols with httptools parsing and a hand-written pool reach ~60,000 (see
docs/architecture.md, D2). So this module speaks HTTP/1.1 to nodes itself, callback
style (no task or future per request): `UpstreamPool.send(origin, request, sink)` drives one
`ResponseSink` (the exchange) through its answer.

What a sink is told, in order:
- `on_response(connection, head, body, complete)` once, for the final answer. Interim 1xx
  answers (100 Continue, 103 Early Hints) are absorbed: the final answer is always the one read
  after them. When the whole answer arrived within `STREAM_AFTER_BYTES` of body, `complete` is
  true and the connection is already back in the pool (or closed); otherwise the sink either
  calls `connection.stream()` (the rest of the body follows through `on_body`, then `on_end`)
  or `connection.abandon()` (the connection is closed, e.g. to fail over on a 421).
- `on_failure(failure)` at most once, instead of or (while streaming) after `on_response`;
  or `on_cancelled()` when the client went away while the answer was streaming.
- `on_slow()` at most once, before any of those, when the request was sent with `hedge` and
  no answer came within the pool's `hedge_after_s` (the exchange may hedge it). Requests the
  C path forwarded are keyed reads and always qualify: the slow one is adopted first.
A sink whose try lost a hedged race is cancelled with `abandon_sink`: its connection (or the
connect under way) is closed and it is told nothing more.

Framing is checked, not trusted: a connection goes back to the pool only when its answer ended
cleanly (content-length or chunked framing, keep-alive on both sides) with no byte after it,
and never after an answer without a body (HEAD, 204, 304: a broken node's late body would
reach the next request); a
body that ends when the node closes (HTTP/1.0, or no framing) is forwarded whole and the
connection is not reused; a 101 to a request that asked for no upgrade, a head over
`MAX_HEAD_BYTES`, a body over `max_response_bytes` or anything unparsable is an
UpstreamProtocol failure and the connection is closed. The head limit counts the head only.

One request at a time per connection (no upstream pipelining). A kept connection the node
closes before any byte of the answer fails with UpstreamClosedKept (the node's keep-alive
timeout racing the request; the caller resends on a new connection), and the pool closes
connections idle for `idle_timeout_s` itself, before a node's keep-alive timeout (uvicorn's
is 5 s) makes that race likely. Deadlines are kept by one sweeper per pool, not a timer per
request: the whole answer must arrive within the try's timeout (the response timeout, or the
per-try timeout of keyed reads, which the C path uses too), except that a streamed body only
has to keep moving (each chunk renews the response timeout) and a stream paused because the
client is not reading has no upstream deadline (the client's send timeout bounds it).

`UpstreamConnection` extends the C half from `proxy._hotpath`: for requests the C path
forwarded, it answers the client itself when the response is whole and simple, and otherwise
hands the request to a Python exchange (`adopt`) and continues here.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import httptools

from proxy._hotpath import Hub, UpstreamBase
from proxy.errors import (
    UpstreamClosedKept,
    UpstreamFailure,
    UpstreamProtocol,
    UpstreamRefused,
    UpstreamReset,
    UpstreamTimeout,
    UpstreamTooLarge,
)
from proxy.http import filter_response_head

Origin = tuple[str, int]
MAX_HEAD_BYTES = 65_536  # a node's status line and headers (the body is not counted)
# Answers up to this much body are buffered whole (so a failed attempt can still fail over
# and a small answer is written in one piece); longer ones are streamed to the client.
STREAM_AFTER_BYTES = 65_536
_CONTENT_LENGTH = re.compile(rb"^content-length[ \t]*:[ \t]*(\d+)[ \t]*\r?$", re.I | re.M)
_TRANSFER_ENCODING = re.compile(rb"^transfer-encoding[ \t]*:([^\r\n]*)", re.I | re.M)


@dataclass(slots=True)
class ResponseHead:
    status: int
    lines: bytes  # header lines to pass on (hop-by-hop, framing and provenance removed)
    content_length: int | None  # as the node framed it; None for chunked or close-delimited


class ResponseSink(Protocol):
    """What receives one answer (the exchange); see the module docstring for the order."""

    def on_response(
        self, connection: UpstreamConnection, head: ResponseHead, body: bytes, complete: bool
    ) -> None: ...

    def on_body(self, data: bytes) -> None: ...

    def on_end(self) -> None: ...

    def on_failure(self, failure: UpstreamFailure) -> None: ...

    def on_cancelled(self) -> None: ...

    def on_slow(self) -> None: ...


Adopt = Callable[["UpstreamConnection"], ResponseSink]


class _HeadResponseEnd(Exception):
    """Raised from on_headers_complete to end an answer to HEAD at its head: httptools cannot
    be told that such an answer has no body (llhttp's skip-body return is not exposed)."""


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
        self._sink: ResponseSink | None = None
        self._reset_answer()

    def _reset_answer(self) -> None:
        self._head_request = False  # the request was HEAD: the answer ends at its head
        self._raw_head = b""  # bytes of the current head until it is complete
        self._in_head = True
        self._interim = False  # the message being parsed is a 1xx
        self._head: ResponseHead | None = None
        self._body: list[bytes] = []
        self._size = 0  # body bytes received
        self._streaming = False
        self._until_close = False  # the body ends when the node closes
        self._complete = False
        self._extra = False  # bytes arrived after the answer ended
        self._keep_alive = False  # both sides allow reuse, as the parser read the answer
        self._paused = False
        self._hedge = False  # the sink wants on_slow once this request is slow
        self._sent_at = 0.0
        self._timeout_s = self._pool.response_timeout_s

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def adopt(self) -> None:
        """The C path forwarded the request but cannot finish it: a Python exchange takes it."""
        head_request = bool(self.fast_head_only)
        self._sink = self._pool.adopt(self)
        self._head_request = head_request
        self._timeout_s = self._pool.try_timeout_s  # what the C path gave it (a keyed read)

    def slow_data_received(self, data: bytes) -> None:
        if self._sink is None:
            self.close_now()  # bytes nobody asked for: the connection cannot be trusted any more
            return
        if self._in_head:
            self._raw_head += data
        try:
            self._parser.feed_data(data)
        except _HeadResponseEnd:
            self._parser = httptools.HttpResponseParser(self)  # it stopped mid-message
            self._complete = True
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocol("101 Switching Protocols to a request without Upgrade"))
            return
        except httptools.HttpParserError as exc:
            context = exc.__context__
            if isinstance(context, _HeadResponseEnd):
                self._parser = httptools.HttpResponseParser(self)
                self._complete = True
            elif self._complete:
                self._extra = True  # the answer was whole; what follows it is not reused
            else:
                self._fail(
                    context
                    if isinstance(context, UpstreamFailure)
                    else UpstreamProtocol(f"unparsable response: {exc}")
                )
                return
        if self._sink is None:
            return  # failed or abandoned inside a callback
        if self._in_head and len(self._raw_head) > MAX_HEAD_BYTES:
            self._fail(UpstreamProtocol(f"response head over {MAX_HEAD_BYTES} bytes"))
        elif self._complete:
            self._end_answer()
        elif not self._streaming and self._head is not None and self._size > STREAM_AFTER_BYTES:
            self._offer(complete=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        if not self.waiting:
            return
        if exc is None and self._until_close and self._head is not None:
            self._complete = True  # a close-delimited body ends here (a reset is a failure)
            self._end_answer()
            return
        reason = f"connection closed by the node ({exc or 'EOF'})"
        if self.idle_since and self._in_head and not self._raw_head:
            self._fail(UpstreamClosedKept(f"kept-alive {reason} before answering"))
        else:
            self._fail(UpstreamReset(reason))

    # -- back-pressure (the client's connection calls these) ---------------------------------

    def pause(self) -> None:
        """The client cannot take more: stop reading the node (and its deadline with it)."""
        if not self._paused and not self.closed:
            self._paused = True
            self.transport.pause_reading()
            self.deadline = float("inf")

    def resume(self) -> None:
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()
            self.deadline = time.monotonic() + self._pool.response_timeout_s

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._complete:
            self._extra = True  # a second answer to one request: never reuse this connection

    def on_headers_complete(self) -> None:
        # Header names and values are not needed one by one (that costs a Python call per
        # header): the raw head is filtered in one pass instead.
        raw = self._raw_head
        end = raw.find(b"\r\n\r\n")
        if end < 0:
            raise UpstreamProtocol("response head not delimited by CRLF")
        if end + 4 > MAX_HEAD_BYTES:
            raise UpstreamProtocol(f"response head over {MAX_HEAD_BYTES} bytes")
        status = self._parser.get_status_code()
        if status < 100:
            raise UpstreamProtocol(f"status {status} is not an HTTP status")
        if status == 101:
            raise UpstreamProtocol("101 Switching Protocols to a request without Upgrade")
        if status < 200:
            self._interim = True  # absorbed; the final answer's head follows it
            self._raw_head = raw[end + 4 :]
            return
        lines = raw[raw.find(b"\r\n") + 2 : end + 2]
        length = _content_length(lines)
        codings = _transfer_codings(lines)
        if codings and codings != [b"chunked"]:
            # Passed on undecoded with the header dropped, the body would be unreadable.
            raise UpstreamProtocol(f"transfer coding {b', '.join(codings).decode()} in an answer")
        self._head = ResponseHead(status, filter_response_head(lines), length)
        self._in_head = False
        self._raw_head = b""
        no_body = status in (204, 304)
        if self._head_request or no_body:
            # An answer without a body is where a broken node most often sends one anyway,
            # later, after the answer looked whole; whatever it sends would be read as the
            # next request's answer. These are rare: such a connection is never reused.
            self._extra = True
        if self._head_request:
            self._keep_alive = self._parser.should_keep_alive()
            raise _HeadResponseEnd
        if length is None and not no_body and not codings:
            self._until_close = True
        if length is not None and length > self._pool.max_response_bytes:
            raise UpstreamTooLarge(f"response over {self._pool.max_response_bytes} bytes")

    def on_body(self, body: bytes) -> None:
        if self._interim:
            raise UpstreamProtocol("an interim (1xx) answer with a body")
        self._size += len(body)
        if self._size > self._pool.max_response_bytes:
            raise UpstreamTooLarge(f"response over {self._pool.max_response_bytes} bytes")
        if self._streaming:
            self.deadline = time.monotonic() + self._pool.response_timeout_s
            sink = self._sink
            if sink is not None:
                sink.on_body(body)
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True
        self._keep_alive = self._parser.should_keep_alive()

    # -- answers ----------------------------------------------------------------------------

    def _offer(self, *, complete: bool) -> None:
        """Give the sink the final answer's head and what arrived of its body."""
        sink, head = self._sink, self._head
        assert sink is not None
        assert head is not None
        body = b"".join(self._body)
        self._body = []
        if complete:
            self._retire()
        sink.on_response(self, head, body, complete)

    def stream(self) -> None:
        """The sink took the partial answer: pass the rest of the body as it comes."""
        self._streaming = True
        self.deadline = time.monotonic() + self._pool.response_timeout_s

    def cancel(self) -> None:
        """The client of the answer streaming here is gone: close, tell the sink."""
        sink = self._sink
        self.abandon()
        if sink is not None:
            sink.on_cancelled()

    def abandon(self) -> None:
        """The sink does not want the rest of this answer: close without reading it."""
        self._sink = None
        self.busy = False
        self.close_now()

    def _end_answer(self) -> None:
        if not self._streaming:
            self._offer(complete=True)
            return
        sink = self._sink
        self._retire()
        if sink is not None:
            sink.on_end()

    def _retire(self) -> None:
        """The answer ended: back to the pool if it ended cleanly, else closed."""
        reusable = (
            self._keep_alive and not self._until_close and not self._extra and not self.closed
        )
        if self._paused and not self.closed:
            self.transport.resume_reading()  # paused for a client that is gone or done
        self._sink = None
        self.busy = False
        self._reset_answer()
        if reusable:
            self._pool.release(self)
        else:
            self.close_now()

    # -- the pool's side --------------------------------------------------------------------

    @property
    def waiting(self) -> bool:
        """A request (the Python path's or the C path's) awaits its response here."""
        return self._sink is not None or self.fast_client is not None

    def send(
        self,
        request: bytes,
        sink: ResponseSink,
        *,
        head_request: bool,
        timeout_s: float | None = None,
        hedge: bool = False,
    ) -> None:
        assert self.transport is not None
        self._sink = sink
        self._head_request = head_request
        self.busy = True
        self._hedge = hedge
        self._timeout_s = self._pool.response_timeout_s if timeout_s is None else timeout_s
        self._sent_at = time.monotonic()
        self.deadline = self._sent_at + self._timeout_s
        self.transport.write(request)

    def hedge_due(self, sent_before: float) -> bool:
        """Whether the request here was sent before `sent_before` and may be hedged (once)."""
        if self.fast_client is not None:  # the C path forwards keyed reads only
            return bool(self.fast_received_at <= sent_before)
        return self._hedge and not self._streaming and self._sent_at <= sent_before

    def slow(self) -> None:
        """No answer within the hedge delay: tell the sink (adopting a C-path request first)."""
        if self.fast_client is not None:
            self.adopt()
        self._hedge = False
        sink = self._sink
        if sink is not None:
            sink.on_slow()

    def expire(self) -> None:
        """The sweeper found this connection past its response deadline."""
        if self.waiting:
            fast = self.fast_client is not None  # the C path's keyed read: the per-try timeout
            timeout_ms = (self._pool.try_timeout_s if fast else self._timeout_s) * 1000
            what = "no body bytes for" if self._streaming else "no whole response within"
            self._fail(UpstreamTimeout(f"{what} {timeout_ms:.0f} ms"))

    def _fail(self, failure: UpstreamFailure) -> None:
        if self.fast_client is not None:
            self.adopt()  # the exchange the C path never built takes the failure (and fails over)
        sink = self._sink
        self._sink = None
        self.busy = False
        self.close_now()
        if sink is not None:
            sink.on_failure(failure)

    def close_now(self) -> None:
        """Close at once and leave the pool (part of the C contract: the C path calls it on a
        connection it will not reuse)."""
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
        self._pool.forget(self)


def _content_length(lines: bytes) -> int | None:
    found = _CONTENT_LENGTH.search(lines)
    return None if found is None else int(found.group(1))


def _transfer_codings(lines: bytes) -> list[bytes]:
    values = b",".join(_TRANSFER_ENCODING.findall(lines))
    return [token.strip().lower() for token in values.split(b",") if token.strip()]


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
        try_timeout_s: float | None = None,
        hedge_after_s: float | None = None,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.hub = hub
        self.connect_timeout_s = connect_timeout_s
        self.response_timeout_s = response_timeout_s
        # A keyed read's try (the hub's response_timeout_s must be the same: the C path's).
        self.try_timeout_s = response_timeout_s if try_timeout_s is None else try_timeout_s
        self.hedge_after_s = hedge_after_s
        self.idle_per_origin = idle_per_origin
        self.idle_timeout_s = idle_timeout_s
        self.max_response_bytes = max_response_bytes
        # Lists, never replaced: the C path pops from and appends to them too.
        self._idle: dict[Origin, list[UpstreamConnection]] = {}
        self._open: set[UpstreamConnection] = set()
        self._connecting: dict[asyncio.Task[None], ResponseSink] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self.opened = 0
        self.adopt: Adopt = _no_adopter

    def idle_list(self, origin: Origin) -> list[UpstreamConnection]:
        return self._idle.setdefault(origin, [])

    def start(self) -> None:
        self._sweeper = self.loop.create_task(self._sweep())

    def _tick_s(self) -> float:
        """The sweeper's period: fine enough for the shortest deadline it keeps (a hedge is
        sent at most a quarter of its delay late), never busier than every 5 ms."""
        shortest = min(self.try_timeout_s, self.idle_timeout_s) / 8
        if self.hedge_after_s is not None:
            shortest = min(shortest, self.hedge_after_s / 4)
        return min(max(shortest, 0.005), 0.25)

    async def _sweep(self) -> None:
        tick = self._tick_s()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            expired, slow = self._due(now)
            for connection in expired:
                connection.expire()
            for connection in slow:
                if connection.busy and not connection.closed:  # an earlier one may have ended it
                    connection.slow()
            self._close_long_idle(now - self.idle_timeout_s)

    def _due(self, now: float) -> tuple[list[UpstreamConnection], list[UpstreamConnection]]:
        """Busy connections past their deadline, and (hedging on) those whose request waited
        longer than the hedge delay. One pass over the open connections per tick."""
        if self.hedge_after_s is None:
            return [c for c in self._open if c.busy and c.deadline < now], []
        sent_before = now - self.hedge_after_s
        expired: list[UpstreamConnection] = []
        slow: list[UpstreamConnection] = []
        for connection in self._open:
            if not connection.busy:
                continue
            if connection.deadline < now:
                expired.append(connection)
            elif connection.hedge_due(sent_before):
                slow.append(connection)
        return expired, slow

    def _close_long_idle(self, idle_before: float) -> None:
        for idle in self._idle.values():
            # Oldest first: the C path and release() append, and sends pop from the end.
            while idle and idle[0].idle_since < idle_before:
                idle.pop(0).close_now()

    def send(
        self,
        origin: Origin,
        request: bytes,
        sink: ResponseSink,
        *,
        head_request: bool = False,
        fresh: bool = False,
        timeout_s: float | None = None,
        hedge: bool = False,
    ) -> None:
        """Over an idle connection to origin, or a new one (always, with `fresh`); the answer
        must come within `timeout_s` (default: the response timeout); `hedge`: see on_slow."""
        idle = None if fresh else self._idle.get(origin)
        while idle:
            connection = idle.pop()
            if not connection.closed and not connection.transport.is_closing():
                connection.send(
                    request, sink, head_request=head_request, timeout_s=timeout_s, hedge=hedge
                )
                return
        task = self.loop.create_task(
            self._connect_and_send(
                origin, request, sink, head_request=head_request, timeout_s=timeout_s, hedge=hedge
            )
        )
        self._connecting[task] = sink
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[None]) -> None:
        self._connecting.pop(task, None)

    def abandon_sink(self, sink: ResponseSink) -> None:
        """`sink` lost a hedged race: close the connection its request is on (never back to
        the pool mid-answer: what the node sends later is never read), or stop its connect."""
        for connection in self._open:
            if connection._sink is sink:
                connection.abandon()
                return
        for task, waiting in list(self._connecting.items()):
            if waiting is sink:
                task.cancel()  # a connection made meanwhile is closed by create_connection

    async def _connect_and_send(
        self,
        origin: Origin,
        request: bytes,
        sink: ResponseSink,
        *,
        head_request: bool,
        timeout_s: float | None,
        hedge: bool,
    ) -> None:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await self.loop.create_connection(
                    lambda: UpstreamConnection(self, origin), *origin
                )
        except TimeoutError:
            sink.on_failure(UpstreamRefused(f"connect timed out after {self.connect_timeout_s}s"))
            return
        except OSError as exc:
            sink.on_failure(UpstreamRefused(f"connect failed: {exc.strerror or exc}"))
            return
        self.opened += 1
        self._open.add(connection)
        connection.send(request, sink, head_request=head_request, timeout_s=timeout_s, hedge=hedge)

    def release(self, connection: UpstreamConnection) -> None:
        idle = self.idle_list(connection.origin)
        if len(idle) >= self.idle_per_origin:
            connection.close_now()
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
                connection.close_now()

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
                connection.close_now()
            idle.clear()
        for connection in [c for c in self._open if c.busy]:
            connection._fail(UpstreamReset("proxy shutting down"))


def _no_adopter(connection: UpstreamConnection) -> ResponseSink:
    raise RuntimeError("the C path forwarded a request but no exchange can adopt it")
