"""Hostile HTTP backends for adapter tests: a minimal asyncio server answering JSON per path,
or misbehaving on purpose (trickling a body, answering 300 MB, never answering)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kroute.embedded import free_port
from tests.listening import stop_listening

Mode = Literal["ok", "trickle", "huge", "hang"]


@dataclass
class FakeWorker:
    """Answers GET <path> with `answers[path]` as JSON (or `{}`), as `mode` says."""

    port: int = field(default_factory=free_port)
    answers: dict[str, Any] = field(default_factory=dict)
    mode: Mode = "ok"
    server: asyncio.Server | None = None
    _open: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeWorker:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await stop_listening(self.server)
            self.server = None
        for writer in list(self._open):
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open.add(writer)
        try:
            line = await reader.readline()
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            path = line.split()[1].decode() if line else "/"
            await self._answer(writer, json.dumps(self.answers.get(path, {})).encode())
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._open.discard(writer)
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, body: bytes) -> None:
        if self.mode == "hang":
            await asyncio.sleep(3600)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
        if self.mode == "trickle":  # headers at once, then a byte every 100 ms, forever
            writer.write(head + b"content-length: 100000\r\n\r\n")
            while True:
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.1)
        if self.mode == "huge":  # no content-length: the cap must count the bytes
            writer.write(head + b"\r\n")
            chunk = b" " * 1_000_000
            for _ in range(300):
                writer.write(chunk)
                await writer.drain()
            return
        writer.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()


STARTED: list[FakeWorker] = []  # stopped by `stop_all` at the end of each test


async def start_workers(count: int) -> list[FakeWorker]:
    workers = [await FakeWorker().start() for _ in range(count)]
    STARTED.extend(workers)
    return workers


async def stop_all() -> None:
    while STARTED:
        await STARTED.pop().stop()
    await asyncio.sleep(0)  # let the handlers see their connections closed
