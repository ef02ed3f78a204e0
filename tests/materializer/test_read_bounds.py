"""Freshness enforced where the data is: the node's ASGI app over a real RocksDB store and a
real LagTracker (its ends set the way a broker's answers set them)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import replace

import httpx
import pytest

from common.clock import now_ms
from materializer.forwarding import Forwarder
from materializer.lag import LagTracker
from materializer.pipeline import Stall
from materializer.read_bounds import PositionWatch
from materializer.server import NodeApp, NodeState
from materializer.sink import IngestStats
from materializer.store import Row, Store
from partitioner import KeyPartitioner, partition
from tests.served_nodes import ServedNode, StandInNode, hosting

PARTITIONS = 6
HOSTED = (0, 1, 2)
KEY = next(f"customer-{i}" for i in range(100) if partition(f"customer-{i}".encode(), 6) == 1)
P = 1  # KEY's partition
PATH = f"/stores/customers/keys/{KEY}"


@pytest.fixture
def state(tmp_path):
    store = Store(tmp_path / "store")
    for p in HOSTED:
        store.add_partition(p)
        rows = [Row(KEY.encode(), b'{"v": "old"}', 7, 1_000)] if p == P else []
        store.apply(p, rows, 8, 1_000)
    node = NodeState(
        node_id="node-a",
        store_name="customers",
        topic="bookings",
        value_format="json",
        store=store,
        lag=LagTracker(store, "bookings", lambda: HOSTED),
        stats=IngestStats(),
        hosting=hosting(HOSTED, role="standby"),
        node=StandInNode(KeyPartitioner("string", "murmur2", PARTITIONS), status={"running": True}),
        min_offset_wait_ms=200,
    )
    node.lag.apply_ends(dict.fromkeys(HOSTED, 8), now_ms())  # caught up
    yield node
    store.close()


async def _get(app: NodeApp, headers: dict[str, str]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        return await client.get(PATH, headers={"x-request-id": uuid.uuid4().hex, **headers})


def get(state: NodeState, **headers: str) -> httpx.Response:
    return asyncio.run(_get(NodeApp(state), {k.replace("_", "-"): v for k, v in headers.items()}))


def fall_behind(state: NodeState, records: int) -> None:
    """The topic's end moves on by `records`; the store stays where it is."""
    state.lag.apply_ends(dict.fromkeys(HOSTED, 8 + records), now_ms())


def write(store: Store, value: str, offset: int) -> None:
    row = Row(KEY.encode(), json.dumps({"v": value}).encode(), offset, 2_000)
    store.apply(P, [row], offset + 1, 2_000)


# -- lag budgets -----------------------------------------------------------------------------


def test_inside_every_budget_the_answer_comes_with_its_position_token(state):
    response = get(state, x_kroute_max_lag="0", x_kroute_max_lag_ms="60000")
    assert response.status_code == 200, response.text
    assert response.json()["value"] == {"v": "old"}
    assert response.headers["x-kroute-position"] == f"{P}:7"  # applied up to offset 7
    assert "x-kroute-refused" not in response.headers


def test_beyond_the_offset_budget_the_node_answers_421_with_its_lag(state):
    fall_behind(state, 50)
    response = get(state, x_kroute_max_lag="10")
    assert response.status_code == 421
    body = response.json()
    assert (body["error"], body["budget"], body["limit"], body["lag"]) == (
        "beyond_budget",
        "max_lag",
        10,
        50,
    )
    assert (body["partition"], body["node"], body["role"]) == (P, "node-a", "standby")
    assert response.headers["x-kroute-refused"] == "lag 50 over budget 10"
    assert response.headers["x-kroute-position"] == f"{P}:7"
    assert get(state, x_kroute_max_lag="50").status_code == 200
    assert get(state).status_code == 200  # no budget asked: no check


def test_the_offset_lag_counts_what_the_store_applied_since_the_last_refresh(state):
    fall_behind(state, 50)
    write(state.store, "new", 57)  # the pipeline applied everything; no refresh since
    response = get(state, x_kroute_max_lag="0")
    assert response.status_code == 200, response.text
    assert response.json()["value"] == {"v": "new"}


