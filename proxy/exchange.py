"""One client request's way through the candidates: send, fail over, answer.

Callback style, no task per request: `start` sends to the first candidate over the pool, and
the exchange, as the pool's `ResponseSink`, either answers the client or moves to the next
candidate. Failover happens only for idempotent requests, only on failures that say nothing
was served (connect failed, connection reset, timeout) or on a keyed request's answer with a
retry status (KROUTE_RETRY_STATUSES, 421 by default: "not mine or not ready"; the table is
refreshed, the node is not ejected), only before any byte of the answer went to the client,
and only within the retry budget (`proxy.retry_budget`), so a sick cluster is not hit with a
multiple of its load. When no replica is left to ask, the last retry-status answer is passed
on as the node sent it (a 404 from every replica is the key's real answer), except a node's
refusal of the request's freshness bounds (421 with x-kroute-refused, proxy.freshness): that
one does not refresh the table, and the last is answered with a 503 naming every refusal.
A malformed or oversized answer is a 502 for that request: the node is not down, so it is
not retried, and not ejected on connection grounds; malformed answers count towards the
consecutive-5xx ejection (KROUTE_EJECT_CONSECUTIVE_5XX), oversized ones do not (the value is
big, the node is fine).

An answer longer than the pool's buffer is streamed: its head goes to the client, then its
body as it arrives, with the client's back-pressure pausing the node's connection. A node
that fails mid-stream cannot be failed over any more (the client has part of an answer):
the client's connection is closed without completing the answer, as HAProxy and Envoy do.

Hedged reads (KROUTE_HEDGE_AFTER_MS): a keyed read whose try has no answer after the hedge
delay (the pool's sweeper calls `on_slow`) is sent to the next candidate as well, if the retry
budget gives a token: so hedges, like failovers, add at most the budget's share of load. The
two tries race; the first with an answer to pass on (any final answer but a retry status)
wins, and the other is cancelled: `UpstreamPool.abandon_sink` closes its connection, so its
late bytes are never read, never pooled, never anyone's answer. A try that fails or answers a
retry status while the other is out just drops out (a failure still ejects its node): the
other one is then the exchange's only try and goes on as any try does. An answer streaming to
the client is never hedged (the pool does not call `on_slow` for it). One hedge per request.
The second try's sink is a `_Hedge`, so the exchange knows which try spoke.

Outlier ejection (`proxy.outliers`): every final answer but a retry status, and every answer
that cannot be passed on, is reported to the node's consecutive-5xx count.

A request the C path (`proxy._hotpath`) forwarded is adopted by an exchange here when it
cannot be finished in C (a failure, a retry status, a response that is not whole and simple):
`adopt` rebuilds the exchange from what the connection kept and it goes on as if it had
started here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

from common.clock import now_ms
from proxy._hotpath import Cached, Candidate
from proxy.choice import LagBudget, Rejection, Replica, rotated
from proxy.errors import UpstreamClosedKept, UpstreamFailure, UpstreamProtocol, UpstreamTooLarge
from proxy.freshness import NodeRefusal, refusal_of, unmet
from proxy.health import Ejections
from proxy.http import (
    CHUNKED,
    LAST_CHUNK,
    NO_BODY,
    UNTIL_CLOSE,
    ClientRequest,
    answer_head,
    body_framing,
    chunk,
    json_response,
    request_head,
)
from proxy.metrics import ProxyMetrics
from proxy.outliers import Outliers
from proxy.retry_budget import RetryBudget
from proxy.upstream import ResponseHead, ResponseSink, UpstreamConnection, UpstreamPool

log = structlog.get_logger("kroute.proxy.exchange")


class Producer(Protocol):
    """What a client's back-pressure pauses: the node connection streaming its answer."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def cancel(self) -> None:
        """The client is gone: stop streaming (the node connection is closed)."""


class Client(Protocol):
    """The client connection an exchange answers (proxy.listener.ClientConnection)."""

    def respond(self, message: bytes, keep_alive: bool) -> None:
        """The whole answer, or its last bytes: the response ends here."""

    def send_part(self, data: bytes, producer: Producer) -> None:
        """Part of an answer that goes on; `producer` is paused while the client cannot
        take more."""

    def abort_response(self) -> None:
        """The answer cannot be completed: close the connection without ending it."""


