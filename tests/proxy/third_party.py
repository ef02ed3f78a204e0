"""Real HTTP servers nobody here wrote, each behind two proxies (C path and Python path).

The conformance tests (issue 17) compare what a client gets through the proxy with what it gets
asking the server directly. The servers run as processes on 127.0.0.1 free ports under the
embedded-services launcher, so they are stopped by PID (and die with the test run):

  uvicorn      serving `tests.proxy.asgi_app` (reads request bodies, so it answers Expect)
               (or another ASGI app: tests.proxy.foreign_app, a service with its own statuses)
  http.server  Python's, speaking HTTP/1.0: close-delimited answers and static files
  nginx        static files, keep-alive, etags
  raw          an asyncio server (this module run as `python -m tests.proxy.third_party raw`)
               that sends interim answers: 103 Early Hints or an unsolicited 100 Continue
               before every 200, or 101 Switching Protocols to a plain GET of /switch/...

Each server is published in Redis as the only node ("n0") of a cluster of its own, so every
request through its proxies, keyed or passthrough, reaches it. `RawConnection` is a strict
HTTP/1.1 client over a plain socket for byte-level checks (framing, 1xx, pipelining).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import socket
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httptools
import redis

from common.contract import Keys, StoreInfo
from kroute.embedded import EmbeddedServices, ManagedProcess, free_port, port_open
from kroute.proxies import ProxyHandle, start_proxy
from kroute.static_cluster import StaticCluster
from tests.proxy.asgi_app import body_for

REPO = Path(__file__).resolve().parents[2]
NODE = "n0"
STORE = "customers"
PATHS = ("c", "python")  # the proxy's C fast path and its Python path
# The static files nginx and http.server serve: empty, tiny, around the old 64 KiB head limit,
# and large enough that a buffering or mis-counting proxy shows it.
FILE_SIZES = (0, 1, 1000, 16 * 1024, 64 * 1024 + 1, 300_000, 1 << 20, 5 << 20)
IO_TIMEOUT_S = 10.0  # every socket operation; nothing here may hang a test run

# The proxies' settings: generous timeouts (5 MB answers on a busy 2-core machine), bodies
# up to 2 MiB, and quick recovery so one test's ejection cannot leak into the next.
CONFORMANCE_SETTINGS = {
    "upstream_timeout_ms": "10000",
    "max_body_bytes": str(2 << 20),
    "eject_ms": "300",
    "probe_interval_ms": "100",
    "refresh_interval_ms": "200",
    "lag_report_stale_ms": "600000",
    "log_level": "warning",
}


# --- a strict raw HTTP/1.1 client ------------------------------------------------------------


class FramingError(AssertionError):
    """The bytes on the wire are not a well-framed HTTP/1.1 answer."""


@dataclass
class RawResponse:
    status: int
    reason: str
    headers: list[tuple[str, str]]  # names lower case, in order
    body: bytes = b""
    framing: str = "none"  # content-length | chunked | close | none (HEAD, 1xx, 204, 304)
    trailers: list[tuple[str, str]] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        values = self.header_list(name)
        return values[0] if values else None

    def header_list(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    @property
    def echo_id(self) -> str | None:
        return self.header("x-echo-id")

    @property
    def closes(self) -> bool:
        """The answer says the connection ends after it."""
        tokens = ",".join(self.header_list("connection")).lower()
        return "close" in [t.strip() for t in tokens.split(",")] or self.framing == "close"


def request_bytes(
    method: str,
    target: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    chunks: list[bytes] | None = None,
) -> bytes:
    """One HTTP/1.1 request; `chunks` sends the body chunked, `body` with content-length."""
    lines = [f"{method} {target} HTTP/1.1", "host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    payload = b""
    if chunks is not None:
        lines.append("transfer-encoding: chunked")
        payload = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks if c) + b"0\r\n\r\n"
    elif body is not None:
        lines.append(f"content-length: {len(body)}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload


class RawConnection:
    """A client connection that reads answers byte by byte and rejects bad framing."""

    def __init__(self, port: int, timeout_s: float = IO_TIMEOUT_S, rcvbuf: int | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect, so the window is small from the start
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout_s)
        self.sock.connect(("127.0.0.1", port))
        self.timeout_s = timeout_s
        self.buffer = bytearray()
        self.eof = False

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        """Read more bytes; False at end of stream (a reset counts as the end too)."""
        if self.eof:
            return False
        try:
            chunk = self.sock.recv(1 << 18)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.buffer += chunk
        return True

    def _line(self, limit: int = 1 << 16) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > limit:
                raise FramingError(f"no CRLF in {limit} bytes")
            if not self._fill():
                raise FramingError(f"connection ended inside a line: {bytes(self.buffer)[:200]!r}")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buffer) < n:
            if not self._fill():
                raise FramingError(f"connection ended {n - len(self.buffer)} bytes short")
        data = bytes(self.buffer[:n])
        del self.buffer[:n]
        return data

    def _to_close(self) -> bytes:
        while self._fill():
            pass
        data = bytes(self.buffer)
        self.buffer.clear()
        return data

    def _fields(self) -> list[tuple[str, str]]:
        fields = []
        while line := self._line():
            name, sep, value = line.decode("latin-1").partition(":")
            if not sep or not name or name != name.strip():
                raise FramingError(f"malformed header line {line!r}")
            fields.append((name.lower(), value.strip()))
        return fields

    def read_response(self, method: str = "GET") -> RawResponse:
        """One message, interim (1xx) ones included: the caller decides what comes next."""
        status_line = self._line()
        match = re.fullmatch(rb"HTTP/1\.[01] (\d{3})(?: (.*))?", status_line)
        if not match:
            raise FramingError(f"bad status line {status_line!r}")
        status = int(match.group(1))
        response = RawResponse(status, (match.group(2) or b"").decode("latin-1"), self._fields())
        if 100 <= status < 200 or status in (204, 304) or method == "HEAD":
            return response
        self._read_body(response)
        return response

    def _read_body(self, response: RawResponse) -> None:
        codings = ",".join(response.header_list("transfer-encoding")).lower()
        lengths = set(response.header_list("content-length"))
        if codings and lengths:
            raise FramingError("both transfer-encoding and content-length")
        if codings:
            if [c.strip() for c in codings.split(",")] != ["chunked"]:
                raise FramingError(f"transfer-encoding {codings!r}")
            response.framing = "chunked"
            response.body, response.trailers = self._chunked()
        elif lengths:
            if len(lengths) > 1 or not next(iter(lengths)).isdigit():
                raise FramingError(f"content-length {sorted(lengths)}")
            response.framing = "content-length"
            response.body = self._exact(int(next(iter(lengths))))
        else:
            response.framing = "close"
            response.body = self._to_close()

    def _chunked(self) -> tuple[bytes, list[tuple[str, str]]]:
        body = bytearray()
        while True:
            size_field = self._line().split(b";", 1)[0].strip()
            if not re.fullmatch(rb"[0-9a-fA-F]+", size_field):
                raise FramingError(f"bad chunk size line {size_field!r}")
            size = int(size_field, 16)
            if size == 0:
                return bytes(body), self._fields()
            body += self._exact(size)
            if self._exact(2) != b"\r\n":
                raise FramingError("chunk data not followed by CRLF")

    def read_final(self, method: str = "GET") -> tuple[list[RawResponse], RawResponse]:
        """Interim answers (1xx other than 101) and then the final one."""
        interims: list[RawResponse] = []
        while True:
            response = self.read_response(method)
            if response.status >= 200 or response.status == 101:
                return interims, response
            interims.append(response)

    def wait_for_bytes(self, wait_s: float) -> bool:
        """Whether anything arrives within `wait_s` (kept in the buffer for the next read)."""
        if self.buffer:
            return True
        self.sock.settimeout(wait_s)
        try:
            return self._fill()
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(self.timeout_s)

    def extra_bytes(self, wait_s: float = 0.1) -> bytes:
        """Bytes that arrive unasked within `wait_s` (a correct peer sends none)."""
        self.wait_for_bytes(wait_s)
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


def fetch(
    port: int,
    method: str,
    target: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
    chunks: list[bytes] | None = None,
) -> tuple[list[RawResponse], RawResponse]:
    """One request on a new connection: its interim answers and its final answer."""
    with RawConnection(port) as conn:
        conn.send(request_bytes(method, target, headers, body, chunks))
        return conn.read_final(method)


# --- starting the servers --------------------------------------------------------------------


@dataclass
class ThirdPartyServer:
    name: str
    port: int
    process: ManagedProcess
    probe: str  # a target answered 200 with x-echo-id = the `id` query parameter

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.stop()


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _start(
    embedded: EmbeddedServices, name: str, command: list[str], port: int, probe: str
) -> ThirdPartyServer:
    process = embedded.start_process(
        name, command, env=_subprocess_env(), ready=lambda: port_open(port), timeout_s=20
    )
    return ThirdPartyServer(name, port, process, probe)


def start_uvicorn(
    embedded: EmbeddedServices, app: str = "tests.proxy.asgi_app:app"
) -> ThirdPartyServer:
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", app,
        "--app-dir", str(REPO), "--host", "127.0.0.1", "--port", str(port),
        "--no-access-log", "--log-level", "warning",
    ]  # fmt: skip
    return _start(embedded, f"uvicorn-{port}", command, port, "/bytes/16?id={id}")


def start_http10(embedded: EmbeddedServices, directory: Path) -> ThirdPartyServer:
    port = free_port()
    command = [
        sys.executable, "-m", "tests.proxy.third_party", "http10",
        "--port", str(port), "--directory", str(directory),
    ]  # fmt: skip
    return _start(embedded, f"http10-{port}", command, port, "/files/size-1?id={id}")


def start_raw(embedded: EmbeddedServices, mode: str) -> ThirdPartyServer:
    port = free_port()
    command = [
        sys.executable, "-m", "tests.proxy.third_party", "raw", "--mode", mode,
        "--port", str(port),
    ]  # fmt: skip
    return _start(embedded, f"raw-{mode}-{port}", command, port, "/plain?id={id}")


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    if not found:
        raise RuntimeError("nginx is not installed (apt-get install nginx; scripts/test does it)")
    return found


def start_nginx(embedded: EmbeddedServices, root: Path, workdir: Path) -> ThirdPartyServer:
    """nginx in the foreground as one process (no master, no daemon): its PID is the server's.
    Everything it writes (pid, logs, temp files) stays in `workdir`."""
    port = free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "nginx.conf"
    config.write_text(_nginx_config(port, root, workdir))
    command = [
        nginx_binary(),
        "-p",
        str(workdir),
        "-e",
        str(workdir / "error.log"),
        "-c",
        str(config),
    ]
    return _start(embedded, f"nginx-{port}", command, port, "/files/size-1?id={id}")


def _nginx_config(port: int, root: Path, workdir: Path) -> str:
    temp = {kind: workdir / kind for kind in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    return textwrap.dedent(f"""\
        daemon off;
        master_process off;
        worker_processes 1;
        pid {workdir}/nginx.pid;
        error_log {workdir}/error.log warn;
        events {{ worker_connections 1024; }}
        http {{
            access_log {workdir}/access.log;
            client_body_temp_path {temp["body"]};
            proxy_temp_path {temp["proxy"]};
            fastcgi_temp_path {temp["fastcgi"]};
            uwsgi_temp_path {temp["uwsgi"]};
            scgi_temp_path {temp["scgi"]};
            types {{ text/plain txt; application/json json; }}
            default_type application/octet-stream;
            sendfile on;
            keepalive_timeout 75s;
            keepalive_requests 100000;
            gzip off;
            etag on;
            server {{
                listen 127.0.0.1:{port};
                server_name localhost;
                root {root};
                # Echo the request's id so every answer can be attributed to its request.
                add_header X-Echo-Id $arg_id always;
                add_header X-Custom kroute-conformance always;
            }}
        }}
        """)


def make_files(root: Path, sizes: tuple[int, ...] = FILE_SIZES) -> Path:
    """Static files `files/size-<n>` (also as the keyed path `stores/customers/keys/size-<n>`)
    and `health/live`, which the proxy probes on an ejected node."""
    for folder in ("files", f"stores/{STORE}/keys", "health"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for size in sizes:
        content = body_for(size, f"file-{size}")
        (root / "files" / f"size-{size}").write_bytes(content)
        (root / "stores" / STORE / "keys" / f"size-{size}").write_bytes(content)
    (root / "health" / "live").write_bytes(b"live\n")
    return root


def file_body(size: int) -> bytes:
    return body_for(size, f"file-{size}")


# --- the proxies in front of a server --------------------------------------------------------


@dataclass
class Proxied:
    """A server published as node n0 of its own cluster, with a proxy per path."""

    server: ThirdPartyServer
    proxies: dict[str, ProxyHandle]

    def proxy(self, path: str) -> ProxyHandle:
        return self.proxies[path]

    def port(self, path: str) -> int:
        return int(self.proxies[path].url.rsplit(":", 1)[1])

    def node(self, path: str) -> dict[str, Any]:
        """n0 as the proxy's admin status shows it (ejected_since_ms, failures, requests)."""
        return dict(self.proxies[path].status()["nodes"][NODE])


