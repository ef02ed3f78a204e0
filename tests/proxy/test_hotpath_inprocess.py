"""The C path against the Python path, in-process: every route kind and setting C serves.

The real-socket differential (test_hotpath.py) generates requests and answers against the
default route; this one goes over the C/Python boundary (proxy.hotpath_spec) case by case: each
route kind C serves (key in the path with the store in the path or named by the route, key in
a query parameter, key in a header, a route with its own partitioner), an unkeyed request, a
route C is told not to serve, and each setting the C path honours (spread, the lag budgets it
passes to nodes, retry statuses, 5xx counted for ejection or not, the header, header-count and
response-size limits). Each case runs twice on a whole in-process proxy (tests/proxy/inprocess.py),
the C path on and off, and both give the same bytes, to the client and to the nodes (modulo
generated request ids and the time-lag value). On the C path each request of a served route is
sent twice, and the second must have been forwarded by C: otherwise the comparison would be of
Python with itself.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from partitioner import KeyPartitioner
from proxy.hotpath_spec import hot_routes
from tests.proxy.inprocess import (
    NODES,
    STORE,
    WAIT_S,
    Client,
    FakeNode,
    InProcessProxy,
    NodeRequest,
    answer,
    owners,
    run,
)

ROUTES = [
    {"path": "/stores/{store}/keys/{key}"},  # key and store in the path
    {"path": "/c/{key}", "store": "customers"},  # key in the path, store named by the route
    {"path": "/lookup", "store": "customers", "key": "query:id"},
    {"path": "/check", "store": "customers", "key": "header:x-card"},
    {"path": "/raw/{key}", "store": "customers", "partitioner": "crc32"},  # its own partitioner
    {"path": "/not-in-c/{key}", "store": "customers"},  # passed to C with c_serves False
]
NOT_IN_C_PREFIX = "/not-in-c/"
KEYS = ("alice", "bob", "carol", "dave")
GENERATED_ID = re.compile(rb"\b[0-9a-f]{8}-[0-9a-f]+\b")  # a proxy-made request id
CONTENT_LENGTH = re.compile(rb"(?im)^content-length: *\d+\r\n")
TIME_LAG = re.compile(rb"(?im)^(x-kroute-time-lag-ms: )\d+\r\n")
ANSWER_START = re.compile(rb"(?=HTTP/1\.1 \d{3} )")


def request(target: str, request_id: str | None, *, extra: str = "", method: str = "GET") -> bytes:
    rid = "" if request_id is None else f"x-request-id: {request_id}\r\n"
    return f"{method} {target} HTTP/1.1\r\nhost: proxy.test\r\n{rid}{extra}\r\n".encode()


def route_requests(key: str, rid: str) -> list[bytes]:
    """One request of each route kind for `key` (the headers each needs included)."""
    return [
        request(f"/stores/customers/keys/{key}", rid + "-p"),
        request(f"/c/{key}", rid + "-f"),
        request(f"/lookup?id={key}", rid + "-q"),
        request("/check", rid + "-h", extra=f"x-card: {key}\r\n"),
        request(f"/raw/{key}", rid + "-r"),
        request(f"/stores/customers/keys/{key}", None, method="HEAD"),  # a generated id
    ]


def served_by_c(raw: bytes) -> bool:
    """Whether the C path forwards this request once its choice is cached: a keyed route C
    serves (the route marked c_serves False and unkeyed requests are Python's)."""
    target = raw.split(b" ", 2)[1].decode()
    return not target.startswith(NOT_IN_C_PREFIX) and target != "/"


@dataclass(frozen=True)
class Case:
    settings: dict[str, Any] = field(default_factory=dict)
    requests: Callable[[str], list[bytes]] = lambda rid: [
        raw for key in KEYS[:2] for raw in route_requests(key, f"{rid}-{key}")
    ]
    node_answer: Callable[[str, str], bytes] = answer  # (node, request id) -> its answer
    c_forwards: Callable[[bytes], bool] = served_by_c  # the second send is forwarded by C
    # False (spread): which replica answers which request is not compared, as the two paths
    # rotate with counters of their own; the answers are compared as multisets without the
    # replica's name, and each path must have spread them over every replica.
    in_order: bool = True


def answer_500(node: str, rid: str) -> bytes:
    return answer(node, rid, 500)


def large_answer(node: str, rid: str) -> bytes:
    """Over max_response_bytes=1024 for the fixed-store route's reads (the others are not:
    Python does not keep a connection whose answer was too large, and C needs one)."""
    return answer(node, rid, body=b"x" * 2048) if rid.endswith("-f") else answer(node, rid)


def active_421(node: str, rid: str) -> bytes:
    """The first node of a partition's order answers 421 (not mine), the others 200."""
    return answer(node, rid, 421 if node == NODES[0] else 200)


def header_lines(count: int) -> str:
    return "".join(f"x-extra-{i}: {i}\r\n" for i in range(count))


def limit_requests(extra_at: int, extra_over: int) -> Callable[[str], list[bytes]]:
    """Keyed reads just inside a request limit (C serves them) and just over it (Python
    refuses them, on both paths alike)."""

    def build(rid: str) -> list[bytes]:
        inside = request("/stores/customers/keys/alice", rid + "-in", extra=header_lines(extra_at))
        over = request("/stores/customers/keys/bob", rid + "-out", extra=header_lines(extra_over))
        return [inside, over]

    return build


def inside_limit(raw: bytes) -> bool:
    return b"-in\r\n" in raw


CASES = {
    "defaults": Case(),
    "spread": Case(
        settings={"spread": True},
        requests=lambda rid: [request(f"/c/{KEYS[0]}", f"{rid}-{i}") for i in range(6)],
        in_order=False,
    ),
    "max_lag": Case(settings={"max_lag": 10}),  # the budget lines C adds to node requests
    "max_lag_ms": Case(settings={"max_lag_ms": 60_000, "max_lag": 5}),
    "retry_status_421": Case(node_answer=active_421),  # C forwards, Python fails over
    "retry_statuses_none": Case(settings={"retry_statuses": ""}, node_answer=active_421),
    "5xx_counted_for_ejection": Case(
        settings={"eject_consecutive_5xx": 1000}, node_answer=answer_500
    ),
    "5xx_not_counted": Case(settings={"eject_consecutive_5xx": 0}, node_answer=answer_500),
    "max_headers": Case(
        settings={"max_headers": 6}, requests=limit_requests(4, 5), c_forwards=inside_limit
    ),
    "max_header_bytes": Case(
        settings={"max_header_bytes": 300},
        requests=limit_requests(6, 20),
        c_forwards=inside_limit,
    ),
    "max_response_bytes": Case(settings={"max_response_bytes": 1024}, node_answer=large_answer),
}


@dataclass
class Transcript:
    client: list[bytes]  # the answers the client read, in order
    nodes: dict[str, list[bytes]]  # per node, the requests it received, in order
    sent: list[tuple[bytes, bool]]  # per request sent: it, and whether C forwarded it


REPLICA = re.compile(
    rb"(?im)^(x-backend|x-kroute-node|x-kroute-role|host): [^\r]*\r\n|\"node\": \"[a-c]\""
)


def without_replica(data: bytes) -> bytes:
    """Without the name, role and address of the replica that answered."""
    return REPLICA.sub(b"REPLICA", data)


def comparable(data: bytes) -> bytes:
    """Without what may differ between two proxies: generated ids (and so lengths) and the
    time-lag values (not whether they are there)."""
    data = TIME_LAG.sub(rb"\1N\r\n", data)
    return CONTENT_LENGTH.sub(b"", GENERATED_ID.sub(b"ID", data))


def answers_begun(client: Client) -> int:
    """Answers the proxy began to write (a parser would wait for a HEAD answer's body)."""
    return len(ANSWER_START.findall(bytes(client.transport.written)))


def node_requests(proxy: InProcessProxy, node: str) -> list[bytes]:
    """The request heads a node received (each connection's, in connection order)."""
    heads: list[bytes] = []
    for connection in proxy.nodes[node].connections:
        assert connection.transport is not None
        written = bytes(connection.transport.written)
        heads += [head + b"\r\n\r\n" for head in written.split(b"\r\n\r\n") if head]
    return heads


async def forwarded_by_c(proxy: InProcessProxy, client: Client, raw: bytes) -> bool:
    """Send one request, wait for its whole answer; whether the C path forwarded it."""
    before = proxy.forwarded_in_c
    wanted = answers_begun(client) + 1  # counted by status lines: see answers_begun
    client.send(raw)
    await proxy.until(lambda: answers_begun(client) >= wanted, f"{wanted} answers")
    await proxy.settle()  # the rest of the answer, and anything else it set off
    return proxy.forwarded_in_c > before


def transcript(path: str, case: Case) -> Transcript:
    """The case run on a fresh in-process proxy with the C path on ("c") or off."""
    result = Transcript([], {}, [])

    async def scenario(proxy: InProcessProxy) -> None:
        hub = proxy.proxy.hub
        routes = hot_routes(proxy.proxy.handler.routes.routes)
        hub.set_routes(
            [replace(r, c_serves=False) if r.literals == ((0, b"not-in-c"),) else r for r in routes]
        )
        for node in proxy.nodes.values():
            node.react = _reacting(node, case.node_answer)  # type: ignore[method-assign,assignment]
        clients = [proxy.connect()]
        # Unkeyed reads first (round robin: each node gets an idle pooled connection), then
        # each request twice: the first may fill the choice cache, the second is C's.
        plain = [request("/", f"plain-{n}") for n in NODES]
        keyed = [*case.requests("req"), request(f"{NOT_IN_C_PREFIX}alice", "not-in-c")]
        for raw in plain + [raw for raw in keyed for _ in range(2)]:
            if clients[-1].transport.closing or clients[-1].transport.eof_written:  # a refusal
                clients.append(proxy.connect())
            result.sent.append((raw, await forwarded_by_c(proxy, clients[-1], raw)))
        for client in clients:
            written = bytes(client.transport.written)
            result.client += [answer for answer in ANSWER_START.split(written) if answer]
        result.nodes = {node: node_requests(proxy, node) for node in NODES}

    run(path, scenario, routes=json.dumps(ROUTES), **case.settings)
    return result


def last_method(request: NodeRequest) -> bytes:
    """The method of the request a node connection received last (one at a time)."""
    transport = request.connection.transport
    assert transport is not None
    heads = [head for head in bytes(transport.written).split(b"\r\n\r\n") if head]
    return heads[-1].split(b" ", 1)[0]


def _reacting(node: FakeNode, make: Callable[[str, str], bytes]) -> Callable[[NodeRequest], None]:
    """A node's reaction that answers with `make`, and a HEAD with the head alone."""

    def react(request: NodeRequest) -> None:
        request.connection.answered += 1
        reply = make(node.node_id, request.request_id)
        if last_method(request) == b"HEAD":
            reply = reply.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        request.connection.send(reply)

    return react


@pytest.mark.parametrize("case_name", list(CASES))
def test_the_c_path_and_the_python_path_give_the_same_bytes(case_name: str) -> None:
    case = CASES[case_name]
    from_c = transcript("c", case)
    from_python = transcript("python", case)
    assert not any(by_c for _, by_c in from_python.sent)
    # The C path forwarded one of the two sends of every request it serves (the second, or
    # the first when its choice was cached already: a HEAD's connection is not reused), and
    # nothing that is not one (unkeyed, the route marked c_serves False, over a limit).
    pairs = zip(from_c.sent[len(NODES) :: 2], from_c.sent[len(NODES) + 1 :: 2], strict=True)
    for (raw, first_by_c), (_, second_by_c) in pairs:
        assert (first_by_c or second_by_c) == case.c_forwards(raw), raw
    assert not any(by_c for _, by_c in from_c.sent[: len(NODES)])
    if case.in_order:
        assert_same_in_order(from_c, from_python)
    else:
        assert_same_spread(from_c, from_python)


def assert_same_in_order(from_c: Transcript, from_python: Transcript) -> None:
    assert [comparable(a) for a in from_c.client] == [comparable(a) for a in from_python.client]
    for node in NODES:
        assert [comparable(r) for r in from_c.nodes[node]] == [
            comparable(r) for r in from_python.nodes[node]
        ], node


def assert_same_spread(from_c: Transcript, from_python: Transcript) -> None:
    """Both spread the keyed reads over every replica, and the answers and the requests to
    the nodes are the same but for which replica took which."""
    for taken in (from_c, from_python):
        keyed = [len(taken.nodes[node]) - 1 for node in NODES]  # each had one unkeyed read
        assert min(keyed) >= len(taken.sent) // (2 * len(NODES)), keyed

    def anonymous(items: list[bytes]) -> list[bytes]:
        return sorted(without_replica(comparable(item)) for item in items)

    assert anonymous(from_c.client) == anonymous(from_python.client)
    to_nodes_c = [r for node in NODES for r in from_c.nodes[node]]
    to_nodes_python = [r for node in NODES for r in from_python.nodes[node]]
    assert anonymous(to_nodes_c) == anonymous(to_nodes_python)


def draining_answer(path: str) -> tuple[bytes, bool]:
    """What a client reads of a keyed read in flight when the proxy begins to stop
    (Listener.shutdown sets Hub.draining), and whether the C path forwarded it."""
    key = "alice"
    partition = KeyPartitioner(STORE.key_format, STORE.partitioner, STORE.partitions)
    active = owners(partition.partition_of(key))[0]
    result: list[tuple[bytes, bool]] = []

    async def scenario(proxy: InProcessProxy) -> None:
        client = proxy.connect()
        await forwarded_by_c(proxy, client, request(f"/c/{key}", "warm"))
        node, before = proxy.nodes[active], proxy.forwarded_in_c
        node.mode = "hold"
        client.send(request(f"/c/{key}", "drained"))
        await proxy.until(lambda: node.held, "the node holds the read")
        forwarded = proxy.forwarded_in_c > before
        stopping = asyncio.ensure_future(proxy.proxy.listener.shutdown(WAIT_S))
        await proxy.settle()
        held = node.held.pop()
        held.connection.send(answer(active, held.request_id))
        await stopping
        result.append((bytes(client.transport.written), forwarded))

    run(path, scenario, routes=json.dumps(ROUTES))
    return result[0]


def test_an_answer_in_flight_while_the_proxy_stops_is_the_same_on_both_paths() -> None:
    from_c, forwarded = draining_answer("c")
    from_python, forwarded_in_python = draining_answer("python")
    assert forwarded
    assert not forwarded_in_python
    assert b"connection: close\r\n" in from_c.split(b"x-request-id: drained")[-1]
    assert comparable(from_c) == comparable(from_python)
