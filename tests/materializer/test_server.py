"""The node's HTTP API in-process (ASGI) over a real RocksDB store."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest

from common.clock import now_ms
from materializer.lag import LagTracker
from materializer.pipeline import Stall
from materializer.server import NodeApp, NodeState
from materializer.sink import IngestStats
from materializer.store import Row, Store
from partitioner import KeyPartitioner, partition
from tests.served_nodes import StandInNode, hosting

NUM_PARTITIONS = 6


def partition_of(key: str) -> int:
    return partition(key.encode(), NUM_PARTITIONS)


def a_key_not_in(hosted: tuple[int, ...]) -> str:
    return next(f"k{i}" for i in range(1000) if partition_of(f"k{i}") not in hosted)


def forget_the_ends(state: NodeState) -> NodeState:
    """As just after a start: positions known from the store, the topic's ends not read yet."""
    state = replace(state, lag=LagTracker(state.store, "bookings", lambda: state.hosted))
    state.lag.refresh_offsets_only()
    return state


@pytest.fixture
def node_state(tmp_path):
    store = Store(tmp_path / "store")
    hosted = (0, 1, 2)
    for p in hosted:
        store.add_partition(p)
    keys = [f"customer-{i}" for i in range(50)]
    for key in keys:
        p = partition_of(key)
        if p in hosted:
            store.apply(
                p, [Row(key.encode(), json.dumps({"name": key}).encode(), 7, 1_000)], 8, 1_000
            )
    state = NodeState(
        node_id="node-a",
        store_name="customers",
        topic="bookings",
        value_format="json",
        store=store,
        lag=LagTracker(store, "bookings", lambda: hosted),
        stats=IngestStats(),
        hosting=hosting(hosted),
        node=StandInNode(
            KeyPartitioner("string", "murmur2", NUM_PARTITIONS), status={"running": True}
        ),
    )
    state.lag.apply_ends(dict.fromkeys(hosted, 8), now_ms())
    yield state
    store.close()


