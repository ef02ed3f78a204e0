"""`kroute adapt fixed`: per-replica freshness, refilling a flushed Redis, slow health
endpoints, a Redis down at start, a second adapter, and one-line usage errors (review 18).
Real redis-server; fake HTTP backends."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from common.contract import Keys, decode_report
from kroute.adapters.fixed import FixedPlacement, PlacementFile
from kroute.cli import main
from kroute.embedded import RedisHandle, free_port
from tests.adapters.fake_workers import start_workers, stop_all

pytestmark = pytest.mark.integration


def spec_for(nodes: dict[str, str], **extra: Any) -> PlacementFile:
    placement = {"0": {"active": "a", "standbys": ["b"]}, "1": {"active": "b"}}
    return PlacementFile.model_validate({
        "nodes": nodes,
        "stores": {"s": {"topic": "t", "partitions": 2, "placement": placement}},
        "health": {"interval_ms": 200, "timeout_ms": 300},
        **extra,
    })  # fmt: skip


def run(redis_server: RedisHandle, test: Callable[[str, Keys], Awaitable[None]]) -> None:
    async def with_workers() -> None:
        try:
            await test(redis_server.url, Keys(f"x-{uuid.uuid4().hex[:8]}"))
        finally:
            await stop_all()

    asyncio.run(with_workers())


def group_lag(group: str) -> dict[str, str]:
    return {"source": "consumer_group", "bootstrap_servers": "127.0.0.1:1", "group": group}


@pytest.mark.parametrize("group", ["svc-{node}", "svc"])
def test_each_replica_has_its_own_freshness(redis_server: RedisHandle, group: str) -> None:
    async def test(url: str, keys: Keys) -> None:
        nodes = {"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}
        client = aioredis.Redis.from_url(url)
        adapter = FixedPlacement(spec_for(nodes, lag=group_lag(group)), client, keys)
        try:
            await adapter.clock.sync(client)
            now = adapter.clock.now_ms()
            adapter.remember_ends({("s", 0): 10}, now - 60_000)
            adapter.remember_ends({("s", 0): 1000}, now)
            committed = {("a", "s", 0): 1000, ("b", "s", 0): 10}
            active = decode_report(adapter._reports("a", committed, now)["s/0"])
            assert active.caught_up_at_ms == now
            standby = adapter._reports("b", committed, now)
            if group == "svc-{node}":  # b's own group: caught up a minute ago, not now
                assert decode_report(standby["s/0"]).caught_up_at_ms == now - 60_000
            else:  # one group: its commits are a's; b's progress is unknown
                assert "s/0" not in standby
        finally:
            await adapter.close()
            await client.aclose()

    run(redis_server, test)


def test_a_flushed_redis_is_refilled_and_a_slow_node_delays_nobody(
    redis_server: RedisHandle,
) -> None:
    async def test(url: str, keys: Keys) -> None:
        fast, slow = await start_workers(2)
        client = aioredis.Redis.from_url(url)
        adapter = FixedPlacement(spec_for({"a": fast.url, "b": slow.url}), client, keys)
        task = asyncio.create_task(adapter.run())
        try:
            await asyncio.sleep(0.6)
            before = set(await client.keys(keys.prefix + "*"))
            for key in before:
                await client.delete(key)  # Redis lost its data
            await asyncio.sleep(0.6)
            assert set(await client.keys(keys.prefix + "*")) == before
            slow.mode = "hang"  # never answers its health probe
            for _ in range(10):
                await asyncio.sleep(0.25)
                assert await client.exists(keys.alive("a"))  # a's heartbeat never lapses
            assert not await client.exists(keys.alive("b"))
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    run(redis_server, test)


def test_redis_down_at_start_is_retried_not_fatal(redis_server: RedisHandle) -> None:
    async def test(_url: str, keys: Keys) -> None:
        client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}", socket_timeout=0.3)
        adapter = FixedPlacement(
            spec_for({"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}), client, keys
        )
        task = asyncio.create_task(adapter.run())
        try:
            await asyncio.sleep(1.0)
            assert not task.done()  # before the fix: ConnectionError out of run()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.aclose()

    run(redis_server, test)


def test_a_second_adapter_writes_nothing_while_the_first_holds_the_lease(
    redis_server: RedisHandle,
) -> None:
    async def test(url: str, keys: Keys) -> None:
        (worker,) = await start_workers(1)
        nodes = {"a": worker.url, "b": worker.url}
        client = aioredis.Redis.from_url(url)
        first = FixedPlacement(spec_for(nodes), client, keys)
        old = spec_for(nodes).model_copy(update={"stores": {}})  # an old file: other placement
        second = FixedPlacement(old, client, keys)
        try:
            await first.probe_and_heartbeat()
            stored = await client.get(keys.assignment)
            await second.probe_and_heartbeat()
            assert await client.get(keys.assignment) == stored
            assert not second.lease.held
        finally:
            await first.close()
            await second.close()
            await client.aclose()

    run(redis_server, test)


BAD_FILES: dict[str, tuple[bytes, str]] = {
    "not UTF-8": (b"\xff\xfe{}", "not UTF-8 text"),
    "URL with a path": (b'"http://127.0.0.1:9/svc"', "is not http://host:port"),
    "TTL below the interval": (b'"http://127.0.0.1:9"', "alive_ttl_ms 100 must exceed"),
    "unknown placeholder": (b'"http://127.0.0.1:9"', "unknown placeholders ['{region}']"),
}


def _file(tmp_path: Path, name: str) -> Path:
    content, _ = BAD_FILES[name]
    path = tmp_path / "placement.json"
    if name == "not UTF-8":
        path.write_bytes(content)
        return path
    body: dict[str, Any] = {
        "nodes": {"a": json.loads(content)},
        "stores": {"s": {"topic": "t", "partitions": 1, "placement": {"0": {"active": "a"}}}},
    }
    if name == "TTL below the interval":
        body["health"] = {"interval_ms": 5000, "alive_ttl_ms": 100}
    if name == "unknown placeholder":
        body["lag"] = group_lag("svc-{region}")
    path.write_text(json.dumps(body))
    return path


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_a_bad_file_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    assert main(["adapt", "fixed", "--placement", str(_file(tmp_path, name)), "--check"]) == 2
    err = capsys.readouterr().err
    assert BAD_FILES[name][1] in err
    assert err.count("\n") == 1


def test_usage_errors_of_the_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "placement.json"
    path.write_text(
        spec_for({"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}).model_dump_json()
    )
    assert main(["adapt", "fixed", "--placement", str(path), "--check"]) == 0  # no --redis
    capsys.readouterr()
    usage = [
        ["adapt", "fixed", "--placement", str(path)],
        ["adapt", "fixed", "--placement", str(path), "--redis", "notaurl"],
        ["adapt", "faust", "--worker", "http://a:1", "--table", "t", "--store", "s",
         "--redis", "notaurl", "--bootstrap", "k:1"],
        ["contract", "check", "--redis", "notaurl"],
    ]  # fmt: skip
    for argv in usage:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("kroute: "), err
        assert err.count("\n") == 1, err
    assert main(["contract", "check", "--redis", f"redis://127.0.0.1:{free_port()}"]) == 1
    err = capsys.readouterr().err
    assert "cannot read Redis" in err
    assert err.count("\n") == 1
