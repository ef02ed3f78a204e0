"""A node's part in the cluster, through Redis: heartbeat, reports, leadership, assignment.

- Heartbeat: `alive:<id>` is set with a TTL (~2 s) several times a second, so a dead node is
  known within the TTL, not after a consumer-group session timeout.
- Reports: what the node serves (`hosting:<id>`) and each partition's offsets (`lag:<id>`).
  The leader takes offset lags from what changed: every node's `report_at:<id>` each step, a
  `report:<id>` body only when its version is not the one it holds, and `lag:<id>` only for a
  node without a usable pair (see `_read_offset_lags`).
- Leadership: one node holds `leader` with a lease it renews; only the holder computes and
  writes the assignment, and the write itself checks the lease and the generation (a Lua
  script), so a leader that lost its lease cannot overwrite a newer leader's assignment, and
  no two different assignments ever carry one generation. The leader reads the stored
  assignment before every computation (a new leader may have missed its predecessor's last
  write) and keeps when it first saw each node dead in `dead_since`, so grace periods survive
  leader changes and Redis errors.
- Watching: the node re-reads `assignment` when an event arrives and on a timer, and hands it
  to the node whenever it differs from the one it has (in anything, not just the generation).
- Time: the heartbeat also reads Redis `TIME`, which keeps this process's shared clock
  (`common.clock`) in step, so every time in the contract is Redis time.

When Redis is unreachable the node keeps serving what it has; its heartbeat lapses (so proxies
and the leader treat it as dead meanwhile) and every loop retries on its own schedule. An error
says nothing about the leader lease: the next leader step renews it if it is still ours.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog

from common.clock import SHARED, SharedClock
from common.contract import (
    Assignment,
    ContractError,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    PartitionReport,
    ReportBodies,
    StoreInfo,
    as_text,
    decode_assignment,
    decode_event,
    decode_node,
    decode_node_report,
    decode_report,
    decode_report_at,
    decode_store,
    encode,
    write_node_report,
)
from common.departed import DEFAULT_GRACE_MS, queue_forget
from materializer.assignment import Member, compute_assignment

log = structlog.get_logger("kroute.materializer.cluster")
# Every write of the assignment is announced (`assignment` event); the timer reads it this
# often in case an event was missed (and on every resubscription).
ASSIGNMENT_POLL_S = 30.0
# `report:<id>` bodies read in one step longer than this, together, are decoded in a thread
# (about a millisecond of decoding on the loop; a body is a few bytes a replica).
THREAD_DECODE_BYTES = 16 * 1024

LagReports = dict[tuple[str, int, str], int | None]  # (store, partition, node) -> offset lag


@dataclass(frozen=True)
class _BodyLags:
    """The offset lags one `report:<id>` body gives, by the body's version."""

    version: int
    lags: LagReports


# Renew the lease only if we still hold it; write only while we hold it (fencing).
RENEW_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
# Write only while we hold the lease (fencing) and only a generation greater than the stored
# one: two different assignments must never share a generation. A stored value that is not
# JSON with a numeric generation cannot be compared and is overwritten.
WRITE_IF_LEADER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
local stored = redis.call('GET', KEYS[2])
if stored then
  local ok, body = pcall(cjson.decode, stored)
  if ok and type(body) == 'table' and type(body['generation']) == 'number'
      and body['generation'] >= tonumber(ARGV[4]) then
    return -1
  end