def provenance_lines(node_id: str, partition: int | None, replica: Replica | None) -> bytes:
    """The x-kroute-* lines every answer from this node carries (one place for both paths:
    the C path sends a candidate's copy of them). Time lag is not here: it grows per answer."""
    lines = b"x-kroute-node: %s\r\n" % node_id.encode()
    if partition is None or replica is None:
        return lines
    lag = b"unknown" if replica.lag is None else str(replica.lag).encode()
    lines += b"x-kroute-partition: %d\r\nx-kroute-role: %s\r\nx-kroute-lag: %s\r\n" % (
        partition,
        replica.role.encode(),
        lag,
    )
    if replica.caught_up_at_ms is None and replica.lag == 0:
        lines += b"x-kroute-time-lag-ms: 0\r\n"  # else computed per answer (it grows)
    return lines


def answer_lines(candidate: Candidate, attempts: int, request_id: bytes) -> bytes:
    """The proxy's header lines on an answer from `candidate`."""
    lines = candidate.provenance
    replica = candidate.replica
    if replica is not None and replica.caught_up_at_ms is not None:
        time_lag = replica.time_lag_ms(now_ms())
        if time_lag is not None:
            lines += b"x-kroute-time-lag-ms: %d\r\n" % time_lag
    if attempts > 1:
        lines += b"x-kroute-attempts: %d\r\n" % attempts
    return lines + b"x-request-id: " + request_id + b"\r\n"


@dataclass(frozen=True, slots=True)
class Target:
    node_id: str
    url: str
    origin: tuple[str, int]
    host_line: bytes  # "host: <authority>\r\n" for requests to this node

    @classmethod
    def build(cls, node_id: str, url: str, host: str, port: int) -> Target:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls(node_id, url, (host, port), f"host: {authority}\r\n".encode())


@dataclass
class ExchangeContext:
    """Collaborators every exchange uses; built once by the composition root."""

    pool: UpstreamPool
    ejections: Ejections
    metrics: ProxyMetrics
    refresh_table: Callable[[], None]
    retry_budget: RetryBudget
    access_log: bool = False
    in_flight: int = 0
    # Statuses meaning "not mine or not ready, ask the next replica" (KROUTE_RETRY_STATUSES).
    retry_statuses: frozenset[int] = frozenset({421})
    # A keyed read's try: how long it may go unanswered (None: the pool's response timeout)
    # and whether it is hedged (the delay is the pool's: its sweeper notices slow tries).
    try_timeout_s: float | None = None
    hedging: bool = False
    outliers: Outliers | None = None
    # The budget a keyed read carries to its node when it asks for none (the handler sets it;
    # the C path sends the same lines), so a node's refusal of it is read as one.
    node_budget: LagBudget | None = None


