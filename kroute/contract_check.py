"""`kroute contract check`: what is wrong with the keys a writer put in Redis.

For anyone writing the Redis contract by hand (a sidecar beside Kafka Streams, a service's own
reporter): it reads every key of one cluster, as a proxy would, and reports each rule of
docs/redis-contract.md the data breaks, naming the key and the field. Errors are what makes a
proxy ignore a value or route wrongly; warnings are what a healthy cluster shows only briefly
(a node that just died, a report a few seconds old) or what only loses availability.

The value models are strict on purpose (no coercion, no unknown fields): proxies decode with
`common.contract`, which refuses unknown fields and a different `v`, and a `"5"` where a number
belongs is a writer's bug even where a lenient reader would let it pass.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import orjson
import redis
from pydantic import BaseModel, ConfigDict, ValidationError

from common.clock import CLOCK_TOLERANCE_MS
from common.contract import (
    DEFAULT_CLUSTER,
    SCHEMA_VERSION,
    ContractError,
    Keys,
    NodeReport,
    as_text,
    decode_node_report,
    decode_report_at,
    lag_field,
)
from kroute.errors import KrouteError, UsageError
from partitioner import ALGORITHMS, KEY_FORMATS

Level = Literal["error", "warning"]
M = TypeVar("M", bound=BaseModel)

# A proxy's default KROUTE_LAG_REPORT_STALE_MS: an older report is unknown lag.
REPORT_STALE_MS = 3_000
MAX_ALIVE_TTL_MS = 10_000  # a longer TTL is legal but keeps a dead node "alive" that long
_KNOWN_KEYS = ("nodes", "stores", "assignment", "leader", "tidy", "dead_since", "events")
_PER_NODE = ("node", "alive", "hosting", "lag", "report", "report_at")


# -- the values, strictly ----------------------------------------------------------------------


class _Value(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    v: Literal[1]


class NodeValue(_Value):
    node_id: str
    url: str
    started_at_ms: int


class StoreValue(_Value):
    name: str
    topic: str
    partitions: int
    key_format: str = "string"
    partitioner: str = "murmur2"
    value_format: str = "json"


class PlacementValue(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)
    active: str | None
    standbys: list[str]


class AssignmentValue(_Value):
    generation: int
    leader: str
    computed_at_ms: int
    stores: dict[str, dict[str, PlacementValue]]


class HostingValue(_Value):
    node_id: str
    generation: int
    stores: dict[str, dict[Literal["active", "standby"], list[int]]]
    updated_at_ms: int


class ReportValue(_Value):
    current_offset: int
    end_offset: int | None
    newest_record_ms: int | None
    caught_up_at_ms: int | None
    updated_at_ms: int


# -- findings ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    level: Level
    key: str
    message: str


@dataclass
class Report:
    cluster: str
    findings: list[Finding] = field(default_factory=list)

    def error(self, key: str, message: str) -> None:
        self.findings.append(Finding("error", key, message))

    def warning(self, key: str, message: str) -> None:
        self.findings.append(Finding("warning", key, message))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    def as_json(self) -> str:
        return json.dumps(
            {
                "cluster": self.cluster,
                "ok": not self.errors,
                "errors": len(self.errors),
                "warnings": len(self.warnings),
                "findings": [asdict(f) for f in self.findings],
            },
            indent=2,
        )

    def as_text(self) -> str:
        lines = [f"{f.level.upper():7} {f.key}: {f.message}" for f in self.findings]
        lines.append(
            f"cluster {self.cluster!r}: {len(self.errors)} error(s), "
            f"{len(self.warnings)} warning(s)"
        )
        return "\n".join(lines)


# -- the check ---------------------------------------------------------------------------------


@dataclass
class _Snapshot:
    """Everything read, decoded where it could be."""

    node_ids: list[str] = field(default_factory=list)
    nodes: dict[str, NodeValue] = field(default_factory=dict)
    stores: dict[str, StoreValue] = field(default_factory=dict)
    assignment: AssignmentValue | None = None
    hostings: dict[str, HostingValue] = field(default_factory=dict)
    alive: set[str] = field(default_factory=set)


def check(client: redis.Redis, cluster: str, *, now_ms: int | None = None) -> Report:
    """Every finding about cluster `cluster` (times judged against Redis TIME unless given)."""
    keys = Keys(cluster)
    report = Report(cluster)
    if now_ms is None:
        seconds, micros = client.time()
        now_ms = int(seconds) * 1000 + int(micros) // 1000
    present = {as_text(k) for k in client.scan_iter(match=f"{keys.prefix}*", count=1000)}
    if not present:
        others = sorted({as_text(k).split(":")[1] for k in client.scan_iter(match="kroute:*:*")})
        report.error(keys.prefix + "*", f"no keys at all; clusters in this Redis: {others}")
        return report
    seen = _Snapshot()
    _check_sets(client, keys, report, seen)
    _check_stores(client, keys, report, seen)
    for node_id in seen.node_ids:
        _check_node(client, keys, report, seen, node_id=node_id, now_ms=now_ms)
    _check_assignment(client, keys, report, seen)
    _check_leader_and_dead_since(client, keys, report)
    _check_unknown_keys(keys, report, seen, present)
    return report


def _check_sets(client: redis.Redis, keys: Keys, report: Report, seen: _Snapshot) -> None:
    for key, target in ((keys.nodes, seen.node_ids), (keys.stores, None)):
        kind = _type(client, key)
        if kind == "none":
            report.error(key, "missing: proxies read ids from this set, they never SCAN")
        elif kind != "set":
            report.error(key, f"is a {kind}, must be a set")
        elif target is not None:
            target.extend(sorted(as_text(m) for m in client.smembers(key)))


def _check_stores(client: redis.Redis, keys: Keys, report: Report, seen: _Snapshot) -> None:
    if _type(client, keys.stores) != "set":
        return
    for name in sorted(as_text(m) for m in client.smembers(keys.stores)):
        key = keys.store(name)
        value = _read_string(client, key, report, StoreValue, required=True)
        if value is None:
            continue
        if value.name != name:
            report.error(key, f"name is {value.name!r}, the key says {name!r}")
        if value.partitions < 1:
            report.error(key, f"partitions is {value.partitions}, must be at least 1")
        if value.key_format not in KEY_FORMATS:
            report.error(key, f"key_format {value.key_format!r} is not one of {KEY_FORMATS}")
        if value.partitioner not in ALGORITHMS:
            report.error(key, f"partitioner {value.partitioner!r} is not one of {ALGORITHMS}")
        seen.stores[name] = value


def _check_node(
    client: redis.Redis, keys: Keys, report: Report, seen: _Snapshot, *, node_id: str, now_ms: int
) -> None:
    key = keys.node(node_id)
    node = _read_string(client, key, report, NodeValue, required=True)
    if node is not None:
        if node.node_id != node_id:
            report.error(key, f"node_id is {node.node_id!r}, the key says {node_id!r}")
        url = urlsplit(node.url)
        if url.scheme != "http" or not url.hostname or url.port is None or url.path.strip("/"):
            report.error(key, f"url {node.url!r} is not http://host:port: proxies ignore the node")
        seen.nodes[node_id] = node
    _check_alive(client, keys.alive(node_id), report, seen, node_id)
    hosting = _read_string(client, keys.hosting(node_id), report, HostingValue, required=False)
    if hosting is not None:
        _check_hosting(keys.hosting(node_id), hosting, report, seen, node_id=node_id, now_ms=now_ms)
        seen.hostings[node_id] = hosting
    lags = _check_lag(client, keys.lag(node_id), report, seen, hosting=hosting, now_ms=now_ms)
    _check_node_report(
        client, keys, report, node_id=node_id, hosting=hosting, lags=lags, now_ms=now_ms
    )


def _check_alive(
    client: redis.Redis, key: str, report: Report, seen: _Snapshot, node_id: str
) -> None:
    kind = _type(client, key)
    if kind == "none":
        report.warning(key, "absent: the node counts as dead")
        return
    if kind != "string":
        report.error(key, f"is a {kind}, must be a string")
        return
    seen.alive.add(node_id)
    ttl = int(client.pttl(key))
    if ttl < 0:
        report.error(key, "has no TTL: a killed node would look alive forever")
    elif ttl > MAX_ALIVE_TTL_MS:
        report.warning(key, f"TTL {ttl} ms: a dead node looks alive that long (kroute: 2000)")
    if client.get(key) != b"1":
        report.warning(key, 'holds something other than "1" (readers only test existence)')


def _check_hosting(
    key: str, hosting: HostingValue, report: Report, seen: _Snapshot, *, node_id: str, now_ms: int
) -> None:
    if hosting.node_id != node_id:
        report.error(key, f"node_id is {hosting.node_id!r}, the key says {node_id!r}")
    for store, roles in hosting.stores.items():
        _check_partitions(key, store, [p for ps in roles.values() for p in ps], report, seen)
        both = set(roles.get("active", ())) & set(roles.get("standby", ()))
        if both:
            report.error(key, f"store {store!r}: partitions {sorted(both)} both active and standby")
    fresh = node_id in seen.alive  # a dead node's hosting may well be old
    _check_time(key, "updated_at_ms", hosting.updated_at_ms, report, now_ms=now_ms, fresh=fresh)


def _check_lag(
    client: redis.Redis,
    key: str,
    report: Report,
    seen: _Snapshot,
    *,
    hosting: HostingValue | None,
    now_ms: int,
) -> dict[tuple[str, int], ReportValue]:
    """The hash's reports that decode, by (store, partition)."""
    hosted = {
        (store, p) for store, roles in (hosting.stores if hosting else {}).items()
        for ps in roles.values() for p in ps
    }  # fmt: skip
    kind = _type(client, key)
    if kind not in ("none", "hash"):
        report.error(key, f"is a {kind}, must be a hash")
        return {}
    decoded: dict[tuple[str, int], ReportValue] = {}
    fields = client.hgetall(key) if kind == "hash" else {}
    reported = {as_text(f) for f in fields}
    missing = sorted(f"{s}/{p}" for s, p in hosted if lag_field(s, p) not in reported)
    if missing:
        report.warning(key, f"no report for hosted {missing}: lag unknown, refused under a budget")
    for raw_field, raw in sorted(fields.items()):
        name = as_text(raw_field)
        where = f"{key} field {name!r}"
        store, _, partition = name.rpartition("/")
        if not store or not partition.isdigit() or name != lag_field(store, int(partition)):
            report.error(where, "field names are <store>/<partition>")
            continue
        value = _decode(where, _as_bytes(raw), report, ReportValue)
        if value is None:
            continue
        decoded[(store, int(partition))] = value
        _check_partitions(where, store, [int(partition)], report, seen)
        if (store, int(partition)) not in hosted:
            report.error(where, "a report for a partition the node's hosting does not list")
        _check_report(where, value, report, now_ms)
    return decoded


