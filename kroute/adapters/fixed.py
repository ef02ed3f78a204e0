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
  of its own.

The adapter is the only writer of its cluster's keys (give it a cluster name of its own). The
file is JSON:

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
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal, Self
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
    Assignment,
    ContractError,
    Event,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    PartitionReport,
    Role,
    StoreInfo,
    decode_assignment,
    encode,
    lag_field,
)
from kroute.agent import EndHistory
from kroute.errors import KrouteError
from materializer.kafka_offsets import fetch_high_watermarks
from partitioner import ALGORITHMS, KEY_FORMATS

log = structlog.get_logger("kroute.adapters.fixed")

LEADER_ID = "fixed-placement"  # the assignment's `leader`: this adapter wrote it
_NO_COMMIT = -1  # OffsetFetch's offset for a partition the group never committed


class PlacementFileError(KrouteError):
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
    timeout_ms: int = Field(default=300, ge=10)
    alive_ttl_ms: int = Field(default=2000, ge=100)
    dead_after: int = Field(default=2, ge=1, description="failed probes in a row: dead")


class UnknownLag(_Strict):
    source: Literal["unknown"] = "unknown"


class GroupLag(_Strict):
    source: Literal["consumer_group"]
    bootstrap_servers: str = Field(min_length=1)
    group: str = Field(min_length=1, description="may contain {node}: one group per replica")
    interval_ms: int = Field(default=1000, ge=100)


class PlacementFile(_Strict):
    nodes: dict[str, str] = Field(min_length=1)
    stores: dict[str, StoreSpec] = Field(min_length=1)
    health: Health = Health()
    lag: Annotated[UnknownLag | GroupLag, Field(discriminator="source")] = UnknownLag()

    @field_validator("nodes")
    @classmethod
    def _urls(cls, nodes: dict[str, str]) -> dict[str, str]:
        for node_id, url in nodes.items():
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname or parts.port is None:
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


