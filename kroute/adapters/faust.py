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
- departed workers: a worker (or an id in `nodes` this adapter no longer knows, from an earlier
  run) gone for `forget_after_ms` and placed nowhere is forgotten (`common.departed`): Faust
  workers in pods get a new URL, so a new id, each time they are replaced.

The adapter is the only writer of its cluster's keys: give it a cluster name of its own. A
lease in `leader` enforces it (`kroute.adapters.fencing`): a second adapter waits. After an
owner change the group's lag describes the previous owner, so the partition has no lag report
until the group commits again (the new owner consumes only once it has restored).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import redis.asyncio as aioredis
import structlog
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.structs import TopicPartition

from common.clock import SHARED
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
    write_node_report,
)
from common.departed import DEFAULT_GRACE_MS, Departures, departures, read_membership
from kroute.adapters import probing
from kroute.adapters.fencing import OwnerLease
from kroute.adapters.probing import redis_url_error
from kroute.agent import EndHistory, conservative_report
from kroute.errors import UsageError
from materializer.kafka_offsets import fetch_high_watermarks

log = structlog.get_logger("kroute.adapters.faust")

LEADER_ID = "faust-adapter"  # the assignment's `leader`: this adapter computed it
_NO_COMMIT = -1  # OffsetFetch's answer for a partition the group never committed
_LEADER_TOPIC = "__assignor-__leader"  # Faust's internal topic: never a table's source

RouterMap = dict[str, dict[str, list[int]]]  # worker URL -> topic -> partitions


class FaustAdapterError(UsageError):
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
    http_timeout_ms: int = 1_000  # the whole of one HTTP probe, body included
    kafka_timeout_ms: int = 2_000
    redis_timeout_ms: int = 1_000
    lease_ms: int = 5_000  # the writer lease: a second adapter takes over this long after us
    standbys: bool = False
    # A worker gone this long (and placed nowhere) is forgotten: kroute's leader's default.
    forget_after_ms: int = DEFAULT_GRACE_MS

    def validate(self) -> None:
        if not self.workers:
            raise FaustAdapterError("give at least one worker URL (--worker http://host:port)")
        for url in self.workers:
            _check_url(url)
        for name, value in (("--table", self.table), ("--store", self.store)):
            if not value or "/" in value or ":" in value:
                raise FaustAdapterError(f"{name} {value!r}: a non-empty name without '/' or ':'")
        if (problem := redis_url_error(self.redis_url)) is not None:
            raise FaustAdapterError(problem)
        if self.interval_ms < 50:
            raise FaustAdapterError(f"--interval-ms {self.interval_ms}: at least 50")
        if self.alive_ttl_ms < max(2 * self.interval_ms, self.interval_ms + self.http_timeout_ms):
            raise FaustAdapterError(
                f"--alive-ttl-ms {self.alive_ttl_ms} must be at least twice --interval-ms "
                f"{self.interval_ms} and more than --interval-ms plus --timeout-ms "
                f"{self.http_timeout_ms}, or a live worker looks dead between two rounds"
            )
        if self.lease_ms < 2 * self.interval_ms + self.http_timeout_ms:
            raise FaustAdapterError(
                f"--lease-ms {self.lease_ms}: at least two intervals plus --timeout-ms, or the "
                "lease lapses between rounds"
            )
        if self.dead_after < 1:
            raise FaustAdapterError(f"--dead-after {self.dead_after}: at least 1")
        if self.forget_after_ms < 0:
            raise FaustAdapterError(f"--forget-after-ms {self.forget_after_ms}: at least 0")
        from partitioner import KEY_FORMATS  # noqa: PLC0415 - only to validate once

        if self.key_format not in KEY_FORMATS:
            raise FaustAdapterError(
                f"--key-format {self.key_format!r}: one of {', '.join(KEY_FORMATS)}"
            )


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # a port that is not a number
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or parts.path.strip("/"):
        raise FaustAdapterError(f"worker URL {url!r}: expected http://host:port")
    return f"http://{parts.hostname}:{port}"


