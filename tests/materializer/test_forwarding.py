"""The node's one-hop forwarder against real sockets: what it sends, what it passes back, and
how it fails (an owner that is down, one that never answers, one that closes kept-alive
connections)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest

from materializer.forwarding import FORWARDED_BY, Forwarded, Forwarder, OwnerUnreachable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_head(reader: asyncio.StreamReader) -> dict[str, str]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {"request-line": lines[0]}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
    return fields


def _answer(status: int, body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    async def closing_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        finally:  # also when asyncio.run cancels a handler still waiting at the end
            writer.close()

    server = await asyncio.start_server(closing_after, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def test_one_hop_marked_and_kroute_headers_passed_back():
    seen: list[dict[str, str]] = []

    async def owner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await _read_head(reader)
            except asyncio.IncompleteReadError:
                break
            seen.append(head)
            request_id = head.get("x-request-id", "")
            writer.write(
                _answer(
                    200,
                    b'{"value": 1}',
                    f"x-kroute-node: owner\r\nx-kroute-echo: {request_id}\r\nserver: o\r\n",
                )
            )
            await writer.drain()

    async def scenario() -> tuple[list[str], list[Forwarded]]:
        server, url = await _serve(owner)
        forwarder = Forwarder("node-a")
        ids = [uuid.uuid4().hex for _ in range(20)]
        try:
            results = await asyncio.gather(
                *(forwarder.forward(url, f"/stores/s/keys/{i}", {"x-request-id": i}) for i in ids)
            )
        finally:
            await forwarder.close()
            server.close()
        return ids, results

    ids, results = asyncio.run(scenario())
    assert len(seen) == 20
    assert sorted(h["request-line"] for h in seen) == sorted(
        f"GET /stores/s/keys/{i} HTTP/1.1" for i in ids
    )
    assert all(h[FORWARDED_BY] == "node-a" for h in seen)
    for request_id, result in zip(ids, results, strict=True):
        assert result.status == 200
        assert result.body == b'{"value": 1}'
        # Each answer is its own request's: the owner echoed the id it was sent.
        assert result.headers == [
            (b"x-kroute-node", b"owner"),
            (b"x-kroute-echo", request_id.encode()),
            (b"x-kroute-forwarded-by", b"node-a"),
        ]


def test_an_owner_that_is_down_is_unreachable():
    async def scenario() -> None:
        server, url = await _serve(lambda _r, w: asyncio.sleep(0))
        server.close()
        await server.wait_closed()  # the port is now closed: connection refused
        forwarder = Forwarder("node-a")
        try:
            await forwarder.forward(url, "/stores/s/keys/k")
        finally:
            await forwarder.close()

    with pytest.raises(OwnerUnreachable):  # what the node's server answers as 503
        asyncio.run(scenario())


def test_an_owner_that_never_answers_times_out_within_the_timeout():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_head(reader)
        await asyncio.sleep(30)

    async def scenario() -> float:
        server, url = await _serve(silent)
        forwarder = Forwarder("node-a", timeout_s=0.5)
        began = time.monotonic()
        try:
            with pytest.raises(OwnerUnreachable):
                await forwarder.forward(url, "/stores/s/keys/k")
            return time.monotonic() - began
        finally:
            await forwarder.close()
            server.close()

    waited = asyncio.run(scenario())
    assert 0.4 <= waited < 2.0, waited


def test_a_connection_the_owner_closed_is_not_reused():
    """An owner that answers `connection: close` (or closes an idle connection) must not make
    the next forward fail: the next one opens a new connection."""
    connections = 0

    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_head(reader)
        writer.write(_answer(200, b"ok", "connection: close\r\n"))
        await writer.drain()

    async def scenario() -> list[int]:
        server, url = await _serve(closing)
        forwarder = Forwarder("node-a")
        try:
            return [(await forwarder.forward(url, f"/k/{i}")).status for i in range(5)]
        finally:
            await forwarder.close()
            server.close()

    assert asyncio.run(scenario()) == [200] * 5
    assert connections == 5
