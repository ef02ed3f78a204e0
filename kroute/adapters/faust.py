"""Put kroute in front of a Faust app: publish its table's placement in the Redis contract.

`kroute adapt faust` reads what Faust itself exposes and writes, every interval, what the proxy
needs to send each lookup straight to the worker that owns the key's partition:

- placement: every worker's `GET /router/` (Faust's router blueprint, on by default) maps each
  worker's canonical URL to the table's changelog partitions it is *active* for. A worker is
  published as hosting a partition only when its own map says so (that is when its
  `table_route` answers locally instead of forwarding), and the assignment names the owner the
  live workers' maps agree on; while they disagree (a Faust rebalance) the partition has no
  owner and the proxy answers a clear 503. Faust's router lists no standbys; `GET /assignment/`
  (served when `web_stats_enabled` or `debug` is on) lists a worker's own standbys, published
  only with `--standbys`: a stock `table_route` view forwards a standby's reads to the active.
- lag: the Faust consumer group's committed offsets on the table's source topics (the topics
  Faust's `/router/topics` places exactly like the changelog) against their high watermarks,
  read from Fetch responses (some brokers, Tansu among them, answer ListOffsets(latest) wrong).
  Faust commits every `broker_commit_interval`, so the lag is an upper bound.
- liveness: the same `/router/` request, with a timeout, is the health probe. A worker that
  does not answer stops being refreshed (its `alive` key expires) and after `dead_after` failed
  probes in a row its `alive` key is deleted at once.

The adapter is the only writer of its cluster's keys: give it a cluster name of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis
import structlog
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.structs import TopicPartition

from common.clock import SHARED
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
from kroute.errors import KrouteError
from materializer.kafka_offsets import fetch_high_watermarks

log = structlog.get_logger("kroute.adapters.faust")

LEADER_ID = "faust-adapter"  # the assignment's `leader`: this adapter computed it
_END_HISTORY = 64  # high watermarks remembered per partition, to date "caught up"
_NO_COMMIT = -1  # OffsetFetch's answer for a partition the group never committed
_LEADER_TOPIC = "__assignor-__leader"  # Faust's internal topic: never a table's source

RouterMap = dict[str, dict[str, list[int]]]  # worker URL -> topic -> partitions


class FaustAdapterError(KrouteError):
    """Bad input to the Faust adapter, or a Faust app it cannot describe; says what to fix."""


@dataclass(frozen=True)
class FaustAdapterSettings:
    workers: tuple[str, ...]  # where to start: any worker's web URL; the rest is discovered
    table: str  # the Faust table's name (app.Table("<name>", ...))
    store: str  # the store name proxies route by
    redis_url: str
    bootstrap_servers: str
    cluster: str = DEFAULT_CLUSTER
    group: str | None = None  # Faust's consumer group (its app id); derived from the changelog
    source_topics: tuple[str, ...] = ()  # empty: discovered from /router/topics
    key_format: str = "json"  # Faust tables serialize str keys as JSON
    interval_ms: int = 500
    alive_ttl_ms: int = 2_000
    dead_after: int = 2  # failed probes in a row before a worker's alive key is deleted
    http_timeout_ms: int = 1_000
    kafka_timeout_ms: int = 2_000
    redis_timeout_ms: int = 1_000
    standbys: bool = False

    def validate(self) -> None:
        if not self.workers:
            raise FaustAdapterError("give at least one worker URL (--worker http://host:port)")
        for url in self.workers:
            _check_url(url)
        for name, value in (("--table", self.table), ("--store", self.store)):
            if not value or "/" in value or ":" in value:
                raise FaustAdapterError(f"{name} {value!r}: a non-empty name without '/' or ':'")
        if self.interval_ms < 50:
            raise FaustAdapterError(f"--interval-ms {self.interval_ms}: at least 50")
        if self.alive_ttl_ms < 2 * self.interval_ms:
            raise FaustAdapterError(
                f"--alive-ttl-ms {self.alive_ttl_ms} must be at least twice --interval-ms "
                f"{self.interval_ms}, or a worker looks dead between two rounds"
            )
        if self.dead_after < 1:
            raise FaustAdapterError(f"--dead-after {self.dead_after}: at least 1")
        from partitioner import KEY_FORMATS  # noqa: PLC0415 - only to validate once

        if self.key_format not in KEY_FORMATS:
            raise FaustAdapterError(
                f"--key-format {self.key_format!r}: one of {', '.join(KEY_FORMATS)}"
            )


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise FaustAdapterError(f"worker URL {url!r}: expected http://host:port")
    return f"http://{parts.hostname}:{parts.port}"


def node_id_for(url: str) -> str:
    """A contract node id for a worker URL: `host-port` (no ':' in ids, they end Redis keys)."""
    parts = urlsplit(url)
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{parts.hostname}-{parts.port}")


# -- reading Faust -----------------------------------------------------------------------------


def parse_router(body: Any) -> RouterMap:
    """A `/router/` (or `/router/topics`) answer: {url: {topic: [partition, ...]}}."""
    if not isinstance(body, dict):
        raise ValueError(f"expected a JSON object of worker URLs, got {type(body).__name__}")
    parsed: RouterMap = {}
    for url, topics in body.items():
        if not isinstance(topics, dict) or not all(
            isinstance(parts, list) and all(isinstance(p, int) for p in parts)
            for parts in topics.values()
        ):
            raise ValueError(f"worker {url!r}: expected {{topic: [partition, ...]}}")
        parsed[str(url)] = {str(t): sorted(parts) for t, parts in topics.items()}
    return parsed


def changelog_topic(views: Mapping[str, RouterMap], table: str, group: str | None) -> str | None:
    """The table's changelog topic among those the routers list (`<app id>-<table>-changelog`)."""
    suffix = f"-{table}-changelog"
    found = {t for view in views.values() for topics in view.values() for t in topics}
    if group is not None:
        return f"{group}{suffix}" if f"{group}{suffix}" in found else None
    matches = sorted(t for t in found if t.endswith(suffix))
    if len(matches) > 1:
        raise FaustAdapterError(
            f"several changelog topics for table {table!r}: {matches}; pass --group (app id)"
        )
    return matches[0] if matches else None