def node_id_for(url: str) -> str:
    """A contract node id for a worker URL: `host-port` (no ':' in ids, they end Redis keys)."""
    parts = urlsplit(url)
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{parts.hostname}-{parts.port}")


# -- reading Faust -----------------------------------------------------------------------------


def _partition_list(parts: Any, count: int | None) -> list[int]:
    """A JSON list of partitions: integers (not booleans) in 0..count-1, each once."""
    if not isinstance(parts, list):
        raise ValueError(f"expected a list of partitions, got {type(parts).__name__}")
    bad = [p for p in parts if type(p) is not int or p < 0 or (count is not None and p >= count)]
    if bad:
        limit = f"0..{count - 1}" if count is not None else "0 or more"
        raise ValueError(f"partitions {bad[:5]} are not integers in {limit}")
    return sorted(set(parts))


def parse_router(body: Any, partitions: Mapping[str, int] | None = None) -> RouterMap:
    """A `/router/` (or `/router/topics`) answer: {url: {topic: [partition, ...]}}, each
    partition once; `partitions` (topic -> count) bounds the topics it names."""
    if not isinstance(body, dict):
        raise ValueError(f"expected a JSON object of worker URLs, got {type(body).__name__}")
    counts = partitions or {}
    parsed: RouterMap = {}
    for url, topics in body.items():
        if not isinstance(topics, dict):
            raise ValueError(f"worker {url!r}: expected {{topic: [partition, ...]}}")
        try:
            parsed[str(url)] = {
                str(t): _partition_list(parts, counts.get(str(t))) for t, parts in topics.items()
            }
        except ValueError as exc:
            raise ValueError(f"worker {url!r}: {exc}") from None
    return parsed


def parse_standbys(body: Any, topic: str, partitions: int) -> tuple[int, ...]:
    """A worker's own standbys of `topic` from its `/assignment/` answer."""
    standbys = body.get("standbys") if isinstance(body, dict) else None
    if not isinstance(standbys, dict):
        raise ValueError("no standbys object (enable web_stats_enabled in the Faust app)")
    return tuple(_partition_list(standbys.get(topic, []), partitions))


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
            for p in set(topics.get(topic, [])):
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
class _PartitionLag:
    owner: str | None = None  # the worker the history below describes
    ends: EndHistory = field(default_factory=EndHistory)
    takeover_at_ms: int | None = None  # a new owner took over: lag unknown until it consumes
    commit_at_takeover: int | None = None  # the group's commit first read after the takeover
    report: PartitionReport | None = None


@dataclass
class LagBook:
    """Per partition: the group's lag, dated "caught up" from recent (end, asked at) pairs.

    The group's committed offset says how far the *owner* got only while the owner does not
    change: a worker that just took a partition over restores the table from the changelog
    first and consumes (and commits) only after that, while the commit still says where the
    previous owner stopped. So on an owner change the partition's history is dropped and its
    lag is unknown (no report) until the commit moves past the first one read after the
    takeover."""

    partitions: dict[int, _PartitionLag] = field(default_factory=dict)

    def follow(self, owners_now: Mapping[int, str | None], now_ms: int) -> None:
        for p, owner in owners_now.items():
            if owner is None:
                continue  # rebalancing: the next owner decides whether this is a takeover
            state = self.partitions.setdefault(p, _PartitionLag())
            if state.owner is not None and owner != state.owner:
                log.info("new owner: lag unknown until it commits", partition=p, owner=owner)
                state.ends = EndHistory()
                state.report = None
                state.takeover_at_ms, state.commit_at_takeover = now_ms, None
            state.owner = owner  # the first owner seen is trusted: nothing says otherwise

    def observe(
        self, committed: Mapping[int, int], ends: Mapping[int, int], asked_at_ms: int, at_ms: int
    ) -> None:
        """One reading of the group's commits and the high watermarks (asked at `asked_at_ms`,
        answered by `at_ms`); its reports hold as of `asked_at_ms`."""
        for p, end in ends.items():
            state = self.partitions.setdefault(p, _PartitionLag())
            current = committed.get(p, 0)
            if not self._owner_consumes(state, current, asked_at_ms):
                continue
            state.ends.recent.append((end, asked_at_ms))
            # Caught up at T: the group's committed position has reached an end read at T. The
            # committed offset trails Faust's real position by up to one commit interval, so
            # this is never later than the truth.
            _, reached_at = state.ends.report(current, asked_at_ms)
            # As of the end read, not `at_ms` when the reading finished: when the figures were
            # true, and a caught-up partition's ages in report:<id> stay the same from one
            # reading to the next (EndHistory.as_of). Both times as read: `reports` maps them.
            state.report = PartitionReport(current, end, None, reached_at, asked_at_ms)

    @staticmethod
    def _owner_consumes(state: _PartitionLag, current: int, asked_at_ms: int) -> bool:
        if state.takeover_at_ms is None:
            return True
        if asked_at_ms < state.takeover_at_ms:
            return False  # read before the takeover: says nothing about the new owner
        if state.commit_at_takeover is None:
            state.commit_at_takeover = current
            return False
        if current <= state.commit_at_takeover:
            return False
        state.takeover_at_ms = state.commit_at_takeover = None
        return True

    def reports(self) -> dict[int, PartitionReport]:
        """The last reading's reports, their times mapped now (`SharedClock.conservative_ms`):
        every round publishes the same reading until the next, and one taken before a
        backward clock step would read fresher than true if mapped when it was taken."""
        return {
            p: conservative_report(s.report, SHARED)
            for p, s in self.partitions.items()
            if s.report is not None
        }