def _check_node_report(
    client: redis.Redis,
    keys: Keys,
    report: Report,
    *,
    node_id: str,
    hosting: HostingValue | None,
    lags: Mapping[tuple[str, int], ReportValue],
    now_ms: int,
) -> None:
    """`report:<id>` (optional) decodes and, as of the time `report_at:<id>` confirms it at,
    says what `hosting:<id>` and `lag:<id>` say: proxies read it instead of them between their
    reads of those."""
    key = keys.report(node_id)
    kind = _type(client, key)
    if kind == "none":
        if _type(client, keys.report_at(node_id)) != "none":
            report.warning(
                keys.report_at(node_id),
                f"present without {key}: proxies read hosting and lag until it is rewritten",
            )
        return
    if kind != "string":
        report.error(key, f"is a {kind}, must be a string holding JSON")
        return
    try:
        compact = decode_node_report(_as_bytes(client.get(key)) or b"")
    except (ContractError, ValueError, RecursionError) as exc:
        report.error(key, f"proxies refuse it and read hosting and lag instead: {exc}")
        return
    if compact.node_id != node_id:
        report.error(key, f"node_id is {compact.node_id!r}, the key says {node_id!r}")
    at_ms = _check_report_at(client, keys.report_at(node_id), compact, report, now_ms=now_ms)
    if at_ms is None:
        return
    if hosting is None:
        report.error(key, f"present without {keys.hosting(node_id)}: written apart from it")
        return
    if compact.generation != hosting.generation or _roles(compact.stores) != _roles(hosting.stores):
        report.error(key, f"disagrees with {keys.hosting(node_id)} on what the node serves")
    _check_compact_lags(key, compact, lags, report, keys.lag(node_id), at_ms=at_ms)


