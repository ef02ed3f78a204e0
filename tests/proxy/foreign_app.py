"""A partitioned service kroute did not build, for tests/proxy/test_foreign_backends.py.

Served by a real uvicorn process, one per node. Like many services in front of Kafka consumer
groups, it says "not mine" and "not ready" with its own statuses, not kroute's 421:

  GET  /stores/{store}/keys/{key}   200 JSON naming the node and the key's partition when this
                                    node holds the partition; 404 {"error": "not_mine"} when it
                                    does not; 404 {"error": "no_such_key"} for a key starting
                                    with "absent-" on the node that holds it; 503
                                    {"error": "rebalancing"} while it rebalances. `hang` makes
                                    every lookup wait 30 s (a node the proxy times out).
  GET  /ready                       its health check: 200, or 503 when not `healthy`
  POST /_control                    JSON: node, partitions (count), owned (partition list),
                                    rebalancing, healthy, hang; answers the state
  GET  /_control                    the state, and how often each non-lookup path was asked
Every answer carries `x-echo-id` (the `x-request-id` header) and so does every JSON body, so a
test can tell whose answer a client got. Anything else is a plain 404 (so is /health/live:
the service has no such path).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from partitioner import KeyPartitioner

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

HEALTH_PATH = "/ready"
_DEFAULTS: dict[str, Any] = {
    "node": "?",
    "partitions": 1,
    "owned": [],
    "rebalancing": False,
    "healthy": True,
    "hang": False,
}
_state: dict[str, Any] = dict(_DEFAULTS)
_hits: Counter[str] = Counter()


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    rid = headers.get("x-request-id", "")
    path: str = scope["path"]
    parts = path.strip("/").split("/")
    if len(parts) == 4 and parts[0] == "stores" and parts[2] == "keys":
        status, payload = await _lookup(parts[3], rid)
    else:
        _hits[path] += 1
        status, payload = await _other(scope, receive, path)
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
    node = _state["node"]
    if _state["hang"]:
        await asyncio.sleep(30)
    if _state["rebalancing"]:
        return 503, {"error": "rebalancing", "node": node, "id": rid}
    partition = KeyPartitioner("string", "murmur2", _state["partitions"]).partition_of(key)
    if partition not in _state["owned"]:
        return 404, {"error": "not_mine", "node": node, "partition": partition, "id": rid}
    if key.startswith("absent-"):
        return 404, {"error": "no_such_key", "node": node, "partition": partition, "id": rid}
    return 200, {"key": key, "node": node, "partition": partition, "id": rid}


async def _other(scope: Scope, receive: Receive, path: str) -> tuple[int, dict[str, Any]]:
    if path == HEALTH_PATH:
        return (200, {"ready": True}) if _state["healthy"] else (503, {"ready": False})
    if path == "/_control":
        if scope["method"] == "POST":
            _state.clear()
            _state.update({**_DEFAULTS, **json.loads(await _body(receive))})
            _hits.clear()
        return 200, {"state": _state, "hits": dict(_hits)}
    return 404, {"error": "no_such_path"}


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
            return
