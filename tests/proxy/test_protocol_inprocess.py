"""The proxy's forwarding behaviour, in-process and in milliseconds (issue 21 item 3).

Each test drives a whole proxy (`proxy.main.Proxy`) through fake transports: clients and
nodes are scripted in memory (tests/proxy/inprocess.py), and every test runs on both paths, the
C path on (it serves what it can: a read after `warm` is forwarded by C, and anything it cannot
finish is adopted by the Python exchange) and off. Every request carries its own id, checked
at the node and in the answer. What needs real sockets stays in test_proxy_loopback.py and
test_backpressure.py.
"""

from __future__ import annotations

import time

import pytest

from proxy.upstream import STREAM_AFTER_BYTES
from tests.proxy.inprocess import (
    EARLY_HINTS,
    NODES,
    Answer,
    InProcessProxy,
    answer,
    get,
    key_in,
    owners,
    run,
    unique_id,
)
from tests.proxy.third_party import PATHS

ON_BOTH_PATHS = pytest.mark.parametrize("path", PATHS)
TRY_TIMEOUT_S = 0.05


def assert_answered_by(reply: Answer, node: str, request_id: str, *, role: str) -> None:
    """The node's own answer, passed on with the proxy's provenance and the request's id."""
    assert reply.status == 200, reply
    assert reply.header("x-backend") == node
    assert reply.header("x-echo-id") == request_id  # the node saw the client's id
    assert reply.header("x-request-id") == request_id
    assert reply.header("x-kroute-node") == node
    assert reply.header("x-kroute-role") == role
    assert reply.body == f'{{"node": "{node}", "id": "{request_id}"}}'.encode()


def assert_forwarded_by(proxy: InProcessProxy, path: str, forwarded_before: int) -> None:
    """The request under test took the path under test: with the hub on the C path forwarded
    it (whatever then took over), with it off nothing ever went through C."""
    if path == "c":
        assert proxy.forwarded_in_c == forwarded_before + 1
    else:
        assert proxy.forwarded_in_c == 0


@ON_BOTH_PATHS
def test_a_keyed_read_is_answered_by_its_partitions_active_with_provenance(path: str) -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        for partition in range(3):
            before = await proxy.warm(partition)
        client = proxy.connect()
        ids = [unique_id(f"read-{p}") for p in range(3)]
        for count, (partition, rid) in enumerate(zip(range(3), ids, strict=True), start=1):
            client.send(get(key_in(partition), rid))  # one at a time, on one connection
            reply = (await proxy.answers(client, count))[-1]
            active = owners(partition)[0]
            assert_answered_by(reply, active, rid, role="active")
            assert reply.header("x-kroute-partition") == str(partition)
            assert reply.header("x-kroute-lag") == "0"
            assert reply.header("x-kroute-attempts") is None
            [seen] = [r for r in proxy.nodes[active].requests if r.request_id == rid]
            assert seen.headers["x-forwarded-for"] == "127.0.0.1"
            assert_forwarded_by(proxy, path, before)
            before = proxy.forwarded_in_c

    run(path, scenario)


@ON_BOTH_PATHS
@pytest.mark.parametrize("failure", ["reset", "down"])
def test_an_active_that_fails_before_answering_is_ejected_and_the_standby_answers(
    path: str, failure: str
) -> None:
    """ "reset": the active closes each connection unanswered (the kept one too: resent once,
    then failed over); "down": it is gone and refuses new connections."""

    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(0)
        active, standby = owners(0)[:2]
        if failure == "down":
            proxy.nodes[active].kill()
        else:
            proxy.nodes[active].mode = "reset"
        client = proxy.connect()
        rid = unique_id("failover")
        client.send(get(key_in(0), rid))
        [reply] = await proxy.answers(client, 1)
        assert_answered_by(reply, standby, rid, role="standby")
        assert reply.header("x-kroute-attempts") == "2"
        assert proxy.ejected == {active}
        assert proxy.metrics.failovers == 1
        if failure == "reset":
            # On the kept connection (closed unanswered: resent once), then on a new one.
            assert proxy.nodes[active].ids().count(rid) == 2
            assert proxy.metrics.resent_after_kept_close == 1
            assert proxy.metrics.node_failures == {(active, "connection_reset"): 1}
            assert_forwarded_by(proxy, path, before)
        else:
            assert proxy.metrics.node_failures == {(active, "connect_failed"): 1}
        # (a dead node has no idle connection: the C path leaves the request to Python)

    run(path, scenario)


