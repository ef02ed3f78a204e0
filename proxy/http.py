"""HTTP/1.1 message bytes for the hot path: requests to nodes, responses to clients (pure).

Hop-by-hop headers (RFC 9110 §7.6.1), and any header a Connection header names, are never
passed on; a node's provenance headers are replaced by the proxy's own (what it routed on).
Framing is the proxy's own on each side (`body_framing`): request bodies are buffered whole
and sent with a Content-Length; an answer is sent with the node's Content-Length when it
has one, else chunked to HTTP/1.1 clients and close-delimited to HTTP/1.0 ones; answers to
HEAD, 204 and 304 never carry a body. `Expect` is answered by the proxy itself and not passed
on (Envoy's default: the proxy reads the whole body before it forwards anything). What
depends only on configuration (status lines, canned bodies) is computed once.
"""

from __future__ import annotations

import json
import re
from http import HTTPStatus
from typing import Any

# RFC 9110 §7.6.1: meaningful for one connection only, never passed on.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# Request headers the proxy writes itself instead of copying.
REPLACED_IN_REQUEST = frozenset(
    {
        b"content-length",  # recomputed
        b"host",  # set to the node's authority; the client's goes in X-Forwarded-Host
        b"x-forwarded-for",  # extended, not copied
        b"x-forwarded-proto",
        b"x-forwarded-host",
        b"expect",  # answered by the proxy (100 Continue) before the body is read
    }
)
# Provenance headers the proxy sets from its own routing view; a node's copies are dropped.
PROVENANCE = frozenset(
    {
        b"x-kroute-node",
        b"x-kroute-partition",
        b"x-kroute-role",
        b"x-kroute-lag",
        b"x-kroute-time-lag-ms",
    }
)
DROP_FROM_REQUEST = HOP_BY_HOP | REPLACED_IN_REQUEST
# A request with a body (or one announced) is forwarded by the Python path only.
BODY_HEADERS = (b"content-length", b"transfer-encoding")
DROP_FROM_RESPONSE = HOP_BY_HOP | PROVENANCE | {b"content-length"}

_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        line = f"HTTP/1.1 {status} {reason}\r\n".encode("latin-1")
        _STATUS_LINES[status] = line
    return line


def status_lines(leave_out: frozenset[int] = frozenset()) -> dict[int, bytes]:
    """Every status line the C path may send, as status_line writes them. An answer whose
    status has no line here is handed to the Python exchange: the proxy leaves out the retry
    statuses (KROUTE_RETRY_STATUSES), so one rule decides failover on both paths."""
    return {
        int(status): status_line(int(status)) for status in HTTPStatus if status not in leave_out
    }


