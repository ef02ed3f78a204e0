"""`kroute adapt faust` against workers that answer wrong, slowly or not at all, against a
second adapter on the same cluster, and across owner changes (review 18). Real redis-server;
the workers are fakes (`fake_workers.py`) and Kafka offsets are stubbed."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from common.clock import SHARED
from common.contract import Keys, PartitionAssignment, decode_assignment
from kroute.adapters.faust import (
    FaustAdapter,
    FaustAdapterSettings,
    LagBook,
    node_id_for,
    owners,
    parse_router,
)
from kroute.embedded import RedisHandle
from tests.adapters.fake_workers import FakeWorker, start_workers, stop_all

pytestmark = pytest.mark.integration
CL = "app-counts-changelog"
TTL_MS = 2_000
TIMEOUT_MS = 800


def make_adapter(redis_url: str, seeds: list[str], cluster: str, **options: object) -> FaustAdapter:
    settings = FaustAdapterSettings(
        workers=tuple(seeds), table="counts", store="counts", redis_url=redis_url,
        bootstrap_servers="127.0.0.1:1", cluster=cluster, source_topics=("src",),
        alive_ttl_ms=TTL_MS, http_timeout_ms=TIMEOUT_MS, **options,  # type: ignore[arg-type]
    )  # fmt: skip
    adapter = FaustAdapter(settings)

    async def partition_count(_topic: str) -> int:
        return 4

    async def offsets(parts: list[int]) -> tuple[dict[tuple[str, int], int], ...]:
        return {("src", p): 100 for p in parts}, {("src", p): 100 for p in parts}

    adapter._partition_count = partition_count  # type: ignore[method-assign]
    adapter._offsets = offsets  # type: ignore[method-assign,assignment]
    return adapter


def route(workers: list[FakeWorker], parts: list[list[int]]) -> dict[str, dict[str, list[int]]]:
    return {w.url: {CL: p} for w, p in zip(workers, parts, strict=True)}


def serve(workers: list[FakeWorker], router: object) -> None:
    for worker in workers:
        worker.answers["/router/"] = router


def run(redis_server: RedisHandle, test: Callable[[str, str], Awaitable[None]]) -> None:
    async def with_workers() -> None:
        try:
            await test(redis_server.url, f"f-{uuid.uuid4().hex[:8]}")
        finally:
            await stop_all()

    asyncio.run(with_workers())


async def alive_nodes(client: aioredis.Redis, cluster: str) -> set[str]:
    return {k.decode().rsplit(":", 1)[1] for k in await client.keys(f"kroute:{cluster}:alive:*")}


def test_a_bad_worker_url_in_one_router_is_skipped_not_fatal(redis_server: RedisHandle) -> None:
    async def test(url: str, cluster: str) -> None:
        workers = await start_workers(2)
        good = route(workers, [[0, 1], [2, 3]])
        serve(workers, good)
        adapter = make_adapter(url, [workers[0].url], cluster)
        client = aioredis.Redis.from_url(url)
        try:
            await adapter.step()
            workers[1].answers["/router/"] = {**good, "https://127.0.0.1:6067": {CL: []}}
            for _ in range(3):
                await adapter.step()  # before the fix: FaustAdapterError from every round
            assert await alive_nodes(client, cluster) == {node_id_for(w.url) for w in workers}
            assert "https://127.0.0.1:6067" not in adapter.known
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


def test_garbage_standbys_are_skipped_per_worker(redis_server: RedisHandle) -> None:
    async def test(url: str, cluster: str) -> None:
        workers = await start_workers(2)
        serve(workers, route(workers, [[0, 1], [2, 3]]))
        workers[0].answers["/assignment/"] = {"standbys": {CL: 5}}
        workers[1].answers["/assignment/"] = {"standbys": {CL: ["x", 2]}}
        adapter = make_adapter(url, [workers[0].url], cluster, standbys=True)
        client = aioredis.Redis.from_url(url)
        try:
            for _ in range(3):
                await adapter.step()  # before the fix: TypeError from sorted(5)
            workers[1].answers["/assignment/"] = {"standbys": {CL: [0]}}
            await adapter.step()
            stored = decode_assignment(await client.get(Keys(cluster).assignment))
            assert stored.stores["counts"][0].standbys == (node_id_for(workers[1].url),)
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


@pytest.mark.parametrize("mode", ["trickle", "huge", "hang"])
def test_a_slow_or_huge_answer_costs_one_deadline_and_only_that_worker(
    redis_server: RedisHandle, mode: str
) -> None:
    async def test(url: str, cluster: str) -> None:
        workers = await start_workers(2)
        serve(workers, route(workers, [[0, 1], [2, 3]]))
        adapter = make_adapter(url, [workers[0].url], cluster, dead_after=1)
        client = aioredis.Redis.from_url(url)
        fast, slow = (node_id_for(w.url) for w in workers)
        try:
            await adapter.step()
            workers[1].mode = mode  # type: ignore[assignment]
            for _ in range(3):
                started = time.monotonic()
                await adapter.step()
                assert time.monotonic() - started < TIMEOUT_MS / 1000 + 0.5
            assert await alive_nodes(client, cluster) == {fast}  # the slow one: dead
            if mode != "huge":  # (a huge answer is refused at once, after 1 MB)
                # The fast worker's heartbeat counts from its answer, not from the end of a
                # round that waited for the slow one (finding 7).
                assert await client.pttl(Keys(cluster).alive(fast)) <= TTL_MS - TIMEOUT_MS + 150
            assert slow not in await alive_nodes(client, cluster)
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


def test_router_partitions_are_checked_and_counted_once() -> None:
    assert parse_router({"u": {"t": [2, 2, 1]}}) == {"u": {"t": [1, 2]}}
    for bad in ([-1], [True], [4], ["1"], 3):
        with pytest.raises(ValueError, match="worker 'u'"):
            parse_router({"u": {"t": bad}}, {"t": 4})
    # a worker listing itself twice does not outvote another worker's map
    views = {"a": parse_router({"a": {"t": [2, 2]}}), "b": parse_router({"b": {"t": [2]}})}
    assert owners(views, "t", 4)[2] is None


def test_a_second_adapter_waits_and_generations_only_grow(redis_server: RedisHandle) -> None:
    async def test(url: str, cluster: str) -> None:
        w1, w2, w3 = await start_workers(3)
        serve([w1, w2], route([w1, w2], [[0, 1], [2, 3]]))
        w3.answers["/router/"] = {w3.url: {CL: [0, 1, 2, 3]}}  # another view of the cluster
        first = make_adapter(url, [w1.url], cluster)
        second = make_adapter(url, [w3.url], cluster)
        client = aioredis.Redis.from_url(url)
        seen: list[tuple[int, str | None]] = []
        try:
            for _ in range(3):
                for adapter in (first, second):
                    await adapter.step()
                    stored = decode_assignment(await client.get(Keys(cluster).assignment))
                    seen.append((stored.generation, stored.stores["counts"][2].active))
            assert seen == [(1, node_id_for(w2.url))] * 6  # the second never wrote
            assert not second.lease.held
            await first.lease.release()  # the first stops: the second takes over at once
            await second.step()
            stored = decode_assignment(await client.get(Keys(cluster).assignment))
            assert (stored.generation, stored.stores["counts"][2].active) == (
                2,
                node_id_for(w3.url),
            )
            await first.step()  # the first, back: waits, writes nothing
            assert not first.lease.held
            assert decode_assignment(await client.get(Keys(cluster).assignment)) == stored
        finally:
            await first.close()
            await second.close()
            await client.aclose()

    run(redis_server, test)


def test_the_fenced_write_refuses_a_generation_not_greater(redis_server: RedisHandle) -> None:
    async def test(url: str, cluster: str) -> None:
        adapter = make_adapter(url, ["http://127.0.0.1:1"], cluster)
        client = aioredis.Redis.from_url(url)
        placed = {"counts": {0: PartitionAssignment("a")}}
        try:
            await SHARED.sync(client)
            assert await adapter.lease.hold()
            assert await adapter.lease.write(placed, "x", 1, lambda pipe, gen: None)
            adapter.lease.generation = 0  # a writer that forgot what it wrote
            other = {"counts": {0: PartitionAssignment("b")}}
            key = Keys(cluster).assignment
            raw = await client.get(key) or b""
            await client.set(key, raw.replace(b'"generation":1', b'"generation":9'))
            assert await adapter.lease.write(other, "x", 2, lambda pipe, gen: None)
            stored = decode_assignment(await client.get(Keys(cluster).assignment))
            assert stored.generation == 10  # past the stored one, never 1 again
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


def test_a_new_owner_has_unknown_lag_until_the_group_commits_again() -> None:
    book = LagBook()
    book.follow({0: "a"}, now_ms=1_000)
    book.observe({0: 100}, {0: 100}, asked_at_ms=1_100, at_ms=1_100)
    assert book.reports()[0].caught_up_at_ms is not None
    book.follow({0: None}, now_ms=2_000)  # rebalancing: nothing changes yet
    assert 0 in book.reports()
    book.follow({0: "b"}, now_ms=3_000)  # b took over: it restores before it consumes
    assert 0 not in book.reports()
    book.observe({0: 100}, {0: 100}, asked_at_ms=2_900, at_ms=3_100)  # asked before: ignored
    book.observe({0: 100}, {0: 100}, asked_at_ms=3_100, at_ms=3_100)  # the commit b starts at
    book.observe({0: 100}, {0: 120}, asked_at_ms=3_500, at_ms=3_500)
    assert 0 not in book.reports()  # still the old owner's commit
    book.observe({0: 110}, {0: 120}, asked_at_ms=4_000, at_ms=4_000)  # b consumes
    report = book.reports()[0]
    assert (report.current_offset, report.end_offset, report.caught_up_at_ms) == (110, 120, None)


def test_lag_is_read_beside_the_round_and_published_for_the_owner(
    redis_server: RedisHandle,
) -> None:
    async def test(url: str, cluster: str) -> None:
        workers = await start_workers(2)
        serve(workers, route(workers, [[0, 1], [2, 3]]))
        adapter = make_adapter(url, [workers[0].url], cluster)
        slow_reads = adapter._offsets

        async def slow(parts: list[int]) -> tuple[dict[tuple[str, int], int], ...]:
            await asyncio.sleep(3)
            return await slow_reads(parts)

        client = aioredis.Redis.from_url(url)
        try:
            await adapter.step()
            await asyncio.sleep(0.1)  # the first lag read (fast) lands
            await adapter.step()
            lag = await client.hgetall(Keys(cluster).lag(node_id_for(workers[0].url)))
            assert sorted(lag) == [b"counts/0", b"counts/1"]
            adapter._offsets = slow  # type: ignore[method-assign,assignment]
            started = time.monotonic()
            await adapter.step()
            await adapter.step()
            assert time.monotonic() - started < 1.0  # a slow broker does not hold rounds back
            body = json.loads(lag[b"counts/0"])
            assert body["current_offset"] == 100
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)
