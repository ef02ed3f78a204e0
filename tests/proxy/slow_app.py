"""A node that can be slow or answer 5xx, for tests/proxy/test_hedging.py (served by uvicorn).

  GET  /stores/{store}/keys/{key}  200 JSON {"key", "node", "id"} after `delay_ms`; or
                                   `error_status` (e.g. 500) for keys starting with
                                   `error_prefix` ("" : every key)
  GET  /health/live                200 (an ejected node is probed back at once)
  POST /_control                   JSON state: node, delay_ms, error_status, error_prefix
                                   (what is not given is the default); answers the state
  GET  /_control                   the state, and `lookups`: lookups started since the last POST
Every answer carries `x-echo-id` (the request's `x-request-id`), and so does every lookup's
JSON body (`id`), so a test can tell whose answer a client got.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_DEFAULTS: dict[str, Any] = {"node": "?", "delay_ms": 0, "error_status": 0, "error_prefix": ""}
_state: dict[str, Any] = dict(_DEFAULTS)
_lookups = [0]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    rid = headers.get("x-request-id", "")
    parts = scope["path"].strip("/").split("/")
    if len(parts) == 4 and parts[0] == "stores" and parts[2] == "keys":
        status, payload = await _lookup(parts[3], rid)
    elif scope["path"] == "/_control":
        status, payload = await _control(scope, receive)
    elif scope["path"] == "/health/live":
        status, payload = 200, {"live": True}
    else:
        status, payload = 404, {"error": "no_such_path"}
    body = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-echo-id", rid.encode("latin-1")),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _lookup(key: str, rid: str) -> tuple[int, dict[str, Any]]:
    _lookups[0] += 1
    node = _state["node"]
    if _state["delay_ms"]:
        await asyncio.sleep(_state["delay_ms"] / 1000)
    if _state["error_status"] and key.startswith(_state["error_prefix"]):
        return int(_state["error_status"]), {"error": "broken", "node": node, "id": rid}
    return 200, {"key": key, "node": node, "id": rid}


async def _control(scope: Scope, receive: Receive) -> tuple[int, dict[str, Any]]:
    if scope["method"] == "POST":
        _state.clear()
        _state.update({**_DEFAULTS, **json.loads(await _body(receive))})
        _lookups[0] = 0
    return 200, {"state": _state, "lookups": _lookups[0]}


async def _body(receive: Receive) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return bytes(body)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
