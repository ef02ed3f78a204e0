"""The steady load generator against a real server that stalls: every request is timed from
when it was due, so the requests queued behind a stalled one count their wait (no coordinated
omission), and none of the sends the stall delayed is skipped."""

from __future__ import annotations

import itertools
import socketserver
import threading
import time
import uuid
from collections.abc import Iterator

from benchmarks.loadgen import Request, SteadyLoad

RATE = 100.0  # one connection: a request due every 10 ms
STALL_S = 1.0
STALL_AT = 20  # the 20th request the server sees is answered STALL_S late


class _StallingHandler(socketserver.StreamRequestHandler):
    """Keep-alive HTTP/1.1: answers each GET at once, echoing its path in x-kroute-node,
    except the STALL_AT-th request of the server's life, answered STALL_S late."""

    def handle(self) -> None:
        server = self.server
        assert isinstance(server, _StallingServer)
        while True:
            line = self.rfile.readline()
            if not line:
                return
            path = line.split(b" ")[1]
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            with server.lock:
                server.seen += 1
                stall = server.seen == STALL_AT
            if stall:
                time.sleep(STALL_S)
            self.wfile.write(
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-kroute-node: " + path + b"\r\n\r\nok"
            )


class _StallingServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _StallingHandler)
        self.lock = threading.Lock()
        self.seen = 0


def _unique_paths() -> Iterator[Request]:
    while True:
        yield Request(f"/k/{uuid.uuid4().hex}")


def test_requests_queued_behind_a_stall_count_their_wait():
    server = _StallingServer()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        load = SteadyLoad(
            "127.0.0.1", port, _unique_paths(), rate=RATE, connections=1, timeout_s=5
        ).start()
        time.sleep(0.2 + STALL_S + 1.0)  # before, during and well after the stall
        outcomes = load.stop()
    finally:
        server.shutdown()
        server.server_close()

    assert all(o.status == 200 for o in outcomes)
    # Each answer was its own request's (the server echoed the unique path).
    assert all(o.headers["x-kroute-node"] == o.path for o in outcomes)
    assert len({o.path for o in outcomes}) == len(outcomes)
    # The schedule never slipped: one request due every 10 ms, none skipped by the stall.
    due = [o.sent_at for o in outcomes]
    gaps = [b - a for a, b in itertools.pairwise(due)]
    assert max(abs(gap - 1 / RATE) for gap in gaps) < 1e-6, gaps
    assert len(outcomes) >= (STALL_S + 1.0) * RATE
    # The stalled request, then ~STALL_S * RATE requests due while it hung: each waited for it,
    # less the time it was due after the stall began (1000 ms, 990 ms, 980 ms, ...).
    stalled = next(i for i, o in enumerate(outcomes) if o.service_ms >= STALL_S * 1000)
    queued = outcomes[stalled + 1 : stalled + int(STALL_S * RATE)]
    for position, outcome in enumerate(queued, start=1):
        waited_at_least = STALL_S * 1000 - position * 1000 / RATE
        assert outcome.latency_ms >= waited_at_least - 15, (position, outcome)
        assert outcome.service_ms < STALL_S * 1000 / 2  # each was quick once it went out
    # So the slow tail is the queue, not one request: half of the stall's requests over 500 ms.
    slow = [o for o in outcomes if o.latency_ms >= STALL_S * 1000 / 2]
    assert len(slow) >= STALL_S * RATE / 2 - 5, len(slow)
    assert sum(o.service_ms >= STALL_S * 1000 / 2 for o in outcomes) == 1