def _check_report_at(
    client: redis.Redis, key: str, body: NodeReport, report: Report, *, now_ms: int
) -> int | None:
    """`report_at:<id>` beside a body: "<version> <at_ms>" naming the body's version, not in
    the future, expiring. Its at_ms when the body can be compared with the other keys."""
    kind = _type(client, key)
    if kind == "none":
        report.error(key, "absent while report:<id> is present: write both on every report")
        return None
    if kind != "string":
        report.error(key, f"is a {kind}, must be a string")
        return None
    try:
        version, at_ms = decode_report_at(_as_bytes(client.get(key)) or b"")
    except ContractError as exc:
        report.error(key, f"proxies refuse it and read hosting and lag instead: {exc}")
        return None
    if int(client.pttl(key)) < 0:
        report.error(key, "has no expiry: a writer that stopped would be confirmed forever")
    _check_time(key, "at_ms", at_ms, report, now_ms=now_ms, fresh=False)
    if version != body.version:
        report.error(
            key,
            f"names version {version}, report:<id> holds {body.version}: write the body and "
            "report_at:<id> in one MULTI/EXEC",
        )
        return None
    return at_ms


def _roles(
    stores: Mapping[str, Mapping[Any, Iterable[int]]],
) -> dict[str, dict[str, tuple[int, ...]]]:
    """Stores and roles as comparable values (a missing role and an empty one alike)."""
    return {
        store: {role: tuple(roles.get(role, ())) for role in ("active", "standby")}
        for store, roles in stores.items()
    }


