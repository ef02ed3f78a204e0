"""One client request's way through the candidates: send, fail over, answer.

Callback style, no task per request: `start` sends to the first candidate over the pool, and
the pool's completion callback either answers the client or moves to the next candidate.
Failover happens only for idempotent requests, only on failures that say nothing was served
(connect failed, connection reset, timeout, unparsable response) or on a node's 421 ("not
mine": the table is refreshed), and only within the retry budget (`proxy.retry_budget`), so a
sick cluster is not hit with a multiple of its load.

A request the C path (`proxy._hotpath`) forwarded is adopted by an exchange here when it
cannot be finished in C (a failure, a 421, a response that is not whole and simple):
`adopt_fast_request` rebuilds the exchange from what the connection kept and it goes on as if
it had started here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from common.clock import now_ms
from proxy._hotpath import Cached, Candidate
from proxy.choice import LagBudget, Rejection, Replica
from proxy.errors import UpstreamClosedKept, UpstreamFailure
from proxy.health import Ejections
from proxy.http import ClientRequest, json_response, request_head, response_bytes
from proxy.metrics import ProxyMetrics
from proxy.retry_budget import RetryBudget
from proxy.upstream import Done, UpstreamConnection, UpstreamPool, UpstreamResponse

log = structlog.get_logger("kroute.proxy.exchange")

Respond = Callable[[bytes, bool], None]


def provenance_lines(node_id: str, partition: int, replica: Replica) -> bytes:
    lag = b"unknown" if replica.lag is None else str(replica.lag).encode()
    lines = b"x-kroute-node: %s\r\nx-kroute-partition: %d\r\nx-kroute-role: %s\r\n" % (
        node_id.encode(),
        partition,
        replica.role.encode(),
    )
    lines += b"x-kroute-lag: " + lag + b"\r\n"
    if replica.caught_up_at_ms is None and replica.lag == 0:
        lines += b"x-kroute-time-lag-ms: 0\r\n"  # else computed per answer (it grows)
    return lines


@dataclass(frozen=True, slots=True)
class Target:
    node_id: str
    url: str
    origin: tuple[str, int]
    host_line: bytes  # "host: <authority>\r\n" for requests to this node
    node_line: bytes  # "x-kroute-node: <id>\r\n" for answers from it

    @classmethod
    def build(cls, node_id: str, url: str, host: str, port: int) -> Target:
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls(node_id, url, (host, port), f"host: {authority}\r\n".encode(), node_id.encode())


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


class Exchange:
    __slots__ = (
        "_attempt",
        "_ctx",
        "_head",
        "_request",
        "_resent",
        "_respond",
        "_tried",
        "budget",
        "idempotent",
        "partition",
        "rejected",
        "store",
        "targets",
    )

    def __init__(
        self,
        ctx: ExchangeContext,
        request: ClientRequest,
        respond: Respond,
        *,
        targets: Sequence[Candidate],
        store: str | None,
        partition: int | None,
        rejected: tuple[Rejection, ...],
        budget: LagBudget | None,
        idempotent: bool,
    ) -> None:
        self._ctx = ctx
        self._request = request
        self._respond = respond
        self.targets = targets
        self.store = store
        self.partition = partition
        self.rejected = rejected
        self.budget = budget
        self.idempotent = idempotent
        self._attempt = 0
        self._tried: list[dict[str, str]] = []
        self._head = b""
        self._resent = False  # once per exchange, after a kept connection closed unanswered

    @classmethod
    def adopt(cls, ctx: ExchangeContext, connection: UpstreamConnection) -> Done:
        """Take over the request the C path forwarded on this connection; returns the
        callback for its outcome. The C path already counted the attempt and the deposit."""
        cached: Cached = connection.fast_cached
        shift = connection.fast_shift
        candidates = cached.candidates
        head: bytes = connection.fast_head
        client = connection.fast_client
        request = ClientRequest(
            method="HEAD" if connection.fast_head_only else "GET",
            target=head.split(b" ", 2)[1].decode("ascii"),
            path="",
            query=None,
            headers=[],
            body=b"",
            client_ip=client._client_ip,
            keep_alive=bool(connection.fast_keep_alive),
            request_id=connection.fast_request_id,
            received_at=connection.fast_received_at,
        )
        exchange = cls(
            ctx,
            request,
            client.respond,
            targets=candidates[shift:] + candidates[:shift],
            store=connection.fast_store.decode(),
            partition=connection.fast_partition,
            rejected=cached.choice.rejected,
            budget=None,
            idempotent=True,
        )
        exchange._head = head
        connection.release_fast()
        ctx.in_flight += 1
        return exchange._on_done

    def start(self) -> None:
        if not self.targets:
            self._no_candidates()
            return
        request = self._request
        self._head = request_head(
            "GET" if request.method == "HEAD" else request.method,
            request.target,
            request.headers,
            client_ip=request.client_ip,
            request_id=request.request_id,
            body_length=len(request.body),
        )
        self._ctx.in_flight += 1
        self._ctx.retry_budget.deposit()
        self._send()

    def _send(self) -> None:
        candidate = self.targets[self._attempt]
        if candidate.choice_tally is not None:
            candidate.choice_tally.value += 1
        candidate.node_tally.value += 1
        self._transmit(candidate.target, fresh=False)

    def _transmit(self, target: Target, *, fresh: bool) -> None:
        message = self._head + target.host_line + b"\r\n" + self._request.body
        self._ctx.pool.send(target.origin, message, self._on_done, fresh=fresh)

    def _on_done(self, response: UpstreamResponse | None, failure: UpstreamFailure | None) -> None:
        target = self.targets[self._attempt].target
        if failure is not None:
            self._failed(target, failure)
        elif response is not None and response.status == 421 and self.store is not None:
            ProxyMetrics.bump(self._ctx.metrics.misdirected, target.node_id)
            self._ctx.refresh_table()
            self._tried.append({"node": target.node_id, "outcome": "421 misdirected"})
            if not self._next():
                self._answer(response)
        elif response is not None:
            self._answer(response)

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
        if self.idempotent and self._next():
            log.info(
                "failover",
                request_id=self._request.request_id.decode(),
                failed_node=target.node_id,
                reason=failure.kind,
                next_node=self.targets[self._attempt].target.node_id,
                partition=self.partition,
            )
            return
        self._finish(
            json_response(
                503 if self.idempotent else 502,
                {
                    "error": "upstream_failed",
                    "detail": "every node tried failed"
                    if self.idempotent
                    else "the node failed and the request is not idempotent (not retried)",
                    **self._where(),
                    "tried": self._tried,
                    "rejected": [_rejection(r) for r in self.rejected],
                },
                keep_alive=self._request.keep_alive,
                extra_headers=[(b"x-request-id", self._request.request_id)],
                head_only=self._request.method == "HEAD",
            ),
            503 if self.idempotent else 502,
        )

    def _next(self) -> bool:
        """Move to the next candidate if there is one and the retry budget allows."""
        ctx = self._ctx
        if self._attempt + 1 >= len(self.targets):
            return False
        if not ctx.retry_budget.withdraw():
            ctx.metrics.retry_budget_exhausted += 1
            self._tried.append({"node": "-", "outcome": "retry budget exhausted"})
            return False
        ctx.metrics.failovers += 1
        self._attempt += 1
        self._send()
        return True

    def _answer(self, response: UpstreamResponse) -> None:
        candidate = self.targets[self._attempt]
        replica: Replica | None = candidate.replica
        request = self._request
        extra = candidate.provenance or candidate.target.node_line
        if replica is not None and replica.caught_up_at_ms is not None:
            time_lag = replica.time_lag_ms(now_ms())
            if time_lag is not None:
                extra += b"x-kroute-time-lag-ms: %d\r\n" % time_lag
        if self._attempt:
            extra += b"x-kroute-attempts: %d\r\n" % (self._attempt + 1)
        self._finish(
            response_bytes(
                response.status,
                response.head_lines,
                extra + b"x-request-id: " + request.request_id + b"\r\n",
                response.body,
                keep_alive=request.keep_alive,
                head_only=request.method == "HEAD",
            ),
            response.status,
        )

    def _no_candidates(self) -> None:
        request = self._request
        if self.store is None:
            payload: dict[str, Any] = {
                "error": "no_nodes",
                "detail": "no live node is registered for this cluster",
            }
        else:
            ProxyMetrics.bump(self._ctx.metrics.no_replica, self.store)
            payload = {
                "error": "no_replica",
                "detail": "all replicas of the partition are dead or beyond the allowed lag",
                **self._where(),
                "replicas": [_rejection(r) for r in self.rejected],
            }
        self._ctx.in_flight += 1  # _finish counts it out
        self._finish(
            json_response(
                503,
                payload,
                keep_alive=request.keep_alive,
                extra_headers=[(b"x-request-id", request.request_id)],
                head_only=request.method == "HEAD",
            ),
            503,
        )

    def _where(self) -> dict[str, Any]:
        where: dict[str, Any] = {}
        if self.store is not None:
            where.update(store=self.store, partition=self.partition)
        if self.budget is not None and not self.budget.unlimited:
            where["budget"] = {"max_lag": self.budget.max_offsets, "max_lag_ms": self.budget.max_ms}
        return where

    def _finish(self, message: bytes, status: int) -> None:
        ctx = self._ctx
        ctx.in_flight -= 1
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
        self._respond(message, request.keep_alive)


def _rejection(rejection: Rejection) -> dict[str, str]:
    return {"node": rejection.node_id, "role": rejection.role, "reason": rejection.reason}