def test_beyond_the_time_budget_the_node_answers_421_with_its_time_lag(state):
    state = replace(state, lag=LagTracker(state.store, "bookings", lambda: HOSTED))
    state.lag.apply_ends(dict.fromkeys(HOSTED, 8), now_ms() - 5_000)  # caught up 5 s ago
    state.lag.apply_ends(dict.fromkeys(HOSTED, 9), now_ms())  # one record behind since
    response = get(state, x_kroute_max_lag_ms="1000")
    assert response.status_code == 421
    body = response.json()
    assert body["budget"] == "max_lag_ms"
    assert 5_000 <= body["time_lag_ms"] < 10_000
    assert response.headers["x-kroute-refused"].startswith("time lag 5")
    assert response.headers["x-kroute-refused"].endswith(" ms over budget 1000 ms")
    assert get(state, x_kroute_max_lag_ms="20000").status_code == 200


def test_unknown_lag_is_beyond_any_budget(state):
    # The broker has not been read for 3 s: the end offset is too old to measure lag against.
    state = replace(state, lag=LagTracker(state.store, "bookings", lambda: HOSTED))
    state.lag.apply_ends(dict.fromkeys(HOSTED, 8), now_ms() - 3_000)
    response = get(state, x_kroute_max_lag="1000000")
    assert response.status_code == 421
    assert response.json()["lag"] is None
    assert response.headers["x-kroute-refused"] == "unknown lag"
    assert get(state).status_code == 200


def test_a_stalled_partition_has_unknown_time_lag(state):
    state.node.stalled = {P: Stall(P, 3, now_ms() - 40_000, "frozen")}
    response = get(state, x_kroute_max_lag_ms="1000000")
    assert response.status_code == 421
    assert response.headers["x-kroute-refused"] == "unknown time lag"
    assert get(state, x_kroute_max_lag="0").status_code == 200  # its offsets stay true


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("x-kroute-max-lag", "-1"),
        ("x-kroute-max-lag-ms", "soon"),
        ("x-kroute-min-offset", "1:x"),
        ("x-kroute-min-offset", "-7"),
    ],
)
def test_malformed_freshness_headers_are_400_naming_the_header(state, header, value):
    response = asyncio.run(_get(NodeApp(state), {header: value}))
    assert response.status_code == 400
    body = response.json()
    assert (body["error"], body["header"], body["value"]) == ("bad_header", header, value)
    assert header in body["detail"]


# -- read-your-writes ------------------------------------------------------------------------


def test_a_min_offset_the_store_has_applied_is_answered_at_once(state):
    state = replace(state, min_offset_wait_ms=5_000)  # a wait would show: "at once" is far below
    for bound in ("7", f"{P}:7", f"0:500,{P}:7", "2:900"):  # 2:900 bounds another partition
        started = time.monotonic()
        response = get(state, x_kroute_min_offset=bound)
        assert response.status_code == 200, (bound, response.text)
        assert time.monotonic() - started < 2.5


def test_a_min_offset_not_applied_in_time_is_421_with_the_position_reached(state):
    started = time.monotonic()
    response = get(state, x_kroute_min_offset=f"{P}:8")
    waited = time.monotonic() - started
    assert response.status_code == 421
    body = response.json()
    assert (body["error"], body["min_offset"], body["applied_offset"]) == (
        "position_not_reached",
        8,
        7,
    )
    assert 190 <= body["waited_ms"] <= 3_000
    assert 0.19 <= waited < 3.0
    assert response.headers["x-kroute-refused"] == "position 7 short of min offset 8"
    assert response.headers["x-kroute-position"] == f"{P}:7"


def test_no_wait_at_all_when_the_wait_is_zero(state):
    state = replace(state, min_offset_wait_ms=0)
    started = time.monotonic()
    assert get(state, x_kroute_min_offset="8").status_code == 421
    assert time.monotonic() - started < 0.19  # below the fixture's 200 ms wait


