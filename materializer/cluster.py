"""A node's part in the cluster, through Redis: heartbeat, reports, leadership, assignment.

- Heartbeat: `alive:<id>` is set with a TTL (~2 s) several times a second, so a dead node is
  known within the TTL, not after a consumer-group session timeout.
- Reports: what the node serves (`hosting:<id>`) and each partition's offsets (`lag:<id>`).
- Leadership: one node holds `leader` with a lease it renews; only the holder computes and
  writes the assignment, and the write itself checks the lease (a Lua script), so a leader that
  lost its lease cannot overwrite a newer leader's assignment.
- Watching: the node re-reads `assignment` when an event arrives and on a timer, and hands a
  newer generation to the node, which applies it.

When Redis is unreachable the node keeps serving what it has; its heartbeat lapses (so proxies
and the leader treat it as dead meanwhile) and every loop retries on its own schedule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog

from common.clock import now_ms
from common.contract import (
    Assignment,
    ContractError,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    PartitionReport,
    StoreInfo,
    as_text,
    decode_assignment,
    decode_node,
    decode_report,
    decode_store,
    encode,
    lag_field,
)
from materializer.assignment import Member, compute_assignment

log = structlog.get_logger("kroute.materializer.cluster")

# Renew the lease only if we still hold it; write only while we hold it (fencing).
_RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_WRITE_IF_LEADER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[2], ARGV[2])
  redis.call('PUBLISH', KEYS[3], ARGV[3])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class ClusterTiming:
    heartbeat_ms: int = 300
    alive_ttl_ms: int = 2000
    leader_lease_ms: int = 3000
    leader_interval_ms: int = 500
    report_interval_ms: int = 250
    poll_interval_ms: int = 1000
    grace_ms: int = 600_000
    standbys: int = 1
    acceptable_recovery_lag: int = 10_000


@dataclass
class ClusterMember:
    redis: aioredis.Redis
    keys: Keys
    node: NodeInfo
    store: StoreInfo
    timing: ClusterTiming
    hosting: Callable[[], Hosting]
    reports: Callable[[], Mapping[int, PartitionReport]]
    on_assignment: Callable[[Assignment], None]
    is_leader: bool = False
    redis_ok: bool = False
    assignment: Assignment | None = None
    node_urls: dict[str, str] = field(default_factory=dict)
    alive_nodes: frozenset[str] = frozenset()
    _dead_since: dict[str, int] = field(default_factory=dict)
    _last_hosting: tuple[object, ...] = ()

    async def run(self) -> None:
        loops = [
            self._every(self.timing.heartbeat_ms, self.heartbeat),
            self._every(self.timing.report_interval_ms, self.report),
            self._every(self.timing.leader_interval_ms, self.lead),
            self._every(self.timing.poll_interval_ms, self.refresh),
            self._listen(),
        ]
        await asyncio.gather(*loops)

    async def _every(self, interval_ms: int, step: Callable[[], object]) -> None:
        while True:
            try:
                await step()  # type: ignore[misc]
                if not self.redis_ok:
                    log.info("redis reachable again")
                self.redis_ok = True
            except (aioredis.RedisError, OSError) as exc:
                if self.redis_ok:
                    log.warning("redis unreachable; serving on, heartbeat lapsing", error=str(exc))
                self.redis_ok = False
                self.is_leader = False
            except Exception:  # one bad step (a malformed value, say) must not end the loop
                log.exception("cluster step failed; retrying", step=getattr(step, "__name__", "?"))
            await asyncio.sleep(interval_ms / 1000)

    async def heartbeat(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.node(self.node.node_id), encode(self.node))
            pipe.sadd(self.keys.nodes, self.node.node_id)
            pipe.set(self.keys.store(self.store.name), encode(self.store))
            pipe.sadd(self.keys.stores, self.store.name)
            pipe.set(self.keys.alive(self.node.node_id), b"1", px=self.timing.alive_ttl_ms)
            await pipe.execute()

    async def report(self) -> None:
        hosting = self.hosting()
        reports = {lag_field(self.store.name, p): encode(r) for p, r in self.reports().items()}
        # What it serves, not when it said so: an event only when that changes.
        serving = (hosting.generation, sorted(hosting.stores.items()))

        # One transaction that replaces the node's reports: fields an earlier run of this node
        # left behind (caught up then, restoring now) or partitions it gave up must not pass
        # for current ones, nor may a reader see the hash half-written.
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.hosting(self.node.node_id), encode(hosting))
            pipe.delete(self.keys.lag(self.node.node_id))
            if reports:
                pipe.hset(self.keys.lag(self.node.node_id), mapping=reports)  # type: ignore[arg-type]
                pipe.pexpire(self.keys.lag(self.node.node_id), self.timing.alive_ttl_ms * 10)
            if serving != self._last_hosting:
                pipe.publish(self.keys.events, encode(Event("hosting", node_id=self.node.node_id)))
            await pipe.execute()
        self._last_hosting = serving

    async def lead(self) -> None:
        me = self.node.node_id
        if self.is_leader:
            renewed = await self.redis.eval(
                _RENEW_LEASE, 1, self.keys.leader, me, self.timing.leader_lease_ms
            )
            if not renewed:
                log.warning("lost the leader lease")
                self.is_leader = False
        if not self.is_leader:
            acquired = await self.redis.set(
                self.keys.leader, me, nx=True, px=self.timing.leader_lease_ms
            )
            if not acquired:
                return
            log.info("became the leader")
            self.is_leader = True
            self._dead_since = {}  # grace periods restart with a new leader: never move early
        await self._assign()

    async def _assign(self) -> None:
        members, stores, lag = await self._cluster_state()
        previous = self.assignment
        assignment = compute_assignment(
            stores,
            members,
            previous,
            lag,
            standbys=self.timing.standbys,
            grace_ms=self.timing.grace_ms,
            caught_up_lag=self.timing.acceptable_recovery_lag,
            now_ms=now_ms(),
            leader=self.node.node_id,
        )
        unchanged = previous is not None and assignment.generation == previous.generation
        if unchanged and await self.redis.exists(self.keys.assignment):
            return  # (a Redis that lost its data gets the assignment back at once)

        event = encode(Event("assignment", generation=assignment.generation))
        written = await self.redis.eval(
            _WRITE_IF_LEADER, 3, self.keys.leader, self.keys.assignment, self.keys.events,
            self.node.node_id, encode(assignment), event,
        )  # fmt: skip
        if written:
            log.info("assignment written", generation=assignment.generation)
            self._accept(assignment)

    async def _cluster_state(
        self,
    ) -> tuple[dict[str, Member], dict[str, int], dict[tuple[str, int, str], int | None]]:
        # Never know less than the last assignment: a Redis that lost its data (restarted
        # empty) must not make the leader drop stores and nodes before they register again.
        # Nodes it held count as members (dead until their heartbeat returns: grace applies).
        previous = self.assignment
        placements = (
            [p for parts in previous.stores.values() for p in parts.values()] if previous else []
        )
        remembered_nodes = {node for placed in placements for node in placed.replicas()}

        registered = {as_text(n) for n in await self.redis.smembers(self.keys.nodes)}
        node_ids = sorted(registered | remembered_nodes)
        store_names = sorted(as_text(s) for s in await self.redis.smembers(self.keys.stores))
        alive_flags = (
            await self.redis.mget([self.keys.alive(n) for n in node_ids]) if node_ids else []
        )
        stores: dict[str, int] = {
            name: len(parts) for name, parts in (previous.stores.items() if previous else ())
        }

        for name, raw in zip(
            store_names,
            await self.redis.mget([self.keys.store(s) for s in store_names]) if store_names else [],
            strict=True,
        ):
            if raw is not None:
                stores[name] = decode_store(raw).partitions
        at = now_ms()
        members: dict[str, Member] = {}
        for node_id, flag in zip(node_ids, alive_flags, strict=True):
            if flag is not None:
                self._dead_since.pop(node_id, None)
                members[node_id] = Member(node_id, alive=True)
            else:
                members[node_id] = Member(
                    node_id, alive=False, dead_since_ms=self._dead_since.setdefault(node_id, at)
                )
        lag: dict[tuple[str, int, str], int | None] = {}
        for node_id in node_ids:
            reported = await self.redis.hgetall(self.keys.lag(node_id))
            for lag_key, raw in reported.items():
                store_name, _, partition = as_text(lag_key).rpartition("/")
                try:
                    lag[(store_name, int(partition), node_id)] = decode_report(raw).lag
                except (ContractError, ValueError):
                    continue
        return members, stores, lag

    async def refresh(self) -> None:
        """Re-read the assignment and who is alive (on a timer, and on every event)."""
        raw = await self.redis.get(self.keys.assignment)
        node_ids = sorted(as_text(n) for n in await self.redis.smembers(self.keys.nodes))
        if node_ids:
            flags = await self.redis.mget([self.keys.alive(n) for n in node_ids])
            self.alive_nodes = frozenset(
                n for n, f in zip(node_ids, flags, strict=True) if f is not None
            )
            infos = await self.redis.mget([self.keys.node(n) for n in node_ids])
            self.node_urls = {
                n: decode_node(i).url for n, i in zip(node_ids, infos, strict=True) if i
            }

        if raw is None:
            return
        try:
            assignment = decode_assignment(raw)
        except ContractError as exc:
            log.warning("ignoring an assignment this node cannot read", error=str(exc))
            return
        if self.assignment is None or assignment.generation != self.assignment.generation:
            self._accept(assignment)

    def _accept(self, assignment: Assignment) -> None:
        self.assignment = assignment
        self.on_assignment(assignment)

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.keys.events)
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        await self.refresh()
            except (aioredis.RedisError, OSError):
                await asyncio.sleep(self.timing.poll_interval_ms / 1000)