class Exchange:
    __slots__ = (
        "_attempt",
        "_client",
        "_connection",
        "_ctx",
        "_framing",
        "_furthest",
        "_head",
        "_hedge",
        "_hedged",
        "_refusals",
        "_request",
        "_resent",
        "_status",
        "_tried",
        "budget",
        "idempotent",
        "min_offset",
        "partition",
        "rejected",
        "store",
        "targets",
    )

    def __init__(
        self,
        ctx: ExchangeContext,
        request: ClientRequest,
        client: Client,
        *,
        targets: Sequence[Candidate],
        store: str | None,
        partition: int | None,
        rejected: tuple[Rejection, ...],
        budget: LagBudget | None,
        idempotent: bool,
        min_offset: int | None = None,
    ) -> None:
        self._ctx = ctx
        self._request = request
        self._client = client
        self.targets = targets
        self.store = store
        self.partition = partition
        self.rejected = rejected
        self.budget = budget
        self.idempotent = idempotent
        self.min_offset = min_offset  # read-your-writes: the offset the store must have applied
        self._refusals: list[NodeRefusal] = []  # 421s with x-kroute-refused: bounds not met
        self._attempt = 0
        self._tried: list[dict[str, str]] = []
        self._head = b""
        self._resent = False  # once per exchange, after a kept connection closed unanswered
        self._connection: UpstreamConnection | None = None  # while streaming an answer
        self._framing = ""
        self._status = 0
        self._furthest = 0  # the furthest candidate sent to (a hedge goes beyond _attempt)
        self._hedge: _Hedge | None = None  # the second try, while the two race
        self._hedged = False

    @classmethod
    def adopt(cls, ctx: ExchangeContext, connection: UpstreamConnection) -> Exchange:
        """Take over the request the C path forwarded on this connection; returns the sink
        for its outcome. The C path already counted the attempt and the deposit."""
        cached: Cached = connection.fast_cached
        head: bytes = connection.fast_head
        client = connection.fast_client
        method = "HEAD" if connection.fast_head_only else "GET"
        request = ClientRequest(
            method=method,
            target=head.split(b" ", 2)[1].decode("ascii"),
            path="",
            query=None,
            headers=[],
            body=b"",
            client_ip=client.client_ip,
            keep_alive=bool(connection.fast_keep_alive),
            request_id=connection.fast_request_id,
            received_at=connection.fast_received_at,
            http11=bool(connection.fast_http11),
        )
        client.adopted(request)
        exchange = cls(
            ctx,
            request,
            client,
            targets=rotated(cached.candidates, cached.spread_width, connection.fast_shift),
            store=connection.fast_store.decode(),
            partition=connection.fast_partition,
            rejected=cached.choice.rejected,
            budget=ctx.node_budget,
            idempotent=True,
        )
        exchange._head = head
        connection.release_fast()
        ctx.in_flight += 1
        return exchange

    def start(self) -> None:
        if not self.targets:
            self._no_candidates()
            return
        request = self._request
        self._head = request_head(
            request.method,
            request.target,
            request.headers,
            client_ip=request.client_ip,
            request_id=request.request_id,
            body_length=len(request.body),
        )
        self._ctx.in_flight += 1
        self._ctx.retry_budget.deposit()
        self._send()

    def _send(self, sink: ResponseSink | None = None, index: int | None = None) -> None:
        candidate = self.targets[self._attempt if index is None else index]
        if candidate.choice_tally is not None:
            candidate.choice_tally.value += 1
        candidate.node_tally.value += 1
        self._transmit(candidate.target, fresh=False, sink=sink)

    def _transmit(self, target: Target, *, fresh: bool, sink: ResponseSink | None = None) -> None:
        message = self._head + target.host_line + b"\r\n" + self._request.body
        ctx = self._ctx
        # A read-your-writes request may wait on the node for its position (bounded by the
        # node's KROUTE_MIN_OFFSET_WAIT_MS): slow by design, so neither hedged nor cut short
        # by the per-try timeout (a lost hedge race would count against a healthy node).
        keyed_read = self.store is not None and self.idempotent and self.min_offset is None
        ctx.pool.send(
            target.origin,
            message,
            self if sink is None else sink,
            head_request=self._request.method == "HEAD",
            fresh=fresh,
            timeout_s=ctx.try_timeout_s if keyed_read else None,
            hedge=keyed_read and ctx.hedging and not self._hedged,
        )

    # -- the pool's ResponseSink ---------------------------------------------------------------

    def on_response(
        self, connection: UpstreamConnection, head: ResponseHead, body: bytes, complete: bool
    ) -> None:
        candidate = self.targets[self._attempt]
        target = candidate.target
        if self._is_retry_status(head.status):
            refusal = self._retry_answer(target, head)
            if self._hedge is not None:  # the hedge is still out: it is the next replica
                if not complete:
                    connection.abandon()
                self._promote_hedge()
                return
            if self._may_retry():
                if not complete:
                    connection.abandon()  # the rest of a long "not mine" is not worth reading
                self._advance()
                return
            if refusal is not None:  # no replica left for the bounds: the proxy's 503 says why
                if not complete:
                    connection.abandon()
                self._bounds_unmet()
                return
        else:
            self._report(candidate, head.status)
            if self._hedge is not None:  # this try answered first: the hedge lost
                self._cancel_hedge()
        if complete:
            self._answer_whole(head, body)
        else:
            self._start_stream(connection, head, body)

    def on_body(self, data: bytes) -> None:
        connection = self._connection
        if connection is None:
            return
        self._client.send_part(chunk(data) if self._framing == CHUNKED else data, connection)

    def on_end(self) -> None:
        self._connection = None
        last = LAST_CHUNK if self._framing == CHUNKED else b""
        keep_alive = self._request.keep_alive and self._framing != UNTIL_CLOSE
        self._finish(last, self._status, keep_alive=keep_alive)

    def on_cancelled(self) -> None:
        """The client went away while its answer was streaming."""
        self._connection = None
        self._ctx.in_flight -= 1
        self._observe(self._status)

    def on_failure(self, failure: UpstreamFailure) -> None:
        target = self.targets[self._attempt].target
        if self._connection is not None:
            self._stream_failed(target, failure)
        elif self._hedge is not None:  # the hedge is still out: wait for it
            if not self._resend_kept(target, failure, self):
                self._drop_out(self._attempt, failure)
                self._promote_hedge()
        elif isinstance(failure, UpstreamProtocol):
            self._bad_answer(target, failure)
        else:
            self._failed(target, failure)

    def on_slow(self) -> None:
        """The try has had no answer for the hedge delay: send the request to the next
        candidate too, if there is one and the retry budget gives a token (a hedge is load
        the budget must bound exactly like a failover)."""
        ctx = self._ctx
        index = self._furthest + 1
        if self._hedged or self._connection is not None or index >= len(self.targets):
            return
        self._hedged = True
        if not ctx.retry_budget.withdraw():
            ctx.metrics.retry_budget_exhausted += 1
            return
        ctx.metrics.hedges_sent += 1
        self._furthest = index
        self._hedge = _Hedge(self, index)
        self._send(self._hedge, index)

    # -- the hedge's race ----------------------------------------------------------------------

    def hedge_response(
        self,
        hedge: _Hedge,
        connection: UpstreamConnection,
        head: ResponseHead,
        body: bytes,
        complete: bool,
    ) -> None:
        """The hedge answered while the first try is still out."""
        candidate = self.targets[hedge.index]
        if self._is_retry_status(head.status):
            self._retry_answer(candidate.target, head)
            if not complete:
                connection.abandon()
            hedge.state = _LOST
            self._hedge = None
            return
        # The hedge wins: the first try is cancelled before anything else can happen to it.
        ctx = self._ctx
        ctx.pool.abandon_sink(self)
        ctx.metrics.hedges_won += 1
        slow = self.targets[self._attempt]
        self._tried.append({"node": slow.target.node_id, "outcome": "lost a hedged race"})
        if ctx.outliers is not None:
            ctx.outliers.failed(slow, "lost a hedged race")
        self._promote_hedge()
        self.on_response(connection, head, body, complete)

    def hedge_failed(self, hedge: _Hedge, failure: UpstreamFailure) -> None:
        """The hedge failed while the first try is still out: that one goes on alone."""
        if self._resend_kept(self.targets[hedge.index].target, failure, hedge):
            return
        self._drop_out(hedge.index, failure)
        hedge.state = _LOST
        self._hedge = None

    def _promote_hedge(self) -> None:
        """The first try is over: the hedge is this exchange's only try from now on."""
        hedge = self._hedge
        assert hedge is not None
        hedge.state = _PROMOTED
        self._hedge = None
        self._attempt = hedge.index

    def _cancel_hedge(self) -> None:
        hedge = self._hedge
        assert hedge is not None
        hedge.state = _CANCELLED
        self._hedge = None
        self._ctx.metrics.hedges_cancelled += 1
        self._ctx.pool.abandon_sink(hedge)
        node = self.targets[hedge.index].target.node_id
        self._tried.append({"node": node, "outcome": "hedge cancelled"})

    def _drop_out(self, index: int, failure: UpstreamFailure) -> None:
        """A racing try failed: it is counted (and its node ejected unless it answered)."""
        ctx = self._ctx
        candidate = self.targets[index]
        target = candidate.target
        ctx.metrics.failed(target.node_id, failure.kind)
        self._tried.append({"node": target.node_id, "outcome": f"{failure.kind}: {failure}"})
        if isinstance(failure, UpstreamProtocol):
            if not isinstance(failure, UpstreamTooLarge):
                self._report(candidate, 502)  # an answer the proxy cannot pass on
        else:
            ctx.ejections.eject(target.node_id, target.url, f"{failure.kind}: {failure}")
            ctx.pool.drop_origin(target.origin)

    def _resend_kept(self, target: Target, failure: UpstreamFailure, sink: ResponseSink) -> bool:
        """A racing try's kept connection closed unanswered: resent once (see _failed)."""
        if not isinstance(failure, UpstreamClosedKept) or self._resent:
            return False
        self._resent = True
        self._ctx.metrics.resent_after_kept_close += 1
        self._transmit(target, fresh=True, sink=sink)
        return True

    def _retry_answer(self, target: Target, head: ResponseHead) -> NodeRefusal | None:
        ProxyMetrics.bump(self._ctx.metrics.misdirected, target.node_id)
        bounded = self.min_offset is not None or self.budget is not None
        refusal = refusal_of(head.lines) if bounded else None
        if refusal is None:
            self._ctx.refresh_table()  # the node may be telling us the table is out of date
            outcome = f"{head.status} (retry)"
        else:
            # The node refused the request's freshness bounds (proxy.freshness): the table is
            # right about where the partition is, and re-reading Redis would not make the node
            # fresher (under a tight budget it would be a read of Redis per request).
            self._refusals.append(refusal)
            outcome = f"{head.status}: {refusal.reason}"
        self._tried.append({"node": target.node_id, "outcome": outcome})
        return refusal

    def _report(self, candidate: Candidate, status: int) -> None:
        """An answer from the candidate's node, for its consecutive-5xx count."""
        outliers = self._ctx.outliers
        if outliers is not None:
            outliers.answered(candidate, status)

    def _is_retry_status(self, status: int) -> bool:
        """A keyed request's "not mine or not ready" answer. The node answered, so it is not
        ejected: the answer is about one partition, and the node serves others. 421 says the
        request was not processed (RFC 9110 15.5.20), so any method may be resent; another
        status only an idempotent request (keyed routes take GET and HEAD only, so today
        every keyed request). A request that matched no route has no partition to be wrong
        about: its answer is passed on whatever it is."""
        return (
            self.store is not None
            and status in self._ctx.retry_statuses
            and (self.idempotent or status == 421)
        )

    # -- failures ------------------------------------------------------------------------------

    def _failed(self, target: Target, failure: UpstreamFailure) -> None:
        ctx = self._ctx
        if isinstance(failure, UpstreamClosedKept) and self.idempotent and not self._resent:
            # Not the node failing: its keep-alive timeout closed the connection as the
            # request went out (RFC 9112 9.3.1 lets an idempotent request be resent).
            self._resent = True
            ctx.metrics.resent_after_kept_close += 1
            log.info(
                "resent on a new connection",
                request_id=self._request.request_id.decode(),
                node=target.node_id,
                reason=str(failure),
            )
            self._transmit(target, fresh=True)
            return
        ctx.metrics.failed(target.node_id, failure.kind)
        ctx.ejections.eject(target.node_id, target.url, f"{failure.kind}: {failure}")
        ctx.pool.drop_origin(target.origin)
        self._tried.append({"node": target.node_id, "outcome": f"{failure.kind}: {failure}"})
        if self.idempotent and self._may_retry():
            self._advance()
            log.info(
                "failover",
                request_id=self._request.request_id.decode(),
                failed_node=target.node_id,
                reason=failure.kind,
                next_node=self.targets[self._attempt].target.node_id,
                partition=self.partition,
            )
            return
        status = 503 if self.idempotent else 502
        detail = (
            "every node tried failed"
            if self.idempotent
            else "the node failed and the request is not idempotent (not retried)"
        )
        self._answer_error(status, "upstream_failed", detail, **self._attempts())

    def _bad_answer(self, target: Target, failure: UpstreamFailure) -> None:
        """A node answered, but not in HTTP the proxy can pass on: 502, the node stays in
        (unless such answers and 5xx come KROUTE_EJECT_CONSECUTIVE_5XX times in a row)."""
        if not isinstance(failure, UpstreamTooLarge):  # a big value says nothing of the node
            self._report(self.targets[self._attempt], 502)
        self._ctx.metrics.failed(target.node_id, failure.kind)
        self._tried.append({"node": target.node_id, "outcome": f"{failure.kind}: {failure}"})
        log.warning(
            "bad answer from a node",
            request_id=self._request.request_id.decode(),
            node=target.node_id,
            reason=str(failure),
        )
        self._answer_error(
            502, "bad_gateway", "the node's answer could not be passed on", **self._attempts()
        )

    def _stream_failed(self, target: Target, failure: UpstreamFailure) -> None:
        """The node failed after part of its answer went to the client: nothing can be
        retried, so the client's connection is closed short of the answer's end."""
        ctx = self._ctx
        self._connection = None
        ctx.metrics.failed(target.node_id, failure.kind)
        ctx.metrics.cut_short += 1
        if not isinstance(failure, UpstreamProtocol):
            ctx.ejections.eject(target.node_id, target.url, f"{failure.kind}: {failure}")
        log.warning(
            "answer cut short",
            request_id=self._request.request_id.decode(),
            node=target.node_id,
            reason=f"{failure.kind}: {failure}",
        )
        ctx.in_flight -= 1
        self._observe(self._status)
        self._client.abort_response()

    def _may_retry(self) -> bool:
        """Whether a next candidate may be tried: there is one and the retry budget allows."""
        ctx = self._ctx
        if max(self._attempt, self._furthest) + 1 >= len(self.targets):
            return False
        if not ctx.retry_budget.withdraw():
            ctx.metrics.retry_budget_exhausted += 1
            self._tried.append({"node": "-", "outcome": "retry budget exhausted"})
            return False
        return True

    def _advance(self) -> None:
        self._ctx.metrics.failovers += 1
        self._attempt = self._furthest = max(self._attempt, self._furthest) + 1
        self._send()

    # -- answers -------------------------------------------------------------------------------

    def _answer_whole(self, head: ResponseHead, body: bytes) -> None:
        request = self._request
        head_request = request.method == "HEAD"
        length = head.content_length if head_request or head.status == 304 else len(body)
        framing_line, framing = body_framing(
            head.status, head_request=head_request, length=length, chunked_ok=request.http11
        )
        lines = answer_lines(self.targets[self._attempt], self._attempt + 1, request.request_id)
        keep_alive = request.keep_alive
        message = answer_head(
            head.status, head.lines, lines, framing_line, keep_alive=keep_alive
        ) + (b"" if framing == NO_BODY else body)
        self._finish(message, head.status, keep_alive=keep_alive)

    def _start_stream(
        self, connection: UpstreamConnection, head: ResponseHead, body: bytes
    ) -> None:
        request = self._request
        framing_line, framing = body_framing(
            head.status, head_request=False, length=head.content_length, chunked_ok=request.http11
        )
        keep_alive = request.keep_alive and framing != UNTIL_CLOSE
        lines = answer_lines(self.targets[self._attempt], self._attempt + 1, request.request_id)
        message = answer_head(head.status, head.lines, lines, framing_line, keep_alive=keep_alive)
        self._framing = framing
        self._status = head.status
        self._connection = connection
        self._ctx.metrics.streamed += 1
        connection.stream()
        self._client.send_part(message + (chunk(body) if framing == CHUNKED else body), connection)

    def _no_candidates(self) -> None:
        if self.store is None:
            error, detail = "no_nodes", "no live node is registered for this cluster"
            extra: dict[str, Any] = {}
        else:
            ProxyMetrics.bump(self._ctx.metrics.no_replica, self.store)
            error = "no_replica"
            detail = "all replicas of the partition are dead or beyond the allowed lag"
            extra = {"replicas": [_rejection(r) for r in self.rejected]}
        self._ctx.in_flight += 1  # _finish counts it out
        self._answer_error(503, error, detail, **extra)

    def _bounds_unmet(self) -> None:
        """Every replica asked refused the request's freshness bounds (or the retry budget
        ran out after one did): 503 naming each refusal, the offset asked and the furthest
        position known, rather than the last node's 421."""
        if self.store is not None:
            ProxyMetrics.bump(self._ctx.metrics.no_replica, self.store)
        replicas = [candidate.replica for candidate in self.targets]
        error, detail, extra = unmet(self._refusals, self.min_offset, replicas)
        self._answer_error(503, error, detail, **extra, **self._attempts())

    def _answer_error(self, status: int, error: str, detail: str, **extra: Any) -> None:
        request = self._request
        payload: dict[str, Any] = {"error": error, "detail": detail, **self._where(), **extra}
        message = json_response(
            status,
            payload,
            keep_alive=request.keep_alive,
            extra_headers=[(b"x-request-id", request.request_id)],
            head_only=request.method == "HEAD",
        )
        self._finish(message, status, keep_alive=request.keep_alive)

    def _attempts(self) -> dict[str, Any]:
        return {"tried": self._tried, "rejected": [_rejection(r) for r in self.rejected]}

    def _where(self) -> dict[str, Any]:
        where: dict[str, Any] = {}
        if self.store is not None:
            where.update(store=self.store, partition=self.partition)
        if self.budget is not None and not self.budget.unlimited:
            where["budget"] = {"max_lag": self.budget.max_offsets, "max_lag_ms": self.budget.max_ms}
        if self.min_offset is not None:
            where["min_offset"] = self.min_offset
        return where

    def _finish(self, message: bytes, status: int, *, keep_alive: bool) -> None:
        self._ctx.in_flight -= 1
        self._observe(status)
        self._client.respond(message, keep_alive)

    def _observe(self, status: int) -> None:
        ctx = self._ctx
        request = self._request
        elapsed = time.perf_counter() - request.received_at
        ctx.metrics.observe("keyed" if self.store is not None else "passthrough", status, elapsed)
        if ctx.access_log:
            log.info(
                "request",
                request_id=request.request_id.decode(),
                method=request.method,
                target=request.target,
                status=status,
                node=self.targets[self._attempt].target.node_id if self.targets else None,
                partition=self.partition,
                attempts=self._attempt + 1,
                ms=round(elapsed * 1000, 3),
            )