def test_a_write_applied_while_waiting_is_served_and_other_lookups_go_on_meanwhile(state):
    """The wait never blocks the event loop: a lookup without a bound is answered while one
    with a bound waits, and the bounded one gets the write as soon as the store applies it."""
    state = replace(state, min_offset_wait_ms=2_000)
    app = NodeApp(state)

    async def scenario() -> tuple[httpx.Response, float, float, list[float]]:
        loop = asyncio.get_running_loop()
        started = time.monotonic()

        async def bounded() -> tuple[httpx.Response, float]:
            response = await _get(app, {"x-kroute-min-offset": "20"})
            return response, time.monotonic() - started

        waiting = asyncio.create_task(bounded())
        await asyncio.sleep(0.05)
        others = []
        for _ in range(5):
            t0 = time.monotonic()
            assert (await _get(app, {})).json()["value"] == {"v": "old"}
            others.append(time.monotonic() - t0)
        assert not waiting.done()
        # The pipeline's thread applies the batch holding offset 20, 300 ms in.
        await asyncio.sleep(0.3 - (time.monotonic() - started))
        await loop.run_in_executor(None, write, state.store, "written", 20)
        applied_at = time.monotonic() - started
        response, answered_at = await waiting
        return response, applied_at, answered_at, others

    response, applied_at, answered_at, others = asyncio.run(scenario())
    assert response.status_code == 200, response.text
    assert response.json()["value"] == {"v": "written"}
    assert response.headers["x-kroute-position"] == f"{P}:20"
    assert applied_at <= answered_at < applied_at + 0.1  # woken within a poll or two
    assert max(others) < 0.1


def test_the_position_token_of_an_answer_is_never_older_than_the_value_it_shows(state):
    write(state.store, "v30", 30)
    response = get(state)
    token = response.headers["x-kroute-position"]
    assert token == f"{P}:30"
    assert response.json()["offset"] == 30
    again = get(state, x_kroute_min_offset=token)
    assert again.status_code == 200
    assert again.json()["offset"] >= response.json()["offset"]


# -- forwarding ------------------------------------------------------------------------------


def test_a_forwarded_lookup_carries_its_bounds_to_the_owner(state, tmp_path):
    """A node whose view of the owners is stale forwards; the owner must check the bounds
    (else a stale table plus one hop would serve beyond the budget)."""
    owner = ServedNode("owner", tmp_path, PARTITIONS).start()
    owner.write(P, KEY, {"v": "owner's"}, 10)
    owner.set_end(P, 500)  # the owner is 489 behind
    state.hosting.assign({0: "standby", 2: "standby"}, now_ms())  # P is not: forwarded
    state.node.owner = owner.url

    async def both() -> tuple[httpx.Response, httpx.Response]:
        state.node.forwarder = Forwarder("node-a")
        app = NodeApp(state)
        try:
            refused = await _get(app, {"x-kroute-max-lag": "10"})
            within = await _get(app, {"x-kroute-max-lag": "1000", "x-kroute-min-offset": "10"})
        finally:
            await state.node.forwarder.close()
        return refused, within

    try:
        refused, within = asyncio.run(both())
    finally:
        owner.stop()
    assert refused.status_code == 421
    assert refused.headers["x-kroute-refused"] == "lag 489 over budget 10"
    assert refused.headers["x-kroute-forwarded-by"] == "node-a"
    assert refused.headers["x-kroute-node"] == "owner"
    assert within.status_code == 200, within.text
    assert within.json()["value"] == {"v": "owner's"}
    assert within.headers["x-kroute-position"] == f"{P}:10"


def test_one_poll_loop_serves_every_waiting_lookup():
    """200 lookups waiting on one partition cost one store read per poll, not 200."""
    reads = 0
    position = {"now": 5}

    def read(_partition: int) -> int:
        nonlocal reads
        reads += 1
        return position["now"]

    watch = PositionWatch(read, poll_s=0.01)

    async def scenario() -> list[int]:
        waits = [asyncio.create_task(watch.wait(1, 9, 5.0)) for _ in range(200)]
        waits += [asyncio.create_task(watch.wait(1, 50, 0.2))]  # never reached: times out
        await asyncio.sleep(0.3)
        position["now"] = 10
        return list(await asyncio.gather(*waits))

    started = time.monotonic()
    reached = asyncio.run(scenario())
    assert reached[:200] == [10] * 200
    # Gave up at its 0.2 s timeout short of 50, at the position then (5, or 10 when a busy
    # loop woke it only after the store moved at 0.3 s).
    assert reached[200] in (5, 10)
    # The 200 were woken by the store moving, not by their own 5 s timeouts.
    assert time.monotonic() - started < 4.0
    # 201 reads up front and at the ends, plus about one per 10 ms poll over 0.3 s.
    assert reads < 201 * 2 + 60, reads
