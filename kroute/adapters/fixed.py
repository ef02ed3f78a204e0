"""`kroute adapt fixed`: publish a service whose placement is fixed, from a file.

For services that do not rebalance (each instance configured with its partitions, or one
instance per partition behind fixed URLs): the file says which URL serves which partition,
active and standby; this process writes that placement in the Redis contract and keeps it
honest about the two things a file cannot know:

- liveness: every `interval_ms` it asks each node's health path (a timeout, any status below
  500 is "up", as the proxy's own probe judges). A node that answers gets its `alive` key
  refreshed with a TTL; one that fails `dead_after` probes in a row loses it at once (and a
  stopped adapter lets every TTL run out: it cannot vouch for anyone).
- lag: unknown (no lag reports: proxies refuse such replicas under a lag budget and serve them
  without one), or a consumer group's committed offsets against the high watermarks (read from
  Fetch responses). A commit trails what the service applied, so this lag is an upper bound.
  The group name may contain `{node}` for services where every replica consumes in a group
  of its own; without it the commits are the active's, so standbys get no report (unknown
  lag), never the active's freshness.

The adapter is the only writer of its cluster's keys (give it a cluster name of its own); a
lease in `leader` enforces it (`kroute.adapters.fencing`). So a node id in `nodes` that the file
does not name was described by an earlier file: it is forgotten (`common.departed`) once it has
been out of the file for `forget_after_ms` (kroute's leader's grace period by default). A node
the file names is never forgotten, dead or not: the file places it. The file is JSON:

    {"nodes": {"a": "http://10.0.0.5:8000", "b": "http://10.0.0.6:8000"},
     "stores": {"customers": {"topic": "customers", "partitions": 2, "key_format": "string",
                              "placement": {"0": {"active": "a", "standbys": ["b"]},
                                            "1": {"active": "b", "standbys": ["a"]}}}},
     "health": {"path": "/health/live", "interval_ms": 500, "timeout_ms": 300},
     "lag": {"source": "consumer_group", "bootstrap_servers": "kafka:9092", "group": "svc"}}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from string import Formatter
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis
import structlog
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.structs import TopicPartition
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.clock import SharedClock
from common.contract import (
    DEFAULT_CLUSTER,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    ReportBodies,
    Role,
    StoreInfo,
    encode,
    lag_field,
    write_node_report,
)
from common.departed import DEFAULT_GRACE_MS, Departures, departures, read_membership
from kroute.adapters import probing
from kroute.adapters.fencing import OwnerLease
from kroute.adapters.probing import redis_url_error
from kroute.agent import EndHistory, conservative_report
from kroute.errors import UsageError
from materializer.kafka_offsets import fetch_high_watermarks
from partitioner import ALGORITHMS, KEY_FORMATS

log = structlog.get_logger("kroute.adapters.fixed")

LEADER_ID = "fixed-placement"  # the assignment's `leader`: this adapter wrote it
_NO_COMMIT = -1  # OffsetFetch's offset for a partition the group never committed


class PlacementFileError(UsageError):
    """The placement file cannot be read or does not describe a placement."""


# -- the file ----------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Placed(_Strict):
    active: str | None
    standbys: list[str] = []


class StoreSpec(_Strict):
    topic: str = Field(min_length=1)
    partitions: int = Field(ge=1)
    key_format: str = "string"
    partitioner: str = "murmur2"
    value_format: str = "json"
    placement: dict[int, Placed]

    @field_validator("key_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        if value not in KEY_FORMATS:
            raise ValueError(f"{value!r} is not one of {', '.join(KEY_FORMATS)}")
        return value

    @field_validator("partitioner")
    @classmethod
    def _known_partitioner(cls, value: str) -> str:
        if value not in ALGORITHMS:
            raise ValueError(f"{value!r} is not one of {', '.join(ALGORITHMS)}")
        return value

    @model_validator(mode="after")
    def _every_partition_once(self) -> Self:
        missing = [p for p in range(self.partitions) if p not in self.placement]
        extra = sorted(p for p in self.placement if not 0 <= p < self.partitions)
        if missing:
            last = self.partitions - 1
            raise ValueError(f"partitions {missing} are not placed (all of 0..{last} must be)")
        if extra:
            raise ValueError(f"partitions {extra} are outside 0..{self.partitions - 1}")
        for partition, placed in self.placement.items():
            named = ([placed.active] if placed.active else []) + placed.standbys
            if len(set(named)) != len(named):
                raise ValueError(f"partition {partition} names a node twice: {named}")
        return self


class Health(_Strict):
    path: str = Field(default="/health/live", pattern=r"^/")
    interval_ms: int = Field(default=500, ge=50)
    timeout_ms: int = Field(default=300, ge=10, description="the whole probe, body excluded")
    alive_ttl_ms: int = Field(default=2000, ge=100)
    dead_after: int = Field(default=2, ge=1, description="failed probes in a row: dead")

    @model_validator(mode="after")
    def _ttl_outlives_a_round(self) -> Self:
        if self.alive_ttl_ms <= self.interval_ms + self.timeout_ms:
            raise ValueError(
                f"alive_ttl_ms {self.alive_ttl_ms} must exceed interval_ms + timeout_ms "
                f"({self.interval_ms} + {self.timeout_ms}), or a live node looks dead between "
                "two probes"
            )
        return self


class UnknownLag(_Strict):
    source: Literal["unknown"] = "unknown"


class GroupLag(_Strict):
    source: Literal["consumer_group"]
    bootstrap_servers: str = Field(min_length=1)
    group: str = Field(min_length=1, description="may contain {node}: one group per replica")
    interval_ms: int = Field(default=1000, ge=100)

    @field_validator("group")
    @classmethod
    def _only_node_placeholder(cls, group: str) -> str:
        try:
            parsed = list(Formatter().parse(group))
        except ValueError as exc:
            raise ValueError(f"{group!r}: {exc} (write {{{{ and }}}} for literal braces)") from None
        unknown = sorted(
            f"{{{name}}}"
            for _, name, spec, _ in parsed
            if name is not None and (name, spec) != ("node", "")
        )
        if unknown:
            raise ValueError(f"{group!r}: unknown placeholders {unknown}; only {{node}} is known")
        return group

    @property
    def per_replica(self) -> bool:
        """Whether every replica consumes in a group of its own (the name has `{node}`)."""
        return "{node}" in self.group


class PlacementFile(_Strict):
    nodes: dict[str, str] = Field(min_length=1)
    stores: dict[str, StoreSpec] = Field(min_length=1)
    health: Health = Health()
    lag: Annotated[UnknownLag | GroupLag, Field(discriminator="source")] = UnknownLag()
    lease_ms: int = Field(default=5000, ge=1000, description="the writer lease (fencing)")
    forget_after_ms: int = Field(
        default=DEFAULT_GRACE_MS, ge=0, description="a node out of the file this long is forgotten"
    )

    @field_validator("nodes")
    @classmethod
    def _urls(cls, nodes: dict[str, str]) -> dict[str, str]:
        for node_id, url in nodes.items():
            if not _is_host_port(url):
                raise ValueError(f"node {node_id!r}: {url!r} is not http://host:port")
            if ":" in node_id or not node_id:
                raise ValueError(f"node id {node_id!r} must be non-empty without ':'")
        return nodes

    @model_validator(mode="after")
    def _known_nodes(self) -> Self:
        for name, store in self.stores.items():
            for partition, placed in store.placement.items():
                named = ([placed.active] if placed.active else []) + placed.standbys
                unknown = [n for n in named if n not in self.nodes]
                if unknown:
                    raise ValueError(
                        f"store {name!r} partition {partition}: nodes {unknown} are not in "
                        f'"nodes" ({", ".join(self.nodes)})'
                    )
        return self

    @model_validator(mode="after")
    def _lease_outlives_a_round(self) -> Self:
        round_ms = 2 * self.health.interval_ms + self.health.timeout_ms
        if self.lease_ms < round_ms:
            raise ValueError(
                f"lease_ms {self.lease_ms}: at least two health intervals plus the probe "
                f"timeout ({round_ms}), or the lease lapses between rounds"
            )
        return self

    def store_infos(self) -> dict[str, StoreInfo]:
        return {
            name: StoreInfo(
                name, s.topic, s.partitions, s.key_format, s.partitioner, s.value_format
            )
            for name, s in self.stores.items()
        }

    def placements(self) -> dict[str, dict[int, PartitionAssignment]]:
        return {
            name: {
                p: PartitionAssignment(placed.active, tuple(placed.standbys))
                for p, placed in sorted(s.placement.items())
            }
            for name, s in self.stores.items()
        }

    def hosting_of(self, node_id: str) -> dict[str, dict[Role, tuple[int, ...]]]:
        hosted: dict[str, dict[Role, tuple[int, ...]]] = {}
        for name, placed in self.placements().items():
            active = tuple(p for p, a in placed.items() if a.active == node_id)
            standby = tuple(p for p, a in placed.items() if node_id in a.standbys)
            if active or standby:
                hosted[name] = {"active": active, "standby": standby}
        return hosted


def _is_host_port(url: str) -> bool:
    """http://host:port and nothing more: proxies ignore any other node URL."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return False
    no_rest = not (parts.path.strip("/") or parts.query or parts.fragment)
    return parts.scheme == "http" and bool(parts.hostname) and port is not None and no_rest


