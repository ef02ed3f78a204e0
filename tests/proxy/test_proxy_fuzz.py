"""Fuzzing the proxy's HTTP parsing and routing with raw socket writes.

Hypothesis writes request lines, headers, keys and bodies (valid, nearly valid and garbage),
truncates them and pipelines several on one connection. Whatever arrives, the proxy must stay
up, answer in well-formed HTTP, give every refusal a JSON reason, and forward to a node only
requests it answered for that node. The corpus is then replayed to see that file descriptors
and memory come back to where they were.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import httptools
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.proxy.conftest import StandIns

pytestmark = pytest.mark.integration

QUIET_S = 0.2  # the proxy said all it will say when nothing more comes for this long

methods = st.sampled_from(
    [b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE"]
) | st.binary(min_size=0, max_size=8)
key_text = st.text(min_size=0, max_size=12) | st.binary(max_size=12).map(
    lambda b: b.decode("latin-1")
)
targets = st.one_of(
    st.builds(
        lambda store, key: b"/stores/" + store + b"/keys/" + key.encode("utf-8", "replace"),
        st.sampled_from([b"customers", b"cards", b"devices", b"nope", b""]),
        key_text,
    ),
    st.builds(lambda key: b"/lookup?id=" + key.encode("utf-8", "replace"), key_text),
    st.sampled_from(
        [b"/", b"*", b"http://evil.example/x", b"//evil.example/x", b"/check", b"/a/../../etc"]
    ),
    st.binary(max_size=20),
)
versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9", b""])
header_names = st.sampled_from(
    [b"Host", b"Content-Length", b"Transfer-Encoding", b"Connection", b"x-card",
     b"x-kroute-max-lag", b"x-kroute-max-lag-ms", b"Expect", b"Upgrade", b"X-Any"]
) | st.binary(min_size=0, max_size=10)  # fmt: skip
header_values = st.sampled_from(
    [b"x", b"0", b"5", b"-1", b"99999999999999999999", b"chunked", b"close", b"keep-alive",
     b"100-continue", b"websocket", b"gzip, chunked"]
) | st.binary(max_size=16)  # fmt: skip
headers = st.lists(st.tuples(header_names, header_values), max_size=6)
bodies = st.binary(max_size=64) | st.sampled_from([b"5\r\nhello\r\n0\r\n\r\n", b"zz\r\n"])


safe_keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.~%20", min_size=1, max_size=12)
benign_headers = st.lists(
    st.sampled_from(
        [b"Accept: */*", b"User-Agent: fuzz", b"x-kroute-max-lag: 1000", b"Connection: close",
         b"x-kroute-max-lag-ms: 60000", b"Cookie: a=b", b"x-card: 12", b"Accept-Encoding: gzip"]
    ),
    max_size=3,
)  # fmt: skip


@st.composite
def well_formed(draw: st.DrawFn) -> bytes:
    """What a real client sends: a keyed lookup, a POST with a body, an unkeyed path."""
    target = draw(
        st.one_of(
            st.builds(lambda k: b"/stores/customers/keys/" + k.encode(), safe_keys),
            st.builds(lambda k: b"/lookup?id=" + k.encode(), safe_keys),
            st.sampled_from([b"/", b"/orders", b"/check"]),
        )
    )
    method = draw(st.sampled_from([b"GET", b"GET", b"POST", b"DELETE", b"PUT"]))
    body = draw(st.binary(max_size=40)) if method in (b"POST", b"PUT") else b""
    head = b"".join(line + b"\r\n" for line in draw(benign_headers))
    length = b"Content-Length: %d\r\n" % len(body) if body else b""
    return (
        method + b" " + target + b" HTTP/1.1\r\nHost: kroute\r\n" + head + length + b"\r\n" + body
    )


@st.composite
def garbled(draw: st.DrawFn) -> bytes:
    line = draw(methods) + b" " + draw(targets) + b" " + draw(versions) + b"\r\n"
    head = b"".join(name + b": " + value + b"\r\n" for name, value in draw(headers))
    return line + head + b"\r\n" + draw(bodies)


@st.composite
def nearly_well_formed(draw: st.DrawFn) -> bytes:
    """A real request with one odd header or a byte flipped somewhere."""
    raw = draw(well_formed())
    if draw(st.booleans()):
        name, value = draw(header_names), draw(header_values)
        return raw.replace(b"\r\n", b"\r\n" + name + b": " + value + b"\r\n", 1)
    at = draw(st.integers(0, len(raw) - 1))
    return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]


def requests() -> st.SearchStrategy[bytes]:
    return st.one_of(well_formed(), nearly_well_formed(), garbled())


@st.composite
def connections(draw: st.DrawFn) -> bytes:
    """One to three requests written back to back, maybe cut short."""
    raw = b"".join(draw(st.lists(requests(), min_size=1, max_size=3)))
    if draw(st.booleans()):
        raw = raw[: draw(st.integers(0, len(raw)))]
    return raw


@dataclass
class Answer:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


class _Responses:
    """httptools callbacks collecting each response."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.answers.append(Answer(0))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.answers[-1].headers[name.decode().lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.answers[-1].status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.answers[-1].body += body


