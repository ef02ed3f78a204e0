"""A lookup service written the way users write them, joined to kroute with `kroute.agent`.

An ASGI app served by uvicorn with its own aiokafka consumer group and in-memory state: the
latest value of every key of the partitions this instance holds. In-memory state is rebuilt
from the start of each partition the group gives it (no offsets are committed). Started as a
separate process (`python -m tests.adapters.consumer_service`), configured by environment:
BOOTSTRAP, TOPIC, GROUP, PARTITIONS, PORT, NODE_ID, REDIS_URL, CLUSTER, STORE.

  GET  /health/live                 200
  GET  /stores/{store}/keys/{key}   200 {"key", "value", "partition", "offset", "node", "id"}
                                    (id: the x-request-id header), 404 for a key it does not
                                    have, 421 for a key of a partition it does not hold
  POST /admin/pause, /admin/resume  pause / resume its consumer (tests: lag must follow)

The lines that join kroute are marked "kroute:".
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import unquote

import uvicorn
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition

from common.contract import StoreInfo
from kroute.agent import Agent, AgentTiming, aiokafka_positions
from partitioner import partition

Scope = dict[str, Any]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class Service:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.node_id = env["NODE_ID"]
        self.topic = env["TOPIC"]
        self.partitions = int(env["PARTITIONS"])
        self.state: dict[int, dict[str, tuple[Any, int]]] = {}  # partition -> key -> (v, offset)
        self.parked: dict[int, dict[str, tuple[Any, int]]] = {}  # revoked, maybe coming back
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=env["BOOTSTRAP"],
            group_id=env["GROUP"],
            enable_auto_commit=False,  # in-memory state: rebuilt from the start every time
            auto_offset_reset="earliest",
            fetch_max_wait_ms=20,  # Tansu does not wake waiting fetches
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
        )

    # -- the consumer side -----------------------------------------------------------------

    async def consume(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=100)
            # Applied before the next await: the agent reads positions between batches.
            for tp, records in batches.items():
                held = self.state.get(tp.partition)
                if held is None:
                    continue  # revoked while the batch was in flight
                for record in records:
                    key = (record.key or b"").decode()
                    held[key] = (json.loads(record.value or b"null"), record.offset)

    async def on_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        # Eager rebalancing revokes everything first: what comes back resumes where it was.
        for tp in assigned:
            kept = self.parked.pop(tp.partition, None)
            self.state[tp.partition] = kept or {}
            if kept:
                self.consumer.seek(tp, max(offset for _, offset in kept.values()) + 1)
            else:
                await self.consumer.seek_to_beginning(tp)
        self.parked.clear()  # given to another instance: it rebuilds them

    def on_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        for tp in revoked:
            held = self.state.pop(tp.partition, None)
            if held:
                self.parked[tp.partition] = held

    # -- the HTTP side ---------------------------------------------------------------------

    async def app(self, scope: Scope, receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode()
        parts = path.strip("/").split("/")
        if path == "/health/live":
            await _answer(send, 200, {"node": self.node_id})
        elif method == "POST" and path in ("/admin/pause", "/admin/resume"):
            held = list(self.consumer.assignment())
            (self.consumer.pause if path.endswith("pause") else self.consumer.resume)(*held)
            await _answer(send, 200, {"node": self.node_id, "partitions": len(held)})
        elif len(parts) == 4 and parts[0] == "stores" and parts[2] == "keys":
            await self.lookup(send, unquote(parts[3]), request_id)
        else:
            await _answer(send, 404, {"error": "no such path"})

    async def lookup(self, send: Send, key: str, request_id: str) -> None:
        chosen = partition(key.encode(), self.partitions)
        held = self.state.get(chosen)
        if held is None:
            # Not mine (any more): 421 makes the proxy try the current owner.
            await _answer(send, 421, {"error": "not this node's partition", "partition": chosen})
            return
        if key not in held:
            await _answer(send, 404, {"key": key, "node": self.node_id, "id": request_id})
            return
        value, offset = held[key]
        body = {"key": key, "value": value, "partition": chosen, "offset": offset}
        await _answer(send, 200, {**body, "node": self.node_id, "id": request_id})


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, service: Service) -> None:
        self.service = service

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        await self.service.on_assigned(assigned)

    def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        self.service.on_revoked(revoked)


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def main() -> None:
    env = dict(os.environ)
    service = Service(env)
    port = int(env["PORT"])
    # kroute: describe this instance, let the agent hear the rebalances, run it alongside.
    agent = Agent.connect(
        env["REDIS_URL"],
        node_id=service.node_id,
        url=f"http://127.0.0.1:{port}",
        store=StoreInfo(env["STORE"], service.topic, service.partitions),
        bootstrap_servers=env["BOOTSTRAP"],
        cluster=env["CLUSTER"],
        timing=AgentTiming(
            heartbeat_ms=300,
            alive_ttl_ms=2000,
            report_interval_ms=250,
            tidy_ms=int(env.get("TIDY_MS", AgentTiming.tidy_ms)),
            forget_after_ms=int(env.get("FORGET_AFTER_MS", AgentTiming.forget_after_ms)),
        ),
    )
    service.consumer.subscribe(
        [service.topic], listener=agent.aiokafka_listener(_Listener(service))
    )
    await service.consumer.start()
    server = uvicorn.Server(
        uvicorn.Config(
            service.app, host="127.0.0.1", port=port, log_level="warning", interface="asgi3"
        )
    )
    try:
        async with agent.running(aiokafka_positions(service.consumer, service.topic)):
            consuming = asyncio.create_task(service.consume())
            await server.serve()  # until SIGTERM (uvicorn's handler)
            consuming.cancel()
    finally:
        await service.consumer.stop()


if __name__ == "__main__":
    asyncio.run(main())
