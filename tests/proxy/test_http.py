"""Message bytes: what is passed on to nodes and clients, and what never is (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.http import filter_response_head, request_head, response_bytes
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