def _check_compact_lags(
    key: str,
    compact: NodeReport,
    lags: Mapping[tuple[str, int], ReportValue],
    report: Report,
    lag_key: str,
    *,
    at_ms: int,
) -> None:
    rebuilt = compact.partition_reports({}, at_ms)  # positions 0: lags and times are what counts
    hosted = [
        (store, p)
        for store, roles in compact.stores.items()
        for p in (*roles.get("active", ()), *roles.get("standby", ()))
    ]
    for where in hosted:
        mine, theirs = rebuilt.get(where), lags.get(where)
        name = lag_field(*where)
        if mine is None or theirs is None:
            if (mine is None) != (theirs is None):
                said = "has no entry" if mine is None else "has an entry"
                report.error(key, f"{name}: {said}, {lag_key} says otherwise")
            continue
        lag = (
            None if theirs.end_offset is None else max(theirs.end_offset - theirs.current_offset, 0)
        )
        # Writers leave the newest record's age out (null) of the body: compared when given.
        newest = theirs.newest_record_ms if mine.newest_record_ms is not None else None
        if (mine.lag, mine.caught_up_at_ms, mine.newest_record_ms) != (
            lag,
            theirs.caught_up_at_ms,
            newest,
        ):
            report.error(
                key,
                f"{name}: lag {mine.lag}, caught up at {mine.caught_up_at_ms}, newest record "
                f"{mine.newest_record_ms}; {lag_key} says {lag}, {theirs.caught_up_at_ms}, "
                f"{theirs.newest_record_ms}",
            )


def _check_report(where: str, value: ReportValue, report: Report, now_ms: int) -> None:
    if value.current_offset < 0 or (value.end_offset is not None and value.end_offset < 0):
        report.error(where, "offsets are never negative")
    if value.end_offset is not None and value.current_offset > value.end_offset:
        report.error(
            where,
            f"current_offset {value.current_offset} is past end_offset {value.end_offset}: a "
            "position the log never reached (proxies read it as lag 0)",
        )
    if value.caught_up_at_ms is not None and value.caught_up_at_ms > value.updated_at_ms:
        report.error(
            where,
            f"caught_up_at_ms is {value.caught_up_at_ms - value.updated_at_ms} ms later than "
            "updated_at_ms: caught up at a time the report had not reached (stamp it when "
            "the end offset was asked for)",
        )
    if value.caught_up_at_ms is not None and value.end_offset is None:
        report.warning(where, "caught_up_at_ms without end_offset: lag is unknown anyway")
    _check_time(where, "updated_at_ms", value.updated_at_ms, report, now_ms=now_ms, fresh=True)


