"""A small plain-ASGI app for the conformance tests, served by a real uvicorn process.

Every answer is a pure function of its request (no clocks, no counters), so asking the server
directly and asking it through the proxy must give byte-for-byte the same body. Answers that a
test must be able to attribute carry the request's id (the `id` query parameter, else the
`x-request-id` header) in `x-echo-id` and, where the body is the app's own, in the body too.

  GET  /health/live                 200 "live" (the proxy probes ejected nodes here)
  GET  /stores/{store}/keys/{key}   JSON echoing store, key and id
  GET  /bytes/{n}                   n bytes (`body_for`) with content-length
  GET  /chunked/{n}                 the same n bytes in several pieces, no content-length, so
                                    uvicorn sends them with Transfer-Encoding: chunked
  POST /echo                        reads the whole body and answers it back (so uvicorn sends
                                    `100 Continue` first when the request had Expect), after
                                    `delay_ms` (query) if given
  GET  /status/{code}               an empty answer with that status (204 has no body)
  GET  /etag                        a fixed body with ETag; 304 to a matching If-None-Match
  GET  /headers                     JSON of the method, target and headers that reached the app
HEAD is answered as GET would be; uvicorn drops the body (and adds no transfer-encoding).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_PATTERN = bytes(range(251)) * 4  # 251 is prime: a shifted or repeated piece shows up
ETAG = b'"conformance-v1"'
LAST_MODIFIED = b"Tue, 02 Jan 2024 03:04:05 GMT"
# Headers every answer carries, so the tests can check end-to-end headers arrive unchanged.
_COMMON = [
    (b"x-custom", b"kroute-conformance"),
    (b"cache-control", b"max-age=60"),
    (b"vary", b"accept-encoding"),
]


def body_for(size: int, request_id: str = "") -> bytes:
    """`size` bytes: the id and a separator, then a repeating pattern (so a body carries whose
    it is, and a misplaced slice of another answer cannot look right)."""
    prefix = f"{request_id}|".encode() if request_id else b""
    out = bytearray(prefix)
    while len(out) < size:
        out += _PATTERN
    return bytes(out[:size])


@dataclass
class Request:
    """What a handler needs of one request."""

    scope: Scope
    receive: Receive
    send: Send
    parts: list[str]  # the path's segments
    headers: dict[str, str]  # lower-case names
    query: dict[str, list[str]]
    rid: str  # the request's id: `id` query parameter, else x-request-id

    async def start(self, status: int, extra: list[tuple[bytes, bytes]]) -> None:
        headers = [*_COMMON, (b"x-echo-id", self.rid.encode("latin-1")), *extra]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def answer(
        self,
        status: int,
        body: bytes,
        content_type: bytes = b"application/octet-stream",
        extra: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        framing = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await self.start(status, [*framing, *extra])
        await self.send({"type": "http.response.body", "body": body})

    async def empty(self, status: int, extra: list[tuple[bytes, bytes]]) -> None:
        """An answer that has no body by definition (204, 304): no content-length either."""
        await self.start(status, extra)
        await self.send({"type": "http.response.body", "body": b""})


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    request_id = (query.get("id") or [headers.get("x-request-id", "")])[0]
    parts = scope["path"].strip("/").split("/")
    handler = _ROUTES.get(parts[0], _not_found)
    await handler(Request(scope, receive, send, parts, headers, query, request_id))


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _health(request: Request) -> None:
    await request.answer(200, b"live", b"text/plain")


async def _keyed(request: Request) -> None:
    parts = request.parts
    if len(parts) != 4 or parts[2] != "keys":
        await _not_found(request)
        return
    body = json.dumps({"store": parts[1], "key": parts[3], "id": request.rid}).encode()
    extra = ((b"etag", ETAG), (b"last-modified", LAST_MODIFIED))
    await request.answer(200, body, b"application/json", extra)


async def _bytes(request: Request) -> None:
    await request.answer(200, body_for(int(request.parts[1]), request.rid))


async def _chunked(request: Request) -> None:
    body = body_for(int(request.parts[1]), request.rid)
    await request.start(200, [(b"content-type", b"application/octet-stream")])
    # Several pieces of different sizes: each becomes one chunk on the wire.
    step = max(1, len(body) // 7)
    for offset in range(0, len(body), step):
        piece = body[offset : offset + step]
        await request.send({"type": "http.response.body", "body": piece, "more_body": True})
    await request.send({"type": "http.response.body", "body": b""})


async def _echo(request: Request) -> None:
    # Reading the body is what makes uvicorn answer `Expect: 100-continue` with a 100.
    body = bytearray()
    while True:
        message = await request.receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    # An app that works on the body before answering: the answer comes well after the 100.
    if delay_ms := int(request.query.get("delay_ms", ["0"])[0]):
        await asyncio.sleep(delay_ms / 1000)
    content_type = request.headers.get("content-type", "application/octet-stream")
    extra = ((b"x-method", request.scope["method"].encode()),)
    await request.answer(200, bytes(body), content_type.encode("latin-1"), extra)


async def _status(request: Request) -> None:
    status = int(request.parts[1])
    if status in (204, 304):
        await request.empty(status, [])
        return
    await request.answer(status, b"")


async def _etag(request: Request) -> None:
    validators = [(b"etag", ETAG), (b"last-modified", LAST_MODIFIED)]
    if request.headers.get("if-none-match", "").encode("latin-1") == ETAG:
        await request.empty(304, validators)
        return
    await request.answer(200, b"versioned content\n", b"text/plain", tuple(validators))


async def _headers(request: Request) -> None:
    scope = request.scope
    seen = {
        "method": scope["method"],
        "target": scope.get("raw_path", b"").decode("latin-1"),
        "http_version": scope["http_version"],
        "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
    }
    await request.answer(200, json.dumps(seen).encode(), b"application/json")


async def _not_found(request: Request) -> None:
    await request.answer(404, b"not found\n", b"text/plain")


_ROUTES: dict[str, Callable[[Request], Awaitable[None]]] = {
    "health": _health,
    "stores": _keyed,
    "bytes": _bytes,
    "chunked": _chunked,
    "echo": _echo,
    "status": _status,
    "etag": _etag,
    "headers": _headers,
}