def parse_responses(data: bytes) -> list[Answer]:
    """Every response in `data`; raises if the bytes are not well-formed HTTP/1.1."""
    responses = _Responses()
    responses.parser.feed_data(data)
    return responses.answers


def exchange(stand_ins: StandIns, raw: bytes) -> bytes:
    return stand_ins.send_raw(raw, quiet_s=QUIET_S, limit_s=5)


CORPUS: list[bytes] = []


def check_one(stand_ins: StandIns, raw: bytes) -> None:
    before = stand_ins.received()
    received = exchange(stand_ins, raw)
    assert stand_ins.proxy.process.is_running(), stand_ins.proxy.process.log_tail(30)
    time.sleep(0.02)  # let a backend finish logging what it got
    forwarded = stand_ins.received() - before
    if b"HEAD" in raw:  # a HEAD answer has a Content-Length but no body: not parseable alone
        # (nothing at all: the proxy still waits for the rest of a request, e.g. b"HEAD")
        assert not received or received.startswith(b"HTTP/1.1 "), received[:200]
        return
    answers = parse_responses(received)
    from_nodes = [a for a in answers if "x-backend" in a.headers]
    event(f"answers from nodes: {len(from_nodes)}, refusals: {len(answers) - len(from_nodes)}")
    # Nothing reaches a node unless the proxy answered with what that node said.
    assert forwarded == len(from_nodes), (raw, received[:400], forwarded)
    for answer in answers:
        if answer.status >= 400 and "x-backend" not in answer.headers:
            problem = json.loads(answer.body)
            assert problem["error"], answer


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=connections())
def test_whatever_arrives_the_proxy_answers_well_formed_and_forwards_only_what_it_accepts(
    stand_ins, raw
):
    CORPUS.append(raw)
    check_one(stand_ins, raw)


def open_fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_replaying_the_corpus_leaks_no_descriptors_or_memory(stand_ins):
    assert CORPUS, "runs after the fuzz test, on what it generated"
    pid = stand_ins.proxy.process.pid
    for raw in CORPUS:  # warm-up: pools, caches and allocator arenas fill up
        exchange(stand_ins, raw)
    time.sleep(0.5)
    fds, rss = open_fds(pid), rss_kib(pid)
    for _ in range(3):
        for raw in CORPUS:
            exchange(stand_ins, raw)
    time.sleep(0.5)
    assert stand_ins.proxy.process.is_running()
    assert open_fds(pid) <= fds + 2, (fds, open_fds(pid))
    assert rss_kib(pid) <= rss + 4096, (rss, rss_kib(pid))  # 3 more rounds: under 4 MiB


def test_a_huge_body_is_refused_without_being_read_into_memory(stand_ins):
    pid = stand_ins.proxy.process.pid
    rss = rss_kib(pid)
    port = stand_ins.proxy_port
    before = stand_ins.received()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST /orders HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n")
        sent = 0
        try:
            while sent < 50_000_000:  # keep pushing: the proxy must refuse, not buffer
                sock.sendall(b"a" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
        sock.settimeout(2)
        try:
            reply = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            reply = b""
    assert stand_ins.received() == before
    assert reply == b"" or reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert sent < 50_000_000, "the proxy kept reading a body far over its limit"
    assert rss_kib(pid) <= rss + 4096
    assert stand_ins.proxy.process.is_running()
