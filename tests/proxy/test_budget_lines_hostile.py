"""The lag budget a proxy carries to its nodes, attacked by its clients, on both paths.

Two real proxy processes (the C path on and off) with a configured budget (KROUTE_MAX_LAG=50,
KROUTE_MAX_LAG_MS=600000) stand before the same echo backends, which answer with the exact bytes
the proxy sent them. Whatever budget headers a client sends (none, looser, tighter, repeated,
in another case), the node must see exactly one line per budget, never looser than the
configured budget or than any the client asked, and the same bytes from both paths; every try
of a request (failover after a 421) carries the same lines.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator

import pytest

from kroute.embedded import EmbeddedServices
from kroute.proxies import ProxyHandle, start_proxy
from tests.proxy.conftest import PROXY_SETTINGS, StandIns, running_stand_ins
from tests.proxy.echo_backend import EchoBackend
from tests.proxy.test_hotpath import TWIN_SETTINGS, comparable, hot_path_count, send

pytestmark = pytest.mark.integration

# The stand-ins' lag reports are as old as the fixture: a time budget of seconds would turn
# every replica away at the proxy (503) before any line reached a node.
BUDGET = {"max_lag": "50", "max_lag_ms": "600000"}
CONFIGURED = {b"x-kroute-max-lag": 50, b"x-kroute-max-lag-ms": 600_000}
BUDGET_LINE = re.compile(rb"(?im)^(x-kroute-max-lag(?:-ms)?):[ \t]*(.*?)[ \t]*\r\n")


@pytest.fixture(scope="module")
def budget_twins(embedded: EmbeddedServices) -> Iterator[tuple[StandIns, ProxyHandle]]:
    """(stand-ins whose proxy has the C path on, a twin with it off), both with the budget."""
    redis_server = embedded.start_redis()
    backends = {f"n{i}": EchoBackend(f"n{i}").start() for i in range(3)}
    on = {**PROXY_SETTINGS, **TWIN_SETTINGS, **BUDGET, "hot_path": "true"}
    with running_stand_ins(embedded, redis_server, backends, **on) as stand_ins:
        twin = start_proxy(
            embedded,
            redis_server.url,
            name=f"proxy-budget-off-{stand_ins.cluster.keys.cluster}",
            cluster=stand_ins.cluster.keys.cluster,
            **{**on, "hot_path": "false"},
        )
        try:
            yield stand_ins, twin
        finally:
            twin.process.stop()
            twin.close()


def _request(key: str, *lines: str) -> bytes:
    extra = "".join(f"{line}\r\n" for line in lines)
    return (
        f"GET /stores/customers/keys/{key} HTTP/1.1\r\nhost: kroute\r\n"
        f"x-request-id: {uuid.uuid4().hex}\r\n{extra}\r\n"
    ).encode()


def _forwarded_head(response: bytes) -> bytes:
    """What the node received, as the echo backend tells it."""
    _, _, body = response.partition(b"\r\n\r\n")
    return json.loads(body)["raw"].encode("latin-1")


def _budget_lines(head: bytes) -> list[tuple[bytes, bytes]]:
    return [(name.lower(), value) for name, value in BUDGET_LINE.findall(head)]


def _both(twins: tuple[StandIns, ProxyHandle], raw: bytes) -> tuple[bytes, bytes]:
    stand_ins, twin = twins
    return (send(stand_ins.proxy, raw, head_only=False), send(twin, raw, head_only=False))


KEYED_TARGETS = [
    ("GET", "/stores/customers/keys/plain-{i}", ""),
    ("GET", "/lookup?id=query-{i}", ""),
    ("GET", "/check", "x-card: {i}\r\n"),
]


@pytest.mark.parametrize(("method", "target", "extra"), KEYED_TARGETS)
def test_a_read_asking_for_no_budget_carries_the_configured_one_byte_for_byte(
    budget_twins, method: str, target: str, extra: str
):
    stand_ins, _ = budget_twins
    before = hot_path_count(stand_ins.proxy)
    for i in range(30):
        raw = (
            f"{method} {target.format(i=i)} HTTP/1.1\r\nhost: kroute\r\n"
            f"x-request-id: {uuid.uuid4().hex}\r\n{extra.format(i=i)}\r\n"
        ).encode()
        c_path, python_path = _both(budget_twins, raw)
        assert c_path.startswith(b"HTTP/1.1 200"), c_path[:200]
        assert comparable(c_path) == comparable(python_path)
        assert _budget_lines(_forwarded_head(c_path)) == [
            (b"x-kroute-max-lag", b"50"),
            (b"x-kroute-max-lag-ms", b"600000"),
        ]
    assert hot_path_count(stand_ins.proxy) > before  # the C path's lines were compared


def _strictest(lines: list[str]) -> list[tuple[bytes, bytes]]:
    """The budget lines a node must see: per budget, the strictest of the configured one and
    every one the client sent."""
    limits = dict(CONFIGURED)
    for line in lines:
        name, _, value = line.partition(":")
        limits[name.strip().lower().encode()] = min(
            limits[name.strip().lower().encode()], int(value)
        )
    return [(name, str(limit).encode()) for name, limit in limits.items()]


@pytest.mark.parametrize(
    "lines",
    [
        ["x-kroute-max-lag: 1000"],  # looser than the configured budget
        ["x-kroute-max-lag: 3", "x-kroute-max-lag-ms: 500000"],  # tighter
        # the same header twice, the looser first
        ["x-kroute-max-lag: 1000", "x-kroute-max-lag: 0"],  # the strictest counts
        ["x-kroute-max-lag-ms: 900000", "x-kroute-max-lag-ms: 400000"],
        # another case: the same header (field names are case-insensitive)
        ["X-Kroute-Max-Lag: 1000"],
        ["X-KROUTE-MAX-LAG: 2"],
        ["x-kroute-max-lag: 1000", "X-Kroute-Max-Lag: 1"],
    ],
)
def test_the_node_sees_one_line_per_budget_never_looser_than_asked(budget_twins, lines: list[str]):
    for i in range(3):
        c_path, python_path = _both(budget_twins, _request(f"hostile-{i}", *lines))
        assert comparable(c_path) == comparable(python_path)
        if c_path.startswith(b"HTTP/1.1 400"):
            continue  # refusing an ambiguous budget is as safe as taking the strictest
        assert c_path.startswith(b"HTTP/1.1 200"), c_path[:300]
        assert _budget_lines(_forwarded_head(c_path)) == _strictest(lines)


@pytest.mark.parametrize("value", ["-1", "1e3", "5, 1000", "", "99999999999999999999"])
def test_a_malformed_budget_is_a_400_on_both_paths(budget_twins, value: str):
    c_path, python_path = _both(budget_twins, _request("malformed", f"x-kroute-max-lag: {value}"))
    assert c_path.startswith(b"HTTP/1.1 400"), c_path[:300]
    assert comparable(c_path) == comparable(python_path)


def test_every_try_of_a_failed_over_read_carries_the_same_lines(budget_twins):
    """Every replica answers 421 (not mine): the proxy tries each; each try carries the
    configured budget once, on both paths."""
    stand_ins, twin = budget_twins
    for proxy in (stand_ins.proxy, twin):
        for i in range(5):
            for backend in stand_ins.backends.values():
                backend.requests.clear()
            request_id = uuid.uuid4().hex
            raw = (
                f"GET /stores/customers/keys/failover-{i} HTTP/1.1\r\nhost: kroute\r\n"
                f"x-request-id: {request_id}\r\nx-test-status: 421\r\n\r\n"
            ).encode()
            response = send(proxy, raw, head_only=False)
            assert response.startswith(b"HTTP/1.1 421"), response[:300]
            tries = [
                r
                for b in stand_ins.backends.values()
                for r in b.requests
                if f"x-request-id: {request_id}" in r["raw"]
            ]
            assert len(tries) >= 2, tries  # the active and its standby at least
            for attempt in tries:
                assert _budget_lines(attempt["raw"].encode("latin-1")) == [
                    (b"x-kroute-max-lag", b"50"),
                    (b"x-kroute-max-lag-ms", b"600000"),
                ]


def test_unkeyed_requests_to_foreign_services_carry_no_budget(budget_twins):
    """A pass-through request (no keyed route) reaches a service that may know nothing of
    kroute: it gets no budget lines, and its answer comes back as it was."""
    raw = b"GET /not/a/keyed/route HTTP/1.1\r\nhost: kroute\r\nx-request-id: pass-1\r\n\r\n"
    c_path, python_path = _both(budget_twins, raw)
    assert c_path.startswith(b"HTTP/1.1 200"), c_path[:300]
    assert comparable(c_path) == comparable(python_path)
    assert _budget_lines(_forwarded_head(c_path)) == []
