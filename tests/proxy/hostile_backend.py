"""A backend that breaks HTTP/1.1 the ways real broken servers do (found by an adversarial
review of the proxy), run as its own process: `python -m tests.proxy.hostile_backend --port N`.

The last path segment is the request's id, echoed in `x-echo-id`; the first names what to do:
  /plain/<id>      200 with the id as its body (the probe)
  /late204/<id>    204, then 30 ms later a whole extra answer nobody asked for
  /status099/<id>  a "099" answer with a body, then the 200
  /gzip/<id>       200, Transfer-Encoding: gzip, no length (a coding the proxy cannot pass on)
  /big/<n>/<id>    200 with n bytes (the id repeated) and a Content-Length
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib


def body_of(size: int, request_id: bytes) -> bytes:
    return (request_id * (size // max(len(request_id), 1) + 1))[:size]


async def _answer(path: str, writer: asyncio.StreamWriter) -> bool:
    """Write the answer for `path`; False when the connection must close after it."""
    parts = path.strip("/").split("/")
    kind, request_id = parts[0], parts[-1].encode()
    if kind == "late204":
        writer.write(b"HTTP/1.1 204 No Content\r\nx-echo-id: %s\r\n\r\n" % request_id)
        await writer.drain()
        await asyncio.sleep(0.03)
        stale = b"STALE-" + request_id
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(stale), stale))
    elif kind == "status099":
        writer.write(b"HTTP/1.1 099 Odd\r\ncontent-length: 9\r\n\r\nINJECTED!")
        writer.write(_plain(request_id))
    elif kind == "gzip":
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n" + request_id)
        return False
    elif kind == "big":
        body = body_of(int(parts[1]), request_id)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nx-echo-id: %s\r\n\r\n"
            % (len(body), request_id)
            + body
        )
    else:
        writer.write(_plain(request_id))
    return True


def _plain(request_id: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nx-echo-id: %s\r\n\r\n%s" % (
        len(request_id),
        request_id,
        request_id,
    )


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode().split("?", 1)[0]
            if not await _answer(path, writer):
                break
            await writer.drain()
    writer.close()


async def _main(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(_main(parser.parse_args().port))