def get(state: NodeState, path: str, method: str = "GET") -> httpx.Response:
    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=NodeApp(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            return await client.request(method, path)

    return asyncio.run(call())


def hosted_key(state: NodeState) -> str:
    return next(f"customer-{i}" for i in range(50) if partition_of(f"customer-{i}") in state.hosted)


def test_lookup_returns_the_value_and_where_it_came_from(node_state):
    key = hosted_key(node_state)
    response = get(node_state, f"/stores/customers/keys/{key}")
    assert response.status_code == 200
    body = response.json()
    assert body["value"] == {"name": key}
    assert (body["partition"], body["node"], body["role"], body["offset"]) == (
        partition_of(key),
        "node-a",
        "active",
        7,
    )
    assert body["position"] == 8
    assert response.headers["x-kroute-partition"] == str(partition_of(key))
    assert response.headers["x-kroute-node"] == "node-a"


def test_absent_key_is_404_with_its_partition(node_state):
    key = next(
        f"nobody-{i}" for i in range(100) if partition_of(f"nobody-{i}") in node_state.hosted
    )
    response = get(node_state, f"/stores/customers/keys/{key}")
    assert response.status_code == 404
    assert response.json()["error"] == "key_not_found"
    assert response.json()["partition"] == partition_of(key)


def test_before_the_node_knows_how_far_behind_it_is_a_lookup_is_421_not_ready(node_state):
    # Just started (or restoring a lost store) with the broker not read yet: a 404 could be
    # a key the store has not reached. 421 makes a proxy ask another replica.
    node_state = forget_the_ends(node_state)
    key = hosted_key(node_state)
    response = get(node_state, f"/stores/customers/keys/{key}")
    assert response.status_code == 421
    assert response.json()["error"] == "not_ready"
    assert response.json()["partition"] == partition_of(key)


def test_key_of_a_partition_not_hosted_is_421(node_state):
    key = a_key_not_in(node_state.hosted)
    response = get(node_state, f"/stores/customers/keys/{key}")
    assert response.status_code == 421
    assert response.json()["partition"] == partition_of(key)
    assert response.json()["hosted"] == [0, 1, 2]


def test_unknown_store_is_404(node_state):
    response = get(node_state, "/stores/orders/keys/x")
    assert response.status_code == 404
    assert response.json() == {"error": "unknown_store", "store": "orders", "stores": ["customers"]}


def test_malformed_key_is_400_saying_why(node_state):
    node_state.node.partitioner = KeyPartitioner("int64", "murmur2", NUM_PARTITIONS)
    response = get(node_state, "/stores/customers/keys/forty-two")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_key"
    assert "decimal integer" in response.json()["detail"]


def test_percent_encoded_keys_are_decoded_and_invalid_utf8_is_refused(node_state):
    key = next(f"a/b {i}" for i in range(100) if partition_of(f"a/b {i}") in node_state.hosted)
    node_state.store.apply(partition_of(key), [Row(key.encode(), b'"slash"', 9, None)], 10, None)
    encoded = key.replace("/", "%2F").replace(" ", "%20")
    assert get(node_state, f"/stores/customers/keys/{encoded}").json()["value"] == "slash"
    bad = get(node_state, "/stores/customers/keys/%FF%FE")
    assert bad.status_code == 400
    assert bad.json()["error"] == "invalid_path"


def test_only_get_is_allowed(node_state):
    response = get(node_state, "/stores/customers/keys/x", method="POST")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET"


def test_unknown_path_is_a_json_404(node_state):
    response = get(node_state, "/admin")
    assert response.status_code == 404
    assert response.json()["error"] == "not_found"


def test_metadata_lists_hosted_partitions(node_state):
    body = get(node_state, "/metadata").json()
    assert [p["partition"] for p in body["partitions"]] == [0, 1, 2]
    assert body["num_partitions"] == NUM_PARTITIONS
    assert all(p["role"] == "active" for p in body["partitions"])


def test_not_ready_until_every_partition_caught_up_once(node_state):
    node_state = forget_the_ends(node_state)
    response = get(node_state, "/health/ready")
    assert response.status_code == 503  # no end offsets read yet
    assert response.json()["catching_up"] == [0, 1, 2]
    assert get(node_state, "/health/live").status_code == 200


def test_string_and_bytes_values(node_state):
    key = hosted_key(node_state)
    node_state.store.apply(partition_of(key), [Row(key.encode(), b"\xff\x00", 20, None)], 21, None)
    node_state = replace(node_state, value_format="bytes")
    assert get(node_state, f"/stores/customers/keys/{key}").json()["value"] == "/wA="
    node_state.store.apply(
        partition_of(key), [Row(key.encode(), "héllo".encode(), 21, None)], 22, None
    )
    node_state = replace(node_state, value_format="string")
    assert get(node_state, f"/stores/customers/keys/{key}").json()["value"] == "héllo"


def stalled_at(state: NodeState, partition: int, for_ms: int) -> Stall:
    stall = Stall(partition, 50, now_ms() - for_ms, "50 offsets unread and the store has not moved")
    state.node.stalled = {partition: stall}
    return stall


def test_a_stalled_pipeline_makes_the_node_not_ready_and_says_why(node_state):
    assert get(node_state, "/health/ready").status_code == 200
    node_state.node.status = {"running": True, "last_error": "ValueError: poison"}
    stalled_at(node_state, 1, for_ms=45_000)
    response = get(node_state, "/health/ready")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not_ready"
    assert body["reason"].startswith("pipeline stalled on partitions [1]: 50 offsets unread")
    assert body["pipeline_error"] == "ValueError: poison"
    [stall] = body["stalled"]
    assert stall["partition"] == 1
    assert stall["unread"] == 50
    assert stall["stalled_for_ms"] >= 45_000


def test_metadata_shows_the_pipelines_state_since_when_it_is_stalled_and_why(node_state):
    body = get(node_state, "/metadata").json()
    assert body["pipeline"]["stalled"] is False
    assert body["pipeline"]["why"] is None
    stall = stalled_at(node_state, 2, for_ms=31_000)
    body = get(node_state, "/metadata").json()
    assert body["pipeline"]["stalled"] is True
    assert body["pipeline"]["stalled_since_ms"] == stall.since_ms
    assert body["pipeline"]["why"] == stall.reason
    assert [p["partition"] for p in body["pipeline"]["stalled_partitions"]] == [2]
    by_partition = {p["partition"]: p for p in body["partitions"]}
    assert by_partition[2]["stalled_since_ms"] == stall.since_ms
    assert "stalled_since_ms" not in by_partition[0]


def test_not_ready_answers_name_the_reason(node_state):
    node_state = forget_the_ends(node_state)
    assert "have not caught up" in get(node_state, "/health/ready").json()["reason"]
    node_state.node.status = {"running": False}
    assert "not running" in get(node_state, "/health/ready").json()["reason"]