@ON_BOTH_PATHS
def test_a_hung_active_times_out_and_the_standby_answers(path: str) -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(0)
        active, standby = owners(0)[:2]
        proxy.nodes[active].mode = "hold"  # takes the request, never answers
        client = proxy.connect()
        rid = unique_id("hung")
        started = time.monotonic()
        client.send(get(key_in(0), rid))
        [reply] = await proxy.answers(client, 1)
        elapsed = time.monotonic() - started
        assert_answered_by(reply, standby, rid, role="standby")
        assert reply.header("x-kroute-attempts") == "2"
        assert [held.request_id for held in proxy.nodes[active].held] == [rid]
        assert TRY_TIMEOUT_S <= elapsed < TRY_TIMEOUT_S + 1.0  # one per-try timeout, then on
        assert proxy.ejected == {active}
        assert proxy.metrics.node_failures == {(active, "timeout"): 1}
        assert_forwarded_by(proxy, path, before)

    run(path, scenario, per_try_timeout_ms=int(TRY_TIMEOUT_S * 1000))


@ON_BOTH_PATHS
def test_a_421_from_the_active_is_asked_of_the_next_replica_without_ejecting(path: str) -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(1)
        active, standby = owners(1)[:2]
        proxy.nodes[active].mode = "421"
        client = proxy.connect()
        rid = unique_id("misdirected")
        client.send(get(key_in(1), rid))
        [reply] = await proxy.answers(client, 1)
        assert_answered_by(reply, standby, rid, role="standby")
        assert reply.header("x-kroute-attempts") == "2"
        assert rid in proxy.nodes[active].ids()
        assert proxy.metrics.misdirected == {active: 1}
        assert proxy.ejected == frozenset()  # it answered: about one partition, not itself
        assert proxy.table_refreshes == 1  # "not mine": the table may be out of date
        assert_forwarded_by(proxy, path, before)

    run(path, scenario)


@ON_BOTH_PATHS
def test_when_every_replica_answers_421_the_last_answer_is_passed_on(path: str) -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(2)
        for node in NODES:
            proxy.nodes[node].mode = "421"
        client = proxy.connect()
        rid = unique_id("all-421")
        client.send(get(key_in(2), rid))
        [reply] = await proxy.answers(client, 1)
        last = owners(2)[-1]
        assert reply.status == 421  # "not mine" from everyone: the node's own answer
        assert reply.header("x-backend") == last
        assert reply.header("x-request-id") == rid
        assert reply.header("x-kroute-attempts") == "3"
        assert all(rid in proxy.nodes[node].ids() for node in NODES)
        assert proxy.ejected == frozenset()
        assert_forwarded_by(proxy, path, before)

    run(path, scenario)


@ON_BOTH_PATHS
def test_when_every_replica_refuses_the_budget_the_proxy_answers_503_naming_each(
    path: str,
) -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(0)
        for node in NODES:
            proxy.nodes[node].mode = "refuse"
        client = proxy.connect()
        rid = unique_id("all-refuse")
        client.send(get(key_in(0), rid))
        [reply] = await proxy.answers(client, 1)
        assert reply.status == 503
        assert reply.header("x-request-id") == rid
        assert b'"error":"beyond_budget"' in reply.body.replace(b" ", b"")
        for node in NODES:
            assert rid in proxy.nodes[node].ids()
            assert proxy.nodes[node].requests[-1].headers["x-kroute-max-lag"] == "10"
            assert f'"node":"{node}","outcome":"421:'.encode() in reply.body.replace(b" ", b"")
        assert proxy.ejected == frozenset()
        assert proxy.table_refreshes == 0  # the table is right: the replicas are behind
        assert_forwarded_by(proxy, path, before)

    run(path, scenario, max_lag=10)


@ON_BOTH_PATHS
def test_a_kept_connection_closed_unanswered_is_resent_once_to_the_same_node(path: str) -> None:
    """The node's keep-alive timeout closing a pooled connection as the request goes out is
    not the node failing: a new connection to the same node, no failover, no ejection."""

    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(0)
        active = owners(0)[0]
        node = proxy.nodes[active]
        node.mode = "close-kept"
        client = proxy.connect()
        rid = unique_id("kept-close")
        client.send(get(key_in(0), rid))
        [reply] = await proxy.answers(client, 1)
        assert_answered_by(reply, active, rid, role="active")
        assert reply.header("x-kroute-attempts") is None
        assert node.ids().count(rid) == 2  # on the kept connection, then on a new one
        assert len(node.connections) == 2
        assert proxy.metrics.resent_after_kept_close == 1
        assert proxy.metrics.failovers == 0
        assert proxy.ejected == frozenset()
        assert_forwarded_by(proxy, path, before)

    run(path, scenario)


