"""Message bytes: what is passed on to nodes and clients, and what never is (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.http import (
    BY_LENGTH,
    CHUNKED,
    LAST_CHUNK,
    NO_BODY,
    UNTIL_CLOSE,
    body_framing,
    chunk,
    filter_response_head,
    request_head,
    response_bytes,
)
from proxy.retry_budget import RetryBudget


def test_request_head_strips_hop_by_hop_and_extends_forwarded_for():
    head = request_head(
        "GET",
        "/stores/s/keys/k",
        [
            (b"host", b"public.example"),
            (b"connection", b"keep-alive, x-private"),
            (b"x-private", b"1"),
            (b"keep-alive", b"timeout=5"),
            (b"transfer-encoding", b"chunked"),
            (b"proxy-authorization", b"secret"),
            (b"x-forwarded-for", b"10.0.0.1"),
            (b"x-request-id", b"client-chosen"),
            (b"accept", b"application/json"),
        ],
        client_ip="192.0.2.7",
        request_id=b"rid-1",
        body_length=0,
    )
    lines = head.split(b"\r\n")
    assert lines[0] == b"GET /stores/s/keys/k HTTP/1.1"
    assert b"accept: application/json" in lines
    assert b"x-forwarded-for: 10.0.0.1, 192.0.2.7" in lines
    assert b"x-forwarded-host: public.example" in lines
    assert b"x-request-id: rid-1" in lines
    for dropped in (b"x-private", b"keep-alive", b"transfer-encoding", b"proxy-authorization"):
        assert not any(line.lower().startswith(dropped + b":") for line in lines)
    assert not any(line.startswith(b"host:") for line in lines)  # added per node


def test_response_head_filter_drops_hop_by_hop_provenance_and_connection_named():
    head = (
        b"Content-Type: application/json\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\n"
        b"Keep-Alive: timeout=5\r\nTransfer-Encoding: chunked\r\nX-Kroute-Node: n9\r\n"
        b"X-Kroute-Lag: 3\r\nContent-Length: 10\r\nX-App: yes\r\n"
    )
    assert filter_response_head(head) == b"Content-Type: application/json\r\nX-App: yes\r\n"


@given(st.lists(st.sampled_from([b"x-a", b"x-b", b"server", b"date", b"etag"]), max_size=6))
def test_plain_headers_pass_unchanged(names):
    head = b"".join(name + b": v\r\n" for name in names)
    assert filter_response_head(head) == head


def test_response_bytes_frames_the_body_and_says_when_it_closes():
    kept = response_bytes(200, b"a: 1\r\n", b"b: 2\r\n", b"body", keep_alive=True)
    assert kept == b"HTTP/1.1 200 OK\r\na: 1\r\nb: 2\r\ncontent-length: 4\r\n\r\nbody"
    closing = response_bytes(503, b"", b"", b"x", keep_alive=False, head_only=True)
    assert closing == (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 1\r\nconnection: close\r\n\r\n"
    )


def test_retry_budget_caps_sustained_retries_and_absorbs_a_burst():
    budget = RetryBudget(percent=20, min_per_s=0, burst=10)
    assert sum(budget.withdraw() for _ in range(50)) == 10  # the burst, then nothing
    for _ in range(100):
        budget.deposit()
    assert sum(budget.withdraw() for _ in range(50)) == 10  # 20% of 100 requests, capped
    idle = RetryBudget(percent=0, min_per_s=1000, burst=5)
    assert sum(idle.withdraw() for _ in range(5)) == 5


statuses = st.sampled_from([100, 103, 200, 201, 204, 206, 301, 304, 404, 421, 500, 503])


@given(
    status=statuses,
    head_request=st.booleans(),
    length=st.one_of(st.none(), st.integers(0, 10**9)),
    chunked_ok=st.booleans(),
)
def test_answer_framing_follows_rfc_9110_and_9112(status, head_request, length, chunked_ok):
    line, how = body_framing(
        status, head_request=head_request, length=length, chunked_ok=chunked_ok
    )
    if status < 200 or status == 204:  # never a Content-Length, never a body
        assert (line, how) == (b"", NO_BODY)
    elif head_request or status == 304:  # the node's length describes the representation
        assert how == NO_BODY
        assert line == (b"" if length is None else b"content-length: %d\r\n" % length)
    elif length is not None:
        assert (line, how) == (b"content-length: %d\r\n" % length, BY_LENGTH)
    elif chunked_ok:
        assert (line, how) == (b"transfer-encoding: chunked\r\n", CHUNKED)
    else:  # an HTTP/1.0 client reads an answer of unknown length until the close
        assert (line, how) == (b"", UNTIL_CLOSE)


@given(st.binary(min_size=1, max_size=5000))
def test_a_chunk_parses_back_to_its_bytes(data):
    import httptools  # noqa: PLC0415

    class Sink:
        body = b""

        def on_body(self, part: bytes) -> None:
            Sink.body += part

    parser = httptools.HttpResponseParser(Sink())
    parser.feed_data(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(data) + LAST_CHUNK
    )
    assert Sink.body == data


def test_expect_is_never_forwarded():
    head = request_head(
        "POST",
        "/x",
        [(b"expect", b"100-continue"), (b"content-length", b"5")],
        client_ip="10.0.0.1",
        request_id=b"r",
        body_length=5,
    )
    assert b"expect" not in head.lower()
    assert b"content-length: 5\r\n" in head