_RACING, _PROMOTED, _CANCELLED, _LOST = range(4)


class _Hedge:
    """The sink of a hedge: while it races the first try its callbacks go to the exchange's
    race handling; once promoted (the first try is over) straight to the exchange's own; once
    cancelled or lost, nowhere (a cancelled one's connection is closed: nothing more comes)."""

    __slots__ = ("exchange", "index", "state")

    def __init__(self, exchange: Exchange, index: int) -> None:
        self.exchange = exchange
        self.index = index
        self.state = _RACING

    def on_response(
        self, connection: UpstreamConnection, head: ResponseHead, body: bytes, complete: bool
    ) -> None:
        if self.state == _RACING:
            self.exchange.hedge_response(self, connection, head, body, complete)
        elif self.state == _PROMOTED:
            self.exchange.on_response(connection, head, body, complete)
        elif not complete:
            connection.abandon()

    def on_body(self, data: bytes) -> None:
        if self.state == _PROMOTED:
            self.exchange.on_body(data)

    def on_end(self) -> None:
        if self.state == _PROMOTED:
            self.exchange.on_end()

    def on_failure(self, failure: UpstreamFailure) -> None:
        if self.state == _RACING:
            self.exchange.hedge_failed(self, failure)
        elif self.state == _PROMOTED:
            self.exchange.on_failure(failure)

    def on_cancelled(self) -> None:
        if self.state == _PROMOTED:
            self.exchange.on_cancelled()

    def on_slow(self) -> None:
        """A hedge is never hedged again (it is sent without asking for this)."""


def _rejection(rejection: Rejection) -> dict[str, str]:
    return {"node": rejection.node_id, "role": rejection.role, "reason": rejection.reason}
