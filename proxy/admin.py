"""The admin listener (a port separate from the data port): liveness, readiness, Prometheus
metrics and cluster status, served by uvicorn. With KROUTE_ADMIN_TOKEN set, everything but the
health checks needs `Authorization: Bearer <token>` (or `?token=` for the page in a browser).

What it shows comes from `AdminViews`, gathered when asked: from this process (one proxy
process), or from every worker merged (the supervisor of KROUTE_WORKERS processes; each worker
serves the same app on a private Unix socket: `admin_server`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class AdminViews:
    """What the admin endpoints answer, each computed when requested (never cached)."""

    metrics: Callable[[], Awaitable[list[bytes]]]  # the Prometheus text exposition, in parts
    status: Callable[[], Awaitable[dict[str, Any]]]
    readiness: Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]


class AdminApp:
    def __init__(self, *, views: AdminViews, status_page: str, token: str | None) -> None:
        self._views = views
        self._page = status_page.encode()
        self._token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] not in ("GET", "HEAD"):
            await _send(send, 405, _json({"error": "method_not_allowed", "allowed": ["GET"]}))
            return
        if path == "/health/live":
            await _send(send, 200, _json({"status": "live"}))
            return
        if path == "/health/ready":
            ready, detail = await self._views.readiness()
            await _send(send, 200 if ready else 503, _json(detail))
            return
        if not self._authorized(scope):
            await _send(
                send,
                401,
                _json({"error": "unauthorized", "detail": "send Authorization: Bearer <token>"}),
                extra=[(b"www-authenticate", b"Bearer")],
            )
            return
        if path == "/metrics":
            parts = await self._views.metrics()
            await _send_parts(send, 200, parts, CONTENT_TYPE_LATEST.encode())
        elif path in ("/cluster/status", "/clusterStatus"):
            status = await self._views.status()
            # Thousands of partitions make megabytes of JSON: encoded off the event loop.
            await _send(send, 200, await asyncio.to_thread(_json, status))
        elif path in ("/", "/cluster"):
            await _send(send, 200, self._page, b"text/html; charset=utf-8")
        else:
            await _send(send, 404, _json({"error": "not_found", "path": path}))

    def _authorized(self, scope: Scope) -> bool:
        if self._token is None:
            return True
        offered = ""
        for name, value in scope.get("headers", []):
            if name == b"authorization" and value.startswith(b"Bearer "):
                offered = value[7:].decode("latin-1")
        if not offered:
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            offered = (query.get("token") or [""])[0]
        return hmac.compare_digest(offered.encode(), self._token.encode())


def _json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


async def _send(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes = b"application/json",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await _send_parts(send, status, [body], content_type, extra)


async def _send_parts(
    send: Send,
    status: int,
    parts: list[bytes],
    content_type: bytes = b"application/json",
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """One response whose body is `parts`, each written as it comes: joined, a 20 MB body
    would be one copy of 20 MB on the event loop."""
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(sum(map(len, parts))).encode()),
        (b"cache-control", b"no-store"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    for part in parts[:-1]:
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": parts[-1] if parts else b""})


class _AdminServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the proxy handles SIGINT/SIGTERM itself (the data port drains first)


def admin_server(
    app: AdminApp, *, host: str = "127.0.0.1", port: int = 0, uds: Path | None = None
) -> uvicorn.Server:
    """uvicorn serving `app` on host:port, or on the Unix socket `uds` (a worker's private
    admin: uvicorn makes the socket world-writable, so its directory must not be)."""
    return _AdminServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            uds=str(uds) if uds is not None else None,
            http="httptools",
            lifespan="off",
            access_log=False,
            log_config=None,
            timeout_graceful_shutdown=2,
        )
    )
