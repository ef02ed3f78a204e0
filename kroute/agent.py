"""Join kroute from a service built on a Kafka consumer group (aiokafka or confluent-kafka).

A service that consumes a key-partitioned topic with a consumer group, keeps per-key state and
answers lookups by key over HTTP already owns exactly the partitions the group gave it. The
agent publishes that in Redis as `docs/redis-contract.md` asks, so a kroute proxy sends each
key straight to the instance holding its partition:

- `node:<id>`, `nodes`, `store:<name>`, `stores`, and `alive:<id>` with a TTL, every
  heartbeat: a killed instance is seen dead within the TTL, not after the group's session
  timeout;
- `hosting:<id>`: the partitions the consumer holds, from its rebalance callbacks (all active:
  consumer groups have no standbys), rewritten at once on every rebalance;
- `lag:<id>`: per held partition the consumer's position against the high watermark, read
  with Fetch requests of the agent's own (the consumer's cached high watermark stops moving
  while it pauses a partition, and ListOffsets(latest) is wrong on Tansu, see
  docs/broker-quirks.md), replaced as a whole on every report;
- `assignment`: there is no leader; every agent merges its own partitions into the stored
  assignment in one optimistic transaction (WATCH/MULTI), so the generation grows by one per
  change and one generation names one assignment.

Usage with aiokafka (positions must cover applied records: apply each batch `getmany` returns
before awaiting anything else, as the example service does):

    agent = Agent.connect(redis_url, node_id="a", url="http://10.0.0.5:8000",
                          store=StoreInfo("customers", "customers", 12),
                          bootstrap_servers=bootstrap)
    consumer.subscribe([topic], listener=agent.aiokafka_listener())
    async with agent.running(aiokafka_positions(consumer, topic)):
        ...  # the service's own consume loop and HTTP server

The service must answer a lookup for a key of a partition it does not hold with 421, so a
proxy whose table is a moment old tries the current owner instead of trusting a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.client import AIOKafkaClient
from redis.exceptions import WatchError

from common.clock import SharedClock
from common.contract import (
    Assignment,
    ContractError,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    ReportBodies,
    StoreInfo,
    as_text,
    decode_assignment,
    encode,
    write_node_report,
)
from common.departed import DEFAULT_GRACE_MS, departures, per_node_keys, read_membership
from materializer.kafka_offsets import fetch_high_watermarks

log = structlog.get_logger("kroute.agent")

# Forget the departed ids named, each only if it is still gone when the script runs: its
# `alive:<id>` absent and its `dead_since` field at least the grace period old, and only if the
# assignment is still the one the round read (a merge in between may place one of them). A
# round reads, decides and then writes; an instance that heartbeats, another agent's round that
# saw it alive, or a merge placing it in that gap must win.
# KEYS: assignment, nodes, dead_since, events, then per id: node, alive, hosting, lag, report,
# report_at. ARGV: the assignment as read ("" when absent), now_ms, grace_ms, the count, the
# ids, then each id's event.
FORGET_IF_STILL_GONE = """
local stored = redis.call('GET', KEYS[1]) or ''
if stored ~= ARGV[1] then
  return {}
end
local now, grace, count = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local forgotten = {}
for i = 1, count do
  local id = ARGV[4 + i]
  local first = 4 + (i - 1) * 6
  local since = tonumber(redis.call('HGET', KEYS[3], id) or '')
  if since and now - since >= grace and redis.call('EXISTS', KEYS[first + 2]) == 0 then
    redis.call('SREM', KEYS[2], id)
    redis.call('HDEL', KEYS[3], id)
    redis.call('DEL', KEYS[first + 1], KEYS[first + 2], KEYS[first + 3], KEYS[first + 4],
      KEYS[first + 5], KEYS[first + 6])
    redis.call('PUBLISH', KEYS[4], ARGV[4 + count + i])
    forgotten[#forgotten + 1] = id
  end
end
return forgotten
"""

PositionSource = Callable[[Collection[int]], Awaitable[Mapping[int, int]]]
"""held partitions -> each one's position (next offset to apply); unknown ones left out."""

_END_HISTORY = 64  # end offsets remembered per partition, for "caught up at" under writes
END_OFFSET_MAX_AGE_MS = 2_000  # older end offsets are not reported: lag unknown, not 0


@dataclass(frozen=True)
class AgentTiming:
    heartbeat_ms: int = 300
    alive_ttl_ms: int = 2000
    report_interval_ms: int = 250
    # How often one of the agents (whichever takes the `tidy` lease) looks for departed
    # instances: it reads every registered id's `alive:<id>`, so the group's cost is one read
    # of the membership per interval, not one per agent.
    tidy_ms: int = 60_000
    # An instance dead this long and placed nowhere is forgotten (kroute's leader's default).
    forget_after_ms: int = DEFAULT_GRACE_MS

    def __post_init__(self) -> None:
        for name, value in dataclasses.asdict(self).items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"AgentTiming.{name} must be a positive number of ms: {value!r}")