end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('PUBLISH', KEYS[3], ARGV[3])
return 1
"""


class Written(enum.IntEnum):
    """What the fenced write did (the Lua script's reply)."""

    NOT_LEADER = 0
    WRITTEN = 1
    STALE_GENERATION = -1


@dataclass(frozen=True)
class ClusterTiming:
    heartbeat_ms: int = 300
    alive_ttl_ms: int = 2000
    leader_lease_ms: int = 3000
    leader_interval_ms: int = 500
    report_interval_ms: int = 250
    poll_interval_ms: int = 1000
    grace_ms: int = DEFAULT_GRACE_MS
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
    clock: SharedClock = field(default_factory=lambda: SHARED)  # this process's, by default
    is_leader: bool = False
    redis_ok: bool = False
    assignment: Assignment | None = None
    node_urls: dict[str, str] = field(default_factory=dict)
    alive_nodes: frozenset[str] = frozenset()
    _last_hosting: tuple[object, ...] = ()
    _raw_assignment: bytes | str | None = None  # the value last decoded
    _report_bodies: ReportBodies = field(default_factory=ReportBodies)  # report:<id> written
    _assignment_read_s: float = 0.0  # monotonic
    _announced: bool = False  # a `node` event sent for this process's node:<id>
    # The leader's copy of each node's last `report:<id>` body (its lags), used while the
    # node's `report_at:<id>` names its version; and the version of a body it refused, not
    # read again until `report_at:<id>` names another one.
    _body_lags: dict[str, _BodyLags] = field(default_factory=dict)
    _refused_bodies: dict[str, int] = field(default_factory=dict)

    async def run(self) -> None:
        loops = [
            self._every(self.timing.heartbeat_ms, self.heartbeat),
            self._every(self.timing.report_interval_ms, self.report),
            self._every(self.timing.leader_interval_ms, self.lead),
            self._every(self.timing.poll_interval_ms, self.poll),
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
                # Leadership is left alone: the lease may well still be ours, and the next
                # leader step renews it (dropping it here left nobody leading for a lease).
                if self.redis_ok:
                    log.warning("redis unreachable; serving on, heartbeat lapsing", error=str(exc))
                self.redis_ok = False
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
            if not self._announced:
                # node:<id> as this process wrote it (a restart may bring a new URL): proxies
                # read it on this event, not at their next slow read of the node (30 s).
                pipe.publish(self.keys.events, encode(Event("node", node_id=self.node.node_id)))
            pipe.time()  # the shared clock rides along: no extra round trip
            sent = self.clock.stopwatch()
            replies = await pipe.execute()
            self.clock.observe(replies[-1], sent, self.clock.stopwatch())
            self._announced = True

    async def sync_clock(self) -> bool:
        """Sync the shared clock now (the heartbeat keeps it in step afterwards): call before
        anything stamps times the contract carries, so no stamp is taken on the local clock."""
        return await self.clock.sync(self.redis)

    async def report(self) -> None:
        if not self.clock.synced:
            # Reports carry times proxies compare with Redis time: never the local clock's.
            await self.sync_clock()
        hosting = self.hosting()
        reports = {(self.store.name, p): self._conservative(r) for p, r in self.reports().items()}
        # What it serves, not when it said so: an event only when that changes.
        serving = (hosting.generation, sorted(hosting.stores.items()))

        # One transaction that replaces the node's reports: fields an earlier run of this node
        # left behind (caught up then, restoring now) or partitions it gave up must not pass
        # for current ones, nor may a reader see the hash half-written.
        async with self.redis.pipeline(transaction=True) as pipe:
            write_node_report(
                pipe,
                self.keys,
                hosting,
                reports,
                self.timing.alive_ttl_ms * 10,
                bodies=self._report_bodies,
            )
            if serving != self._last_hosting:
                pipe.publish(self.keys.events, encode(Event("hosting", node_id=self.node.node_id)))
            await pipe.execute()
        self._last_hosting = serving

    def _conservative(self, report: PartitionReport) -> PartitionReport:
        """The report with a "caught up at" stamped before a backward clock step (the first
        sync of a host whose clock ran ahead, say) moved back with it: never fresher than
        true. (Dropping the time would not do: lag 0 without a time reads as time lag 0.)"""
        if report.caught_up_at_ms is None:
            return report
        moved = self.clock.conservative_ms(report.caught_up_at_ms)
        if moved == report.caught_up_at_ms:
            return report
        return dataclasses.replace(report, caught_up_at_ms=moved)

    async def lead(self) -> None:
        if await self._hold_lease():
            await self._assign()
        else:
            # Only the leader reads them: a node that leads again later reads every body afresh.
            self._body_lags.clear()
            self._refused_bodies.clear()

    async def _hold_lease(self) -> bool:
        """Whether this node holds the leader lease after this step.

        Renew first, whatever we believed: a leader whose last step failed on a Redis error
        still holds its lease, and asking for it with SET NX would fail against itself and
        leave nobody leading until the lease ran out."""
        me = self.node.node_id
        lease = self.timing.leader_lease_ms
        if await self.redis.eval(RENEW_LEASE, 1, self.keys.leader, me, lease):
            if not self.is_leader:
                log.info("holding the leader lease")
            self.is_leader = True
            return True
        if self.is_leader:
            log.warning("lost the leader lease")
            self.is_leader = False
        if not await self.redis.set(self.keys.leader, me, nx=True, px=lease):
            return False
        log.info("became the leader")
        self.is_leader = True
        return True

    async def _assign(self, *, retry: bool = True) -> None:
        # Read before computing: a new leader may have missed its predecessor's last write,
        # and computing from its own copy would give a different assignment the same number.
        stored, previous = await self._stored_assignment()
        members, stores, lag = await self._cluster_state(previous)
        # In a thread: at 1,000 nodes and 20,000 partitions one computation takes ~250-470 ms
        # of Python, which on the loop would stop this node's lookups every leader step. Its
        # inputs are this step's own copies.
        assignment = await asyncio.to_thread(
            compute_assignment,
            stores,
            members,
            previous,
            lag,
            standbys=self.timing.standbys,
            grace_ms=self.timing.grace_ms,
            caught_up_lag=self.timing.acceptable_recovery_lag,
            now_ms=self.clock.now_ms(),
            leader=self.node.node_id,
        )
        await self._forget_departed(members, assignment)
        if stored is not None and assignment == stored:
            return  # (a Redis that lost its data, stored None, gets the assignment back at once)

        written = await self._write(assignment)
        if written is Written.WRITTEN:
            log.info("assignment written", generation=assignment.generation)
            self._raw_assignment = None  # its own copy: the next read decodes what is stored
            self._accept(assignment)
        elif written is Written.STALE_GENERATION:
            log.warning(
                "assignment refused: redis holds this generation or a newer one; re-reading",
                generation=assignment.generation,
                will_retry=retry,
            )
            if retry:
                await self._assign(retry=False)

    async def _forget_departed(self, members: Mapping[str, Member], assignment: Assignment) -> None:
        """Nodes dead for longer than the grace period, and placed nowhere, leave the contract:
        out of `nodes` and `dead_since`, their `node`, `hosting`, `lag` and `report` keys
        deleted, and a `node` event so proxies drop them. A node that comes back registers
        again with its next heartbeat. Without this, `nodes` keeps every id that ever
        registered (pods get new ones) and every reader reads more each time."""
        at = self.clock.now_ms()
        placed = assignment.placed_nodes()
        departed = sorted(
            m.node_id
            for m in members.values()
            if not m.alive
            and m.dead_since_ms is not None
            and at - m.dead_since_ms >= self.timing.grace_ms
            and m.node_id not in placed
        )
        if not departed:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            queue_forget(pipe, self.keys, departed)
            await pipe.execute()
        log.info("departed nodes forgotten", nodes=departed, grace_ms=self.timing.grace_ms)

    async def _stored_assignment(self) -> tuple[Assignment | None, Assignment | None]:
        """(what Redis holds, what to compute from): the stored assignment unless it is
        missing, unreadable or older than ours (a Redis that lost or rolled back its data:
        never know less than the last assignment)."""
        raw = await self.redis.get(self.keys.assignment)
        mine = self.assignment
        if raw is None:
            return None, mine
        try:
            stored = decode_assignment(raw)
        except ContractError as exc:
            log.warning("stored assignment unreadable; computing from ours", error=str(exc))
            return None, mine
        if mine is not None and stored.generation < mine.generation:
            log.warning(
                "redis holds an older assignment than ours; computing from ours",
                stored=stored.generation,
                ours=mine.generation,
            )
            return stored, mine
        if stored != mine:
            self._accept(stored)  # what the cluster follows is what Redis holds
        return stored, stored

    async def _write(self, assignment: Assignment) -> Written:
        event = encode(Event("assignment", generation=assignment.generation))
        reply = await self.redis.eval(
            WRITE_IF_LEADER, 3, self.keys.leader, self.keys.assignment, self.keys.events,
            self.node.node_id, encode(assignment), event, assignment.generation,
        )  # fmt: skip
        return Written(int(reply))

    async def _cluster_state(
        self, previous: Assignment | None
    ) -> tuple[dict[str, Member], dict[str, int], dict[tuple[str, int, str], int | None]]:
        # Never know less than the last assignment: a Redis that lost its data (restarted
        # empty) must not make the leader drop stores and nodes before they register again.
        # Nodes it held count as members (dead until their heartbeat returns: grace applies).
        remembered_nodes = previous.placed_nodes() if previous else set()

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
        alive = {
            node_id: flag is not None for node_id, flag in zip(node_ids, alive_flags, strict=True)
        }
        dead_since = await self._dead_since(alive)
        members = {
            node_id: Member(node_id, alive=up, dead_since_ms=None if up else dead_since[node_id])
            for node_id, up in alive.items()
        }
        lag = await self._read_offset_lags(node_ids)
        return members, stores, lag

    async def _read_offset_lags(self, node_ids: list[str]) -> LagReports:
        """Every node's offset lags, reading what changed: every `report_at:<id>` in one MGET
        (~30 bytes a node), then the `report:<id>` body (a few bytes a replica) of only the
        nodes whose version is not the one held (at steady state none), and `lag:<id>` (~150
        bytes a replica, with positions and times the leader does not use) only of the nodes
        without a usable pair: a writer that writes only `hosting` and `lag`, or a value that
        does not follow the contract. The same lags as reading every `lag:<id>`: its writer
        puts both in one transaction (`write_node_report`). At 1,000 nodes and 20,000
        partitions (one standby) reading every `lag:<id>` was 7.2 MB and ~290 ms of decoding
        per step; this is 34 KB and ~2 ms at steady state, 0.9 MB and ~46 ms (in a thread)
        when every body changed."""
        held = self._body_lags
        for node_id in held.keys() - set(node_ids):
            del held[node_id]  # forgotten (or never to be read again): its body goes too
        for node_id in self._refused_bodies.keys() - set(node_ids):
            del self._refused_bodies[node_id]
        versions = await self._report_versions(node_ids)
        changed = [
            node_id
            for node_id, version in versions.items()
            if self._held_version(node_id) != version
            and self._refused_bodies.get(node_id) != version
        ]
        await self._read_bodies(changed, versions)
        usable = [node_id for node_id in versions if node_id in held]
        from_bodies = set(usable)
        legacy = [node_id for node_id in node_ids if node_id not in from_bodies]
        async with self.redis.pipeline(transaction=False) as pipe:  # one round trip, not N
            for node_id in legacy:
                pipe.hgetall(self.keys.lag(node_id))
            legacy_reports = await pipe.execute() if legacy else []
        # Merged (and any `lag:<id>` decoded) off the loop, like the computation that reads
        # them: 40,000 replicas at 1,000 nodes.
        parts = [held[node_id].lags for node_id in usable]
        return await asyncio.to_thread(_all_lags, parts, legacy, legacy_reports)

    def _held_version(self, node_id: str) -> int | None:
        held = self._body_lags.get(node_id)
        return None if held is None else held.version

    async def _report_versions(self, node_ids: list[str]) -> dict[str, int]:
        """node id -> the body version its `report_at:<id>` names, for the nodes with a
        readable and recent one. (A malformed one is not logged here: every leader step would
        repeat it; proxies and `kroute contract check` say so.)

        Recent: as of no more than `_stamp_limit_ms` ago. A writer of only `hosting` and `lag`
        that took over a node id (a rolling downgrade, a third-party writer) leaves a body and
        its `report_at:<id>` to expire after ten heartbeat TTLs, while `lag:<id>` moves on: the
        node is then read from `lag:<id>`, as every node was. A live compact writer stamps one
        on every report; a stamp read older (a dead node, a clock stepped back) costs only
        that read of `lag:<id>`, which its writer wrote in the same transaction."""
        if not node_ids:
            return {}
        stamps = await self.redis.mget([self.keys.report_at(node_id) for node_id in node_ids])
        oldest = self.clock.now_ms() - self._stamp_limit_ms()
        versions: dict[str, int] = {}
        for node_id, raw in zip(node_ids, stamps, strict=True):
            if raw is None:
                continue
            try:
                version, at_ms = decode_report_at(raw)
            except ContractError:
                continue
            if at_ms >= oldest:
                versions[node_id] = version
        return versions

    def _stamp_limit_ms(self) -> int:
        """How old a `report_at:<id>` may be for its body to stand for `lag:<id>`: a heartbeat
        TTL (a node reports every `report_interval_ms`, far more often), or two report
        intervals if those are longer."""
        timing = self.timing
        return max(timing.alive_ttl_ms, 2 * timing.report_interval_ms)

    async def _read_bodies(self, node_ids: list[str], versions: Mapping[str, int]) -> None:
        """Read, decode and hold the `report:<id>` bodies of these nodes (their versions
        changed), or forget the one held: absent, refused (whole: the first entry that does
        not follow the contract refuses the body, no lag of it is used) or older than the
        version named."""
        if not node_ids:
            return
        raws = await self.redis.mget([self.keys.report(node_id) for node_id in node_ids])
        size = sum(len(raw) for raw in raws if raw is not None)
        if size > THREAD_DECODE_BYTES:  # every body at a leader's first step, or a rebalance
            read = await asyncio.to_thread(_decode_bodies, node_ids, raws)
        else:
            read = _decode_bodies(node_ids, raws)
        for node_id, body in zip(node_ids, read, strict=True):
            self._hold_body(node_id, versions[node_id], body)

    def _hold_body(
        self, node_id: str, version: int, body: _BodyLags | ContractError | None
    ) -> None:
        if isinstance(body, ContractError):
            log.warning(
                "report body refused; reading lag:<id> until a new version",
                node=node_id,
                version=version,
                error=str(body),
            )
            self._refused_bodies[node_id] = version
        # A body older than its `report_at:<id>` names (only a writer outside the contract)
        # may say less than `lag:<id>`: the node is read from there. A newer one was written
        # between the two reads, with `lag:<id>`: as good as the one named.
        if not isinstance(body, _BodyLags) or body.version < version:
            self._body_lags.pop(node_id, None)
            return
        self._body_lags[node_id] = body
        self._refused_bodies.pop(node_id, None)

    async def _dead_since(self, alive: Mapping[str, bool]) -> dict[str, int]:
        """When each dead node was first seen dead, kept in Redis (`dead_since`).

        In memory it restarted with every new leader, so with leader changes (or Redis
        blips) more often than the grace period a dead node's partitions never moved. The
        earliest sighting wins (HSETNX); a node seen alive loses its field. Unfenced: a late
        write from a deposed leader can only record a true sighting or restart a grace
        period, which moves partitions later, never earlier."""
        key = self.keys.dead_since
        known: dict[str, int] = {}
        unreadable: set[str] = set()
        for raw_node, raw_since in (await self.redis.hgetall(key)).items():
            try:
                known[as_text(raw_node)] = int(raw_since)
            except ValueError:
                unreadable.add(as_text(raw_node))  # replaced below, as if never seen dead
        at = self.clock.now_ms()
        newly_dead = [n for n, up in alive.items() if not up and n not in known]
        back = [n for n, up in alive.items() if up and (n in known or n in unreadable)]
        if newly_dead or back:
            async with self.redis.pipeline(transaction=False) as pipe:
                for node_id in newly_dead:
                    (pipe.hset if node_id in unreadable else pipe.hsetnx)(key, node_id, at)
                if back:
                    pipe.hdel(key, *back)
                await pipe.execute()
            for node_id in newly_dead:
                log.info(
                    "node seen dead; grace period starts",
                    node=node_id,
                    grace_ms=self.timing.grace_ms,
                )
            for node_id in back:
                log.info("node alive again", node=node_id, dead_since_ms=known.get(node_id))
        return {n: known.get(n, at) for n, up in alive.items() if not up}

    async def poll(self) -> None:
        """The timer's refresh: who is alive every time; the assignment only every
        ASSIGNMENT_POLL_S, since its writer announces every change with an event and it grows
        with the table (a megabyte at 20,000 partitions, read by every node)."""
        await self.refresh(
            with_assignment=time.monotonic() - self._assignment_read_s >= ASSIGNMENT_POLL_S
        )

    async def refresh(self, *, with_assignment: bool = True) -> None:
        """Re-read who is alive and (unless told not to) the assignment: on every event that
        concerns nodes, on (re)subscribing, and on the timer (`poll`)."""
        raw = await self.redis.get(self.keys.assignment) if with_assignment else None
        if with_assignment:
            self._assignment_read_s = time.monotonic()
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

        if raw is None or raw == self._raw_assignment:
            return
        try:
            assignment = decode_assignment(raw)
        except ContractError as exc:
            log.warning("ignoring an assignment this node cannot read", error=str(exc))
            return
        # Anything that differs, not just the number: should two different assignments ever
        # carry one generation (a writer outside this script), nodes still follow Redis.
        self._raw_assignment = raw
        if assignment != self.assignment:
            self._accept(assignment)

    def _accept(self, assignment: Assignment) -> None:
        self.assignment = assignment
        self.on_assignment(assignment)

    async def _listen(self) -> None:
        while True:
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                await pubsub.subscribe(self.keys.events)
                await self.refresh()  # what changed while it was not subscribed
                async for message in pubsub.listen():
                    if message.get("type") == "message" and _concerns_nodes(message.get("data")):
                        await self.refresh()
            except (aioredis.RedisError, OSError):
                await asyncio.sleep(self.timing.poll_interval_ms / 1000)


def _concerns_nodes(raw: object) -> bool:
    """Whether an event may change what a node acts on (the assignment, who is where).

    `hosting` and `lag` events say a node's own reports changed, which only proxies read:
    with hundreds of nodes each reading every node's keys on each of them, the nodes alone
    would load Redis with the square of their number."""
    try:
        event = decode_event(raw)  # type: ignore[arg-type]
    except (ContractError, ValueError, TypeError):
        return True  # unreadable: re-read, as before
    return event.type in ("assignment", "node")


def _decode_bodies(
    node_ids: list[str], raws: list[bytes | str | None]
) -> list[_BodyLags | ContractError | None]:
    """Each node's `report:<id>` as its lags, the error that refused it, or None (absent)."""
    read: list[_BodyLags | ContractError | None] = []
    for node_id, raw in zip(node_ids, raws, strict=True):
        try:
            read.append(None if raw is None else _body_lags(node_id, raw))
        except ContractError as exc:
            read.append(exc)
    return read


def _body_lags(node_id: str, raw: bytes | str) -> _BodyLags:
    """A `report:<id>` body's offset lags: its entries are [lag, caught_up_ago, newest_ago],
    aligned with the active then the standby partitions; a null entry (no report) gives no
    lag, as a partition without a `lag:<id>` field does."""
    body = decode_node_report(raw)  # strict: anything outside the contract refuses it whole
    if body.node_id != node_id:
        raise ContractError(f"report:{node_id} names node {body.node_id!r}")
    lags: LagReports = {}
    for store, roles in body.stores.items():
        hosted = (*roles.get("active", ()), *roles.get("standby", ()))
        for partition, entry in zip(hosted, body.lags[store], strict=True):
            if entry is not None:
                lags[(store, partition, node_id)] = entry[0]
    return _BodyLags(body.version, lags)


def _all_lags(
    parts: list[LagReports], legacy: list[str], legacy_reports: list[dict[bytes, bytes]]
) -> LagReports:
    """One mapping of the lags from bodies and from the `lag:<id>` hashes of the rest."""
    lag = _offset_lags(legacy, legacy_reports)
    for part in parts:
        lag.update(part)
    return lag


def _offset_lags(node_ids: list[str], every_report: list[dict[bytes, bytes]]) -> LagReports:
    """(store, partition, node) -> offset lag, from each node's `lag:<id>` hash; a field that
    does not follow the contract is skipped."""
    lag: LagReports = {}
    for node_id, reported in zip(node_ids, every_report, strict=True):
        for lag_key, raw in reported.items():
            store_name, _, partition = as_text(lag_key).rpartition("/")
            try:
                lag[(store_name, int(partition), node_id)] = decode_report(raw).lag
            except (ContractError, ValueError):
                continue
    return lag
