"""Keeps the routing snapshot current from Redis: pub/sub events plus a periodic poll.

Every refresh reads the whole contract (two round trips), builds a new immutable snapshot off
to the side and hands it over with one call; requests never touch Redis. When Redis cannot be
read the last snapshot stays in use, the watcher reports itself degraded, and it keeps
retrying on its own; the first good read clears the flag. Values that do not follow the
contract are skipped (and logged once each), never half-applied.

Every refresh also reads Redis `TIME` (in the same round trip), which keeps this process's
shared clock (`common.clock`) in step: the times nodes report are Redis time, and so is the
"now" the proxy measures them against. A report stamped further in the future than
`CLOCK_TOLERANCE_MS` comes from a writer whose clock is not the shared one (ahead: its
"caught up at" would make answers look fresher than they are) and is treated as no report.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import structlog

from common.clock import CLOCK_TOLERANCE_MS, SHARED, SharedClock
from common.contract import (
    ContractError,
    Hosting,
    Keys,
    NodeInfo,
    PartitionReport,
    StoreInfo,
    as_text,
    decode_assignment,
    decode_hosting,
    decode_node,
    decode_report,
    decode_store,
)
from proxy.routing import EMPTY, RoutingSnapshot, build_snapshot

log = structlog.get_logger("kroute.proxy.watcher")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
MIN_GAP_S = 0.02  # coalesce bursts of events (every node reports lag several times a second)


class TableWatcher:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        refresh_interval_ms: int,
        networks: tuple[Network, ...] | None,
        on_snapshot: Callable[[RoutingSnapshot], None] = lambda _snapshot: None,
        hold_smaller_table_ms: int = 10_000,
        clock: SharedClock = SHARED,
    ) -> None:
        self.redis = redis
        self.clock = clock  # this process's (the handler's now_ms reads the same one)
        self.keys = keys
        self.refresh_interval_s = refresh_interval_ms / 1000
        self.networks = networks
        self.on_snapshot = on_snapshot
        self.snapshot: RoutingSnapshot = EMPTY
        self.loaded = False
        self.degraded = False
        self.last_error: str | None = None
        self.last_refresh_ms: int | None = None
        self.refreshes = 0
        self.refresh_failures = 0
        self.hold_smaller_table_ms = hold_smaller_table_ms
        self._smaller_since_ms: int | None = None
        self._wake = asyncio.Event()
        self._warned: set[str] = set()

    def refresh_soon(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        await asyncio.gather(self._poll(), self._listen())

    async def _poll(self) -> None:
        while True:
            self._wake.clear()
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.refresh_interval_s)
            await asyncio.sleep(MIN_GAP_S)

    async def refresh(self) -> None:
        try:
            snapshot = await self._read()
        except (aioredis.RedisError, OSError) as exc:
            self.refresh_failures += 1
            self.last_error = str(exc) or type(exc).__name__
            if not self.degraded:
                log.warning(
                    "redis unreachable: routing on the last table",
                    error=self.last_error,
                    table_generation=self.snapshot.generation,
                )
            self.degraded = True
            return
        if self._holding_last_table(snapshot):
            return
        if self.degraded:
            log.info("redis reachable again: table refreshed", generation=snapshot.generation)
        self.degraded = False
        self.last_error = None
        self.loaded = True
        self.refreshes += 1
        self.last_refresh_ms = snapshot.built_at_ms
        previous, self.snapshot = self.snapshot, snapshot
        if previous.generation != snapshot.generation:
            log.info("routing table changed", generation=snapshot.generation)
        self.on_snapshot(snapshot)

    def _holding_last_table(self, snapshot: RoutingSnapshot) -> bool:
        """Whether to keep the last table because Redis now holds less than it described.

        A Redis restarted empty fills up again as nodes heartbeat and the leader rewrites the
        assignment; swapping in a half-filled table would turn good reads into 404s and 503s.
        So a table with fewer placed replicas than the last one is held back for
        `hold_smaller_table_ms` (a real shrink, such as a cluster down to one node that can
        no longer place standbys, is accepted after that).
        """
        if not self.loaded or _placed(snapshot) >= _placed(self.snapshot):
            self._smaller_since_ms = None
            return False
        at = self.clock.now_ms()
        if self._smaller_since_ms is None:
            self._smaller_since_ms = at
            log.warning(
                "redis describes less than the last table (restarted empty?): keeping it",
                placed_now=_placed(snapshot),
                placed_before=_placed(self.snapshot),
                hold_ms=self.hold_smaller_table_ms,
            )
        if at - self._smaller_since_ms < self.hold_smaller_table_ms:
            self.degraded = True
            self.last_error = "redis holds less than the last table; waiting for nodes"
            return True
        log.warning("accepting a smaller table", placed=_placed(snapshot))
        self._smaller_since_ms = None
        return False

    async def _read(self) -> RoutingSnapshot:
        keys = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.smembers(keys.nodes)
            pipe.smembers(keys.stores)
            pipe.get(keys.assignment)
            pipe.time()
            sent = self.clock.stopwatch()
            node_set, store_set, raw_assignment, redis_time = await pipe.execute()
            self.clock.observe(redis_time, sent, self.clock.stopwatch())
        node_ids = sorted(as_text(n) for n in node_set)
        store_names = sorted(as_text(s) for s in store_set)
        async with self.redis.pipeline(transaction=False) as pipe:
            for node_id in node_ids:
                pipe.get(keys.node(node_id))
                pipe.exists(keys.alive(node_id))
                pipe.get(keys.hosting(node_id))
                pipe.hgetall(keys.lag(node_id))
            for name in store_names:
                pipe.get(keys.store(name))
            results = await pipe.execute()
        at = self.clock.now_ms()  # after the reports arrived: none can be newer but by skew
        nodes: dict[str, NodeInfo] = {}
        alive: set[str] = set()
        hostings: dict[str, Hosting] = {}
        reports: dict[tuple[str, str, int], PartitionReport] = {}
        for index, node_id in enumerate(node_ids):
            raw_node, is_alive, raw_hosting, raw_lag = results[index * 4 : index * 4 + 4]
            info = self._decoded(decode_node, raw_node, f"node:{node_id}")
            if info is None or not self._allowed(info):
                continue
            nodes[node_id] = info
            if is_alive:
                alive.add(node_id)
            hosting = self._decoded(decode_hosting, raw_hosting, f"hosting:{node_id}")
            if hosting is not None:
                hostings[node_id] = hosting
            for raw_field, raw_report in raw_lag.items():
                store, _, partition = as_text(raw_field).rpartition("/")
                report = self._decoded(decode_report, raw_report, f"lag:{node_id}")
                if report is not None and self._from_the_future(node_id, report, at):
                    continue
                if report is not None and partition.isdigit():
                    reports[(node_id, store, int(partition))] = report
        stores: dict[str, StoreInfo] = {}
        for name, raw_store in zip(store_names, results[len(node_ids) * 4 :], strict=True):
            info_store = self._decoded(decode_store, raw_store, f"store:{name}")
            if info_store is not None:
                stores[name] = info_store
        assignment = self._decoded(decode_assignment, raw_assignment, "assignment")
        return build_snapshot(
            stores=stores,
            assignment=assignment,
            hostings=hostings,
            reports=reports,
            nodes=nodes,
            alive=frozenset(alive),
            built_at_ms=at,
        )

    def _from_the_future(self, node_id: str, report: PartitionReport, at: int) -> bool:
        """Whether a report carries a time beyond what two synced clocks can disagree by.

        Its writer's clock runs ahead of Redis time (a writer that does not sync, or not
        yet): its "caught up at" would understate how stale an answer is by that much, so
        the report counts as missing (unknown lag: refused under a budget), not as fresh."""
        newest = max(report.updated_at_ms, report.caught_up_at_ms or 0)
        if newest <= at + CLOCK_TOLERANCE_MS:
            return False
        self._warn_once(
            f"future:{node_id}",
            "ignoring lag reports stamped in the future: the node's clock is ahead of redis time",
            node=node_id,
            ahead_by_ms=newest - at,
            tolerance_ms=CLOCK_TOLERANCE_MS,
        )
        return True

    def _decoded(self, decode: Callable[[Any], Any], raw: Any, what: str) -> Any:
        if raw is None:
            return None
        try:
            return decode(raw)
        except (ContractError, ValueError) as exc:
            self._warn_once(f"{what}:{exc}", "ignoring a value that breaks the contract", key=what)
            return None

    def _allowed(self, info: NodeInfo) -> bool:
        parts = urlsplit(info.url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            self._warn_once(
                f"url:{info.node_id}:{info.url}",
                "ignoring a node whose URL is not http://host:port",
                node=info.node_id,
                url=info.url,
            )
            return False
        if self.networks is None:
            return True
        try:
            address = ipaddress.ip_address(parts.hostname)
        except ValueError:
            address = None
        if address is None or not any(address in network for network in self.networks):
            self._warn_once(
                f"allow:{info.node_id}:{info.url}",
                "ignoring a node outside KROUTE_ALLOWED_NETWORKS",
                node=info.node_id,
                url=info.url,
            )
            return False
        return True

    def _warn_once(self, token: str, message: str, **fields: Any) -> None:
        if token not in self._warned:
            self._warned.add(token)
            log.warning(message, **fields)

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.events)
                self.refresh_soon()  # whatever happened while we were not subscribed
                while True:
                    message = await pubsub.get_message(timeout=self.refresh_interval_s)
                    if message is not None and message.get("type") == "message":
                        self.refresh_soon()
            except (aioredis.RedisError, OSError):
                await asyncio.sleep(self.refresh_interval_s)
            finally:
                with contextlib.suppress(aioredis.RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]


def _placed(snapshot: RoutingSnapshot) -> int:
    return sum(len(replicas) for route in snapshot.stores.values() for replicas in route.replicas)