@contextmanager
def proxied(
    embedded: EmbeddedServices, redis_url: str, server: ThirdPartyServer, **settings: str
) -> Iterator[Proxied]:
    """`server` as the one node of a new cluster in Redis, and two proxies in front of it
    started as a user starts them (`python -m proxy`); the proxies are stopped afterwards."""
    client = redis.Redis.from_url(redis_url)
    keys = Keys(f"conf-{uuid.uuid4().hex[:8]}")
    cluster = StaticCluster(keys, {NODE: server.url})
    cluster.add_store(StoreInfo(STORE, STORE, 4, "string"))
    cluster.publish(client)
    proxies: dict[str, ProxyHandle] = {}
    merged: dict[str, Any] = {**CONFORMANCE_SETTINGS, **settings}
    try:
        for path in PATHS:
            proxies[path] = start_proxy(
                embedded,
                redis_url,
                name=f"proxy-{server.name}-{path}-{keys.cluster}",
                cluster=keys.cluster,
                hot_path="true" if path == "c" else "false",
                **merged,
            )
        yield Proxied(server, proxies)
    finally:
        for handle in proxies.values():
            handle.process.stop()
            handle.close()
        client.close()


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def send_queues(port: int) -> list[tuple[str, int]]:
    """(state, unsent bytes) of every IPv4 socket whose local port is `port` (the kernel's
    view: a socket the proxy closed with data still queued shows up here too)."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].rsplit(":", 1)[1], 16)
        state, tx_queue = fields[3], int(fields[4].split(":")[0], 16)
        if local_port == port and state != "0A":  # 0A: the listening socket
            rows.append((state, tx_queue))
    return rows


def until(check: Any, timeout_s: float, interval_s: float = 0.1) -> Any:
    """Poll `check()` until it returns something truthy (that value) or time runs out (None)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if value := check():
                return value
        time.sleep(interval_s)
    return None