@dataclass
class EndHistory:
    """The end offsets read for one partition lately, (end offset, asked at ms), and when it
    was last known caught up (the contract's `caught_up_at_ms`)."""

    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=_END_HISTORY))
    caught_up_at_ms: int | None = None

    def report(self, position: int, at_ms: int) -> tuple[int | None, int | None]:
        """(end offset to report, caught up at): the latest end the position has reached
        marks when the partition was last known caught up."""
        for end, asked_at in reversed(self.recent):
            if position >= end:
                self.caught_up_at_ms = max(self.caught_up_at_ms or 0, asked_at)
                break
        if self.end_asked_at(at_ms) is None:
            return None, self.caught_up_at_ms
        return self.recent[-1][0], self.caught_up_at_ms

    def end_asked_at(self, at_ms: int) -> int | None:
        """When the end offset `report` gives at `at_ms` was asked for; None when it gives
        none (never read, or read too long ago)."""
        if not self.recent or at_ms - self.recent[-1][1] > END_OFFSET_MAX_AGE_MS:
            return None
        return self.recent[-1][1]

    def as_of(self, at_ms: int) -> int:
        """The time a report made at `at_ms` holds as of (its `updated_at_ms`): when its end
        offset was asked for, else `at_ms`. Never later than true, and equal to a caught-up
        replica's `caught_up_at_ms`, so its ages in `report:<id>` stay the same from one
        report to the next (docs/redis-contract.md, "The compact report")."""
        asked_at = self.end_asked_at(at_ms)
        return at_ms if asked_at is None else asked_at


def conservative_report(report: PartitionReport, clock: SharedClock) -> PartitionReport:
    """A report with its times mapped by `clock` now (`SharedClock.conservative_ms`), equal
    ones alike (so a caught-up replica's ages stay 0). For a writer that publishes a report
    again later (a reading kept between reads): mapped when it was made, one taken before a
    backward clock step would read fresher than true."""
    caught_up = report.caught_up_at_ms
    return dataclasses.replace(
        report,
        caught_up_at_ms=None if caught_up is None else clock.conservative_ms(caught_up),
        updated_at_ms=clock.conservative_ms(report.updated_at_ms),
    )


def merged_assignment(
    stored: Assignment | None,
    store: StoreInfo,
    node_id: str,
    held: Collection[int],
    at_ms: int,
    *,
    take: bool | Collection[int],
) -> Assignment | None:
    """The stored assignment with this node active on exactly the partitions it holds, or
    None when nothing changes.

    Each writer touches only entries naming itself, so agents merging concurrently never undo
    each other. `take` (True: all held partitions; or the partitions a rebalance just gave
    us) overwrites another node's entry; elsewhere (a periodic repair, after Redis lost its
    data) only empty entries are filled: an instance resuming from a long pause must not take
    back what the group has since given to someone else."""
    placements = dict(stored.stores.get(store.name, {})) if stored else {}
    taking = set(held) if take is True else set(take or ())
    changed = False
    for partition in range(store.partitions):
        entry = placements.get(partition)
        standbys = entry.standbys if entry else ()
        if partition in held:
            free = entry is None or entry.active is None
            if (entry is None or entry.active != node_id) and (partition in taking or free):
                placements[partition] = PartitionAssignment(node_id, standbys)
                changed = True
        elif entry is not None and entry.active == node_id:
            placements[partition] = PartitionAssignment(None, standbys)
            changed = True
    if not changed:
        return None
    stores = {**(dict(stored.stores) if stored else {}), store.name: placements}
    generation = stored.generation + 1 if stored else 1
    return Assignment(generation, node_id, at_ms, stores)