def load_placement(path: Path) -> PlacementFile:
    """The file, validated; PlacementFileError saying on one line where and what is wrong."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise PlacementFileError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise PlacementFileError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    try:
        return PlacementFile.model_validate_json(text)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "(file)"
            problems.append(f"{where}: {error['msg'].removeprefix('Value error, ')}")
        raise PlacementFileError(f"{path}: not a placement: " + "; ".join(problems)) from exc


# -- publishing --------------------------------------------------------------------------------

_MAX_BACKOFF_MS = 2_000  # retries after Redis errors slow down to this, not further


class FixedPlacement:
    """Writes one placement file's cluster and keeps liveness and lag current.

    Every health round rewrites the whole placement (nodes, stores, hosting; the assignment
    when Redis holds another or none): a Redis that restarted empty is refilled within a
    round. All writes are fenced by the writer lease (`kroute.adapters.fencing`)."""

    def __init__(self, spec: PlacementFile, redis: aioredis.Redis, keys: Keys) -> None:
        self.spec = spec
        self.redis = redis
        self.keys = keys
        self.clock = SharedClock()
        self.lease = OwnerLease(redis, keys, kind=LEADER_ID, lease_ms=spec.lease_ms)
        self.failures: dict[str, int] = dict.fromkeys(spec.nodes, 0)
        self.alive: set[str] = set()
        self.started_at_ms: int | None = None  # `started_at_ms` of every node: this adapter's
        # (node, store, partition): each replica's own history, never another replica's.
        self._ends: dict[tuple[str, str, int], EndHistory] = {}
        # node -> its last lag reports (GroupLag), rewritten with every round's hosting.
        self._last_reports: dict[str, dict[tuple[str, int], PartitionReport]] = {}
        self._expire_ms = spec.health.alive_ttl_ms * 10
        self._report_bodies = ReportBodies()  # every node's report:<id> as last written
        self._http = httpx.AsyncClient(timeout=spec.health.timeout_ms / 1000, trust_env=False)
        self._kafka: AIOKafkaClient | None = None
        self._admin: AIOKafkaAdminClient | None = None

    @property
    def generation(self) -> int:
        return self.lease.generation

    async def run(self) -> None:
        loops = [self._every(self.spec.health.interval_ms, self.probe_and_heartbeat)]
        if isinstance(self.spec.lag, GroupLag):
            loops.append(self._every(self.spec.lag.interval_ms, self.report_lag))
        try:
            await asyncio.gather(*loops)
        finally:
            with contextlib.suppress(Exception):  # best effort: the lease lapses anyway
                await asyncio.wait_for(self.lease.release(), 1.0)
            await self.close()

    async def close(self) -> None:
        await self._http.aclose()
        if self._admin is not None:
            await self._admin.close()
        if self._kafka is not None:
            await self._kafka.close()

    async def _every(self, interval_ms: int, step: Callable[[], Awaitable[None]]) -> None:
        failed = 0
        while True:
            try:
                await step()
                if failed:
                    log.info("redis reachable again", step=step.__name__)
                failed = 0
            except (aioredis.RedisError, OSError) as exc:
                failed += 1
                if failed == 1:
                    log.warning("redis unreachable; heartbeats lapsing", error=str(exc))
            except Exception:  # one bad round must not end the loop
                failed += 1
                log.exception("fixed placement step failed; retrying")
            delay_ms = min(interval_ms * 2 ** min(failed, 6), max(_MAX_BACKOFF_MS, interval_ms))
            await asyncio.sleep((delay_ms if failed else interval_ms) / 1000)

    async def probe_and_heartbeat(self) -> None:
        """One health round: hold the lease, probe every node (each one's heartbeat written
        as its answer arrives), then rewrite the placement and hosting in one fenced write."""
        if not self.clock.synced:
            await self.clock.sync(self.redis)  # nothing is stamped on the local clock
        if not await self.lease.hold():
            return
        if self.started_at_ms is None:
            self.started_at_ms = self.clock.now_ms()
        nodes = self.spec.nodes
        results = await asyncio.gather(*(self._probe(n, url) for n, url in nodes.items()))
        for (node_id, url), up in zip(nodes.items(), results, strict=True):
            self.failures[node_id] = 0 if up else self.failures[node_id] + 1
            self._note_change(node_id, url, up)
        leaving = await self._departures()
        at = self.clock.now_ms()

        def queue(pipe: Any, generation: int) -> None:
            self._queue_round(pipe, generation)
            leaving.queue(pipe, self.keys, at)

        if not await self.lease.write(self.spec.placements(), LEADER_ID, at, queue):
            log.warning("round not published: the lease or assignment changed meanwhile")
        elif leaving.departed:
            log.info(
                "nodes no longer in the file forgotten",
                nodes=leaving.departed,
                forget_after_ms=self.spec.forget_after_ms,
            )

    async def _departures(self) -> Departures:
        """Ids in `nodes` the file does not name (an earlier file's): their grace period
        starts, and ends in forgetting them. Ids the file names are present, dead or not."""
        membership = await read_membership(self.redis, self.keys)
        named = set(self.spec.nodes)
        return departures(
            membership,
            absent=membership.registered - named,
            present=named,
            placed=named,
            now_ms=self.clock.now_ms(),
            grace_ms=self.spec.forget_after_ms,
        )

    def _queue_round(self, pipe: Any, generation: int) -> None:
        keys, at = self.keys, self.clock.now_ms()
        started = self.started_at_ms if self.started_at_ms is not None else at
        for info in self.spec.store_infos().values():
            pipe.sadd(keys.stores, info.name)
            pipe.set(keys.store(info.name), encode(info))
        for node_id, url in self.spec.nodes.items():
            pipe.sadd(keys.nodes, node_id)
            pipe.set(keys.node(node_id), encode(NodeInfo(node_id, url, started)))
            if self.failures[node_id] >= self.spec.health.dead_after:
                pipe.delete(keys.alive(node_id))
            # hosting is refreshed with the heartbeat: its age says this adapter runs; the
            # lag reports written with it are the last ones read (none: lag unknown).
            hosting = Hosting(node_id, generation, self.spec.hosting_of(node_id), at)
            write_node_report(
                pipe,
                keys,
                hosting,
                self._still_hosted(hosting),
                self._expire_ms,
                bodies=self._report_bodies,
            )
        pipe.publish(keys.events, encode(Event("hosting", generation=generation)))
        pipe.time()  # keeps the clock in step without another round trip

    def _note_change(self, node_id: str, url: str, up: bool) -> None:
        dead = self.failures[node_id] >= self.spec.health.dead_after
        if up and node_id not in self.alive:
            self.alive.add(node_id)
            log.info("node answers its health probe", node=node_id, url=url)
        elif dead and node_id in self.alive:
            self.alive.discard(node_id)
            log.warning("node failed its health probes: dead", node=node_id, url=url)

    async def _probe(self, node_id: str, url: str) -> bool:
        """Probe one node within the timeout (status only: the body is never read) and, if
        it answers, refresh its heartbeat at once, counted from its answer."""
        health = self.spec.health
        try:
            answer = await probing.get(
                self._http,
                url.rstrip("/") + health.path,
                deadline_s=health.timeout_ms / 1000,
                read_body=False,
            )
        except probing.ProbeFailed:
            return False
        if answer.status >= 500:
            return False
        await self.redis.set(self.keys.alive(node_id), b"1", px=health.alive_ttl_ms)
        return True

    # -- lag from a consumer group ---------------------------------------------------------

    async def report_lag(self) -> None:
        if not self.clock.synced or not self.lease.held:
            return  # the health round syncs and takes the lease first
        lag = self.spec.lag
        assert isinstance(lag, GroupLag)
        kafka, admin = await self._clients(lag)
        stores = self.spec.store_infos()
        asked_at = self.clock.now_ms()  # the ends describe the log when asked
        ends: dict[tuple[str, int], int] = {}
        for name, info in stores.items():
            highs = await fetch_high_watermarks(kafka, info.topic, range(info.partitions))
            ends.update({(name, p): high for p, high in highs.items()})
        self.remember_ends(ends, asked_at)
        committed = await self._committed(admin, lag, stores)
        at = self.clock.now_ms()

        def queue(pipe: Any, generation: int) -> None:
            for node_id in self.spec.nodes:
                read = self._lag_reports_as_read(node_id, committed, at)
                self._last_reports[node_id] = read  # health rounds publish them again
                reports = self._conservative(read)
                hosting = Hosting(node_id, generation, self.spec.hosting_of(node_id), at)
                write_node_report(
                    pipe,
                    self.keys,
                    hosting,
                    reports,
                    self._expire_ms,
                    bodies=self._report_bodies,
                )
            pipe.publish(self.keys.events, encode(Event("lag")))

        await self.lease.write(self.spec.placements(), LEADER_ID, at, queue)

    def reported(self, node_id: str) -> list[tuple[str, int]]:
        """(store, partition) a node gets lag reports for. With one group for all replicas
        its commits are the active's: a standby's progress is unknown, never the active's."""
        lag = self.spec.lag
        per_replica = isinstance(lag, GroupLag) and lag.per_replica
        return [
            (store, p)
            for store, roles in self.spec.hosting_of(node_id).items()
            for p in roles["active"] + (roles["standby"] if per_replica else ())
        ]

    def remember_ends(self, ends: Mapping[tuple[str, int], int], asked_at: int) -> None:
        for node_id in self.spec.nodes:
            for store, p in self.reported(node_id):
                if (store, p) in ends:
                    history = self._ends.setdefault((node_id, store, p), EndHistory())
                    history.recent.append((ends[(store, p)], asked_at))

    def _reports(
        self,
        node_id: str,
        committed: Mapping[tuple[str, str, int], int],
        at: int,
    ) -> dict[str, bytes]:
        """A node's lag reports as `lag:<id>` holds them."""
        return {
            lag_field(store, p): encode(r)
            for (store, p), r in self._lag_reports(node_id, committed, at).items()
        }

    def _lag_reports(
        self,
        node_id: str,
        committed: Mapping[tuple[str, str, int], int],
        at: int,
    ) -> dict[tuple[str, int], PartitionReport]:
        """A node's lag reports at `at`, their times mapped (never fresher than true after a
        clock step)."""
        return self._conservative(self._lag_reports_as_read(node_id, committed, at))

    def _lag_reports_as_read(
        self,
        node_id: str,
        committed: Mapping[tuple[str, str, int], int],
        at: int,
    ) -> dict[tuple[str, int], PartitionReport]:
        """A node's lag reports at `at`, their times as this clock read them."""
        reports = {}
        for store, partition in self.reported(node_id):
            position = committed.get((node_id, store, partition))
            if position is None:
                continue
            history = self._ends.setdefault((node_id, store, partition), EndHistory())
            end, caught_up_at = history.report(position, at)
            # As of the end read (EndHistory.as_of): a caught-up replica's ages in
            # report:<id> then stay the same from one round to the next.
            as_of = history.as_of(at)
            reports[(store, partition)] = PartitionReport(position, end, None, caught_up_at, as_of)
        return reports

    def _conservative(
        self, reports: Mapping[tuple[str, int], PartitionReport]
    ) -> dict[tuple[str, int], PartitionReport]:
        """Reports with their times mapped now: the health rounds publish the last ones read
        again until the next lag round, and mapped when read, one read before a backward
        clock step would read fresher than true."""
        return {where: conservative_report(r, self.clock) for where, r in reports.items()}

    def _still_hosted(self, hosting: Hosting) -> dict[tuple[str, int], PartitionReport]:
        """The last lag reports read for a node, of the partitions it still hosts."""
        hosted = {
            (store, p)
            for store, roles in hosting.stores.items()
            for ps in roles.values()
            for p in ps
        }
        last = self._last_reports.get(hosting.node_id, {})
        return self._conservative({where: r for where, r in last.items() if where in hosted})

    async def _committed(
        self, admin: AIOKafkaAdminClient, lag: GroupLag, stores: Mapping[str, StoreInfo]
    ) -> dict[tuple[str, str, int], int]:
        """(node, store, partition) -> the group's committed offset (0 if never committed)."""
        by_group: dict[str, list[str]] = {}
        for node_id in self.spec.nodes:
            by_group.setdefault(lag.group.format(node=node_id), []).append(node_id)
        wanted = [
            TopicPartition(info.topic, p)
            for info in stores.values()
            for p in range(info.partitions)
        ]
        committed = {}
        for group, node_ids in by_group.items():
            # Partitions named: asking for "all" (a null topic list) breaks on Tansu.
            offsets = await admin.list_consumer_group_offsets(group, partitions=wanted)
            by_tp = {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items()}
            for name, info in stores.items():
                for p in range(info.partitions):
                    offset = by_tp.get((info.topic, p), _NO_COMMIT)
                    for node_id in node_ids:
                        committed[(node_id, name, p)] = max(offset, 0)
        return committed

    async def _clients(self, lag: GroupLag) -> tuple[AIOKafkaClient, AIOKafkaAdminClient]:
        if self._kafka is None or self._admin is None:
            self._kafka = AIOKafkaClient(bootstrap_servers=lag.bootstrap_servers)
            self._admin = AIOKafkaAdminClient(bootstrap_servers=lag.bootstrap_servers)
            await self._kafka.bootstrap()
            await self._admin.start()
        return self._kafka, self._admin


def run_fixed(path: Path, redis_url: str, cluster: str) -> None:
    """The CLI's work: validate the file and the URL, then publish until stopped."""
    spec = load_placement(path)
    if (problem := redis_url_error(redis_url)) is not None:
        raise UsageError(problem)

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            await FixedPlacement(spec, client, Keys(cluster)).run()
        finally:
            await client.aclose()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


def add_command(adapters: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kroute adapt fixed ...`: registered under the CLI's `adapt` command."""
    fixed = adapters.add_parser(
        "fixed",
        help="publish a fixed placement (a file) with probed liveness and group lag",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    fixed.add_argument(
        "--placement",
        required=True,
        type=Path,
        metavar="FILE",
        help="JSON: nodes, stores with placement, health, lag (see --help)",
    )
    fixed.add_argument("--redis", metavar="URL", help="redis://host:port/db (not with --check)")
    fixed.add_argument("--cluster", default=DEFAULT_CLUSTER, help="the contract's cluster name")
    fixed.add_argument(
        "--check", action="store_true", help="only validate the file, publish nothing"
    )
    fixed.set_defaults(handler=command)  # fmt: skip


def command(args: argparse.Namespace) -> int:
    if args.check:
        spec = load_placement(args.placement)
        stores = ", ".join(f"{n} ({s.partitions} partitions)" for n, s in spec.stores.items())
        print(f"{args.placement}: {len(spec.nodes)} nodes; stores {stores}")
        return 0
    if not args.redis:
        raise UsageError("adapt fixed: --redis URL is required (unless --check)")
    run_fixed(args.placement, args.redis, args.cluster)
    return 0