def owners(views: Mapping[str, RouterMap], topic: str, partitions: int) -> dict[int, str | None]:
    """partition -> the worker the live workers' routers agree owns it (None: they disagree,
    or none lists it). Each live worker's own map counts once."""
    votes: dict[int, Counter[str]] = {p: Counter() for p in range(partitions)}
    for view in views.values():
        for url, topics in view.items():
            for p in topics.get(topic, []):
                if p in votes:
                    votes[p][url] += 1
    placed: dict[int, str | None] = {}
    for p, counted in votes.items():
        ranked = counted.most_common(2)
        tied = len(ranked) == 2 and ranked[0][1] == ranked[1][1]
        placed[p] = ranked[0][0] if ranked and not tied else None
    return placed


def self_claims(views: Mapping[str, RouterMap], topic: str) -> dict[str, tuple[int, ...]]:
    """worker -> the partitions its own router map says it is active for (it serves them)."""
    return {url: tuple(view.get(url, {}).get(topic, [])) for url, view in views.items()}


def source_topics(topic_view: RouterMap, table_view: RouterMap, table_topic: str) -> list[str]:
    """Topics Faust places exactly like the table's changelog: the ones feeding the table."""
    placed_like_table = {url: set(t.get(table_topic, [])) for url, t in table_view.items()}
    candidates = {t for topics in topic_view.values() for t in topics if _LEADER_TOPIC not in t}
    return sorted(
        t
        for t in candidates
        if {url: set(ts.get(t, [])) for url, ts in topic_view.items() if ts.get(t)}
        == {url: ps for url, ps in placed_like_table.items() if ps}
    )


# -- lag ---------------------------------------------------------------------------------------


@dataclass
class LagBook:
    """Per partition: recent (high watermark sum, asked at) pairs, to date "caught up"."""

    ends: dict[int, deque[tuple[int, int]]] = field(default_factory=dict)

    def report(self, partition: int, current: int, end: int, asked_at_ms: int) -> PartitionReport:
        history = self.ends.setdefault(partition, deque(maxlen=_END_HISTORY))
        history.append((end, asked_at_ms))
        # Caught up at T: the group's committed position has reached an end read at T. The
        # committed offset trails Faust's real position by up to one commit interval, so
        # this is never later than the truth.
        reached = [at for e, at in history if e <= current]
        caught_up = SHARED.conservative_ms(max(reached)) if reached else None
        return PartitionReport(
            current_offset=current,
            end_offset=end,
            newest_record_ms=None,  # Faust does not say; the proxy does not need it
            caught_up_at_ms=caught_up,
            updated_at_ms=SHARED.now_ms(),
        )