class Agent:
    """Publishes one service instance in the Redis contract; see the module docstring."""

    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        keys: Keys,
        node: NodeInfo,
        store: StoreInfo,
        bootstrap_servers: str,
        timing: AgentTiming = AgentTiming(),
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.node = node
        self.store = store
        self.bootstrap_servers = bootstrap_servers
        self.timing = timing
        self.clock = SharedClock()  # Redis time, synced on every heartbeat
        self.held: frozenset[int] = frozenset()
        # Given by a rebalance but not yet merged into the assignment (a Redis error during
        # the callback): the loop retries taking them until a merge succeeds.
        self.pending_take: frozenset[int] = frozenset()
        self.generation = 0  # of the last assignment this agent wrote or saw
        # Rebalance callbacks and the periodic report write hosting and assignment one at a
        # time, each from `held` as it is when it writes: a report that awaited positions
        # while a partition was revoked must not publish it again.
        self._writing = asyncio.Lock()
        self._ends: dict[int, EndHistory] = {}
        self._last_reports: dict[int, PartitionReport] = {}  # as last written, by partition
        self._report_bodies = ReportBodies()  # report:<id> as last written
        self._kafka: AIOKafkaClient | None = None

    @classmethod
    def connect(
        cls,
        redis_url: str,
        *,
        node_id: str,
        url: str,
        store: StoreInfo,
        bootstrap_servers: str,
        cluster: str = "default",
        timing: AgentTiming = AgentTiming(),
    ) -> Agent:
        node = NodeInfo(node_id, url, 0)  # started_at_ms is stamped on Redis time at start
        redis = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
        return cls(
            redis=redis,
            keys=Keys(cluster),
            node=node,
            store=store,
            bootstrap_servers=bootstrap_servers,
            timing=timing,
        )

    # -- what the consumer holds -------------------------------------------------------------

    async def assigned(self, partitions: Iterable[int]) -> None:
        """The group gave this instance these partitions (in addition to what it holds)."""
        given = frozenset(partitions)
        self.held = self.held | given
        self.pending_take = self.pending_take | given
        await self._publish_holding()

    async def revoked(self, partitions: Iterable[int]) -> None:
        """These partitions are no longer this instance's: unpublished before anyone else
        can take them (the group waits for revoke callbacks before reassigning)."""
        gone = frozenset(partitions)
        self.held = self.held - gone
        self.pending_take = self.pending_take - gone
        for partition in gone:
            self._ends.pop(partition, None)
        await self._publish_holding()

    def aiokafka_listener(
        self, inner: ConsumerRebalanceListener | None = None
    ) -> ConsumerRebalanceListener:
        """A rebalance listener for `consumer.subscribe(..., listener=...)`; `inner` (the
        service's own) runs first on assignment (it may seek) and last on revocation."""
        return _AiokafkaListener(self, self.store.topic, inner)

    async def _publish_holding(self) -> None:
        try:
            async with self._writing:
                await self._merge_assignment()
                await self._write_hosting(None)
        except (aioredis.RedisError, OSError) as exc:
            # The loops retry; a rebalance must not fail because Redis blinked.
            log.warning("could not publish a rebalance; retrying in the loop", error=str(exc))

    # -- running -----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self, positions: PositionSource) -> AsyncIterator[Agent]:
        """Heartbeat and report while the body runs; unpublish this instance afterwards."""
        self._kafka = AIOKafkaClient(bootstrap_servers=self.bootstrap_servers)
        await self._kafka.bootstrap()
        await self.clock.sync(self.redis)  # no time is stamped on the local clock
        self.node = NodeInfo(self.node.node_id, self.node.url, self.clock.now_ms())
        tasks = [
            asyncio.create_task(self._every(self.timing.heartbeat_ms, self.heartbeat)),
            asyncio.create_task(
                self._every(self.timing.report_interval_ms, lambda: self.report(positions))
            ),
            asyncio.create_task(self._every(self.timing.tidy_ms, self.forget_departed)),
        ]
        try:
            yield self
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._leave()
            await self._kafka.close()
            await self.redis.aclose()

    async def _every(self, interval_ms: int, step: Callable[[], Awaitable[object]]) -> None:
        current = asyncio.current_task()
        while True:
            try:
                await step()
            except (aioredis.RedisError, OSError) as exc:
                log.warning("redis unreachable; heartbeat lapsing", error=str(exc))
            except Exception:  # one bad step must not end the loop (the service runs on)
                log.exception("agent step failed; retrying")
            if current is not None and current.cancelling():
                # A cancellation a client call swallowed (on 3.11 asyncio.wait_for can, when
                # it lands as the call completes): without this the loop runs on and the
                # service's shutdown waits for it forever.
                raise asyncio.CancelledError
            await asyncio.sleep(interval_ms / 1000)

    async def heartbeat(self) -> None:
        keys, node = self.keys, self.node
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(keys.node(node.node_id), encode(node))
            pipe.sadd(keys.nodes, node.node_id)
            pipe.set(keys.store(self.store.name), encode(self.store))
            pipe.sadd(keys.stores, self.store.name)
            pipe.set(keys.alive(node.node_id), b"1", px=self.timing.alive_ttl_ms)
            pipe.time()  # keeps the clock in step without another round trip
            sent = self.clock.stopwatch()
            replies = await pipe.execute()
            self.clock.observe(replies[-1], sent, self.clock.stopwatch())

    async def report(self, positions: PositionSource | None) -> None:
        """Write hosting and lag (one transaction, lag replaced as a whole). Without
        `positions` (a rebalance callback) only hosting changes: no lag reports are lost."""
        reports: dict[int, PartitionReport] | None = None
        if positions is not None:
            held = self.held
            if held:
                await self._read_ends(held, await positions(held))
            reports = await self._reports(held, positions)
        async with self._writing:
            if positions is not None:
                # Heals a Redis that lost its data, and retries a take that failed.
                await self._merge_assignment()
            await self._write_hosting(reports)

    async def _write_hosting(self, reports: dict[int, PartitionReport] | None) -> None:
        """hosting and lag from `held` as it is now (the caller holds `_writing`): reports
        of partitions revoked since they were read are dropped. Without `reports` (a
        rebalance) the last ones written stand for the partitions still held."""
        held = self.held
        at = self.clock.now_ms()
        hosting = Hosting(
            self.node.node_id,
            self.generation,
            {self.store.name: {"active": tuple(sorted(held)), "standby": ()}},
            at,
        )
        source = self._last_reports if reports is None else reports
        kept = {p: r for p, r in source.items() if p in held}
        async with self.redis.pipeline(transaction=True) as pipe:
            write_node_report(
                pipe,
                self.keys,
                hosting,
                {(self.store.name, p): r for p, r in kept.items()},
                self.timing.alive_ttl_ms * 10,
                bodies=self._report_bodies,
            )
            pipe.publish(self.keys.events, encode(Event("lag", node_id=self.node.node_id)))
            await pipe.execute()
        self._last_reports = kept

    async def _read_ends(self, held: Collection[int], positions: Mapping[int, int]) -> None:
        assert self._kafka is not None
        asked_at = self.clock.now_ms()  # the ends describe the log when asked, not answered
        try:
            ends = await fetch_high_watermarks(
                self._kafka, self.store.topic, held, positions=positions, timeout_s=2.0
            )
        except Exception as exc:  # noqa: BLE001 - the report says "unknown" once ends age
            log.warning("cannot read end offsets; lag turns unknown", error=str(exc))
            return
        for partition, end in ends.items():
            self._ends.setdefault(partition, EndHistory()).recent.append((end, asked_at))

    async def _reports(
        self, held: Collection[int], positions: PositionSource
    ) -> dict[int, PartitionReport]:
        at = self.clock.now_ms()
        known = await positions(held)
        reports = {}
        for partition in sorted(held):
            if partition not in known:
                continue  # no position yet (resetting): no report, so lag is unknown
            position = known[partition]
            history = self._ends.setdefault(partition, EndHistory())
            end, caught_up_at = history.report(position, at)
            # Both mapped alike: never fresher than true after a clock step, and equal when
            # they were.
            report = PartitionReport(
                current_offset=position,
                end_offset=end,
                newest_record_ms=None,
                caught_up_at_ms=None
                if caught_up_at is None
                else self.clock.conservative_ms(caught_up_at),
                updated_at_ms=self.clock.conservative_ms(history.as_of(at)),
            )
            reports[partition] = report
        return reports

    async def _merge_assignment(self) -> None:
        """Merge `held` into the stored assignment, taking over the partitions of a
        rebalance not merged yet (`pending_take`); they stay pending until a merge succeeds."""
        key = self.keys.assignment
        taking = self.pending_take
        async with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    stored = _readable(raw)
                    new = merged_assignment(
                        stored, self.store, self.node.node_id, self.held, self.clock.now_ms(),
                        take=taking,
                    )  # fmt: skip
                    if new is None:
                        await pipe.unwatch()  # type: ignore[no-untyped-call]
                        self.generation = stored.generation if stored else 0
                        self.pending_take = self.pending_take - taking
                        return
                    pipe.multi()  # type: ignore[no-untyped-call]
                    pipe.set(key, encode(new))
                    pipe.publish(
                        self.keys.events, encode(Event("assignment", generation=new.generation))
                    )
                    await pipe.execute()
                    self.generation = new.generation
                    self.pending_take = self.pending_take - taking
                    return
                except WatchError:
                    continue  # another agent merged meanwhile: merge into theirs

    async def forget_departed(self) -> bool:
        """Forget the instances dead for `forget_after_ms` and placed nowhere, as kroute's
        leader does (docs/redis-contract.md, "Departed nodes"): without it `nodes`, which every
        proxy reads, keeps every id that ever registered, and instances in pods get a new id
        each time they are replaced. No agent decides for the group, so whichever takes the
        `tidy` lease (for `tidy_ms`) does this round; the others skip it (False). A wrong
        call heals: a live instance's next heartbeat registers it again, its next report
        rewrites its hosting."""
        keys, timing = self.keys, self.timing
        if not await self.redis.set(keys.tidy, self.node.node_id, nx=True, px=timing.tidy_ms):
            return False
        membership = await read_membership(self.redis, keys)
        ids = sorted(membership.registered | set(membership.since) | membership.unreadable)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(keys.assignment)
            if ids:
                pipe.mget([keys.alive(node_id) for node_id in ids])
            raw_assignment, *flags = await pipe.execute()
        stored = _readable(raw_assignment)
        if raw_assignment is not None and stored is None:
            return True  # placements unknown: forget nobody (it may place anyone)
        alive = flags[0] if flags else []
        present = {n for n, flag in zip(ids, alive, strict=True) if flag is not None}
        now_ms = self.clock.now_ms()
        round_ = departures(
            membership,
            absent=set(ids) - present,
            present=present,
            placed=stored.placed_nodes() if stored else set(),
            now_ms=now_ms,
            grace_ms=timing.forget_after_ms,
        )
        async with self.redis.pipeline(transaction=True) as pipe:
            dataclasses.replace(round_, departed=()).queue(pipe, keys, now_ms)
            await pipe.execute()
        if round_.departed:
            forgotten = await self._forget(round_.departed, raw_assignment, now_ms)
            if forgotten:
                log.info("forgot departed instances", nodes=forgotten)
        return True

    async def _forget(self, node_ids: Sequence[str], seen: bytes | None, now_ms: int) -> list[str]:
        """Forget the ids still gone when Redis runs it (`FORGET_IF_STILL_GONE`); those it
        forgot."""
        keys = self.keys
        script_keys = [keys.assignment, keys.nodes, keys.dead_since, keys.events]
        for node_id in node_ids:
            script_keys.extend(per_node_keys(keys, node_id))
        events = [encode(Event("node", node_id=node_id)) for node_id in node_ids]
        args: list[bytes | str | int] = [seen or b"", now_ms, self.timing.forget_after_ms]
        args += [len(node_ids), *node_ids, *events]
        reply = await self.redis.eval(FORGET_IF_STILL_GONE, len(script_keys), *script_keys, *args)
        return [as_text(node_id) for node_id in reply]

    async def _leave(self) -> None:
        """A clean stop: give up every partition and the heartbeat at once (the TTL would
        have said the same a little later)."""
        with contextlib.suppress(aioredis.RedisError, OSError):
            self.held = self.pending_take = frozenset()
            async with self._writing:
                await self._merge_assignment()
                await self._write_hosting(None)
            await self.redis.delete(self.keys.alive(self.node.node_id))