def _check_time(
    key: str, name: str, at_ms: int, report: Report, *, now_ms: int, fresh: bool
) -> None:
    """A time must not be ahead of Redis time (beyond the clock tolerance); with `fresh`, a
    time older than proxies accept is a warning."""
    if at_ms > now_ms + CLOCK_TOLERANCE_MS:
        report.error(
            key,
            f"{name} is {at_ms - now_ms} ms in the future: the writer's clock is not Redis "
            "TIME; proxies treat its reports as missing",
        )
    elif fresh and now_ms - at_ms > REPORT_STALE_MS:
        report.warning(key, f"{name} is {now_ms - at_ms} ms old: proxies count its lag as unknown")


def _check_partitions(
    key: str, store: str, partitions: Iterable[int], report: Report, seen: _Snapshot
) -> None:
    info = seen.stores.get(store)
    if info is None:
        report.error(key, f"store {store!r} is not described (stores set / store:{store})")
        return
    outside = sorted(p for p in partitions if not 0 <= p < info.partitions)
    if outside:
        report.error(key, f"store {store!r}: partitions {outside} outside 0..{info.partitions - 1}")


def _check_assignment(client: redis.Redis, keys: Keys, report: Report, seen: _Snapshot) -> None:
    key = keys.assignment
    assignment = _read_string(client, key, report, AssignmentValue, required=True)
    if assignment is None:
        return
    seen.assignment = assignment
    for store, placements in assignment.stores.items():
        where = f"{key} store {store!r}"
        numbered = {}
        for text, placed in placements.items():
            if not text.isdigit() or str(int(text)) != text:
                report.error(where, f"partition {text!r} is not a decimal partition number")
                continue
            numbered[int(text)] = placed
            _check_placement(f"{where} partition {text}", placed, report, seen)
        _check_partitions(where, store, numbered, report, seen)
        _check_served(where, store, numbered, report, seen)


def _check_placement(where: str, placed: PlacementValue, report: Report, seen: _Snapshot) -> None:
    named = ([placed.active] if placed.active else []) + placed.standbys
    unknown = sorted({n for n in named if n not in seen.node_ids})
    if unknown:
        report.error(where, f"names {unknown}, not in the nodes set: proxies skip them")
    if placed.active is not None and placed.active in placed.standbys:
        report.error(where, f"{placed.active!r} is both active and standby")
    if len(set(placed.standbys)) != len(placed.standbys):
        report.error(where, f"standbys repeat a node: {placed.standbys}")


def _check_served(
    where: str,
    store: str,
    placements: Mapping[int, PlacementValue],
    report: Report,
    seen: _Snapshot,
) -> None:
    """Hosting against assignment: a proxy routes to a replica only where both agree."""
    info = seen.stores.get(store)
    unplaced = [p for p in range(info.partitions) if p not in placements] if info else []
    unserved = []
    for partition, placed in sorted(placements.items()):
        roles = [("active", placed.active)] if placed.active else []
        roles += [("standby", n) for n in placed.standbys]
        agreeing = 0
        for role, node_id in roles:
            hosting = seen.hostings.get(node_id)
            served = hosting.stores.get(store, {}) if hosting is not None else {}
            if partition in served.get(role, []):  # type: ignore[call-overload]
                agreeing += 1
            elif node_id in seen.alive:
                report.warning(
                    where, f"partition {partition}: {node_id} is {role} here, its hosting "
                    "does not serve it so (still applying the assignment?)",
                )  # fmt: skip
        if placed.active is None or agreeing == 0:
            unserved.append(partition)
    if unplaced:
        report.warning(where, f"partitions {unplaced} are not in the assignment: keys there 503")
    if unserved:
        report.warning(where, f"partitions {unserved} have no active or no replica serving them")


def _check_leader_and_dead_since(client: redis.Redis, keys: Keys, report: Report) -> None:
    _check_lease(client, keys.leader, report, "a dead leader would hold the lease forever")
    _check_lease(client, keys.tidy, report, "no agent would look for departed instances again")
    kind = _type(client, keys.dead_since)
    if kind not in ("none", "hash"):
        report.error(keys.dead_since, f"is a {kind}, must be a hash")
    elif kind == "hash":
        for node, since in client.hgetall(keys.dead_since).items():
            if not since.isdigit():
                report.error(keys.dead_since, f"field {as_text(node)!r}: {since!r} is not ms")


