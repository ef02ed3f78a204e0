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

`lag:<id>` hash `<store>/<partition>` -> PartitionReport (the node); `assignment` Assignment
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
        body = json.loads(raw)
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
            store: {
                int(p): PartitionAssignment(a["active"], tuple(a["standbys"]))
                for p, a in parts.items()
            }
            for store, parts in body.pop("stores").items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ContractError(f"not an Assignment: {exc}") from exc
    return _build(Assignment, {**body, "stores": stores})