def _readable(raw: bytes | str | None) -> Assignment | None:
    if raw is None:
        return None
    try:
        return decode_assignment(raw)
    except ContractError as exc:
        # A value without a readable generation cannot be compared: start over (as the
        # contract says the leader does); the other agents fill their entries back in.
        log.warning("stored assignment unreadable; replacing it", error=str(exc))
        return None


class _AiokafkaListener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, agent: Agent, topic: str, inner: ConsumerRebalanceListener | None) -> None:
        self.agent = agent
        self.topic = topic
        self.inner = inner

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        await self.agent.revoked(tp.partition for tp in revoked if tp.topic == self.topic)
        if self.inner is not None:
            await _maybe_await(self.inner.on_partitions_revoked(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        if self.inner is not None:
            await _maybe_await(self.inner.on_partitions_assigned(assigned))
        await self.agent.assigned(tp.partition for tp in assigned if tp.topic == self.topic)


async def _maybe_await(result: Any) -> None:
    if asyncio.iscoroutine(result):
        await result


def aiokafka_positions(consumer: AIOKafkaConsumer, topic: str) -> PositionSource:
    """Positions from an aiokafka consumer: the offset after the last record `getmany`
    returned (the service applies each batch before awaiting anything else)."""

    async def positions(held: Collection[int]) -> Mapping[int, int]:
        known = {}
        for partition in held:
            with contextlib.suppress(Exception):  # revoked meanwhile, or still resetting
                tp = TopicPartition(topic, partition)
                known[partition] = int(await asyncio.wait_for(consumer.position(tp), 0.5))
        return known

    return positions