# --- servers run as `python -m tests.proxy.third_party ...` -----------------------------------


class _Http10Handler(SimpleHTTPRequestHandler):
    """HTTP/1.0: one answer per connection. /close/<n> answers n bytes with no content-length
    (the body ends when the server closes); anything else is a static file with one."""

    protocol_version = "HTTP/1.0"

    def do_GET(self) -> None:
        if not self._close_delimited(send_body=True):
            super().do_GET()

    def do_HEAD(self) -> None:
        if not self._close_delimited(send_body=False):
            super().do_HEAD()

    def _close_delimited(self, send_body: bool) -> bool:
        parts = urlsplit(self.path)
        if parts.path == "/health/live":
            body, request_id = b"live\n", ""
        elif parts.path.startswith("/close/"):
            request_id = (parse_qs(parts.query).get("id") or [""])[0]
            body = body_for(int(parts.path.rsplit("/", 1)[1]), request_id)
        else:
            return False
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("X-Echo-Id", request_id)
        self.send_header("X-Custom", "kroute-conformance")
        self.end_headers()
        if send_body:
            self.wfile.write(body)
        self.close_connection = True
        return True

    def end_headers(self) -> None:
        query = parse_qs(urlsplit(self.path).query)
        if "id" in query and not self.path.startswith("/close/"):
            self.send_header("X-Echo-Id", query["id"][0])
        super().end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # the base's signature
        pass  # the conformance tests check answers, not logs


