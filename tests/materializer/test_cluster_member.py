"""A ClusterMember's steps against a real redis-server, without nodes or Spark (the clock
tests read what it wrote back through a proxy's TableWatcher)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
import redis.asyncio as aioredis

from common.clock import SharedClock
from common.contract import (
    Assignment,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    StoreInfo,
    decode_assignment,
    decode_event,
    decode_report,
    encode,
)
from materializer.assignment import compute_assignment
from materializer.cluster import ClusterMember, ClusterTiming, Written
from proxy.choice import LagBudget, Replica, choose_replicas
from proxy.watcher import TableWatcher

pytestmark = pytest.mark.integration

LAST = Assignment(
    4,
    "b",
    0,
    {"customers": {0: PartitionAssignment("a", ("b",)), 1: PartitionAssignment("b", ("a",))}},
)


def member(url: str, keys: Keys, assignment: Assignment | None) -> ClusterMember:
    client = aioredis.Redis.from_url(url)
    return ClusterMember(
        redis=client,
        keys=keys,
        node=NodeInfo("a", "http://127.0.0.1:1", 0),
        store=StoreInfo("customers", "bookings", 2),
        timing=ClusterTiming(grace_ms=600_000, standbys=1),
        hosting=lambda: Hosting("a", 4, {}, 0),
        reports=dict,
        on_assignment=lambda _assignment: None,
        assignment=assignment,
    )


def test_a_leader_facing_an_emptied_redis_keeps_the_last_assignment(redis_server):
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> Assignment:
        leader = member(redis_server.url, keys, LAST)  # Redis holds nothing for this cluster
        try:
            await leader.lead()  # takes the lease, computes, writes (the key is missing)
            raw = await leader.redis.get(keys.assignment)
            assert raw is not None
            return decode_assignment(raw)
        finally:
            await leader.redis.aclose()

    written = asyncio.run(scenario())
    assert written.stores == LAST.stores, "no store or node forgotten before it re-registered"
    assert written.generation == LAST.generation


def test_only_the_lease_holder_writes_the_assignment(redis_server):
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> tuple[bool, bytes | None]:
        leader = member(redis_server.url, keys, None)
        try:
            await leader.redis.set(keys.leader, "someone-else", px=10_000)
            await leader.heartbeat()
            await leader.lead()
            return leader.is_leader, await leader.redis.get(keys.assignment)
        finally:
            await leader.redis.aclose()

    is_leader, assignment = asyncio.run(scenario())
    assert not is_leader
    assert assignment is None


def test_a_restarted_node_replaces_the_reports_its_last_run_left(redis_server):
    # The last run reported partition 0 caught up; this run has not measured anything yet
    # (restoring a lost store, say). Proxies must not take the old report for a current one.
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> dict[bytes, bytes]:
        restarted = member(redis_server.url, keys, None)
        try:
            await restarted.redis.hset(keys.lag("a"), "customers/0", b"caught up, last run")
            await restarted.report()
            return await restarted.redis.hgetall(keys.lag("a"))
        finally:
            await restarted.redis.aclose()

    assert asyncio.run(scenario()) == {}


# -- one generation, one assignment (issue 23, defect 3) -----------------------------------


class Cluster:
    """Members of one cluster, each with its own Redis client; nothing runs on its own."""

    def __init__(self, url: str, grace_ms: int = 0, partitions: int = 4) -> None:
        self.url = url
        self.keys = Keys(f"t-{uuid.uuid4().hex[:8]}")
        self.grace_ms = grace_ms
        self.partitions = partitions
        self.members: dict[str, ClusterMember] = {}
        self.accepted: list[tuple[str, Assignment]] = []  # (node, assignment) as each took it
        self.admin = aioredis.Redis.from_url(url)

    def add(self, node_id: str, **options: object) -> ClusterMember:
        self.members[node_id] = ClusterMember(
            redis=aioredis.Redis.from_url(self.url),
            keys=self.keys,
            node=NodeInfo(node_id, f"http://127.0.0.1:{len(self.members) + 1}", 0),
            store=StoreInfo("customers", "bookings", self.partitions),
            timing=ClusterTiming(grace_ms=self.grace_ms, standbys=1),
            hosting=lambda: Hosting(node_id, 0, {}, 0),
            reports=dict,
            on_assignment=lambda a: self.accepted.append((node_id, a)),
            **options,  # type: ignore[arg-type]
        )
        return self.members[node_id]

    async def kill(self, node_id: str) -> None:
        """Its heartbeat expires and, if it led, its lease runs out."""
        await self.admin.delete(self.keys.alive(node_id))
        if await self.admin.get(self.keys.leader) == node_id.encode():
            await self.admin.delete(self.keys.leader)

    async def stored(self) -> Assignment:
        raw = await self.admin.get(self.keys.assignment)
        assert raw is not None
        return decode_assignment(raw)

    async def close(self) -> None:
        for m in self.members.values():
            await m.redis.aclose()
        await self.admin.aclose()


def one_assignment_per_generation(accepted: list[tuple[str, Assignment]]) -> dict[int, set[str]]:
    """generation -> the distinct assignments (as JSON) nodes accepted under it."""
    seen: dict[int, set[str]] = {}
    for _node, assignment in accepted:
        seen.setdefault(assignment.generation, set()).add(encode(assignment).decode())
    return {g: s for g, s in seen.items() if len(s) > 1}


def test_a_new_leader_that_missed_a_write_never_reuses_its_generation(redis_server):
    # Leader A writes generation 2 while B is cut off; A dies; B leads. B must build on A's
    # generation 2 (read before computing), not on its own generation 1, and C and D must
    # follow what B writes.
    async def scenario() -> tuple[Assignment, dict[str, Assignment | None], dict[int, set[str]]]:
        cluster = Cluster(redis_server.url)
        try:
            a, b, c = (cluster.add(n) for n in "abc")
            for m in (a, b, c):
                await m.heartbeat()
            await a.lead()
            for m in (a, b, c):
                await m.refresh()
            assert {m.assignment.generation for m in (a, b, c) if m.assignment} == {1}

            d = cluster.add("d")  # joins while b is cut off (b reads nothing)
            await d.heartbeat()
            await a.lead()
            for m in (c, d):
                await m.refresh()
            assert (await cluster.stored()).generation == 2

            await cluster.kill("a")
            await b.lead()  # b takes over, with generation 1 in memory
            for m in (c, d):
                await m.refresh()
            held = {n: m.assignment for n, m in cluster.members.items()}
            return await cluster.stored(), held, one_assignment_per_generation(cluster.accepted)
        finally:
            await cluster.close()

    stored, held, conflicts = asyncio.run(scenario())
    assert conflicts == {}, "two different assignments were accepted under one generation"
    assert stored.generation == 3
    assert stored.leader == "b"
    assert all("a" not in placed.replicas() for placed in stored.stores["customers"].values())
    for node in "bcd":
        assert held[node] == stored, f"{node} does not follow the stored assignment"


def test_the_write_refuses_a_generation_that_is_not_greater(redis_server):
    async def scenario() -> tuple[list[Written], Assignment]:
        cluster = Cluster(redis_server.url)
        try:
            leader = cluster.add("a")
            await leader.heartbeat()
            await leader.lead()  # generation 1
            first = await cluster.stored()
            same = Assignment(first.generation, "a", 1, {"customers": {}})
            older = Assignment(first.generation - 1, "a", 1, {"customers": {}})
            newer = Assignment(first.generation + 1, "a", 1, first.stores)
            results = [await leader._write(x) for x in (same, older, newer)]
            return results, await cluster.stored()
        finally:
            await cluster.close()

    results, stored = asyncio.run(scenario())
    assert results == [Written.STALE_GENERATION, Written.STALE_GENERATION, Written.WRITTEN]
    assert stored.generation == 2


def test_a_refused_write_makes_the_leader_read_again_and_build_on_what_it_finds(redis_server):
    # Another writer gets generation 2 in between the leader's read and its write.
    async def scenario() -> tuple[Assignment, Assignment]:
        cluster = Cluster(redis_server.url)
        try:
            a, b = cluster.add("a"), cluster.add("b")
            for m in (a, b):
                await m.heartbeat()
            await a.lead()  # generation 1 over a and b
            first = await cluster.stored()
            raced = Assignment(2, "x", 1, first.stores)
            read_state = a._cluster_state

            async def racing_state(previous: Assignment | None):  # type: ignore[no-untyped-def]
                if not await cluster.admin.exists(f"{cluster.keys.prefix}raced"):
                    await cluster.admin.set(f"{cluster.keys.prefix}raced", 1)
                    await cluster.admin.set(cluster.keys.assignment, encode(raced))
                return await read_state(previous)

            a._cluster_state = racing_state  # type: ignore[method-assign]
            await cluster.kill("b")  # something to recompute: b's partitions move (grace 0)
            await a.lead()
            return raced, await cluster.stored()
        finally:
            await cluster.close()

    raced, stored = asyncio.run(scenario())
    assert stored.generation == raced.generation + 1
    assert all("b" not in placed.replicas() for placed in stored.stores["customers"].values())


def test_a_node_follows_a_stored_assignment_that_differs_in_more_than_the_number(redis_server):
    async def scenario() -> Assignment | None:
        cluster = Cluster(redis_server.url)
        try:
            node = cluster.add("c", assignment=LAST)
            other = Assignment(
                LAST.generation, "x", 99, {"customers": {0: PartitionAssignment("c")}}
            )
            await cluster.admin.set(cluster.keys.assignment, encode(other))
            await node.refresh()
            return node.assignment
        finally:
            await cluster.close()

    held = asyncio.run(scenario())
    assert held is not None
    assert held.leader == "x"


# -- leadership through Redis errors, grace periods through leader changes (defect 4) -------


def test_a_leader_keeps_its_lease_through_a_redis_error(redis_server):
    async def scenario() -> tuple[bool, bytes | None, int]:
        cluster = Cluster(redis_server.url)
        try:
            leader = cluster.add("a")
            await leader.heartbeat()
            await leader.lead()
            assert leader.is_leader

            async def failing_step() -> None:  # any loop's step meeting a Redis error
                await leader.redis.execute_command("NO-SUCH-COMMAND")

            loop = asyncio.create_task(leader._every(10_000, failing_step))
            await asyncio.sleep(0.05)
            loop.cancel()
            await leader.lead()
            ttl = await cluster.admin.pttl(cluster.keys.leader)
            return leader.is_leader, await cluster.admin.get(cluster.keys.leader), ttl
        finally:
            await cluster.close()

    is_leader, holder, ttl = asyncio.run(scenario())
    assert is_leader, "the leader locked itself out of its own lease"
    assert holder == b"a"
    assert ttl > ClusterTiming().leader_lease_ms - 500, "the lease was renewed"


def test_a_grace_period_survives_a_change_of_leader(redis_server):
    # d is dead from the start. a leads and starts d's grace period; leadership moves to b
    # part-way through. d's partitions must move when the period that a started ends, not a
    # whole period after b took over.
    grace_ms = 3_000

    async def scenario() -> tuple[Assignment, float]:
        cluster = Cluster(redis_server.url, grace_ms=grace_ms)
        try:
            a, b, c = (cluster.add(n) for n in "abc")
            # d held partitions in the last assignment and has not come back since.
            start = Assignment(
                5,
                "old",
                0,
                {
                    "customers": {
                        p: PartitionAssignment("abcd"[p], ("abcd"[(p + 1) % 4],)) for p in range(4)
                    }
                },
            )
            await cluster.admin.set(cluster.keys.assignment, encode(start))
            await cluster.admin.sadd(cluster.keys.nodes, "d")
            for m in (a, b, c):
                await m.heartbeat()
            await a.lead()
            seen_dead_at = time.monotonic()
            assert (await cluster.stored()).stores == start.stores, "d is within its grace"

            await asyncio.sleep(grace_ms / 1000 * 0.5)
            await cluster.admin.delete(cluster.keys.leader)  # a's lease lapses (paused, say)
            await b.lead()
            assert b.is_leader
            await asyncio.sleep(max(0.0, seen_dead_at + grace_ms / 1000 + 0.2 - time.monotonic()))
            for m in (a, b, c):
                await m.heartbeat()
            await b.lead()
            return await cluster.stored(), time.monotonic() - seen_dead_at
        finally:
            await cluster.close()

    stored, elapsed_s = asyncio.run(scenario())
    # Well before a grace period counted from b's start (1.5 grace periods after a's).
    assert elapsed_s < grace_ms / 1000 * 1.4
    assert all("d" not in placed.replicas() for placed in stored.stores["customers"].values()), (
        "the grace period restarted with the new leader"
    )


def test_dead_since_is_kept_in_redis_and_cleared_when_the_node_returns(redis_server):
    async def scenario() -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
        cluster = Cluster(redis_server.url, grace_ms=600_000)
        try:
            a, d = cluster.add("a"), cluster.add("d")
            await a.heartbeat()
            await cluster.admin.sadd(cluster.keys.nodes, "d")
            await a.lead()
            while_dead = await cluster.admin.hgetall(cluster.keys.dead_since)
            await d.heartbeat()
            await a.lead()
            return while_dead, await cluster.admin.hgetall(cluster.keys.dead_since)
        finally:
            await cluster.close()

    while_dead, after = asyncio.run(scenario())
    assert set(while_dead) == {b"d"}
    assert abs(int(while_dead[b"d"]) - time.time() * 1000) < 5_000
    assert after == {}


def test_a_node_dead_past_its_grace_period_is_forgotten_and_registers_again(redis_server):
    # Pods come back with new ids: without forgetting, `nodes` would keep every id that ever
    # registered and every reader would read more each time.
    grace_ms = 1_000

    async def scenario() -> tuple[set[bytes], list[int], set[bytes], set[bytes]]:
        cluster = Cluster(redis_server.url, grace_ms=grace_ms)
        try:
            a, d = cluster.add("a"), cluster.add("d")
            for m in (a, d):
                await m.heartbeat()
                await m.report()
            await a.lead()
            await cluster.admin.delete(cluster.keys.alive("d"))  # d dies
            await a.lead()
            during_grace = await cluster.admin.smembers(cluster.keys.nodes)
            await asyncio.sleep(grace_ms / 1000 + 0.3)
            await a.lead()  # its partitions move to a ...
            await a.lead()  # ... and, placed nowhere, it is forgotten
            left = [
                await cluster.admin.exists(key)
                for key in (
                    cluster.keys.node("d"),
                    cluster.keys.hosting("d"),
                    cluster.keys.lag("d"),
                    cluster.keys.report("d"),
                    cluster.keys.report_at("d"),
                )
            ]
            forgotten = await cluster.admin.smembers(cluster.keys.nodes)
            await d.heartbeat()  # it comes back
            return during_grace, left, forgotten, await cluster.admin.smembers(cluster.keys.nodes)
        finally:
            await cluster.close()

    during_grace, left, forgotten, back = asyncio.run(scenario())
    assert during_grace == {b"a", b"d"}, "kept while its grace period runs"
    assert forgotten == {b"a"}
    assert left == [0] * 5, "its node, hosting, lag, report and report_at keys went with it"
    assert back == {b"a", b"d"}


# -- one clock: Redis time (issue 23, defect 2) ---------------------------------------------


def skewed_node(url: str, keys: Keys, skew_ms: int, caught_up_ago_ms: int) -> ClusterMember:
    """A node whose host clock is `skew_ms` off, serving partition 0 of a one-partition store
    that it last saw caught up `caught_up_ago_ms` ago (measured on its own clock, as
    materializer/lag.py does)."""
    clock = SharedClock(skew_ms=skew_ms)

    def reports() -> dict[int, PartitionReport]:
        at = clock.now_ms()
        return {0: PartitionReport(10, 10, None, at - caught_up_ago_ms, at)}

    return ClusterMember(
        redis=aioredis.Redis.from_url(url),
        keys=keys,
        node=NodeInfo("n", "http://127.0.0.1:1", 0),
        store=StoreInfo("customers", "bookings", 1),
        timing=ClusterTiming(standbys=0),
        hosting=lambda: Hosting("n", 1, {"customers": {"active": (0,), "standby": ()}}, 0),
        reports=reports,
        on_assignment=lambda _assignment: None,
        clock=clock,
    )


async def as_a_proxy_sees_it(url: str, keys: Keys) -> tuple[Replica, int]:
    """The replica of partition 0 in a proxy's table, and the proxy's now."""
    client = aioredis.Redis.from_url(url)
    try:
        watcher = TableWatcher(
            client, keys, refresh_interval_ms=1000, networks=None, clock=SharedClock()
        )
        await watcher.refresh()
        (replica,) = watcher.snapshot.stores["customers"].replicas[0]
        return replica, watcher.clock.now_ms()
    finally:
        await client.aclose()


def serve_through_a_proxy(url: str, skew_ms: int, caught_up_ago_ms: int) -> tuple[Replica, int]:
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> tuple[Replica, int]:
        node = skewed_node(url, keys, skew_ms, caught_up_ago_ms)
        try:
            await node.heartbeat()
            await node.lead()
            await node.report()
            return await as_a_proxy_sees_it(url, keys)
        finally:
            await node.redis.aclose()

    return asyncio.run(scenario())


def test_a_node_five_seconds_ahead_cannot_pass_a_stale_answer_for_a_fresh_one(redis_server):
    # The case: caught up 5.4 s ago, on a host 5 s ahead; the proxy saw 400 ms.
    replica, now = serve_through_a_proxy(redis_server.url, 5_000, 5_400)
    time_lag = replica.time_lag_ms(now)
    assert time_lag is not None
    assert time_lag >= 5_400, "never fresher than true"
    # Just after its first sync the node cannot tell its stamps from before the 5 s step
    # back from those after it, so it moves them all back: older than true for those 5 s.
    assert time_lag < 5_400 + 5_000 + 1_000
    refused = choose_replicas((replica,), LagBudget(None, 1_000), now_ms=now)
    assert refused.candidates == ()
    assert refused.rejected[0].reason.startswith("time lag"), "refused on its report's time"


def test_a_node_behind_by_more_than_the_staleness_limit_still_reports_fresh(redis_server):
    replica, now = serve_through_a_proxy(redis_server.url, -3_500, 100)
    assert replica.reported_at_ms is not None
    assert now - replica.reported_at_ms < 1_000
    chosen = choose_replicas((replica,), LagBudget(None, 1_000), now_ms=now)
    assert chosen.candidates == (replica,), chosen.rejected


def test_a_time_stamped_before_the_first_sync_is_moved_back_with_the_clock(redis_server):
    # materializer/lag.py may stamp "caught up at" before the cluster has synced the clock:
    # on a host 5 s ahead that stamp reads 5 s fresher than it is, unless moved back.
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> tuple[int, int]:
        node = skewed_node(redis_server.url, keys, 5_000, 0)
        early = node.clock.now_ms() - 400  # before any sync: the host's own clock
        node.reports = lambda: {0: PartitionReport(10, 10, None, early, node.clock.now_ms())}
        try:
            await node.report()  # syncs first
            raw = await node.redis.hget(keys.lag("n"), "customers/0")
            assert raw is not None
            seconds, micros = await node.redis.time()
            return decode_report(raw).caught_up_at_ms or 0, seconds * 1000 + micros // 1000
        finally:
            await node.redis.aclose()

    caught_up_at, redis_now = asyncio.run(scenario())
    assert redis_now - caught_up_at >= 400 - 50


def test_a_process_announces_its_node_key_once_with_its_first_heartbeat(redis_server):
    """A node restarted on another URL rewrites node:<id>; proxies read node keys on an event
    (or every 30 s), so its first heartbeat says so, and later heartbeats stay silent."""
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")

    async def scenario() -> list[str]:
        node = member(redis_server.url, keys, None)
        listener = aioredis.Redis.from_url(redis_server.url)
        pubsub = listener.pubsub()
        try:
            await pubsub.subscribe(keys.events)
            await pubsub.get_message(timeout=1.0)  # the subscription's confirmation
            for _ in range(3):
                await node.heartbeat()
            events: list[str] = []
            while (message := await pubsub.get_message(timeout=0.5)) is not None:
                events.append(decode_event(message["data"]).type)
            return events
        finally:
            await pubsub.aclose()
            await listener.aclose()
            await node.redis.aclose()

    assert asyncio.run(scenario()) == ["node"]


def test_the_leader_computes_the_assignment_off_the_event_loop(redis_server, monkeypatch):
    """At 1,000 nodes and 20,000 partitions a computation takes hundreds of milliseconds of
    Python: on the event loop it would stop the leader's own lookups at every step."""
    keys = Keys(f"t-{uuid.uuid4().hex[:8]}")
    threads: list[int] = []

    def recording(*args: object, **kwargs: object) -> Assignment:
        threads.append(threading.get_ident())
        return compute_assignment(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("materializer.cluster.compute_assignment", recording)

    async def scenario() -> int:
        leader = member(redis_server.url, keys, None)
        try:
            await leader.heartbeat()
            await leader.lead()
            return threading.get_ident()
        finally:
            await leader.redis.aclose()

    loop_thread = asyncio.run(scenario())
    assert threads, "the leader computed no assignment"
    assert loop_thread not in threads
