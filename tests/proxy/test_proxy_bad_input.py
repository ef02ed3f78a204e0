"""Bad input on raw sockets: clear 4xx with a JSON body, no crash, nothing forwarded."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.proxy.conftest import StandIns

pytestmark = pytest.mark.integration


def exchange(stand_ins: StandIns, raw: bytes, *, wait_s: float = 3.0) -> list[tuple[int, bytes]]:
    """Send raw bytes; read until the proxy closes or goes quiet; (status, body) of each
    response."""
    return parse_responses(stand_ins.send_raw(raw, quiet_s=wait_s))


def parse_responses(data: bytes) -> list[tuple[int, bytes]]:
    responses = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        length = next(
            int(line.split(b":", 1)[1])
            for line in lines
            if line.lower().startswith(b"content-length")
        )
        responses.append((status, rest[:length]))
        data = rest[length:]
    return responses


def only_response(stand_ins: StandIns, raw: bytes, **kwargs: float) -> tuple[int, dict]:
    responses = exchange(stand_ins, raw, **kwargs)
    assert len(responses) == 1, responses
    status, body = responses[0]
    return status, json.loads(body)


GET_A = b"GET /stores/customers/keys/a HTTP/1.1\r\nHost: x\r\n"
POST = b"POST /orders HTTP/1.1\r\nHost: x\r\n"
CASES = [
    ("malformed request line", b"GARBAGE\r\n\r\n", 400),
    ("absolute-form target", b"GET http://evil.example/ HTTP/1.1\r\nHost: evil\r\n\r\n", 400),
    ("asterisk-form target", b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    ("CONNECT", b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n", 405),
    ("bare CR in a header value", GET_A + b"X-A: a\rb\r\n\r\n", 400),
    ("LF injected in a header value", GET_A + b"X-A: a\nX-B: b\r\n\r\n", 400),
    ("NUL in a header value", GET_A + b"X-A: a\x00b\r\n\r\n", 400),
    ("non-ASCII target", "GET /stores/customers/keys/é HTTP/1.1\r\n\r\n".encode(), 400),
    ("oversized header", GET_A + b"X-Big: " + b"a" * 5000 + b"\r\n\r\n", 431),
    ("too many headers", GET_A + b"".join(b"X-%d: v\r\n" % i for i in range(25)) + b"\r\n", 431),
    ("body over the limit", POST + b"Content-Length: 5000\r\n\r\n" + b"a" * 5000, 413),
    (
        "chunked body over the limit",
        POST + b"Transfer-Encoding: chunked\r\n\r\n800\r\n" + b"a" * 2048 + b"\r\n0\r\n\r\n",
        413,
    ),
    ("websocket upgrade", GET_A + b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n", 400),
    # The head limit counts the request target too, and a head in one read.
    ("target over the head limit", b"GET /" + b"a" * 60_000 + b" HTTP/1.1\r\n\r\n", 431),
    (
        "target over the head limit, with headers",
        b"GET /stores/customers/keys/" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        431,
    ),
    (
        "a transfer coding other than chunked",
        POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        501,
    ),
    (
        "transfer coding in an HTTP/1.0 request",
        b"POST /orders HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        400,
    ),
    ("an expectation other than 100-continue", POST + b"Expect: teapot\r\n\r\n", 417),
    ("invalid percent-encoding", b"GET /stores/c/keys/%FF%FE HTTP/1.1\r\nHost: x\r\n\r\n", 400),
]


@pytest.mark.parametrize(("raw", "status"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_with_a_json_reason_and_never_forwarded(stand_ins, raw, status):
    before = stand_ins.received()
    got, body = only_response(stand_ins, raw)
    assert got == status
    assert body["error"]
    assert body["detail"]
    assert stand_ins.received() == before
    assert stand_ins.proxy.process.is_running()


def test_host_header_cannot_send_traffic_elsewhere(stand_ins):
    raw = b"GET /stores/customers/keys/alice HTTP/1.1\r\nHost: evil.example:80\r\n\r\n"
    ((status, body),) = exchange(stand_ins, raw, wait_s=1.0)
    assert status == 200
    echoed = json.loads(body)
    assert echoed["node"] in stand_ins.backends
    headers = dict(echoed["headers"])
    assert headers["host"] == stand_ins.backends[echoed["node"]].url.removeprefix("http://")
    assert headers["x-forwarded-host"] == "evil.example:80"


def test_encoded_crlf_in_a_key_stays_encoded_on_the_way_to_the_node(stand_ins):
    raw = b"GET /stores/customers/keys/a%0D%0AX-Evil:%201 HTTP/1.1\r\nHost: x\r\n\r\n"
    ((status, body),) = exchange(stand_ins, raw, wait_s=1.0)
    assert status == 200
    echoed = json.loads(body)
    assert echoed["target"] == "/stores/customers/keys/a%0D%0AX-Evil:%201"
    assert "x-evil" not in dict(echoed["headers"])


def test_pipelined_requests_are_answered_in_order(stand_ins):
    raw = b"".join(
        b"GET /stores/customers/keys/k%d HTTP/1.1\r\nHost: x\r\nX-Request-Id: r%d\r\n\r\n" % (i, i)
        for i in range(5)
    )
    responses = exchange(stand_ins, raw, wait_s=1.0)
    assert [status for status, _ in responses] == [200] * 5
    assert [json.loads(body)["target"] for _, body in responses] == [
        f"/stores/customers/keys/k{i}" for i in range(5)
    ]


def test_a_malformed_request_after_good_ones_is_refused_after_they_are_answered(stand_ins):
    # Found by the fuzzer: the refusal used to close the connection and drop the answers.
    good = b"".join(
        b"GET /stores/customers/keys/k%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(3)
    )
    before = stand_ins.received()
    responses = exchange(stand_ins, good + b"\x00ET / HTTP/1.1\r\n\r\n" + good, wait_s=1.0)
    assert [status for status, _ in responses] == [200, 200, 200, 400]
    assert json.loads(responses[3][1])["error"] == "bad_request"
    assert stand_ins.received() - before == 3  # nothing after the refusal was read


def test_a_slow_client_gets_408_and_is_disconnected(stand_ins):
    port = stand_ins.proxy_port
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /stores/customers/keys/a HTTP/1.1\r\nHost: x\r\n")
        for _ in range(8):  # trickle a header every 0.3 s: never a whole request
            time.sleep(0.3)
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                break
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    assert received.startswith(b"HTTP/1.1 408")
    assert time.monotonic() - started < 4.5


def test_truncated_requests_and_idle_connections_do_not_hurt(stand_ins):
    port = stand_ins.proxy_port
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    for sock in sockets[:10]:
        sock.sendall(b"GET /stores/customers/keys/a HT")
    for sock in sockets:
        sock.close()
    response = stand_ins.proxy.get("/stores/customers/keys/still-fine")
    assert response.status_code == 200
    assert stand_ins.proxy.process.is_running()


def test_chunked_trailers_never_become_headers(stand_ins):
    raw = (
        POST + b"X-Request-Id: from-the-head\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n0\r\nX-Request-Id: from-a-trailer\r\nX-Injected: 1\r\n\r\n"
    )
    ((status, body),) = exchange(stand_ins, raw, wait_s=1.0)
    assert status == 200
    echoed = json.loads(body)
    assert echoed["body"] == "hello"
    headers = dict(echoed["headers"])
    assert "x-injected" not in headers
    assert headers["x-request-id"] == "from-the-head"
    assert headers["content-length"] == "5"
    assert "transfer-encoding" not in headers


def test_expect_100_continue_is_answered_by_the_proxy_and_not_forwarded(stand_ins):
    with socket.create_connection(("127.0.0.1", stand_ins.proxy_port), timeout=3) as sock:
        sock.sendall(POST + b"Content-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        received = b""
        while b"\r\n\r\n" not in received or not received.endswith(b"}"):
            received += sock.recv(65536)
    ((status, body),) = parse_responses(received)
    echoed = json.loads(body)
    assert status == 200
    assert echoed["body"] == "hello"
    assert "expect" not in dict(echoed["headers"])
