"""A stand-in node for proxy tests: a real HTTP/1.1 server on loopback, in a thread.

It answers every request with JSON naming itself and echoing what it received (method, target,
headers, body, and the raw bytes), so a test can see exactly what the proxy forwarded. `mode`
makes it misbehave: "421" answers misdirected, "hang" never answers, "close" closes without
answering, "close-kept" answers a connection's first request and closes it on the next one
unanswered (a keep-alive timeout firing as a request arrives). A request may choose the
answer's status (`x-test-status`) and header lines (`x-test-head`, hex of the raw lines), so
tests can vary what the proxy must pass on.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httptools

from kroute.embedded import free_port
from tests.listening import stop_listening


class _EchoProtocol(asyncio.Protocol):
    def __init__(self, backend: EchoBackend) -> None:
        self.backend = backend
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.headers: list[tuple[str, str]] = []
        self.url = b""
        self.body = b""
        self.raw = b""
        self.answered = 0  # requests received on this connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.backend.connections += 1
        self.backend.transports.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.backend.transports.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        self.raw += data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode().lower(), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        assert self.transport is not None
        backend = self.backend
        received = {
            "node": backend.node_id,
            "method": self.parser.get_method().decode(),
            "target": self.url.decode("latin-1"),
            "headers": self.headers,
            "body": self.body.decode("latin-1"),
            "raw": self.raw.decode("latin-1"),
        }
        backend.requests.append(received)
        chosen = dict(self.headers)
        self.headers, self.url, self.body, self.raw = [], b"", b"", b""
        if backend.mode == "hang":
            return
        self.answered += 1
        if backend.mode == "close" or (backend.mode == "close-kept" and self.answered > 1):
            self.transport.close()
            return
        status = 421 if backend.mode == "421" else int(chosen.get("x-test-status", backend.status))
        body = json.dumps(received).encode()
        if "x-test-head" in chosen:
            lines = bytes.fromhex(chosen["x-test-head"])
            head = b"HTTP/1.1 %d X\r\n%scontent-length: %d\r\n\r\n" % (status, lines, len(body))
            self.transport.write(head + body)
            return
        head = (
            f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-backend: {backend.node_id}\r\n"
            "x-kroute-node: from-the-node\r\nconnection: keep-alive\r\n"
            "keep-alive: timeout=5\r\n\r\n"
        )
        self.transport.write(head.encode() + body)


class EchoBackend:
    def __init__(self, node_id: str, host: str = "127.0.0.1") -> None:
        self.node_id = node_id
        self.host = host
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self.transports: set[asyncio.Transport | None] = set()
        self.mode = "ok"
        self.status = 200
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> EchoBackend:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(5)
        return self

    async def _serve(self) -> None:
        self._server = await self._loop.create_server(
            lambda: _EchoProtocol(self), self.host, self.port
        )

    def stop(self) -> None:
        """Stop listening and close every connection (as a killed process would)."""

        async def close() -> None:
            if self._server is not None:
                await stop_listening(self._server)
            for transport in list(self.transports):
                if transport is not None:
                    transport.abort()  # RST, as the kernel does for a killed process

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)

    def restart(self) -> None:
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(5)

    def shutdown(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
