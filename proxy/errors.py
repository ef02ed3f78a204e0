"""Errors of the proxy: what a client is told, and what an upstream did.

ProxyError(Exception)
├── RequestRejected      the client's request cannot be served as sent (never forwarded; 4xx,
│                        501, or 503 while the proxy has no table)
│   ├── BadRequest       malformed request line, target, header or budget (400)
│   ├── KeyRejected      a keyed route's key is missing or not valid for the store's format (400)
│   ├── UnknownStore     no such store in the routing table (404)
│   ├── NoTable          no routing table read yet (503: Redis or the table process away)
│   ├── MethodNotAllowed a keyed route takes GET and HEAD only (405)
│   ├── TooLarge         headers or body over the configured bounds (413 / 431)
│   ├── ExpectationFailed  an Expect other than 100-continue (417)
│   └── UnsupportedCoding  a request transfer coding other than chunked alone (501)
└── UpstreamFailure      a node could not give an answer (retriable: try the next candidate)
    ├── UpstreamRefused  connect failed (refused, unreachable, connect timeout)
    ├── UpstreamReset    the connection closed or reset before a whole response arrived
    │   └── UpstreamClosedKept  a kept-alive one, before any byte of the answer
    ├── UpstreamTimeout  no whole response within the upstream timeout
    └── UpstreamProtocol the node's answer cannot be passed on (unparsable, a 101, over a
                         limit): a 502, and not a sign that the node is down

Each class carries its HTTP status and a short machine-readable code; the listener turns a
RequestRejected into a JSON body, and the exchange turns UpstreamFailures into failover.
"""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    """Base class for proxy failures."""


class RequestRejected(ProxyError):
    status = 400
    code = "bad_request"

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra = extra

    def payload(self) -> dict[str, Any]:
        return {"error": self.code, "detail": self.detail, **self.extra}


class BadRequest(RequestRejected):
    pass


class KeyRejected(RequestRejected):
    code = "invalid_key"


class UnknownStore(RequestRejected):
    status = 404
    code = "unknown_store"


class NoTable(RequestRejected):
    """No table read since the proxy started: it cannot tell an unknown store from a known
    one (a 404 would say the store does not exist); retriable."""

    status = 503
    code = "no_routing_table"


class MethodNotAllowed(RequestRejected):
    status = 405
    code = "method_not_allowed"


class TooLarge(RequestRejected):
    status = 413
    code = "too_large"

    def __init__(self, detail: str, *, status: int = 413, **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.status = status


class ExpectationFailed(RequestRejected):
    status = 417
    code = "expectation_failed"


class UnsupportedCoding(RequestRejected):
    status = 501
    code = "unsupported_transfer_coding"


class UpstreamFailure(ProxyError):
    kind = "upstream_failure"


class UpstreamRefused(UpstreamFailure):
    kind = "connect_failed"


class UpstreamReset(UpstreamFailure):
    kind = "connection_reset"


class UpstreamClosedKept(UpstreamReset):
    """A kept-alive connection closed before any byte of the answer: most likely the node's
    keep-alive timeout closing it just as the request was sent (the request was not served),
    not a node failing. An idempotent request is resent once on a new connection."""

    kind = "kept_connection_closed"


class UpstreamTimeout(UpstreamFailure):
    kind = "timeout"


class UpstreamProtocol(UpstreamFailure):
    kind = "bad_response"


class UpstreamTooLarge(UpstreamProtocol):
    """A well-formed answer over KROUTE_MAX_RESPONSE_BYTES: a property of the value asked for,
    not of the node's health, so it never counts towards ejecting the node."""

    kind = "response_too_large"