def load_placement(path: Path) -> PlacementFile:
    """The file, validated; PlacementFileError saying where and what is wrong."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlacementFileError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        return PlacementFile.model_validate_json(text)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"]) or "(file)"
            problems.append(f"  {where}: {error['msg'].removeprefix('Value error, ')}")
        raise PlacementFileError(f"{path}: not a placement:\n" + "\n".join(problems)) from exc


# -- publishing --------------------------------------------------------------------------------


class FixedPlacement:
    """Writes one placement file's cluster and keeps liveness and lag current."""

    def __init__(self, spec: PlacementFile, redis: aioredis.Redis, keys: Keys) -> None:
        self.spec = spec
        self.redis = redis
        self.keys = keys
        self.clock = SharedClock()
        self.failures: dict[str, int] = dict.fromkeys(spec.nodes, 0)
        self.alive: set[str] = set()
        self.generation = 0
        self._ends: dict[tuple[str, int], EndHistory] = {}
        self._http = httpx.AsyncClient(timeout=spec.health.timeout_ms / 1000, trust_env=False)
        self._kafka: AIOKafkaClient | None = None
        self._admin: AIOKafkaAdminClient | None = None

    async def run(self) -> None:
        await self.clock.sync(self.redis)
        await self.publish_placement()
        loops = [self._every(self.spec.health.interval_ms, self.probe_and_heartbeat)]
        if isinstance(self.spec.lag, GroupLag):
            loops.append(self._every(self.spec.lag.interval_ms, self.report_lag))
        try:
            await asyncio.gather(*loops)
        finally:
            await self.close()

    async def close(self) -> None:
        await self._http.aclose()
        if self._admin is not None:
            await self._admin.close()
        if self._kafka is not None:
            await self._kafka.close()

    async def _every(self, interval_ms: int, step: object) -> None:
        while True:
            try:
                await step()  # type: ignore[operator]
            except (aioredis.RedisError, OSError) as exc:
                log.warning("redis unreachable; heartbeats lapsing", error=str(exc))
            except Exception:  # one bad round must not end the loop
                log.exception("fixed placement step failed; retrying")
            await asyncio.sleep(interval_ms / 1000)

    async def publish_placement(self) -> None:
        """Nodes, stores, every node's hosting and the assignment (a new generation only
        when the stored placement differs from the file's)."""
        at = self.clock.now_ms()
        placements = self.spec.placements()
        stored = await self._stored_assignment()
        if stored is not None and dict(stored.stores) == placements:
            self.generation = stored.generation
        else:
            self.generation = (stored.generation if stored else 0) + 1
        assignment = Assignment(self.generation, LEADER_ID, at, placements)
        async with self.redis.pipeline(transaction=True) as pipe:
            for info in self.spec.store_infos().values():
                pipe.sadd(self.keys.stores, info.name)
                pipe.set(self.keys.store(info.name), encode(info))
            for node_id, url in self.spec.nodes.items():
                pipe.sadd(self.keys.nodes, node_id)
                pipe.set(self.keys.node(node_id), encode(NodeInfo(node_id, url, at)))
                hosting = Hosting(node_id, self.generation, self.spec.hosting_of(node_id), at)
                pipe.set(self.keys.hosting(node_id), encode(hosting))
                if isinstance(self.spec.lag, UnknownLag):
                    pipe.delete(self.keys.lag(node_id))  # no report: lag unknown
            pipe.set(self.keys.assignment, encode(assignment))
            pipe.publish(self.keys.events, encode(Event("assignment", generation=self.generation)))
            await pipe.execute()

    async def _stored_assignment(self) -> Assignment | None:
        raw = await self.redis.get(self.keys.assignment)
        if raw is None:
            return None
        try:
            return decode_assignment(raw)
        except ContractError:
            return None  # unreadable: replaced

    async def probe_and_heartbeat(self) -> None:
        nodes = self.spec.nodes
        results = await asyncio.gather(*(self._probe(url) for url in nodes.values()))
        at = self.clock.now_ms()
        async with self.redis.pipeline(transaction=False) as pipe:
            for (node_id, url), up in zip(nodes.items(), results, strict=True):
                self.failures[node_id] = 0 if up else self.failures[node_id] + 1
                if up:
                    pipe.set(self.keys.alive(node_id), b"1", px=self.spec.health.alive_ttl_ms)
                elif self.failures[node_id] >= self.spec.health.dead_after:
                    pipe.delete(self.keys.alive(node_id))
                self._note_change(node_id, url, up)
                # hosting is refreshed with the heartbeat: its age says this adapter runs
                hosting = Hosting(node_id, self.generation, self.spec.hosting_of(node_id), at)
                pipe.set(self.keys.hosting(node_id), encode(hosting))
            pipe.publish(self.keys.events, encode(Event("node")))
            pipe.time()
            sent = self.clock.stopwatch()
            replies = await pipe.execute()
            self.clock.observe(replies[-1], sent, self.clock.stopwatch())

    def _note_change(self, node_id: str, url: str, up: bool) -> None:
        dead = self.failures[node_id] >= self.spec.health.dead_after
        if up and node_id not in self.alive:
            self.alive.add(node_id)
            log.info("node answers its health probe", node=node_id, url=url)
        elif dead and node_id in self.alive:
            self.alive.discard(node_id)
            log.warning("node failed its health probes: dead", node=node_id, url=url)

    async def _probe(self, url: str) -> bool:
        try:
            response = await self._http.get(url.rstrip("/") + self.spec.health.path)
        except httpx.HTTPError:
            return False
        return response.status_code < 500

    # -- lag from a consumer group ---------------------------------------------------------

    async def report_lag(self) -> None:
        lag = self.spec.lag
        assert isinstance(lag, GroupLag)
        kafka, admin = await self._clients(lag)
        stores = self.spec.store_infos()
        asked_at = self.clock.now_ms()  # the ends describe the log when asked
        ends: dict[tuple[str, int], int] = {}
        for name, info in stores.items():
            highs = await fetch_high_watermarks(kafka, info.topic, range(info.partitions))
            ends.update({(name, p): high for p, high in highs.items()})
            for p, high in highs.items():
                self._ends.setdefault((name, p), EndHistory()).recent.append((high, asked_at))
        committed = await self._committed(admin, lag, stores)
        at = self.clock.now_ms()
        async with self.redis.pipeline(transaction=True) as pipe:
            for node_id in self.spec.nodes:
                reports = self._reports(node_id, committed, at)
                pipe.delete(self.keys.lag(node_id))
                if reports:
                    pipe.hset(self.keys.lag(node_id), mapping=reports)  # type: ignore[arg-type]
                    pipe.pexpire(self.keys.lag(node_id), self.spec.health.alive_ttl_ms * 10)
            pipe.publish(self.keys.events, encode(Event("lag")))
            await pipe.execute()

    def _reports(
        self,
        node_id: str,
        committed: Mapping[tuple[str, str, int], int],
        at: int,
    ) -> dict[str, bytes]:
        reports = {}
        for store, roles in self.spec.hosting_of(node_id).items():
            for partition in roles["active"] + roles["standby"]:
                position = committed.get((node_id, store, partition))
                if position is None:
                    continue
                history = self._ends.setdefault((store, partition), EndHistory())
                end, caught_up_at = history.report(position, at)
                if caught_up_at is not None:  # never fresher than true after a clock step
                    caught_up_at = self.clock.conservative_ms(caught_up_at)
                report = PartitionReport(position, end, None, caught_up_at, at)
                reports[lag_field(store, partition)] = encode(report)
        return reports

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
    """The CLI's work: validate the file, then publish until stopped."""
    spec = load_placement(path)

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_url, socket_timeout=2.0)
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
    fixed.add_argument("--redis", required=True, metavar="URL", help="redis://host:port/db")
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
    run_fixed(args.placement, args.redis, args.cluster)
    return 0