# -- the adapter -------------------------------------------------------------------------------


@dataclass
class Round:
    """What one round saw."""

    views: dict[str, RouterMap]  # live worker URL -> its router map
    standbys: dict[str, tuple[int, ...]]
    failed: dict[str, str]  # worker URL -> why its probe failed


class FaustAdapter:
    def __init__(self, settings: FaustAdapterSettings) -> None:
        settings.validate()
        self.settings = settings
        self.keys = Keys(settings.cluster)
        self.seeds = tuple(_check_url(url) for url in settings.workers)
        self.known: dict[str, int] = {}  # worker URL -> first seen (Redis ms)
        self.failures: Counter[str] = Counter()
        self.generation = 0
        self.placement: dict[int, PartitionAssignment] | None = None
        self.topic: str | None = None
        self.partitions = 0
        self.sources: list[str] = []
        self.lag_book = LagBook()
        self._warned: set[str] = set()
        timeout = settings.http_timeout_ms / 1000
        self.http = httpx.AsyncClient(timeout=timeout, trust_env=False)
        self.redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_ms / 1000,
            socket_connect_timeout=settings.redis_timeout_ms / 1000,
        )
        self.kafka: AIOKafkaClient | None = None
        self.admin: AIOKafkaAdminClient | None = None

    async def run(self, stop: asyncio.Event) -> None:
        """Publish every interval until `stop` is set; errors of one round are logged."""
        interval = self.settings.interval_ms / 1000
        log.info(
            "faust adapter starting",
            seeds=self.seeds,
            table=self.settings.table,
            store=self.settings.store,
            cluster=self.settings.cluster,
        )
        try:
            while not stop.is_set():
                try:
                    await self.step()
                except Exception as exc:  # noqa: BLE001 - keep publishing; say why it failed
                    log.warning("round failed", error=f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(TimeoutError):  # the interval passed: next round
                    await asyncio.wait_for(stop.wait(), interval)
        finally:
            await self.close()

    async def close(self) -> None:
        await self.http.aclose()
        await self.redis.aclose()
        await self._close_kafka()

    async def step(self) -> None:
        """One round: probe, place, measure, publish."""
        await asyncio.wait_for(SHARED.sync(self.redis), self.settings.redis_timeout_ms / 1000)
        if self.generation == 0:
            self.generation = await self._stored_generation()
        seen = await self._probe()
        if not await self._resolve_table(seen):
            return
        placement = self._placement(seen)
        if placement != self.placement:
            self.generation += 1
            log.info("placement changed", generation=self.generation, **_describe(placement))
            self.placement = placement
        reports = await self._lag(placement)
        await self._publish(seen, placement, reports)

    # probing

    async def _probe(self) -> Round:
        urls = sorted(set(self.seeds) | set(self.known))
        answers = await asyncio.gather(*(self._get_json(url, "/router/") for url in urls))
        views: dict[str, RouterMap] = {}
        failed: dict[str, str] = {}
        for url, (body, error) in zip(urls, answers, strict=True):
            if error is not None:
                failed[url] = error
                continue
            try:
                views[url] = parse_router(body)
            except ValueError as exc:
                failed[url] = f"not a Faust /router/ answer: {exc}"
        self._learn_workers(views, failed)
        standbys = await self._standbys(views) if self.settings.standbys else {}
        live = {url: view for url, view in views.items() if url in self.known}
        return Round(live, standbys, {u: e for u, e in failed.items() if u in self.known})

    def _learn_workers(self, views: Mapping[str, RouterMap], failed: Mapping[str, str]) -> None:
        now = SHARED.now_ms()
        for view in views.values():
            for url in view:
                if url not in self.known:
                    _check_url(url)  # Faust's canonical_url: the proxy needs http://host:port
                    self.known[url] = now
                    log.info("found worker", url=url, node_id=node_id_for(url))
        for url in views:
            self.failures.pop(url, None)
            if url not in self.known and views[url]:
                self._warn_once(
                    f"seed:{url}",
                    "seed answers but is not among the workers its router lists: set Faust's "
                    "canonical_url to an address kroute can reach",
                    seed=url,
                    workers=sorted(views[url]),
                )
        for url, error in failed.items():
            self.failures[url] += 1
            log.warning("worker probe failed", url=url, error=error, in_a_row=self.failures[url])

    async def _standbys(self, views: Mapping[str, RouterMap]) -> dict[str, tuple[int, ...]]:
        urls = [url for url in views if url in self.known]
        answers = await asyncio.gather(*(self._get_json(url, "/assignment/") for url in urls))
        found: dict[str, tuple[int, ...]] = {}
        for url, (body, error) in zip(urls, answers, strict=True):
            standby = body.get("standbys") if isinstance(body, dict) else None
            if error is not None or not isinstance(standby, dict):
                self._warn_once(
                    f"standbys:{url}",
                    "no standbys from /assignment/ (enable web_stats_enabled in the Faust app)",
                    url=url,
                    error=error,
                )
                continue
            found[url] = tuple(sorted(standby.get(self.topic or "", [])))
        return found

    async def _get_json(self, url: str, path: str) -> tuple[Any, str | None]:
        try:
            response = await self.http.get(url + path)
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if response.status_code != 200:
            return None, f"{path} answered {response.status_code}"
        try:
            return response.json(), None
        except ValueError:
            return None, f"{path} answered something that is not JSON"

    # placement

    async def _resolve_table(self, seen: Round) -> bool:
        """Find the changelog topic and its partition count once; False until Faust has one."""
        if self.topic is not None:
            return True
        topic = changelog_topic(seen.views, self.settings.table, self.settings.group)
        if topic is None:
            self._warn_once(
                "no-table",
                "no worker's router lists the table yet (workers starting, or wrong --table)",
                table=self.settings.table,
                live_workers=sorted(seen.views),
            )
            return False
        self.partitions = await self._partition_count(topic)
        self.topic = topic
        self.sources = list(self.settings.source_topics) or await self._discover_sources(seen)
        log.info(
            "found table",
            changelog=topic,
            partitions=self.partitions,
            source_topics=self.sources,
            group=self._group(),
        )
        if not self.sources:
            log.warning("no source topics: lag is not reported (pass --source-topic)")
        return True

    async def _discover_sources(self, seen: Round) -> list[str]:
        assert self.topic is not None
        for url, view in seen.views.items():
            body, error = await self._get_json(url, "/router/topics")
            if error is None:
                return source_topics(parse_router(body), view, self.topic)
        return []

    def _placement(self, seen: Round) -> dict[int, PartitionAssignment]:
        assert self.topic is not None
        active = owners(seen.views, self.topic, self.partitions)
        placed: dict[int, PartitionAssignment] = {}
        for p in range(self.partitions):
            owner = active[p]
            standbys = tuple(
                node_id_for(url)
                for url, parts in sorted(seen.standbys.items())
                if p in parts and url != owner
            )
            placed[p] = PartitionAssignment(node_id_for(owner) if owner else None, standbys)
        return placed

    # lag

    def _group(self) -> str:
        if self.settings.group:
            return self.settings.group
        assert self.topic is not None
        return self.topic[: -len(f"-{self.settings.table}-changelog")]

    async def _lag(
        self, placement: Mapping[int, PartitionAssignment]
    ) -> dict[int, PartitionReport]:
        partitions = [p for p, placed in placement.items() if placed.active]
        if not self.sources or not partitions:
            return {}
        try:
            asked_at = SHARED.now_ms()
            committed, ends = await asyncio.wait_for(
                self._offsets(partitions), self.settings.kafka_timeout_ms / 1000 * 2
            )
        except Exception as exc:  # noqa: BLE001 - publish placement without lag; say why
            log.warning("cannot read offsets; lag unknown this round", error=repr(exc))
            await self._close_kafka()
            return {}
        return {
            p: self.lag_book.report(
                p,
                sum(committed[(t, p)] for t in self.sources),
                sum(ends[(t, p)] for t in self.sources),
                asked_at,
            )
            for p in partitions
        }

    async def _offsets(
        self, partitions: list[int]
    ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
        kafka, admin = await self._kafka_clients()
        wanted = [TopicPartition(t, p) for t in self.sources for p in partitions]
        # The ends are read first: a position read later can only be further on, so a
        # partition is never reported behind an end it had already reached.
        ends: dict[tuple[str, int], int] = {}
        timeout_s = self.settings.kafka_timeout_ms / 1000
        for topic in self.sources:
            highs = await fetch_high_watermarks(kafka, topic, partitions, timeout_s=timeout_s)
            ends.update({(topic, p): high for p, high in highs.items()})
        offsets = await admin.list_consumer_group_offsets(self._group(), partitions=wanted)
        committed = {
            (tp.topic, tp.partition): max(meta.offset, 0) if meta.offset != _NO_COMMIT else 0
            for tp, meta in offsets.items()
        }
        for tp in wanted:
            committed.setdefault((tp.topic, tp.partition), 0)
        return committed, ends

    async def _kafka_clients(self) -> tuple[AIOKafkaClient, AIOKafkaAdminClient]:
        if self.kafka is None or self.admin is None:
            timeout_ms = self.settings.kafka_timeout_ms
            self.kafka = AIOKafkaClient(
                bootstrap_servers=self.settings.bootstrap_servers, request_timeout_ms=timeout_ms
            )
            self.admin = AIOKafkaAdminClient(
                bootstrap_servers=self.settings.bootstrap_servers, request_timeout_ms=timeout_ms
            )
            await asyncio.wait_for(self.kafka.bootstrap(), timeout_ms / 1000)
            await asyncio.wait_for(self.admin.start(), timeout_ms / 1000)
        return self.kafka, self.admin

    async def _close_kafka(self) -> None:
        kafka, admin, self.kafka, self.admin = self.kafka, self.admin, None, None
        for closing in (kafka.close() if kafka else None, admin.close() if admin else None):
            if closing is not None:
                try:
                    await asyncio.wait_for(closing, self.settings.kafka_timeout_ms / 1000)
                except Exception as exc:  # noqa: BLE001 - closing a broken client
                    log.debug("closing a Kafka client failed", error=repr(exc))

    async def _partition_count(self, topic: str) -> int:
        kafka, _ = await self._kafka_clients()
        metadata = await asyncio.wait_for(
            kafka.fetch_all_metadata(), self.settings.kafka_timeout_ms / 1000
        )
        partitions = metadata.partitions_for_topic(topic)
        if not partitions:
            raise FaustAdapterError(f"topic {topic!r} has no partitions on the broker")
        return len(partitions)

    # publishing

    async def _stored_generation(self) -> int:
        """Continue after the stored assignment's generation: it only grows (a restart)."""
        raw = await self.redis.get(self.keys.assignment)
        if raw is None:
            return 0
        try:
            return decode_assignment(raw).generation
        except ContractError as exc:
            log.warning("stored assignment unreadable; starting at generation 1", error=str(exc))
            return 0

    async def _publish(
        self,
        seen: Round,
        placement: dict[int, PartitionAssignment],
        reports: Mapping[int, PartitionReport],
    ) -> None:
        assert self.topic is not None
        keys, store, at = self.keys, self.settings.store, SHARED.now_ms()
        info = StoreInfo(store, self.topic, self.partitions, self.settings.key_format)
        claims = self_claims(seen.views, self.topic)
        pipe = self.redis.pipeline(transaction=True)
        pipe.sadd(keys.stores, store)
        pipe.set(keys.store(store), encode(info))
        pipe.set(
            keys.assignment, encode(Assignment(self.generation, LEADER_ID, at, {store: placement}))
        )
        for url, first_seen in sorted(self.known.items()):
            node_id = node_id_for(url)
            pipe.sadd(keys.nodes, node_id)
            pipe.set(keys.node(node_id), encode(NodeInfo(node_id, url, first_seen)))
            if url in seen.views:
                self._publish_live(pipe, node_id, claims[url], seen.standbys.get(url, ()), reports)
            elif self.failures[url] >= self.settings.dead_after:
                pipe.delete(keys.alive(node_id))
        pipe.publish(keys.events, encode(Event("assignment", generation=self.generation)))
        await asyncio.wait_for(pipe.execute(), self.settings.redis_timeout_ms / 1000)

    def _publish_live(
        self,
        pipe: Any,
        node_id: str,
        active: tuple[int, ...],
        standby: tuple[int, ...],
        reports: Mapping[int, PartitionReport],
    ) -> None:
        keys, store, at = self.keys, self.settings.store, SHARED.now_ms()
        roles: dict[Role, tuple[int, ...]] = {"active": active, "standby": standby}
        pipe.set(keys.alive(node_id), "1", px=self.settings.alive_ttl_ms)
        pipe.set(
            keys.hosting(node_id), encode(Hosting(node_id, self.generation, {store: roles}, at))
        )
        # Replaced as a whole: no report may outlive the partition it was about.
        pipe.delete(keys.lag(node_id))
        for p in active:
            if p in reports:
                pipe.hset(keys.lag(node_id), lag_field(store, p), encode(reports[p]))

    def _warn_once(self, topic: str, message: str, **context: Any) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            log.warning(message, **context)


def _describe(placement: Mapping[int, PartitionAssignment]) -> dict[str, Any]:
    by_node: dict[str, list[int]] = {}
    for p, placed in sorted(placement.items()):
        by_node.setdefault(placed.active or "(none: rebalancing)", []).append(p)
    return {"actives": by_node}


async def run_until_stopped(settings: FaustAdapterSettings, stop: asyncio.Event) -> None:
    await FaustAdapter(settings).run(stop)


# -- command line ------------------------------------------------------------------------------


def add_command(adapters: Any) -> None:
    """`kroute adapt faust ...`: registered under the CLI's `adapt` command."""
    faust = adapters.add_parser(
        "faust",
        help="publish a Faust app's table placement, lag and liveness in Redis",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    faust.add_argument(
        "--worker",
        action="append",
        required=True,
        metavar="URL",
        help="a worker's web URL (repeat; one is enough, the rest are discovered)",
    )
    faust.add_argument("--table", required=True, help="the Faust table's name")
    faust.add_argument("--store", required=True, help="the store name the proxy's routes use")
    faust.add_argument("--redis", required=True, metavar="URL", help="redis://host:port/db")
    faust.add_argument(
        "--bootstrap", required=True, metavar="HOST:PORT", help="Kafka bootstrap servers (for lag)"
    )
    faust.add_argument("--cluster", default=DEFAULT_CLUSTER, help="the contract's cluster name")
    faust.add_argument(
        "--group",
        help="Faust's consumer group (its app id); default: derived "
        "from the changelog topic <app id>-<table>-changelog",
    )
    faust.add_argument(
        "--source-topic",
        action="append",
        default=[],
        metavar="TOPIC",
        help="a topic feeding the table (repeat); default: discovered",
    )
    faust.add_argument(
        "--key-format",
        default="json",
        help="how Faust serialized the table's "
        "keys (json: orjson installed; json-ascii: without orjson)",
    )
    faust.add_argument("--interval-ms", type=int, default=500)
    faust.add_argument("--alive-ttl-ms", type=int, default=2_000)
    faust.add_argument(
        "--dead-after",
        type=int,
        default=2,
        help="failed probes in a row before a worker is published dead",
    )
    faust.add_argument(
        "--timeout-ms", type=int, default=1_000, help="timeout of each HTTP probe and Redis call"
    )
    faust.add_argument(
        "--standbys",
        action="store_true",
        help="also publish standbys from "
        "/assignment/ (only if the app's view answers standby reads itself)",
    )
    faust.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    faust.set_defaults(handler=command)


def settings_from(args: Any) -> FaustAdapterSettings:
    return FaustAdapterSettings(
        workers=tuple(args.worker),
        table=args.table,
        store=args.store,
        redis_url=args.redis,
        bootstrap_servers=args.bootstrap,
        cluster=args.cluster,
        group=args.group,
        source_topics=tuple(args.source_topic),
        key_format=args.key_format,
        interval_ms=args.interval_ms,
        alive_ttl_ms=args.alive_ttl_ms,
        dead_after=args.dead_after,
        http_timeout_ms=args.timeout_ms,
        redis_timeout_ms=args.timeout_ms,
        standbys=args.standbys,
    )


def command(args: Any) -> int:
    """Run until SIGINT or SIGTERM."""
    from common.logging import configure_logging  # noqa: PLC0415 - the entry point's job

    settings = settings_from(args)
    settings.validate()  # before logging starts: a usage error is one plain line
    configure_logging(args.log_level, component="faust-adapter")
    asyncio.run(_main(settings))
    return 0


async def _main(settings: FaustAdapterSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await run_until_stopped(settings, stop)
