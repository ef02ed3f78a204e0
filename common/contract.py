"""The Redis contract between whoever hosts state (materializer nodes, or a sidecar beside an
existing Kafka Streams / ksqlDB deployment) and whoever routes to it (proxies).

This module alone owns the key names, the JSON encoding and the schema version;
docs/redis-contract.md describes the same contract for writers in other languages. Every value
carries `"v": SCHEMA_VERSION`; a reader refuses values of a newer major version instead of
guessing.

Keys, for a cluster named C, all under `kroute:C:` (details in docs/redis-contract.md):
`nodes` / `stores` sets of ids and names (the leader removes a node dead past its grace period
and placed nowhere); `node:<id>` NodeInfo (the node); `alive:<id>` "1" with
a TTL, the heartbeat (the node); `store:<name>` StoreInfo (every node hosting the store, who
must agree); `hosting:<id>` Hosting, what a node serves (the node);

`lag:<id>` hash `<store>/<partition>` -> PartitionReport (the node); `report:<id>` NodeReport,
optional, the same hosting and lags compactly, without positions or time, rewritten only when
it changes, and `report_at:<id>` "<version> <at_ms>", written on every report, saying which
body holds as of when (the node, in the same transaction: `write_node_report`); `assignment`
Assignment
(the leader); `leader` the leader's id with a lease TTL; `dead_since` hash node id -> ms when a
leader first saw it dead (the leader); pub/sub channel `events` Event.

Times are Redis time (`common.clock`): every writer and reader keeps an offset to Redis `TIME`.
An assignment's generation only grows (the leader's write refuses one that is not greater);
readers take the stored assignment whenever it differs from theirs in anything, never by
comparing generations alone. Writers announce changes on `events` naming the node (or the
assignment); readers read what an event names, sweep every node's reports, and read everything
only at start, after missed events or errors (docs/redis-contract.md, "What readers read").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import orjson

SCHEMA_VERSION = 1
DEFAULT_CLUSTER = "default"

Role = Literal["active", "standby"]
T = TypeVar("T")


class ContractError(ValueError):
    """A value in Redis does not follow this contract (or follows a newer one)."""


@dataclass(frozen=True)
class Keys:
    """Key names for one cluster."""

    cluster: str = DEFAULT_CLUSTER

    @property
    def prefix(self) -> str:
        return f"kroute:{self.cluster}:"

    def node(self, node_id: str) -> str:
        return f"{self.prefix}node:{node_id}"

    def alive(self, node_id: str) -> str:
        return f"{self.prefix}alive:{node_id}"

    def store(self, name: str) -> str:
        return f"{self.prefix}store:{name}"

    def hosting(self, node_id: str) -> str:
        return f"{self.prefix}hosting:{node_id}"

    def lag(self, node_id: str) -> str:
        return f"{self.prefix}lag:{node_id}"

    def report(self, node_id: str) -> str:
        """NodeReport: hosting and lags in one compact value, beside `hosting` and `lag`."""
        return f"{self.prefix}report:{node_id}"

    def report_at(self, node_id: str) -> str:
        """ "<version> <at_ms>": the `report:<id>` body of that version holds as of at_ms."""
        return f"{self.prefix}report_at:{node_id}"

    @property
    def nodes(self) -> str:
        """Set of every node id that ever registered (the leader reads it, never SCANs)."""
        return f"{self.prefix}nodes"

    @property
    def stores(self) -> str:
        """Set of every store name."""
        return f"{self.prefix}stores"

    @property
    def assignment(self) -> str:
        return f"{self.prefix}assignment"

    @property
    def leader(self) -> str:
        return f"{self.prefix}leader"

    @property
    def events(self) -> str:
        return f"{self.prefix}events"

    @property
    def tidy(self) -> str:
        """Lease (a TTL'd string naming its holder) of the one agent (`kroute.agent`) that
        looks for departed instances this round: a cluster of agents has no leader."""
        return f"{self.prefix}tidy"

    @property
    def dead_since(self) -> str:
        """Hash node id -> when a leader first saw it dead (ms, Redis time), so the grace
        period survives leader changes; a node's field goes when it is seen alive."""
        return f"{self.prefix}dead_since"

    def node_id_of(self, key: str | bytes) -> str:
        text = key.decode() if isinstance(key, bytes) else key
        return text.rsplit(":", 1)[1]


def as_text(value: bytes | str) -> str:
    """A Redis reply as text (clients return bytes unless told to decode)."""
    return value.decode() if isinstance(value, bytes) else value


def lag_field(store: str, partition: int) -> str:
    return f"{store}/{partition}"


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    url: str
    started_at_ms: int


@dataclass(frozen=True)
class StoreInfo:
    name: str
    topic: str
    partitions: int
    key_format: str = "string"
    partitioner: str = "murmur2"
    value_format: str = "json"


@dataclass(frozen=True)
class PartitionAssignment:
    active: str | None
    standbys: tuple[str, ...] = ()

    def replicas(self) -> tuple[str, ...]:
        return ((self.active,) if self.active else ()) + self.standbys

    def role_of(self, node_id: str) -> Role | None:
        if node_id == self.active:
            return "active"
        return "standby" if node_id in self.standbys else None


@dataclass(frozen=True)
class Assignment:
    """Which node is active and which are standbys for every partition of every store."""

    generation: int
    leader: str
    computed_at_ms: int
    stores: Mapping[str, Mapping[int, PartitionAssignment]] = field(default_factory=dict)

    def for_node(self, node_id: str) -> dict[str, dict[Role, list[int]]]:
        hosted: dict[str, dict[Role, list[int]]] = {}
        for store, partitions in self.stores.items():
            for partition, placed in sorted(partitions.items()):
                role = placed.role_of(node_id)
                if role is not None:
                    hosted.setdefault(store, {"active": [], "standby": []})[role].append(partition)
        return hosted

    def placed_nodes(self) -> set[str]:
        """Every node id it names, active or standby, in any store."""
        return {
            node for parts in self.stores.values() for p in parts.values() for node in p.replicas()
        }


@dataclass(frozen=True)
class Hosting:
    """What a node actually serves right now (may lag behind the assignment it applies)."""

    node_id: str
    generation: int
    stores: Mapping[str, Mapping[Role, tuple[int, ...]]]
    updated_at_ms: int  # a node cut off from Redis cannot write: readers judge age by this


@dataclass(frozen=True)
class PartitionReport:
    current_offset: int
    end_offset: int | None
    newest_record_ms: int | None
    caught_up_at_ms: int | None
    updated_at_ms: int

    @property
    def lag(self) -> int | None:
        return None if self.end_offset is None else max(self.end_offset - self.current_offset, 0)


EventType = Literal["node", "assignment", "hosting", "lag"]


@dataclass(frozen=True)
class Event:
    type: EventType
    node_id: str | None = None
    generation: int | None = None


# -- encoding ----------------------------------------------------------------------------------


def encode(value: NodeInfo | StoreInfo | Assignment | Hosting | PartitionReport | Event) -> bytes:
    body = _plain(value)
    body["v"] = SCHEMA_VERSION
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _plain(value: Any) -> dict[str, Any]:
    if isinstance(value, Assignment):
        return {
            "generation": value.generation,
            "leader": value.leader,
            "computed_at_ms": value.computed_at_ms,
            "stores": {
                store: {
                    str(p): {"active": a.active, "standbys": list(a.standbys)}
                    for p, a in parts.items()
                }
                for store, parts in value.stores.items()
            },
        }
    if isinstance(value, Hosting):
        plain = asdict(value)
        plain["stores"] = {
            s: {role: list(ps) for role, ps in roles.items()} for s, roles in value.stores.items()
        }
        return plain
    return asdict(value)


def _load(raw: bytes | str) -> dict[str, Any]:
    try:
        # orjson, not json: json accepts a lone surrogate ("\ud800") in a string, which no
        # UTF-8 text can hold; a node id or store name made of one would break every
        # exposition, log line and page that writes it.
        body = orjson.loads(raw)
    except ValueError as exc:
        raise ContractError(f"not JSON: {raw[:80]!r}") from exc
    if not isinstance(body, dict):
        raise ContractError(f"expected a JSON object, got {type(body).__name__}")
    version = body.pop("v", None)
    if version != SCHEMA_VERSION:
        raise ContractError(f"schema version {version!r}; this reader understands {SCHEMA_VERSION}")
    return body


def _build(kind: type[T], body: dict[str, Any]) -> T:
    try:
        return kind(**body)
    except TypeError as exc:
        raise ContractError(f"not a {kind.__name__}: {exc}") from exc


def decode_node(raw: bytes | str) -> NodeInfo:
    return _build(NodeInfo, _load(raw))


def decode_store(raw: bytes | str) -> StoreInfo:
    return _build(StoreInfo, _load(raw))


def decode_report(raw: bytes | str) -> PartitionReport:
    return _build(PartitionReport, _load(raw))


def decode_event(raw: bytes | str) -> Event:
    return _build(Event, _load(raw))


def decode_hosting(raw: bytes | str) -> Hosting:
    body = _load(raw)
    try:
        body["stores"] = {
            s: {role: tuple(ps) for role, ps in roles.items()}
            for s, roles in body["stores"].items()
        }
    except (KeyError, AttributeError) as exc:
        raise ContractError(f"not a Hosting: {exc}") from exc
    return _build(Hosting, body)


def decode_assignment(raw: bytes | str) -> Assignment:
    body = _load(raw)
    try:
        stores = {
            store: {int(p): _placement(a) for p, a in parts.items()}
            for store, parts in body.pop("stores").items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ContractError(f"not an Assignment: {exc}") from exc
    return _build(Assignment, {**body, "stores": stores})


def _placement(entry: Any) -> PartitionAssignment:
    """One partition's entry, its types checked: `tuple("b")` would read a string of
    standbys as one standby per character, and a number as an active would name no node."""
    active, standbys = entry["active"], entry["standbys"]
    if active is not None and not isinstance(active, str):
        raise TypeError(f"active {active!r} is not a node id or null")
    if not isinstance(standbys, list) or not all(isinstance(s, str) for s in standbys):
        raise TypeError(f"standbys {standbys!r} is not a list of node ids")
    return PartitionAssignment(active, tuple(standbys))


# -- the compact per-node report ---------------------------------------------------------------

# One replica's lag in a NodeReport: [lag, at_ms - caught_up_at_ms, at_ms - newest_record_ms]
# (the "ago" values None when unknown, at_ms the time `report_at:<id>` gives); None for a
# partition without a report. Writers (`node_report`) always write the third as None: the
# newest record's age moves on every report while no reader routes by it (`lag:<id>` keeps
# newest_record_ms); readers still accept a number there.
LagEntry = tuple[int | None, int | None, int | None]
_NODE_REPORT_FIELDS = frozenset({"v", "node_id", "generation", "version", "stores"})
_STORE_FIELDS = frozenset({"active", "standby", "lag"})
# A writer rewrites an unchanged body (same version) this often: a transaction that did not
# happen after its body was counted as written, or a Redis restarted empty, heals within this,
# before readers count the node's reports as stale (3 s by default).
BODY_REWRITE_MS = 2_000
_MAX_DIGITS = 18  # `report_at:<id>` numbers: ms times, far below 10**18


@dataclass(frozen=True)
class NodeReport:
    """`report:<id>`: what `hosting:<id>` says and every hosted replica's lag from
    `lag:<id>`, in a few bytes a replica, without time: its ages are counted back from the
    time `report_at:<id>` confirms it at, so at steady state the body does not change and is
    written (and read) only when it does. No positions (`current_offset`) either: they change
    on every report and are what makes `lag:<id>` big; readers take end offsets from `lag:<id>`,
    less often, and count a position back from one (the end only grows, so `end - lag` is a
    lower bound; a position itself falls when a replica is reset)."""

    node_id: str
    generation: int
    # The writer's time when it first wrote this body: unique and increasing per node, and
    # what `report_at:<id>` names.
    version: int
    stores: Mapping[str, Mapping[Role, tuple[int, ...]]]
    # Per store, aligned with stores[store]["active"] then stores[store]["standby"].
    lags: Mapping[str, tuple[LagEntry | None, ...]]

    def hosting(self, at_ms: int) -> Hosting:
        """The hosting it says, as of `at_ms` (the time `report_at:<id>` confirms it at)."""
        return Hosting(self.node_id, self.generation, self.stores, at_ms)

    def partition_reports(
        self, ends: Mapping[tuple[str, int], int], at_ms: int
    ) -> dict[tuple[str, int], PartitionReport]:
        """(store, partition) -> its report as of `at_ms`, rebuilt around an end offset known
        from an earlier read (the log's end only grows): the lag and the times exact, the
        position `end - lag` a lower bound (0 when either is unknown). Not the earlier
        position itself: a replica's position falls when its store is reset or rebuilt, and
        an old one would claim offsets the replica no longer has (read-your-writes)."""
        # On the proxy's sweep for every replica of every node: kept lean (positional).
        at = at_ms
        reports: dict[tuple[str, int], PartitionReport] = {}
        for store, roles in self.stores.items():
            hosted = (*roles.get("active", ()), *roles.get("standby", ()))
            for partition, entry in zip(hosted, self.lags[store], strict=True):
                if entry is None:
                    continue
                lag, caught_up_ago, newest_ago = entry
                where = (store, partition)
                end = ends.get(where)
                position = 0 if lag is None or end is None else max(end - lag, 0)
                reports[where] = PartitionReport(
                    position,  # current_offset
                    None if lag is None else position + lag,  # end_offset
                    None if newest_ago is None else at - newest_ago,  # newest_record_ms
                    None if caught_up_ago is None else at - caught_up_ago,  # caught_up_at_ms
                    at,  # updated_at_ms
                )
        return reports


def report_time(hosting: Hosting, reports: Mapping[tuple[str, int], PartitionReport]) -> int:
    """The time a node's report stands for: the oldest of its hosting's and its hosted
    replicas' reports, so no entry reads younger than the report it comes from."""
    hosted = {
        (store, p) for store, roles in hosting.stores.items() for ps in roles.values() for p in ps
    }
    return min(
        [hosting.updated_at_ms, *(r.updated_at_ms for w, r in reports.items() if w in hosted)]
    )


def node_report(
    hosting: Hosting, reports: Mapping[tuple[str, int], PartitionReport], version: int = 0
) -> NodeReport:
    """The NodeReport of a hosting and its reports, ages counted back from `report_time`.

    Only what stays the same on an idle, caught-up node whose reports are stamped with their
    end offset's read (its caught-up age is then 0): the lag and the caught-up age. Not the
    newest record's age: on an idle partition that record is fixed while the report time
    moves, so the body, and every proxy's read of it, would change on every report."""
    at = report_time(hosting, reports)

    def entry(report: PartitionReport | None) -> LagEntry | None:
        if report is None:
            return None
        caught_up = report.caught_up_at_ms
        return (report.lag, None if caught_up is None else at - caught_up, None)

    lags = {
        store: tuple(
            entry(reports.get((store, p)))
            for p in (*roles.get("active", ()), *roles.get("standby", ()))
        )
        for store, roles in hosting.stores.items()
    }
    return NodeReport(hosting.node_id, hosting.generation, version, hosting.stores, lags)


def _report_plain(report: NodeReport) -> dict[str, Any]:
    """The body as JSON-ready values, without `v` and `version`: what "changed" compares."""
    stores = {
        store: {
            "active": list(roles.get("active", ())),
            "standby": list(roles.get("standby", ())),
            "lag": [None if e is None else list(e) for e in report.lags[store]],
        }
        for store, roles in report.stores.items()
    }
    return {"node_id": report.node_id, "generation": report.generation, "stores": stores}


def encode_node_report(report: NodeReport) -> bytes:
    return _encode_report_plain(_report_plain(report), report.version)


def _encode_report_plain(plain: dict[str, Any], version: int) -> bytes:
    body = {"v": SCHEMA_VERSION, **plain, "version": version}
    return json.dumps(body, separators=(",", ":")).encode()


def decode_node_report(raw: bytes | str) -> NodeReport:
    """Strict: another `v`, a field this contract does not list, a value of the wrong type,
    a lag list not aligned with the partitions or a negative lag is refused."""
    try:
        body = orjson.loads(raw)  # read on every change: orjson's C parser, ~4x json's
    except orjson.JSONDecodeError as exc:
        raise ContractError(f"not JSON: {raw[:80]!r}") from exc
    if not isinstance(body, dict):
        raise ContractError(f"expected a JSON object, got {type(body).__name__}")
    if body.get("v") != SCHEMA_VERSION:
        raise ContractError(f"schema version {body.get('v')!r}; this reader understands 1")
    if body.keys() != _NODE_REPORT_FIELDS:
        raise ContractError(f"not a NodeReport: fields {sorted(body)}")
    node_id, generation, version = body["node_id"], body["generation"], body["version"]
    if not isinstance(node_id, str) or not _is_int(generation) or not _is_int(version):
        raise ContractError("not a NodeReport: node_id, generation or version of the wrong type")
    if not isinstance(body["stores"], dict):
        raise ContractError("not a NodeReport: stores is not an object")
    stores: dict[str, dict[Role, tuple[int, ...]]] = {}
    lags: dict[str, tuple[LagEntry | None, ...]] = {}
    for store, value in body["stores"].items():
        stores[store], lags[store] = _store_report(store, value)
    return NodeReport(node_id, generation, version, stores, lags)


def _store_report(
    store: str, value: Any
) -> tuple[dict[Role, tuple[int, ...]], tuple[LagEntry | None, ...]]:
    if not isinstance(value, dict) or set(value) != _STORE_FIELDS:
        raise ContractError(f"not a NodeReport: store {store!r} is not {sorted(_STORE_FIELDS)}")
    active, standby, lag = value["active"], value["standby"], value["lag"]
    for partitions in (active, standby):
        if not isinstance(partitions, list) or not all(
            type(p) is int and p >= 0 for p in partitions
        ):
            raise ContractError(f"not a NodeReport: store {store!r} partitions not integers")
    if not isinstance(lag, list) or len(lag) != len(active) + len(standby):
        raise ContractError(f"not a NodeReport: store {store!r} lag not aligned with partitions")
    if len(set(active) | set(standby)) != len(active) + len(standby):
        # One replica per partition and node: a second entry would overwrite the first.
        raise ContractError(f"not a NodeReport: store {store!r} lists a partition twice")
    return {"active": tuple(active), "standby": tuple(standby)}, tuple(map(_lag_entry, lag))


def _lag_entry(value: Any) -> LagEntry | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3:
        raise ContractError(f"not a NodeReport: lag entry {value!r} is not [lag, ago, ago]")
    lag, caught_up_ago, newest_ago = value
    if not all(v is None or type(v) is int for v in value) or (lag is not None and lag < 0):
        raise ContractError(f"not a NodeReport: lag entry {value!r} is not [lag ≥ 0, ago, ago]")
    return lag, caught_up_ago, newest_ago


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def encode_report_at(version: int, at_ms: int) -> bytes:
    """`report_at:<id>`: a plain string, like `alive:<id>` (read for every node on every
    sweep: two integers, no JSON to parse)."""
    return f"{version} {at_ms}".encode()


def decode_report_at(raw: bytes | str) -> tuple[int, int]:
    """(version, at_ms) of a `report_at:<id>`; strict: two non-negative decimal integers
    separated by one space, nothing else."""
    try:
        text = as_text(raw)
    except UnicodeDecodeError as exc:
        raise ContractError(f"not a report_at value ('<version> <at_ms>'): {raw[:40]!r}") from exc
    parts = text.split(" ")
    if len(parts) != 2 or not all(
        p.isascii() and p.isdigit() and len(p) <= _MAX_DIGITS for p in parts
    ):
        raise ContractError(f"not a report_at value ('<version> <at_ms>'): {text[:40]!r}")
    return int(parts[0]), int(parts[1])


@dataclass
class _WrittenBody:
    plain: dict[str, Any]  # the body without its version (what "changed" compares)
    version: int
    written_at_ms: int  # when its last SET was queued (writer's time)


@dataclass
class ReportBodies:
    """What `write_node_report` last wrote as each node's `report:<id>` body: one per writer
    (a writer of many nodes keeps them all in one), kept beside it for as long as it runs."""

    written: dict[str, _WrittenBody] = field(default_factory=dict)

    def forget(self, node_id: str) -> None:
        """The writer no longer writes this node (and deleted its keys)."""
        self.written.pop(node_id, None)


def write_node_report(
    pipe: Any,
    keys: Keys,
    hosting: Hosting,
    reports: Mapping[tuple[str, int], PartitionReport],
    expire_ms: int,
    *,
    bodies: ReportBodies,
) -> None:
    """Queue a node's whole report on `pipe` (a MULTI/EXEC pipeline, so readers never see
    half of it): `hosting:<id>`, `lag:<id>` replaced as a whole and expiring in `expire_ms`;
    `report:<id>` (the same, compact) only when its body differs from the last one written
    (then with a new version), its expiry renewed otherwise; and `report_at:<id>` always,
    naming the body's version and the time it holds as of, expiring with it. Every writer
    writes through this, so the keys cannot disagree."""
    node_id = hosting.node_id
    lag_key, report_key = keys.lag(node_id), keys.report(node_id)
    pipe.set(keys.hosting(node_id), encode(hosting))
    pipe.delete(lag_key)
    if reports:
        fields = {lag_field(store, p): encode(r) for (store, p), r in reports.items()}
        pipe.hset(lag_key, mapping=fields)
        pipe.pexpire(lag_key, expire_ms)
    now = hosting.updated_at_ms
    plain = _report_plain(node_report(hosting, reports))
    last = bodies.written.get(node_id)
    if last is None or last.plain != plain:
        # A new version: the writer's time, and past the last one whatever its clock did.
        version = now if last is None else max(now, last.version + 1)
        last = bodies.written[node_id] = _WrittenBody(plain, version, now)
        pipe.set(report_key, _encode_report_plain(plain, version), px=expire_ms)
    elif not 0 <= now - last.written_at_ms < BODY_REWRITE_MS:
        last.written_at_ms = now
        pipe.set(report_key, _encode_report_plain(plain, last.version), px=expire_ms)
    else:
        pipe.pexpire(report_key, expire_ms)
    at = report_time(hosting, reports)
    pipe.set(keys.report_at(node_id), encode_report_at(last.version, at), px=expire_ms)