def _serve_http10(port: int, directory: str) -> None:
    handler = lambda *a, **kw: _Http10Handler(*a, directory=directory, **kw)  # noqa: E731
    ThreadingHTTPServer.daemon_threads = True
    with ThreadingHTTPServer(("127.0.0.1", port), handler) as server:
        server.serve_forever()


_INTERIM = {
    "early-hints": b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload; as=style\r\n\r\n",
    "continue": b"HTTP/1.1 100 Continue\r\n\r\n",
}
_SWITCH = b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
_WEBSOCKET_FRAME = b"\x81\x05hello"  # what a switched server then says: not HTTP


class _RawServerProtocol(asyncio.Protocol):
    """Answers each request in order: an interim answer (by mode) and then a 200 with JSON
    naming the request's id. Written by hand so it can send what frameworks will not."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.queue: asyncio.Queue[tuple[str, str] | None] = asyncio.Queue()
        self.switched = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        asyncio.get_running_loop().create_task(self._answer_in_order())

    def connection_lost(self, exc: Exception | None) -> None:
        self.queue.put_nowait(None)

    def data_received(self, data: bytes) -> None:
        if self.switched:
            return  # after 101 the bytes are the new protocol's; a websocket server ignores us
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        self.queue.put_nowait((self.parser.get_method().decode(), self.url.decode("latin-1")))
        self.url = b""

    async def _answer_in_order(self) -> None:
        while (request := await self.queue.get()) is not None:
            await self._answer(*request)

    async def _answer(self, method: str, target: str) -> None:
        transport = self.transport
        assert transport is not None
        parts = urlsplit(target)
        request_id = (parse_qs(parts.query).get("id") or [""])[0]
        if self.mode == "switch" and parts.path.startswith("/switch"):
            self.switched = True
            transport.write(_SWITCH)
            await asyncio.sleep(0.01)
            transport.write(_WEBSOCKET_FRAME)
            return
        if self.mode in _INTERIM and parts.path != "/health/live":
            transport.write(_INTERIM[self.mode])
            await asyncio.sleep(0.005)  # a segment of its own, as a real server's would be
        body = f'{{"id": "{request_id}", "path": "{parts.path}", "method": "{method}"}}'.encode()
        head = (
            f"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nx-echo-id: {request_id}\r\n"
            f"x-custom: kroute-conformance\r\n\r\n"
        ).encode("latin-1")
        transport.write(head if method == "HEAD" else head + body)


async def _serve_raw(port: int, mode: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _RawServerProtocol(mode), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = parser.add_subparsers(dest="server", required=True)
    http10 = sub.add_parser("http10")
    http10.add_argument("--port", type=int, required=True)
    http10.add_argument("--directory", required=True)
    raw = sub.add_parser("raw")
    raw.add_argument("--port", type=int, required=True)
    raw.add_argument("--mode", choices=["early-hints", "continue", "switch"], required=True)
    args = parser.parse_args(argv)
    if args.server == "http10":
        _serve_http10(args.port, args.directory)
    else:
        asyncio.run(_serve_raw(args.port, args.mode))


if __name__ == "__main__":
    main()
