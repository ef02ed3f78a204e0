"""The leader's read of offset lags against a real redis-server: from `report_at:<id>` and the
`report:<id>` bodies whose version changed, falling back to `lag:<id>`, and giving the
assignment function the same lags as reading every `lag:<id>` did."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis

from common.contract import (
    Hosting,
    Keys,
    NodeInfo,
    PartitionReport,
    ReportBodies,
    Role,
    StoreInfo,
    encode,
    write_node_report,
)
from materializer import cluster
from materializer.assignment import compute_assignment
from materializer.cluster import ClusterMember, ClusterTiming

pytestmark = pytest.mark.integration

Lags = dict[tuple[str, int, str], int | None]
Roles = dict[str, dict[Role, tuple[int, ...]]]
EXPIRE_MS = 60_000
NOW_MS = 1_800_000_000_000


class Redis:
    """One cluster's keys in the test's redis-server, written as nodes write them."""

    def __init__(self, url: str) -> None:
        self.keys = Keys(f"t-{uuid.uuid4().hex[:8]}")
        self.client = aioredis.Redis.from_url(url)
        self.bodies = ReportBodies()  # one writer of every simulated node

    async def report(
        self, node_id: str, roles: Roles, reports: Mapping[tuple[str, int], PartitionReport]
    ) -> None:
        hosting = Hosting(node_id, 1, roles, NOW_MS)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.sadd(self.keys.nodes, node_id)
            write_node_report(pipe, self.keys, hosting, reports, EXPIRE_MS, bodies=self.bodies)
            await pipe.execute()

    async def every_lag_hash(self, node_ids: list[str]) -> Lags:
        """What the leader read before: every node's `lag:<id>`, decoded by `_offset_lags`."""
        async with self.client.pipeline(transaction=False) as pipe:
            for node_id in node_ids:
                pipe.hgetall(self.keys.lag(node_id))
            return cluster._offset_lags(node_ids, await pipe.execute())

    async def node_ids(self) -> list[str]:
        return sorted(n.decode() for n in await self.client.smembers(self.keys.nodes))


def leader_of(redis: Redis) -> ClusterMember:
    return ClusterMember(
        redis=redis.client,
        keys=redis.keys,
        node=NodeInfo("leader", "http://127.0.0.1:1", 0),
        store=StoreInfo("customers", "bookings", 8),
        timing=ClusterTiming(grace_ms=600_000, standbys=1),
        hosting=lambda: Hosting("leader", 0, {}, 0),
        reports=dict,
        on_assignment=lambda _assignment: None,
    )


@contextmanager
def lags_given_to_the_assignment(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Lags]]:
    """Every `lag` argument the leader passes to the assignment function."""
    seen: list[Lags] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(dict(args[3]))
        return compute_assignment(*args, **kwargs)

    monkeypatch.setattr("materializer.cluster.compute_assignment", recording)
    yield seen


async def lead_once(leader: ClusterMember, seen: list[Lags]) -> Lags:
    await leader.heartbeat()
    await leader.lead()
    assert seen, "the leader computed no assignment"
    return seen[-1]


def report(lag: int | None, caught_up_ago: int | None = 0) -> PartitionReport:
    """A replica's report with this offset lag (None: end offset unknown)."""
    end = None if lag is None else 1_000 + lag
    caught_up = None if caught_up_ago is None else NOW_MS - caught_up_ago
    return PartitionReport(1_000, end, None, caught_up, NOW_MS)


def random_node(rng: random.Random) -> tuple[Roles, dict[tuple[str, int], PartitionReport]]:
    """Roles in one or two stores (one named with a slash, as `lag:<id>` fields allow) and
    a report per hosted partition: a lag, an unknown lag, or none at all."""
    roles: Roles = {}
    reports: dict[tuple[str, int], PartitionReport] = {}
    for store in rng.sample(["customers", "orders/v2"], rng.randint(1, 2)):
        hosted = rng.sample(range(64), rng.randint(0, 12))
        split = rng.randint(0, len(hosted))
        roles[store] = {"active": tuple(hosted[:split]), "standby": tuple(hosted[split:])}
        for partition in hosted:
            kind = rng.random()
            if kind < 0.15:
                continue  # hosted without a report: unknown lag, no entry
            lag = None if kind < 0.3 else rng.choice([0, 0, 3, 10_000, 123_456])
            reports[(store, partition)] = report(lag, rng.choice([0, 250, None]))
    return roles, reports