def connection_named(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in Connection: hop-by-hop for this message only."""
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    return frozenset(named)


def request_head(
    method: str,
    target: str,
    headers: list[tuple[bytes, bytes]],
    *,
    client_ip: str,
    request_id: bytes,
    body_length: int,
) -> bytes:
    """Everything of the request to a node but its Host line, which differs per node."""
    named = connection_named(headers) if any(n == b"connection" for n, _ in headers) else ()
    lines = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1")]
    forwarded_for = client_ip.encode()
    host = b""
    for name, value in headers:
        if name in DROP_FROM_REQUEST or name in named:
            if name == b"x-forwarded-for":
                forwarded_for = value + b", " + forwarded_for
            elif name == b"host":
                host = value
            continue
        if name == b"x-request-id":
            continue  # replaced by the id the proxy logs
        lines.append(name + b": " + value + b"\r\n")
    lines.append(b"x-forwarded-for: " + forwarded_for + b"\r\n")
    lines.append(b"x-forwarded-proto: http\r\n")
    if host:
        lines.append(b"x-forwarded-host: " + host + b"\r\n")
    lines.append(b"x-request-id: " + request_id + b"\r\n")
    if body_length or method not in ("GET", "HEAD"):
        lines.append(b"content-length: " + str(body_length).encode() + b"\r\n")
    return b"".join(lines)


def _header_lines_named(names: frozenset[bytes] | set[bytes]) -> re.Pattern[bytes]:
    """Matches whole header lines (CRLF included) with any of these names, in any case."""
    alternatives = b"|".join(re.escape(name) for name in sorted(names))
    return re.compile(rb"^(?:" + alternatives + rb")[ \t]*:[^\n]*\n", re.IGNORECASE | re.MULTILINE)


_DROP_LINE = _header_lines_named(DROP_FROM_RESPONSE)
_CONNECTION_VALUE = re.compile(rb"^connection[ \t]*:([^\r\n]*)", re.IGNORECASE | re.MULTILINE)
_PLAIN_CONNECTION_TOKENS = frozenset({b"", b"keep-alive", b"close"})


def filter_response_head(lines: bytes) -> bytes:
    """A node's header lines (each ending CRLF) without hop-by-hop and provenance headers.

    One regex substitution in C instead of a Python loop over headers: this runs for every
    response. Headers a Connection header names are hop-by-hop too (RFC 9110 §7.6.1); that
    rare case takes a second pass.
    """
    named: set[bytes] = set()
    for value in _CONNECTION_VALUE.findall(lines):
        named.update(token.strip().lower() for token in value.split(b","))
    kept = _DROP_LINE.sub(b"", lines)
    extra = named - _PLAIN_CONNECTION_TOKENS
    if extra:
        alternatives = b"|".join(re.escape(name) for name in sorted(extra))
        kept = re.sub(rb"^(?:" + alternatives + rb")[ \t]*:[^\n]*\n", b"", kept, flags=re.I | re.M)
    return kept


# How an answer's body is sent to the client (see body_framing).
NO_BODY, BY_LENGTH, CHUNKED, UNTIL_CLOSE = "no_body", "length", "chunked", "until_close"
LAST_CHUNK = b"0\r\n\r\n"


def body_framing(
    status: int, *, head_request: bool, length: int | None, chunked_ok: bool
) -> tuple[bytes, str]:
    """The framing header line of an answer to the client, and how its body is sent.

    `length` is the body's length when known (for HEAD and 304, the node's Content-Length,
    which describes the representation: RFC 9110 §8.6 lets both carry it); `chunked_ok` says
    the client speaks HTTP/1.1 (an HTTP/1.0 client reads an unknown length until the close).
    A 1xx or 204 answer carries neither Content-Length nor a body (RFC 9110 §8.6).
    """
    if status < 200 or status == 204:
        return b"", NO_BODY
    if head_request or status == 304:
        return (b"" if length is None else b"content-length: %d\r\n" % length), NO_BODY
    if length is not None:
        return b"content-length: %d\r\n" % length, BY_LENGTH
    if chunked_ok:
        return b"transfer-encoding: chunked\r\n", CHUNKED
    return b"", UNTIL_CLOSE


def answer_head(
    status: int, head_lines: bytes, extra_lines: bytes, framing_line: bytes, *, keep_alive: bool
) -> bytes:
    """Status line, the node's kept header lines, the proxy's own, framing, end of head."""
    ending = b"\r\n" if keep_alive else b"connection: close\r\n\r\n"
    return status_line(status) + head_lines + extra_lines + framing_line + ending


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (RFC 9112 §7.1); never the last (empty) one."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def response_bytes(
    status: int,
    head_lines: bytes,
    extra_lines: bytes,
    body: bytes,
    *,
    keep_alive: bool,
    head_only: bool = False,
) -> bytes:
    """A whole response: status line, the given header lines, a fresh Content-Length."""
    return b"".join(
        (
            status_line(status),
            head_lines,
            extra_lines,
            b"content-length: %d\r\n" % len(body),
            b"\r\n" if keep_alive else b"connection: close\r\n\r\n",
            b"" if head_only else body,
        )
    )


_JSON_TYPE = b"content-type: application/json\r\n"


def json_response(
    status: int,
    payload: dict[str, Any],
    *,
    keep_alive: bool,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
    head_only: bool = False,
) -> bytes:
    body = json.dumps(payload, separators=(",", ":")).encode()
    extra = b"".join(name + b": " + value + b"\r\n" for name, value in extra_headers or ())
    return response_bytes(
        status, _JSON_TYPE, extra, body, keep_alive=keep_alive, head_only=head_only
    )


class ClientRequest:
    """One whole request from a client, as the listener parsed it."""

    __slots__ = (
        "body",
        "client_ip",
        "headers",
        "http11",
        "keep_alive",
        "method",
        "path",
        "query",
        "received_at",
        "request_id",
        "target",
    )

    def __init__(
        self,
        *,
        method: str,
        target: str,
        path: str,
        query: str | None,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        client_ip: str,
        keep_alive: bool,
        request_id: bytes,
        received_at: float,
        http11: bool = True,
    ) -> None:
        self.method = method
        self.target = target
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.client_ip = client_ip
        self.keep_alive = keep_alive
        self.request_id = request_id
        self.received_at = received_at
        self.http11 = http11  # HTTP/1.1 or later: can read a chunked answer

    def header(self, name: bytes) -> bytes | None:
        for header_name, value in self.headers:
            if header_name == name:
                return value
        return None
