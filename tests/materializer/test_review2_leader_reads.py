"""Review (issue 22, 398a6bd): the leader's lags from `report:<id>` bodies must not outlive the
writer that wrote them. A node whose `report_at:<id>` stopped moving (a writer of only the
schema-1 keys took over the node id: a rolling downgrade, a third-party writer) still names a
body until the key expires (ten heartbeat TTLs); `lag:<id>` has moved on. Reading every
`lag:<id>`, as the leader did, gave the new lags; the assignment must get them still (a
standby reported caught up by the old body is not caught up now)."""

from __future__ import annotations

import asyncio

import pytest

from common.contract import Hosting, PartitionReport, encode, lag_field, write_node_report
from tests.materializer.test_cluster_leader_reads import (
    Lags,
    Redis,
    lags_given_to_the_assignment,
    lead_once,
    leader_of,
)

pytestmark = pytest.mark.integration


def _report(lag: int, at_ms: int) -> PartitionReport:
    return PartitionReport(1_000, 1_000 + lag, None, at_ms - lag, at_ms)


def test_a_body_whose_report_at_stopped_moving_gives_way_to_the_lag_hash(redis_server, monkeypatch):
    async def scenario() -> tuple[Lags, Lags]:
        redis = Redis(redis_server.url)
        leader = leader_of(redis)
        keys = redis.keys
        roles = {"customers": {"active": (0,), "standby": (1,)}}
        try:
            seconds, _ = await redis.client.time()
            now = seconds * 1_000
            with lags_given_to_the_assignment(monkeypatch) as seen:
                # The compact writer's last report, 10 s ago: caught up.
                old = now - 10_000
                hosting = Hosting("n1", 1, roles, old)
                reports = {("customers", p): _report(0, old) for p in (0, 1)}
                async with redis.client.pipeline(transaction=True) as pipe:
                    pipe.sadd(keys.nodes, "n1")
                    write_node_report(pipe, keys, hosting, reports, 60_000, bodies=redis.bodies)
                    await pipe.execute()
                before = await lead_once(leader, seen)
                # Since then, only `hosting:<id>` and `lag:<id>` (no report:<id>): 5,000 behind.
                async with redis.client.pipeline(transaction=True) as pipe:
                    pipe.set(keys.hosting("n1"), encode(Hosting("n1", 1, roles, now)))
                    pipe.delete(keys.lag("n1"))
                    pipe.hset(
                        keys.lag("n1"),
                        mapping={
                            lag_field("customers", p): encode(_report(5_000, now)) for p in (0, 1)
                        },
                    )
                    await pipe.execute()
                after = await lead_once(leader, seen)
                return before, after
        finally:
            await redis.client.aclose()

    before, after = asyncio.run(scenario())
    assert before[("customers", 1, "n1")] == 0
    assert after[("customers", 1, "n1")] == 5_000, "the lags lag:<id> holds now"
