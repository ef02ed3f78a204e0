"""Writers that read end offsets (the agent, `kroute adapt fixed`, `kroute adapt faust`)
stamp each lag report as of its end-offset read, so an idle, caught-up replica's compact
report (`report:<id>`) is the same from one report to the next (issue 22). No services."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from common.contract import Hosting, Keys, PartitionReport, encode_node_report, node_report
from kroute.adapters.faust import LagBook
from kroute.adapters.fixed import FixedPlacement, PlacementFile
from kroute.agent import EndHistory

T0 = 1_700_000_000_000


def body(reports: dict[tuple[str, int], PartitionReport], reported_at: int) -> bytes:
    """The compact body (version 0) of node a hosting s/0 with `reports`, made `reported_at`."""
    hosting = Hosting("a", 1, {"s": {"active": (0,), "standby": ()}}, reported_at)
    return encode_node_report(node_report(hosting, reports))


def test_a_report_holds_as_of_its_end_read_and_as_of_itself_without_one():
    history = EndHistory()
    assert history.as_of(T0) == T0, "no end read: the report's own time"
    history.recent.append((100, T0))
    assert history.as_of(T0 + 40) == T0
    assert history.report(100, T0 + 40) == (100, T0)  # caught up at that same read
    assert history.as_of(T0 + 10_000) == T0 + 10_000, "an end read too long ago is none"
    assert history.report(100, T0 + 10_000)[0] is None


def test_the_fixed_adapter_makes_the_same_body_for_an_idle_replica():
    spec = PlacementFile.model_validate({
        "nodes": {"a": "http://127.0.0.1:9"},
        "stores": {"s": {"topic": "t", "partitions": 1, "placement": {"0": {"active": "a"}}}},
        "lag": {"source": "consumer_group", "bootstrap_servers": "127.0.0.1:1", "group": "g"},
    })  # fmt: skip
    client = aioredis.Redis.from_url("redis://127.0.0.1:1")  # never connected

    async def rounds() -> list[bytes]:
        adapter = FixedPlacement(spec, client, Keys("stamps"))
        try:
            bodies = []
            for asked_at, at in ((T0, T0 + 23), (T0 + 1_000, T0 + 1_000 + 310)):
                adapter.remember_ends({("s", 0): 50}, asked_at)
                reports = adapter._lag_reports("a", {("a", "s", 0): 50}, at)
                assert reports[("s", 0)].updated_at_ms == asked_at
                bodies.append(body(reports, at))
            return bodies
        finally:
            await adapter.close()
            await client.aclose()

    first, second = asyncio.run(rounds())
    assert first == second


def test_the_faust_adapter_makes_the_same_body_for_an_idle_partition():
    book = LagBook()
    book.follow({0: "w1"}, now_ms=T0 - 1_000)
    bodies = []
    for asked_at, at in ((T0, T0 + 12), (T0 + 1_000, T0 + 1_000 + 95)):
        book.observe({0: 70}, {0: 70}, asked_at_ms=asked_at, at_ms=at)
        report = book.reports()[0]
        assert (report.caught_up_at_ms, report.updated_at_ms) == (asked_at, asked_at)
        bodies.append(body({("s", 0): report}, at + 50))
    assert bodies[0] == bodies[1]