# -- the adapter -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Probed:
    """One worker's answers in one round."""

    view: RouterMap | None  # None: the probe failed
    standbys: tuple[int, ...] | None
    answered_at_ms: int  # Redis time when its router answer arrived
    error: str | None = None


@dataclass
class Round:
    """What one round saw."""

    views: dict[str, RouterMap]  # live worker URL -> its router map
    standbys: dict[str, tuple[int, ...]]
    failed: dict[str, str]  # worker URL -> why its probe failed
    answered_at: dict[str, int] = field(default_factory=dict)  # live worker URL -> Redis ms


class FaustAdapter:
    def __init__(self, settings: FaustAdapterSettings) -> None:
        settings.validate()
        self.settings = settings
        self.keys = Keys(settings.cluster)
        self.seeds = tuple(_check_url(url) for url in settings.workers)
        self.known: dict[str, int] = {}  # worker URL -> first seen (Redis ms)
        self.failures: Counter[str] = Counter()
        self.placement: dict[int, PartitionAssignment] | None = None
        self.topic: str | None = None
        self.partitions = 0
        self.sources: list[str] = []
        self.lag_book = LagBook()
        self._report_bodies = ReportBodies()  # every worker's report:<id> as last written
        self._lag_task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        timeout = settings.http_timeout_ms / 1000
        self.http = httpx.AsyncClient(timeout=timeout, trust_env=False)
        self.redis = aioredis.Redis.from_url(
            settings.redis_url,
            socket_timeout=settings.redis_timeout_ms / 1000,
            socket_connect_timeout=settings.redis_timeout_ms / 1000,
        )
        self.lease = OwnerLease(self.redis, self.keys, kind=LEADER_ID, lease_ms=settings.lease_ms)
        self.kafka: AIOKafkaClient | None = None
        self.admin: AIOKafkaAdminClient | None = None

    @property
    def generation(self) -> int:
        return self.lease.generation

    async def run(self, stop: asyncio.Event) -> None:
        """Publish every interval until `stop` is set; errors of one round are logged."""
        interval = self.settings.interval_ms / 1000
        log.info(
            "faust adapter starting",
            seeds=self.seeds,
            table=self.settings.table,
            store=self.settings.store,
            cluster=self.settings.cluster,
            instance=self.lease.holder_id,
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
            with contextlib.suppress(Exception):  # best effort: the lease lapses anyway
                await asyncio.wait_for(self.lease.release(), self.settings.redis_timeout_ms / 1000)
            await self.close()

    async def close(self) -> None:
        if self._lag_task is not None:
            self._lag_task.cancel()
            await asyncio.gather(self._lag_task, return_exceptions=True)
        await self.http.aclose()
        await self.redis.aclose()
        await self._close_kafka()

    async def step(self) -> None:
        """One round: hold the lease, probe, place, publish (lag is read alongside)."""
        redis_timeout = self.settings.redis_timeout_ms / 1000
        await asyncio.wait_for(SHARED.sync(self.redis), redis_timeout)
        if not await asyncio.wait_for(self.lease.hold(), redis_timeout):
            return  # another adapter writes this cluster (logged once by the lease)
        seen = await self._probe()
        if not await self._resolve_table(seen):
            return
        placement = self._placement(seen)
        if placement != self.placement:
            log.info("placement changed", **_describe(placement))
            self.placement = placement
        self.lag_book.follow({p: a.active for p, a in placement.items()}, SHARED.now_ms())
        self._start_lag_read()
        leaving = await self._departures(seen, placement)
        await self._publish(seen, placement, leaving)

    # probing

    async def _probe(self) -> Round:
        urls = sorted(set(self.seeds) | set(self.known))
        # Each worker on its own: a slow one costs the round at most the probe deadline, and
        # the others' heartbeats are written as their answers arrive.
        answers = await asyncio.gather(*(self._probe_worker(url) for url in urls))
        views: dict[str, RouterMap] = {}
        failed: dict[str, str] = {}
        standbys: dict[str, tuple[int, ...]] = {}
        answered: dict[str, int] = {}
        for url, probed in zip(urls, answers, strict=True):
            if probed.view is None:
                failed[url] = probed.error or "no answer"
                continue
            views[url], answered[url] = probed.view, probed.answered_at_ms
            if probed.standbys is not None:
                standbys[url] = probed.standbys
        self._learn_workers(views, failed)
        live = {url: view for url, view in views.items() if url in self.known}
        return Round(
            live,
            {u: s for u, s in standbys.items() if u in live},
            {u: e for u, e in failed.items() if u in self.known},
            {u: at for u, at in answered.items() if u in live},
        )

    async def _probe_worker(self, url: str) -> Probed:
        asking = [self._get_json(url, "/router/")]
        if self.settings.standbys and self.topic is not None:
            asking.append(self._get_json(url, "/assignment/"))
        (body, error), *more = await asyncio.gather(*asking)
        answered_at = SHARED.now_ms()
        if error is not None:
            return Probed(None, None, answered_at, error)
        limits = {self.topic: self.partitions} if self.topic is not None else None
        try:
            view = parse_router(body, limits)
        except ValueError as exc:
            return Probed(None, None, answered_at, f"not a Faust /router/ answer: {exc}")
        if url in self.known and view.get(url):
            await self._heartbeat(url, answered_at)
        return Probed(view, self._standbys_of(url, more[0]) if more else None, answered_at)

    async def _heartbeat(self, url: str, answered_at_ms: int) -> None:
        """Refresh a worker's `alive` key as soon as it answered (not after the slowest)."""
        ttl = _remaining_ttl(self.settings.alive_ttl_ms, answered_at_ms)
        if ttl <= 0:
            return
        try:
            await asyncio.wait_for(
                self.redis.set(self.keys.alive(node_id_for(url)), "1", px=ttl),
                self.settings.redis_timeout_ms / 1000,
            )
        except (aioredis.RedisError, OSError, TimeoutError) as exc:
            log.debug("heartbeat not written; the round's write retries", error=repr(exc))

    def _standbys_of(self, url: str, answer: tuple[Any, str | None]) -> tuple[int, ...] | None:
        body, error = answer
        assert self.topic is not None
        try:
            if error is not None:
                raise ValueError(error)
            return parse_standbys(body, self.topic, self.partitions)
        except ValueError as exc:
            self._warn_once(f"standbys:{url}", "no usable standbys from /assignment/", url=url,
                            error=str(exc))  # fmt: skip
            return None

    def _learn_workers(self, views: Mapping[str, RouterMap], failed: Mapping[str, str]) -> None:
        now = SHARED.now_ms()
        for seed, view in views.items():
            for url in view:
                if url in self.known:
                    continue
                try:
                    _check_url(url)  # Faust's canonical_url: the proxy needs http://host:port
                except FaustAdapterError:
                    self._warn_once(
                        f"url:{url}",
                        "a router lists a worker URL that is not http://host:port; skipped "
                        "(set Faust's canonical_url to one)",
                        url=url,
                        listed_by=seed,
                    )
                    continue
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

    async def _get_json(self, url: str, path: str) -> tuple[Any, str | None]:
        try:
            answer = await probing.get(
                self.http, url + path, deadline_s=self.settings.http_timeout_ms / 1000
            )
        except probing.ProbeFailed as exc:
            return None, f"{path}: {exc}"
        if answer.status != 200:
            return None, f"{path} answered {answer.status}"
        try:
            return orjson.loads(answer.body), None
        except orjson.JSONDecodeError:
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
        partitions = await self._partition_count(topic)
        out_of_range = {
            url: bad
            for url, view in seen.views.items()
            if (bad := [p for ps in view.values() for p in ps.get(topic, []) if p >= partitions])
        }  # fmt: skip
        if out_of_range:  # this round's maps were parsed before the count was known
            log.warning("routers name partitions the topic does not have", found=out_of_range)
            return False
        self.partitions, self.topic = partitions, topic
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
            if error is not None:
                continue
            try:
                return source_topics(parse_router(body), view, self.topic)
            except ValueError as exc:
                log.warning("not a Faust /router/topics answer", url=url, error=str(exc))
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

    async def _departures(
        self, seen: Round, placement: Mapping[int, PartitionAssignment]
    ) -> Departures:
        """Who starts or ends a grace period this round, and who is forgotten: a known worker
        that failed its probe, or an id in `nodes` this adapter does not know (an earlier run
        described it), gone for `forget_after_ms` and placed nowhere. A forgotten worker is no
        longer probed (unless it is a seed); if it comes back, a router lists it again and it
        is found and registered like a new one."""
        membership = await asyncio.wait_for(
            read_membership(self.redis, self.keys), self.settings.redis_timeout_ms / 1000
        )
        url_of = {node_id_for(url): url for url in self.known}
        found = departures(
            membership,
            absent={node_id_for(url) for url in seen.failed}
            | (membership.registered - url_of.keys()),
            present={node_id_for(url) for url in seen.views},
            placed={node for placed in placement.values() for node in placed.replicas()},
            now_ms=SHARED.now_ms(),
            grace_ms=self.settings.forget_after_ms,
        )
        # Forgotten here before the write: if the write fails, the id is still in `nodes` with
        # its old `dead_since`, so the next round forgets it again.
        for node_id in found.departed:
            if (url := url_of.get(node_id)) is not None:
                del self.known[url]
                self.failures.pop(url, None)
            self._report_bodies.forget(node_id)
        return found

    # lag

    def _group(self) -> str:
        if self.settings.group:
            return self.settings.group
        assert self.topic is not None
        return self.topic[: -len(f"-{self.settings.table}-changelog")]

    def _start_lag_read(self) -> None:
        """Read lag beside the rounds, never inside one: a slow broker must not hold back
        heartbeats (the rounds publish the latest reading; its age shows in updated_at_ms)."""
        if self.sources and (self._lag_task is None or self._lag_task.done()):
            self._lag_task = asyncio.create_task(self._read_lag())

    async def _read_lag(self) -> None:
        partitions = list(range(self.partitions))
        try:
            asked_at = SHARED.now_ms()
            committed, ends = await asyncio.wait_for(
                self._offsets(partitions), self.settings.kafka_timeout_ms / 1000 * 2
            )
        except Exception as exc:  # noqa: BLE001 - publish placement without lag; say why
            log.warning("cannot read offsets; lag unknown until they are read", error=repr(exc))
            await self._close_kafka()
            return
        self.lag_book.observe(
            {p: sum(committed[(t, p)] for t in self.sources) for p in partitions},
            {p: sum(ends[(t, p)] for t in self.sources) for p in partitions},
            asked_at,
            SHARED.now_ms(),
        )

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

    async def _publish(
        self,
        seen: Round,
        placement: dict[int, PartitionAssignment],
        leaving: Departures,
    ) -> None:
        """Everything in one fenced transaction: only while we hold the lease."""
        assert self.topic is not None
        keys, store = self.keys, self.settings.store
        info = StoreInfo(store, self.topic, self.partitions, self.settings.key_format)
        claims = self_claims(seen.views, self.topic)
        reports = self.lag_book.reports()

        def queue(pipe: Any, generation: int) -> None:
            pipe.sadd(keys.stores, store)
            pipe.set(keys.store(store), encode(info))
            for url, first_seen in sorted(self.known.items()):
                node_id = node_id_for(url)
                pipe.sadd(keys.nodes, node_id)
                pipe.set(keys.node(node_id), encode(NodeInfo(node_id, url, first_seen)))
                if url in seen.views:
                    roles: dict[Role, tuple[int, ...]] = {
                        "active": claims[url],
                        "standby": seen.standbys.get(url, ()),
                    }
                    self._publish_live(pipe, node_id, seen.answered_at[url])
                    self._publish_report(pipe, node_id, roles, generation, reports)
                elif self.failures[url] >= self.settings.dead_after:
                    pipe.delete(keys.alive(node_id))
            leaving.queue(pipe, keys, at)
            pipe.publish(keys.events, encode(Event("hosting", generation=generation)))

        at = SHARED.now_ms()
        written = await asyncio.wait_for(
            self.lease.write({store: placement}, LEADER_ID, at, queue),
            self.settings.redis_timeout_ms / 1000,
        )
        if not written:
            log.warning("round not published: the lease or assignment changed meanwhile")
        elif leaving.departed:
            log.info(
                "departed workers forgotten",
                nodes=leaving.departed,
                forget_after_ms=self.settings.forget_after_ms,
            )

    def _publish_live(self, pipe: Any, node_id: str, answered_at_ms: int) -> None:
        keys = self.keys
        # The worker is known alive as of its answer, not as of now: a TTL counted from now
        # would vouch for a worker that died after answering for longer than the TTL says.
        ttl = _remaining_ttl(self.settings.alive_ttl_ms, answered_at_ms)
        if ttl > 0:
            pipe.set(keys.alive(node_id), "1", px=ttl)

    def _publish_report(
        self,
        pipe: Any,
        node_id: str,
        roles: dict[Role, tuple[int, ...]],
        generation: int,
        reports: Mapping[int, PartitionReport],
    ) -> None:
        # hosting, and lag replaced as a whole: no report may outlive the partition it was
        # about. The group's lag is the owner's: reported for the partitions it is active for.
        store = self.settings.store
        hosting = Hosting(node_id, generation, {store: roles}, SHARED.now_ms())
        owned = {p: placed.active for p, placed in (self.placement or {}).items()}
        lags = {
            (store, p): reports[p]
            for p in roles["active"]
            if p in reports and owned.get(p) == node_id
        }
        write_node_report(
            pipe,
            self.keys,
            hosting,
            lags,
            self.settings.alive_ttl_ms * 10,
            bodies=self._report_bodies,
        )

    def _warn_once(self, topic: str, message: str, **context: Any) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            log.warning(message, **context)


def _remaining_ttl(ttl_ms: int, since_ms: int) -> int:
    return ttl_ms - max(SHARED.now_ms() - since_ms, 0)


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
        "--lease-ms",
        type=int,
        default=5_000,
        help="the writer lease: a second adapter on the cluster waits, and takes over this "
        "long after the first stops",
    )
    faust.add_argument(
        "--standbys",
        action="store_true",
        help="also publish standbys from "
        "/assignment/ (only if the app's view answers standby reads itself)",
    )
    faust.add_argument(
        "--forget-after-ms",
        type=int,
        default=DEFAULT_GRACE_MS,
        help="a worker gone this long, and placed nowhere, leaves the contract "
        "(default: 600000, kroute's leader's grace period)",
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
        lease_ms=args.lease_ms,
        standbys=args.standbys,
        forget_after_ms=args.forget_after_ms,
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