@ON_BOTH_PATHS
def test_interim_answers_are_absorbed_and_the_final_one_forwarded(path: str) -> None:
    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(0)
        active = owners(0)[0]
        node = proxy.nodes[active]
        client = proxy.connect()
        # 103 and 100 before the 200, all in one read.
        node.mode = "interim"
        first = unique_id("interim-one-read")
        client.send(get(key_in(0), first))
        [reply] = await proxy.answers(client, 1)
        assert_answered_by(reply, active, first, role="active")
        assert_forwarded_by(proxy, path, before)
        before = proxy.forwarded_in_c
        # A 103 alone, then the answer in a later read: nothing reaches the client between.
        node.mode = "hold"
        second = unique_id("interim-two-reads")
        client.send(get(key_in(0), second))
        await proxy.until(lambda: node.held, "the request held")
        held = node.held.pop()
        written = client.received_bytes
        held.connection.send(EARLY_HINTS.encode())
        await proxy.settle()
        assert client.received_bytes == written
        held.connection.send(answer(active, second))
        replies = await proxy.answers(client, 2)
        assert_answered_by(replies[1], active, second, role="active")
        assert client.interim == []  # no 1xx ever reached the client
        assert_forwarded_by(proxy, path, before)

    run(path, scenario)


@ON_BOTH_PATHS
def test_pipelined_requests_are_answered_in_order(path: str) -> None:
    """Three requests for three partitions (three nodes): the first alone (the C path forwards
    it, when on), the other two in one read while it is out; the first node is the slowest.
    The answers still come in the order asked, each to its own request."""

    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(0)
        first_node = proxy.nodes[owners(0)[0]]
        first_node.mode = "hold"
        client = proxy.connect()
        ids = [unique_id(f"pipelined-{p}") for p in range(3)]
        client.send(get(key_in(0), ids[0]))
        await proxy.until(lambda: first_node.held, "the first request held")
        client.send(get(key_in(1), ids[1]) + get(key_in(2), ids[2]))
        await proxy.settle()
        assert client.answers == []  # the later ones wait their turn
        held = first_node.held.pop()
        assert held.request_id == ids[0]
        held.connection.send(answer(first_node.node_id, ids[0]))
        replies = await proxy.answers(client, 3)
        for partition, (reply, rid) in enumerate(zip(replies, ids, strict=True)):
            assert_answered_by(reply, owners(partition)[0], rid, role="active")
        assert_forwarded_by(proxy, path, before)

    run(path, scenario)


@ON_BOTH_PATHS
def test_a_client_that_stops_reading_pauses_the_node_streaming_to_it(path: str) -> None:
    """An answer longer than the proxy buffers is streamed; once the client's unsent bytes pass
    the high-water mark, the node's connection is no longer read (nor the client's), until
    the client takes them. The answer then completes, whole."""

    async def scenario(proxy: InProcessProxy) -> None:
        before = await proxy.warm(0)
        active = owners(0)[0]
        node = proxy.nodes[active]
        node.mode = "hold"
        client = proxy.connect()
        rid = unique_id("streamed")
        client.send(get(key_in(0), rid))
        await proxy.until(lambda: node.held, "the request held")
        held = node.held.pop()
        upstream = held.connection.transport
        assert upstream is not None
        piece = 2 * STREAM_AFTER_BYTES
        body = bytes(range(256)) * (3 * piece // 256)
        head = answer(active, rid, body=body).split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        client.transport.stall()
        held.connection.send(head + body[:piece])  # over the buffer: streamed
        await proxy.until(lambda: not upstream.reading, "the node's connection paused")
        assert client.transport.writing_paused
        assert not client.transport.reading  # nor is the client read while it is behind
        written = client.received_bytes
        assert written < len(body)
        held.connection.send(body[piece : 2 * piece])  # held in the paused transport
        await proxy.settle()
        assert client.received_bytes == written
        client.transport.drain()  # the client reads again
        await proxy.until(lambda: upstream.reading, "the node's connection resumed")
        held.connection.send(body[2 * piece :])
        [reply] = await proxy.answers(client, 1)
        assert reply.status == 200
        assert reply.header("x-request-id") == rid
        assert reply.body == body
        assert client.transport.reading
        assert proxy.metrics.streamed == 1
        assert_forwarded_by(proxy, path, before)

    run(path, scenario)
