"""Back-pressure (issue 17 item 3): clients that send requests and never read their answers.

nginx serves large static files behind the proxy (both paths). A client that pipelines
hundreds of requests for 300 KB answers and reads nothing must not make the proxy buffer them
all: its RSS stays under a bound while other clients are served as usual. With a connection
limit, connections the proxy is still holding (their answers queued in the kernel) count
against it, so six such clients are never all held at once, and once they are gone the proxy
accepts again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kroute.embedded import EmbeddedServices, RedisHandle
from tests.proxy.third_party import (
    PATHS,
    Proxied,
    RawConnection,
    ThirdPartyServer,
    file_body,
    make_files,
    proxied,
    request_bytes,
    rss_bytes,
    send_queues,
    start_nginx,
    until,
)

pytestmark = pytest.mark.integration

ON_BOTH_PATHS = pytest.mark.parametrize("path", PATHS)
BIG = 300_000
MEDIUM = 60_000  # under the 64 KiB that main's proxy could pass on at all (issue 17 item 2)
# The bound for now; the documented per-connection bound will replace it (issue 17 item 3).
RSS_BOUND = 150 * 1024 * 1024
UNREAD_BYTES = 150_000_000  # the answers a non-reading client asks for: as much as the bound
HOG_RCVBUF = 16 * 1024  # a small window, so the answers cannot hide in the client's kernel
HELD = 64 * 1024  # a proxy socket with this much unsent is holding a non-reading client
LIMIT = 3


@pytest.fixture(scope="module")
def nginx(
    embedded: EmbeddedServices, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThirdPartyServer]:
    root = make_files(tmp_path_factory.mktemp("pressure-site"), (1000, MEDIUM, BIG))
    server = start_nginx(embedded, root, tmp_path_factory.mktemp("pressure-nginx"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def pressure_site(
    embedded: EmbeddedServices, redis_server: RedisHandle, nginx: ThirdPartyServer
) -> Iterator[Proxied]:
    with proxied(embedded, redis_server.url, nginx) as site:
        yield site


@pytest.fixture(scope="module")
def limited_site(
    embedded: EmbeddedServices, redis_server: RedisHandle, nginx: ThirdPartyServer
) -> Iterator[Proxied]:
    # A short idle timeout: a proxy that closes a non-reading client as idle (and stops
    # counting it while its answers still sit in the send queue) shows it within seconds.
    settings = {"max_connections": str(LIMIT), "idle_timeout_ms": "1000"}
    with proxied(embedded, redis_server.url, nginx, **settings) as site:
        yield site


def file_request(size: int, rid: str) -> bytes:
    return request_bytes("GET", f"/files/size-{size}?id={rid}", {"x-request-id": rid})


def hog(port: int, label: str, size: int, requests: int) -> tuple[RawConnection, list[str]]:
    """A client that pipelines `requests` requests for `size`-byte answers and reads nothing."""
    conn = RawConnection(port, rcvbuf=HOG_RCVBUF)
    ids = [f"{label}-{i}" for i in range(requests)]
    conn.send(b"".join(file_request(size, rid) for rid in ids))
    return conn, ids


class Bystander(threading.Thread):
    """A well-behaved client asking for small files the whole time; what went wrong, and
    its slowest answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.done = threading.Event()
        self.problems: list[str] = []
        self.answered = 0
        self.slowest_s = 0.0

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10, trust_env=False) as client:
            while not self.done.is_set():
                rid = f"bystander-{self.answered}-{time.monotonic_ns()}"
                started = time.monotonic()
                try:
                    response = client.get(f"/files/size-1000?id={rid}")
                except httpx.HTTPError as exc:
                    self.problems.append(f"{rid}: {exc!r}")
                    continue
                self.slowest_s = max(self.slowest_s, time.monotonic() - started)
                if response.headers.get("x-echo-id") != rid or response.content != file_body(1000):
                    self.problems.append(f"{rid}: {response.status_code} {response.headers}")
                self.answered += 1
                time.sleep(0.02)


@ON_BOTH_PATHS
@pytest.mark.parametrize("size", [MEDIUM, BIG], ids=str)
def test_a_client_that_never_reads_keeps_the_proxy_small(
    pressure_site: Proxied, path: str, size: int
) -> None:
    pid = pressure_site.proxy(path).process.pid
    baseline = rss_bytes(pid)
    bystander = Bystander(pressure_site.proxy(path).url)
    bystander.start()
    requests = UNREAD_BYTES // size
    conn, ids = hog(pressure_site.port(path), "hog", size, requests)
    peak = baseline
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and peak < 2 * RSS_BOUND:  # stop early if it runs away
            peak = max(peak, rss_bytes(pid))
            time.sleep(0.1)
        bystander.done.set()
        bystander.join(15)
        # The hog's first answers are real ones (a proxy failing big answers would be small).
        conn.sock.settimeout(10)
        firsts = [conn.read_final()[1] for _ in range(3)]
    finally:
        bystander.done.set()
        conn.close()
    print(
        f"\n[{path}] proxy RSS: {baseline / 2**20:.1f} MiB before, peak {peak / 2**20:.1f} MiB "
        f"with {requests} x {size} B answers unread; bystander: {bystander.answered} "
        f"answers, slowest {bystander.slowest_s * 1000:.0f} ms"
    )
    for rid, answer in zip(ids[:3], firsts, strict=True):
        what = f"the non-reading client's answer to {rid}: {answer.status} {answer.body[:100]!r}"
        assert (answer.status, answer.echo_id) == (200, rid), what
        assert answer.body == file_body(size), what
    assert peak <= RSS_BOUND, f"proxy RSS {peak / 2**20:.1f} MiB > {RSS_BOUND / 2**20:.0f} MiB"
    assert not bystander.problems, bystander.problems[:5]
    assert bystander.answered >= 20, "the bystander was hardly served"


TCP_STATES = {"01": "ESTABLISHED", "04": "FIN_WAIT1", "08": "CLOSE_WAIT", "0B": "CLOSING"}


def held_connections(port: int) -> list[str]:
    """Proxy-side sockets with a non-reading client's answers queued: open ones, and closed
    ones the kernel still holds because their data was never sent (a close without abort)."""
    return [
        f"{TCP_STATES.get(state, state)} {unsent} B unsent"
        for state, unsent in send_queues(port)
        if unsent >= HELD
    ]


def served(port: int) -> bool:
    rid = f"after-{time.monotonic_ns()}"
    with RawConnection(port, timeout_s=3) as conn:
        conn.send(request_bytes("GET", f"/files/size-1000?id={rid}", {"x-request-id": rid}))
        answer = conn.read_final()[1]
    return (answer.status, answer.echo_id) == (200, rid)


@ON_BOTH_PATHS
def test_non_reading_clients_cannot_escape_the_connection_limit(
    limited_site: Proxied, path: str
) -> None:
    port = limited_site.port(path)
    hogs: list[RawConnection] = []
    most_held: list[str] = []
    try:
        for wave in range(2):  # the second wave after the first could have been closed as idle
            for i in range(LIMIT):
                hogs.append(hog(port, f"wave{wave}-hog{i}", MEDIUM, 80)[0])
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                most_held = max(most_held, held_connections(port), key=len)
                time.sleep(0.1)
    finally:
        for conn in hogs:
            conn.close()
    print(f"\n[{path}] at most {len(most_held)} non-reading clients held at once: {most_held}")
    assert len(most_held) <= LIMIT, f"held with a limit of {LIMIT}: {most_held}"
    assert until(lambda: served(port), timeout_s=15), "the proxy did not accept again"