def _check_lease(client: redis.Redis, key: str, report: Report, without_ttl: str) -> None:
    """A lease: absent, or a string with a TTL."""
    kind = _type(client, key)
    if kind not in ("none", "string"):
        report.error(key, f"is a {kind}, must be a string")
    elif kind == "string" and int(client.pttl(key)) < 0:
        report.error(key, f"has no TTL: {without_ttl}")


def _check_unknown_keys(keys: Keys, report: Report, seen: _Snapshot, present: set[str]) -> None:
    expected = {keys.prefix + name for name in _KNOWN_KEYS}
    expected |= {keys.store(name) for name in seen.stores}
    for node_id in seen.node_ids:
        expected |= {f"{keys.prefix}{kind}:{node_id}" for kind in _PER_NODE}
    for key in sorted(present - expected):
        kind, _, rest = key.removeprefix(keys.prefix).partition(":")
        if kind in _PER_NODE and rest:
            report.error(key, f"node {rest!r} is not in the nodes set: proxies never read this")
        elif kind == "store" and rest:
            report.error(key, f"store {rest!r} is not in the stores set: proxies never read this")
        else:
            report.warning(key, "not a key of the contract (a typo?)")


# -- reading -----------------------------------------------------------------------------------


def _type(client: redis.Redis, key: str) -> str:
    kind = client.type(key)
    return kind.decode() if isinstance(kind, bytes) else str(kind)


def _read_string(
    client: redis.Redis, key: str, report: Report, model: type[M], *, required: bool
) -> M | None:
    kind = _type(client, key)
    if kind == "none":
        if required:
            report.error(key, "missing")
        return None
    if kind != "string":
        report.error(key, f"is a {kind}, must be a string holding JSON")
        return None
    return _decode(key, _as_bytes(client.get(key)), report, model)


def _as_bytes(raw: bytes | str | None) -> bytes | None:
    return raw.encode() if isinstance(raw, str) else raw


def _decode(key: str, raw: bytes | None, report: Report, model: type[M]) -> M | None:
    try:
        body = orjson.loads(raw or b"")
    except orjson.JSONDecodeError as exc:
        report.error(key, f"not JSON ({exc}): {(raw or b'')[:60]!r}")
        return None
    if not isinstance(body, dict):
        report.error(key, f"must be a JSON object, is {type(body).__name__}")
        return None
    if body.get("v") != SCHEMA_VERSION:
        report.error(key, f'"v" is {body.get("v")!r}: readers refuse all but {SCHEMA_VERSION}')
        return None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(part) for part in error["loc"])
            report.error(key, f"field {where}: {error['msg']} (got {error.get('input')!r})")
        return None


def run_check(
    redis_url: str, cluster: str, as_json: bool, say: Callable[[str], None] = print
) -> int:  # say: print by default (a CLI's output, not a log)
    """The CLI's work: 0 when no errors, 1 otherwise (and when Redis cannot be read)."""
    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    except ValueError as exc:
        raise UsageError(f"--redis {redis_url!r}: {exc}") from None
    try:
        result = check(client, cluster)
    except (redis.RedisError, OSError) as exc:
        raise KrouteError(f"cannot read Redis at {redis_url}: {exc}") from None
    finally:
        client.close()
    say(result.as_json() if as_json else result.as_text())
    return 1 if result.errors else 0


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`kroute contract check ...`: registered by the CLI."""
    contract = commands.add_parser("contract", help="the Redis contract (docs/redis-contract.md)")
    actions = contract.add_subparsers(dest="contract_action", required=True)
    checker = actions.add_parser(
        "check", help="tell what is wrong with the keys a writer put in Redis (exit 1 on errors)"
    )
    checker.add_argument("--redis", required=True, metavar="URL", help="redis://host:port/db")
    checker.add_argument("--cluster", default=DEFAULT_CLUSTER, help="the contract's cluster name")
    checker.add_argument("--json", action="store_true", help="machine-readable output")
    checker.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    return run_check(args.redis, args.cluster, args.json)
