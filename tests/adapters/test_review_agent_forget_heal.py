"""Review of fe7fc40, invariant 2: a wrong call heals. An instance paused for longer than
`forget_after_ms` (its partitions given to another by the group meanwhile) is forgotten by the
other agent's tidy round; when it resumes, its own loops register it again and the group's
rebalance gives it partitions, and a real proxy routes its keys to it again, with no manual
step. Real redis-server and proxy; the instances' HTTP servers are tiny in-process ones; no
Kafka (end offsets are the positions: lag 0)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis

import kroute.agent as agent_module
from common.contract import Keys, NodeInfo, StoreInfo, as_text
from common.departed import queue_forget
from kroute.agent import Agent, AgentTiming
from kroute.contract_check import check
from kroute.embedded import EmbeddedServices, RedisHandle
from kroute.proxies import ProxyHandle, start_proxy
from partitioner import KeyPartitioner

pytestmark = pytest.mark.integration

STORE = StoreInfo("customers", "customers", 4)
TIMING = AgentTiming(
    heartbeat_ms=150, alive_ttl_ms=600, report_interval_ms=250, tidy_ms=300, forget_after_ms=1500
)


class _Answer(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"node": self.server.node_name}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class Instance:
    """One service instance: an HTTP server naming itself and an agent whose loops a test
    starts and stops (stopping without leaving: a paused process writes nothing)."""

    def __init__(self, url: str, keys: Keys, name: str) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
        self.server.node_name = name  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        port = self.server.server_address[1]
        self.agent = Agent(
            redis=aioredis.Redis.from_url(url),
            keys=keys,
            node=NodeInfo(name, f"http://127.0.0.1:{port}", 0),
            store=STORE,
            bootstrap_servers="127.0.0.1:1",
            timing=TIMING,
        )
        self.agent._kafka = object()  # ends come from the stand-in (ends_are_positions)
        self.tasks: list[asyncio.Task[None]] = []
        self.stop = asyncio.Event()

    async def start(self) -> None:
        agent = self.agent
        await agent.clock.sync(agent.redis)
        agent.node = NodeInfo(agent.node.node_id, agent.node.url, agent.clock.now_ms())
        self.stop = asyncio.Event()
        self.tasks = [
            asyncio.create_task(self._every(TIMING.heartbeat_ms, agent.heartbeat)),
            asyncio.create_task(
                self._every(TIMING.report_interval_ms, lambda: agent.report(at_ten))
            ),
            asyncio.create_task(self._every(TIMING.tidy_ms, agent.forget_departed)),
        ]

    async def _every(self, interval_ms: int, step: Any) -> None:
        """`Agent._every`, stopped between steps (a cancel in the middle of one would leave
        its connection to the garbage collector)."""
        while not self.stop.is_set():
            with contextlib.suppress(Exception):  # as Agent._every: the loop goes on
                await step()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), interval_ms / 1000)

    async def pause(self) -> None:
        """Stop writing, without leaving: a paused process writes nothing."""
        self.stop.set()
        await asyncio.gather(*self.tasks)
        self.tasks = []

    async def close(self) -> None:
        await self.pause()
        await self.agent.redis.aclose()
        self.server.shutdown()
        self.server.server_close()


async def at_ten(held: Collection[int]) -> Mapping[int, int]:
    return dict.fromkeys(held, 10)


async def ends_are_positions(
    _kafka: object,
    _topic: str,
    held: Collection[int],
    *,
    positions: Mapping[int, int],
    timeout_s: float,
) -> dict[int, int]:
    return {p: positions.get(p, 10) for p in held}


def keys_by_partition() -> dict[int, list[str]]:
    partitioner = KeyPartitioner(STORE.key_format, STORE.partitioner, STORE.partitions)
    found: dict[int, list[str]] = {p: [] for p in range(STORE.partitions)}
    i = 0
    while any(len(v) < 3 for v in found.values()):
        key = f"k{i}"
        found[partitioner.partition_of(key)].append(key)
        i += 1
    return found


def answered_by(proxy: ProxyHandle, key: str) -> str | None:
    try:
        response = proxy.get(f"/stores/{STORE.name}/keys/{key}")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return str(response.json().get("node"))


async def until(what: str, condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(condition):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@pytest.fixture
def client(redis_server: RedisHandle) -> Iterator[redis.Redis]:
    made = redis.Redis.from_url(redis_server.url)
    try:
        yield made
    finally:
        made.close()


def test_an_instance_forgotten_while_paused_comes_back_and_is_routed_to_again(
    embedded: EmbeddedServices,
    redis_server: RedisHandle,
    client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_module, "fetch_high_watermarks", ends_are_positions)
    keys = Keys(f"review-heal-{uuid.uuid4().hex[:8]}")
    by_partition = keys_by_partition()

    def routes(owners: dict[int, str]) -> bool:
        return all(
            answered_by(proxy, key) == owner
            for partition, owner in owners.items()
            for key in by_partition[partition]
        )

    def registered() -> set[str]:
        return {as_text(n) for n in client.smembers(keys.nodes)}

    proxy: ProxyHandle

    async def scenario() -> None:
        nonlocal proxy
        other = Instance(redis_server.url, keys, "other")
        paused = Instance(redis_server.url, keys, "paused")
        try:
            for instance in (other, paused):
                await instance.start()
            await other.agent.assigned([0, 1])
            await paused.agent.assigned([2, 3])
            proxy = await asyncio.to_thread(
                start_proxy, embedded, redis_server.url, name=f"proxy-{keys.cluster}",
                cluster=keys.cluster,
            )  # fmt: skip
            try:
                everyone = {0: "other", 1: "other", 2: "paused", 3: "paused"}
                await until("the proxy routes to both", lambda: routes(everyone), 15)

                # Paused (no writes, no leave); the group gives its partitions to `other`.
                await paused.pause()
                await other.agent.assigned([2, 3])
                await until(
                    "the paused instance forgotten",
                    lambda: (
                        "paused" not in registered()
                        and not client.exists(keys.node("paused"), keys.hosting("paused"))
                    ),
                    (TIMING.alive_ttl_ms + TIMING.forget_after_ms + 3 * TIMING.tidy_ms) / 1000 + 5,
                )
                await until(
                    "the proxy dropped it",
                    lambda: "paused" not in proxy.status()["nodes"],
                    10,
                )
                await until(
                    "other serves all", lambda: routes(dict.fromkeys(range(4), "other")), 10
                )

                # It resumes: its own loops, then the group's rebalance, no manual step.
                await paused.start()
                await other.agent.revoked([2, 3])
                await paused.agent.revoked([2, 3])
                await paused.agent.assigned([2, 3])
                await until("registered again", lambda: "paused" in registered(), 5)
                await until("the proxy routes to it again", lambda: routes(everyone), 15)
                assert client.exists(keys.node("paused"), keys.alive("paused")) == 2
                assert client.exists(keys.hosting("paused"), keys.report("paused")) == 2
                report = check(client, keys.cluster)
                assert not report.errors, report.as_text()
            finally:
                proxy.process.stop()
                proxy.close()
        finally:
            for instance in (other, paused):
                await instance.close()

    asyncio.run(scenario())


def test_a_running_instance_forgotten_by_a_racing_round_heals_within_seconds(
    embedded: EmbeddedServices,
    redis_server: RedisHandle,
    client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a round whose reads were stale does to an instance that is running (see the races
    in test_review_agent_forget.py): its keys deleted while it writes on. Its own loops bring
    it back, `report:<id>` included (its agent still thinks that body written)."""
    monkeypatch.setattr(agent_module, "fetch_high_watermarks", ends_are_positions)
    keys = Keys(f"review-heal-{uuid.uuid4().hex[:8]}")
    by_partition = keys_by_partition()
    everyone = {0: "other", 1: "other", 2: "live", 3: "live"}

    def routes() -> bool:
        return all(
            answered_by(proxy, key) == owner
            for partition, owner in everyone.items()
            for key in by_partition[partition]
        )

    def clean() -> bool:
        return not check(client, keys.cluster).errors

    proxy: ProxyHandle

    async def scenario() -> None:
        nonlocal proxy
        other = Instance(redis_server.url, keys, "other")
        live = Instance(redis_server.url, keys, "live")
        try:
            for instance in (other, live):
                await instance.start()
            await other.agent.assigned([0, 1])
            await live.agent.assigned([2, 3])
            proxy = await asyncio.to_thread(
                start_proxy, embedded, redis_server.url, name=f"proxy-{keys.cluster}",
                cluster=keys.cluster,
            )  # fmt: skip
            try:
                await until("the proxy routes to both", routes, 15)
                await until("the contract holds", clean, 5)
                with client.pipeline(transaction=True) as pipe:
                    queue_forget(pipe, keys, ["live"])
                    pipe.execute()
                started = time.monotonic()
                await until("the proxy routes to it again", routes, 10)
                await until(
                    "report:<id> written again", lambda: client.exists(keys.report("live")), 5
                )
                why = check(client, keys.cluster)
                assert not why.errors, why.as_text()
                assert time.monotonic() - started < 5
            finally:
                proxy.process.stop()
                proxy.close()
        finally:
            for instance in (other, live):
                await instance.close()

    asyncio.run(scenario())