def test_the_assignment_gets_the_same_lags_from_bodies_as_from_every_lag_hash(
    redis_server, monkeypatch
):
    """Differential: at each step the lags the assignment function gets equal what decoding
    every node's `lag:<id>` gives on the same Redis contents, while the leader's lags come
    from the bodies (held, or read again when their version changed)."""
    rng = random.Random(22)

    async def scenario() -> None:
        redis = Redis(redis_server.url)
        leader = leader_of(redis)
        nodes = {f"n{i}": random_node(rng) for i in range(40)}
        try:
            with lags_given_to_the_assignment(monkeypatch) as seen:
                for step in range(3):
                    if step:  # a third of the nodes report something new
                        for node_id in rng.sample(sorted(nodes), len(nodes) // 3):
                            nodes[node_id] = random_node(rng)
                    for node_id, (roles, reports) in nodes.items():
                        await redis.report(node_id, roles, reports)
                    given = await lead_once(leader, seen)
                    expected = await redis.every_lag_hash(await redis.node_ids())
                    assert given == expected, f"step {step}"
                    assert len(expected) > 200  # not an empty comparison
                    assert set(leader._body_lags) == set(nodes)  # read from the bodies
        finally:
            await redis.client.aclose()

    asyncio.run(scenario())


def test_a_body_is_read_again_only_when_its_version_changes(redis_server, monkeypatch):
    async def scenario() -> list[int | None]:
        redis = Redis(redis_server.url)
        leader = leader_of(redis)
        roles: Roles = {"customers": {"active": (0,), "standby": (1,)}}
        key = ("customers", 1, "n1")
        given: list[int | None] = []
        try:
            with lags_given_to_the_assignment(monkeypatch) as seen:
                await redis.report("n1", roles, {("customers", 1): report(5)})
                given.append((await lead_once(leader, seen))[key])
                # The same version with other contents (no writer does this): the body held
                # is used, neither the body nor `lag:<id>` is read again.
                await redis.client.hset(redis.keys.lag("n1"), "customers/1", encode(report(6)))
                raw = await redis.client.get(redis.keys.report("n1"))
                await redis.client.set(redis.keys.report("n1"), raw.replace(b"[5,", b"[6,"))
                given.append((await lead_once(leader, seen))[key])
                # A new body (a new version): read again, its lags used.
                await redis.report("n1", roles, {("customers", 1): report(7)})
                given.append((await lead_once(leader, seen))[key])
                assert leader._body_lags["n1"].lags[key] == 7  # from the body, not lag:<id>
        finally:
            await redis.client.aclose()
        return given

    assert asyncio.run(scenario()) == [5, 5, 7]


def test_a_node_without_report_keys_is_read_from_its_lag_hash(redis_server, monkeypatch):
    """A writer of only the schema-1 keys (`hosting`, `lag`), and one whose `report_at:<id>`
    is unreadable, whose body is gone, or older than `report_at:<id>` names: their lags come
    from `lag:<id>`."""

    async def scenario() -> Lags:
        redis = Redis(redis_server.url)
        leader = leader_of(redis)
        keys = redis.keys
        try:
            for node_id, lag in (("old", 4), ("garbled", 8), ("bodiless", 9)):
                await redis.report(node_id, {"s": {"active": (0,)}}, {("s", 0): report(lag)})
            await redis.client.delete(keys.report("old"), keys.report_at("old"))
            await redis.client.set(keys.report_at("garbled"), b"12 not-a-time")
            await redis.client.delete(keys.report("bodiless"))
            await redis.report("stale", {"s": {"active": (0,)}}, {("s", 0): report(1)})
            older = await redis.client.get(keys.report("stale"))
            await redis.report("stale", {"s": {"active": (0,)}}, {("s", 0): report(10)})
            await redis.client.set(keys.report("stale"), older)  # report_at names the newer
            with lags_given_to_the_assignment(monkeypatch) as seen:
                return await lead_once(leader, seen)
        finally:
            await redis.client.aclose()

    assert asyncio.run(scenario()) == {
        ("s", 0, "old"): 4,
        ("s", 0, "garbled"): 8,
        ("s", 0, "bodiless"): 9,
        ("s", 0, "stale"): 10,
    }


def malformed(body: dict[str, Any], why: str) -> dict[str, Any]:
    """The body with one thing outside the contract, its other lags changed to 99."""
    body = json.loads(json.dumps(body))
    lags = body["stores"]["s"]["lag"]
    body["stores"]["s"]["lag"] = [[99, 0, None] for _ in lags]
    if why == "negative lag":
        body["stores"]["s"]["lag"][-1] = [-1, 0, None]
    elif why == "not aligned":
        body["stores"]["s"]["lag"].append([99, 0, None])
    elif why == "another node":
        body["node_id"] = "someone-else"
    elif why == "unknown field":
        body["extra"] = 1
    return body


@pytest.mark.parametrize("why", ["negative lag", "not aligned", "another node", "unknown field"])
def test_a_body_outside_the_contract_is_refused_whole(redis_server, monkeypatch, why):
    """None of its lags is used, not even the well-formed ones: the node's lags come from
    `lag:<id>`, until a new version brings a body that follows the contract."""

    async def scenario() -> tuple[Lags, Lags, Lags]:
        redis = Redis(redis_server.url)
        leader = leader_of(redis)
        keys = redis.keys
        roles: Roles = {"s": {"active": (0, 1), "standby": (2,)}}
        reports = {("s", 0): report(1), ("s", 1): report(2), ("s", 2): report(3)}
        try:
            await redis.report("n1", roles, reports)
            body = json.loads(await redis.client.get(keys.report("n1")))
            await redis.client.set(keys.report("n1"), json.dumps(malformed(body, why)))
            with lags_given_to_the_assignment(monkeypatch) as seen:
                refused = await lead_once(leader, seen)
                # The same version, now following the contract (no writer does this): it is
                # not read again until `report_at:<id>` names another version.
                await redis.client.set(keys.report("n1"), json.dumps(malformed(body, "")))
                again = await lead_once(leader, seen)
                await redis.report("n1", roles, {**reports, ("s", 2): report(30)})
                renewed = await lead_once(leader, seen)
            assert "n1" in leader._body_lags  # the new body was used, not lag:<id>
            return refused, again, renewed
        finally:
            await redis.client.aclose()

    refused, again, renewed = asyncio.run(scenario())
    from_lag_hash = {("s", 0, "n1"): 1, ("s", 1, "n1"): 2, ("s", 2, "n1"): 3}
    assert refused == from_lag_hash
    assert again == from_lag_hash
    assert renewed == {**from_lag_hash, ("s", 2, "n1"): 30}


def test_a_forgotten_node_s_body_is_dropped_and_a_former_leader_drops_them_all(
    redis_server, monkeypatch
):
    async def scenario() -> tuple[set[str], set[str], set[str]]:
        redis = Redis(redis_server.url)
        leader = leader_of(redis)
        try:
            for node_id in ("n1", "n2"):
                await redis.report(node_id, {"s": {"active": (0,)}}, {("s", 0): report(0)})
            with lags_given_to_the_assignment(monkeypatch) as seen:
                await lead_once(leader, seen)
                held = set(leader._body_lags)
                await redis.client.srem(redis.keys.nodes, "n2")  # as `_forget_departed` does
                await lead_once(leader, seen)
                after_forgetting = set(leader._body_lags)
                await redis.client.set(redis.keys.leader, "someone-else")
                await leader.lead()
                return held, after_forgetting, set(leader._body_lags)
        finally:
            await redis.client.aclose()

    assert asyncio.run(scenario()) == ({"n1", "n2"}, {"n1"}, set())


def test_many_bodies_are_decoded_off_the_event_loop(redis_server, monkeypatch):
    """Every body at a new leader's first step (40,000 replicas at 1,000 nodes)."""
    decoded_in: list[bool] = []
    real = cluster._decode_bodies

    def recording(*args: Any) -> Any:
        decoded_in.append(_on_a_loop())
        return real(*args)

    monkeypatch.setattr("materializer.cluster._decode_bodies", recording)
    rng = random.Random(5)

    async def scenario() -> None:
        redis = Redis(redis_server.url)
        leader = leader_of(redis)
        try:
            for i in range(200):
                await redis.report(f"n{i}", *random_node(rng))
            with lags_given_to_the_assignment(monkeypatch) as seen:
                await lead_once(leader, seen)  # every body: more than THREAD_DECODE_BYTES
                await redis.report("n0", *random_node(rng))
                await lead_once(leader, seen)  # one small body: on the loop
        finally:
            await redis.client.aclose()

    asyncio.run(scenario())
    assert decoded_in == [False, True]


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
