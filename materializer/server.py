"""The node's HTTP API (ASGI, served by uvicorn on uvloop + httptools).

    GET /stores/{store}/keys/{key}   200 value + where it came from, 404 absent key or store,
                                     400 malformed key, 421 a partition this node does not host
                                     or freshness it cannot give (materializer.read_bounds);
                                     in a cluster, forwarded once to the partition's owner:
                                     503 owner_unreachable, 502 owner_bad_answer (too large,
                                     a redirect or 101: materializer.forwarding)
    GET /metadata                    hosted partitions: offsets, end offsets, lag, newest record;
                                     the pipeline: last batch applied, errors, stalls and why
    GET /metrics                     Prometheus text: batch times, records, skips, lag, stalls
    GET /health/live                 the process answers
    GET /health/ready                200 once every hosted partition has caught up once and none
                                     is stalled, else 503 with the reason

Lookups read RocksDB directly on the event loop (~1 µs); they never wait for a micro-batch,
only, at worst, for one partition's write of one batch (bounded by max_records_per_partition).
Keys are taken from the raw path, so a key may contain an encoded slash (%2F).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote

from common.clock import now_ms
from common.freshness import (
    POSITION_HEADER,
    REFUSED_HEADER,
    BadFreshnessHeader,
    position_token,
    reached,
)
from materializer.forwarding import (
    FORWARDED_BY,
    Forwarded,
    Forwarder,
    OwnerBadAnswer,
    OwnerUnreachable,
)
from materializer.lag import LagTracker
from materializer.metrics import NodeMetrics
from materializer.pipeline import Stall
from materializer.read_bounds import (
    PositionWatch,
    ReadBounds,
    Refusal,
    bad_header,
    freshness_headers,
    lag_refusal,
    position_refusal,
)
from materializer.sink import IngestStats
from materializer.store import Store
from partitioner import KeyFormatError, KeyPartitioner

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = (b"content-type", b"application/json")


class HostingView(Protocol):
    """Which partitions the node hosts and as what (materializer.hosting), read-only."""

    @property
    def hosted(self) -> tuple[int, ...]: ...

    def role_of(self, partition: int) -> str: ...


class RunningNode(Protocol):
    """What only the running node knows, asked at the moment of each answer (`Node`)."""

    @property
    def partitioner(self) -> KeyPartitioner | None:
        """None until the topic's partition count is known."""

    @property
    def forwarder(self) -> Forwarder | None:
        """In a cluster: how to reach a partition's owner (None: never forward)."""

    def owner_of(self, partition: int) -> str | None:
        """In a cluster: the URL of the node that is active for a partition."""

    def pipeline_status(self) -> dict[str, Any]: ...

    def stalls(self) -> Mapping[int, Stall]:
        """Partitions whose pipeline is stalled."""


@dataclass(frozen=True)
class NodeState:
    """What the handlers read, in three parts that change differently: what is fixed when the
    node starts (identity, store, formats), its hosting (changed by the node only, read here
    through `HostingView`), and what only the running node knows (`RunningNode`). The app
    never writes any of it."""

    node_id: str
    store_name: str
    topic: str
    value_format: str
    store: Store
    lag: LagTracker
    stats: IngestStats
    hosting: HostingView
    node: RunningNode
    # How long a lookup with x-kroute-min-offset waits for the store to apply it (then 421).
    min_offset_wait_ms: int = 500

    @property
    def hosted(self) -> tuple[int, ...]:
        return self.hosting.hosted

    def role_of(self, partition: int) -> str:
        return self.hosting.role_of(partition)

    @property
    def partitioner(self) -> KeyPartitioner | None:
        return self.node.partitioner

    @property
    def forwarder(self) -> Forwarder | None:
        return self.node.forwarder

    def owner_of(self, partition: int) -> str | None:
        return self.node.owner_of(partition)

    def pipeline_status(self) -> dict[str, Any]:
        return self.node.pipeline_status()

    def stalls(self) -> Mapping[int, Stall]:
        return self.node.stalls()


class NodeApp:
    def __init__(self, state: NodeState) -> None:
        self.state = state
        self.forwarded = 0  # lookups this node passed on to the partition's owner (an extra hop)
        self._positions = PositionWatch(lambda partition: _position(state.store, partition))
        self._metrics = NodeMetrics(state, lambda: self.forwarded)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] not in ("GET", "HEAD"):
            await _respond(
                send, 405, {"error": "method_not_allowed", "allowed": ["GET"]}, [(b"allow", b"GET")]
            )
            return
        path = scope.get("raw_path") or scope["path"].encode()
        segments = path.split(b"?", 1)[0].split(b"/")
        if len(segments) == 5 and segments[1] == b"stores" and segments[3] == b"keys":
            store, key = _path_text(segments[2]), _path_text(segments[4])
            if store is None or key is None:
                await _respond(
                    send,
                    400,
                    {
                        "error": "invalid_path",
                        "detail": "percent-encoded bytes are not valid UTF-8",
                    },
                )
                return
            await self._lookup(send, store, key, scope, path)
        elif path == b"/metadata":
            await _respond(send, 200, self._metadata())
        elif path == b"/metrics":
            await self._metrics.respond(send)
        elif path == b"/health/live":
            await _respond(send, 200, {"status": "live", "node": self.state.node_id})
        elif path == b"/health/ready":
            await self._ready(send)
        else:
            await _respond(
                send,
                404,
                {"error": "not_found", "detail": "no such endpoint", "path": scope["path"]},
            )

    async def _lookup(
        self, send: Send, store: str, key_text: str, scope: Scope, path: bytes
    ) -> None:
        state = self.state
        try:
            partition, key = self._locate(store, key_text)
            bounds = _read_bounds(scope, partition)
        except _Refused as refused:
            await _respond(send, refused.status, refused.payload)
            return
        if partition not in state.hosted:
            if await self._forward(send, partition, scope, path):
                return
            await _respond(
                send,
                421,
                {
                    "error": "misdirected",
                    "detail": f"partition {partition} is not hosted by node {state.node_id}",
                    "partition": partition,
                    "hosted": list(state.hosted),
                },
            )
            return
        lag = state.lag.snapshot.get(partition)
        if lag is None or lag.end_offset is None:
            await _respond(send, 421, _not_ready(state.node_id, partition))
            return
        refusal = None if bounds is None else await self._refusal(bounds, partition, lag)
        provenance = _provenance(state, partition, lag)
        if refusal is not None:
            why = (REFUSED_HEADER.encode(), refusal.reason.encode())
            headers = [*_provenance_headers(provenance), _position_line(state, partition), why]
            await _respond(send, 421, refusal.payload, headers)
            return
        found = state.store.get(partition, key)
        # Read after the value: the token may be newer than what the answer shows, never older,
        # so a later read bounded by it is at least as fresh as this one (monotonic reads).
        headers = [*_provenance_headers(provenance), _position_line(state, partition)]
        if found is None:
            await _respond(
                send,
                404,
                {"error": "key_not_found", "store": store, "key": key_text, **provenance},
                headers,
            )
            return
        body = {
            "store": store,
            "key": key_text,
            **provenance,
            "offset": found.offset,
            "timestamp_ms": found.timestamp_ms,
        }
        await _respond_raw(send, 200, _with_value(body, found.value, state.value_format), headers)

    async def _refusal(self, bounds: ReadBounds, partition: int, lag: Any) -> Refusal | None:
        """Why the bounds the request asks for cannot be met here (None: they are). A minimum
        offset the store has not applied is waited for, up to `min_offset_wait_ms`."""
        state = self.state
        where = {"partition": partition, "node": state.node_id, "role": state.role_of(partition)}
        position = _position(state.store, partition)
        if bounds.min_offset is not None and not reached(position, bounds.min_offset):
            started = time.monotonic()
            wait_s = state.min_offset_wait_ms / 1000
            position = await self._positions.wait(partition, bounds.min_offset, wait_s)
            if not reached(position, bounds.min_offset):
                waited_ms = round((time.monotonic() - started) * 1000)
                return position_refusal(bounds.min_offset, position, waited_ms, where)
        if bounds.max_lag is None and bounds.max_lag_ms is None:
            return None
        # Stalls cost a look at every hosted partition: only a time budget needs them.
        stalled = bounds.max_lag_ms is not None and partition in state.stalls()
        now = state.lag.snapshot.get(partition, lag)  # refreshed while we waited, maybe
        return lag_refusal(bounds, now, position, stalled=stalled, at_ms=now_ms(), where=where)

    def _locate(self, store: str, key_text: str) -> tuple[int, bytes]:
        """The key's partition and bytes; _Refused when the request cannot be answered here."""
        state = self.state
        if store != state.store_name:
            raise _Refused(
                404, {"error": "unknown_store", "store": store, "stores": [state.store_name]}
            )
        if state.partitioner is None:
            raise _Refused(
                503,
                {
                    "error": "starting",
                    "detail": "the topic's partition count is not known yet (broker unreachable?)",
                },
            )
        try:
            key = state.partitioner.serialize(key_text)
            return state.partitioner.partition_of_bytes(key), key
        except KeyFormatError as exc:
            raise _Refused(
                400,
                {
                    "error": "invalid_key",
                    "key_format": exc.key_format,
                    "key": key_text,
                    "detail": exc.reason,
                },
            ) from None

    async def _forward(self, send: Send, partition: int, scope: Scope, path: bytes) -> bool:
        """Forward once to the partition's active node; False when that is not possible."""
        state = self.state
        headers = scope.get("headers", [])
        already_forwarded = any(name == FORWARDED_BY.encode() for name, _ in headers)
        forwarder = state.forwarder
        owner = state.owner_of(partition) if forwarder is not None else None
        if already_forwarded or owner is None or forwarder is None:
            return False
        self.forwarded += 1
        where = {"partition": partition, "owner": owner}
        marked = [(FORWARDED_BY.encode(), state.node_id.encode())]
        try:
            bounds = freshness_headers(headers)  # the owner checks them: see Forwarder.forward
            result = await forwarder.forward(owner, path.decode("ascii"), bounds)
        except OwnerUnreachable as exc:
            payload = {"error": "owner_unreachable", **where, "detail": str(exc)}
            await _respond(send, 503, payload, marked)
            return True
        except OwnerBadAnswer as exc:  # passing it on would be worse than saying so
            await _respond(
                send, 502, {"error": "owner_bad_answer", **where, "detail": str(exc)}, marked
            )
            return True
        await _respond_forwarded(send, result)
        return True

    def _metadata(self) -> dict[str, Any]:

        state = self.state
        at = now_ms()
        with state.stats.lock:
            problems = dict(state.stats.problems_by_partition)
            ingest = {
                "batches": state.stats.batches,
                "records": state.stats.records,
                "changes_written": state.stats.changes_written,
            }
        stalls = state.stalls()
        partitions = []
        for partition in state.hosted:
            lag = state.lag.snapshot.get(partition)
            entry: dict[str, Any] = lag.as_json(at) if lag else {"partition": partition}
            entry.update(
                {"role": state.role_of(partition), "skipped_records": problems.get(partition, 0)}
            )
            stall = stalls.get(partition)
            if stall is not None:
                entry["stalled_since_ms"] = stall.since_ms
            partitions.append(entry)
        return {
            "node": state.node_id,
            "store": state.store_name,
            "topic": state.topic,
            "num_partitions": state.partitioner.num_partitions if state.partitioner else None,
            "partitions": partitions,
            "catching_up": [p["partition"] for p in partitions if not p.get("caught_up")],
            # No longer assigned, still on disk for the grace period in case they come back.
            "kept_for_grace": sorted(state.store.partitions() - set(state.hosted)),
            "broker_error": state.lag.broker_error,
            "ingest": ingest,
            "forwarded": self.forwarded,
            "pipeline": {**state.pipeline_status(), **_stall_summary(stalls, at)},
        }

    async def _ready(self, send: Send) -> None:
        state = self.state
        pipeline = state.pipeline_status()
        never_caught_up = [
            p
            for p in state.hosted
            if (lag := state.lag.snapshot.get(p)) is None or lag.caught_up_at_ms is None
        ]
        stalls, at = state.stalls(), now_ms()
        reason = _not_ready_reason(
            state.partitioner is not None, bool(pipeline.get("running")), never_caught_up, stalls
        )
        if reason is not None:
            await _respond(
                send,
                503,
                {
                    "status": "not_ready",
                    "node": state.node_id,
                    "reason": reason,
                    "partitioner_known": state.partitioner is not None,
                    "pipeline_running": bool(pipeline.get("running")),
                    "pipeline_error": pipeline.get("last_error"),
                    "catching_up": never_caught_up,
                    "stalled": [stall.as_json(at) for stall in stalls.values()],
                },
            )
            return
        await _respond(send, 200, {"status": "ready", "node": state.node_id})


def _not_ready_reason(
    partitioner_known: bool,
    pipeline_running: bool,
    never_caught_up: list[int],
    stalls: Mapping[int, Stall],
) -> str | None:
    """Why the node is not ready, in words (None: it is ready)."""
    if not partitioner_known:
        return "starting: the topic's partition count is not known yet (broker unreachable?)"
    if stalls:
        first = min(stalls.values(), key=lambda stall: stall.since_ms)
        return f"pipeline stalled on partitions {sorted(stalls)}: {first.reason}"
    if not pipeline_running:
        return "the streaming query is not running (starting, or restarting after a failure)"
    if never_caught_up:
        return f"partitions {never_caught_up} have not caught up since the node started"
    return None


def _stall_summary(stalls: Mapping[int, Stall], at_ms: int) -> dict[str, Any]:
    """The pipeline's stall state for /metadata: since when, and why."""
    if not stalls:
        return {"stalled": False, "stalled_since_ms": None, "why": None, "stalled_partitions": []}
    first = min(stalls.values(), key=lambda stall: stall.since_ms)
    return {
        "stalled": True,
        "stalled_since_ms": first.since_ms,
        "why": first.reason,
        "stalled_partitions": [stall.as_json(at_ms) for stall in stalls.values()],
    }


def _path_text(segment: bytes) -> str | None:
    """A percent-decoded path segment, or None when its bytes are not UTF-8 (never guessed)."""
    try:
        return unquote(segment.decode("ascii"), errors="strict")
    except UnicodeError:
        return None


def _provenance(state: NodeState, partition: int, lag: Any) -> dict[str, Any]:
    at = now_ms()
    return {
        "partition": partition,
        "node": state.node_id,
        "role": state.role_of(partition),
        "position": lag.current_offset if lag else None,
        "lag": lag.lag if lag else None,
        "time_lag_ms": lag.time_lag_ms(at) if lag else None,
    }


def _read_bounds(scope: Scope, partition: int) -> ReadBounds | None:
    """The freshness the request asks for (common.freshness); a malformed header is a 400."""
    try:
        return ReadBounds.from_headers(scope.get("headers", []), partition)
    except BadFreshnessHeader as exc:
        raise _Refused(400, bad_header(exc)) from None


def _position(store: Store, partition: int) -> int:
    """The store's position in the partition now: the next offset it reads."""
    checkpoint = store.checkpoint(partition)
    return checkpoint.next_offset if checkpoint else 0


def _position_line(state: NodeState, partition: int) -> tuple[bytes, bytes]:
    """The answer's position token (see common.freshness), read from the store now."""
    token = position_token(partition, _position(state.store, partition))
    return (POSITION_HEADER.encode(), token.encode())


def _provenance_headers(provenance: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-kroute-node", str(provenance["node"]).encode()),
        (b"x-kroute-partition", str(provenance["partition"]).encode()),
        (b"x-kroute-role", str(provenance["role"]).encode()),
        (
            b"x-kroute-lag",
            b"unknown" if provenance["lag"] is None else str(provenance["lag"]).encode(),
        ),
    ]


def _with_value(body: dict[str, Any], value: bytes, value_format: str) -> bytes:
    """The body with the value embedded: JSON as it is (validated at ingest), else as text."""
    if value_format == "json":
        head = json.dumps(body, separators=(",", ":")).encode()
        return head[:-1] + b',"value":' + value + b"}"
    if value_format == "string":
        body["value"] = value.decode("utf-8")
    else:
        body["value"] = base64.b64encode(value).decode("ascii")
        body["value_encoding"] = "base64"
    return json.dumps(body, separators=(",", ":")).encode()


async def _respond(
    send: Send,
    status: int,
    payload: dict[str, Any],
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    await _respond_raw(send, status, json.dumps(payload, separators=(",", ":")).encode(), headers)


async def _respond_raw(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _respond_forwarded(send: Send, result: Forwarded) -> None:
    """The owner's answer with its own content type (a node's is JSON) and encoding."""
    typed = any(name == b"content-type" for name, _ in result.headers)
    headers = result.headers if typed else [_JSON, *result.headers]
    length = (b"content-length", str(len(result.body)).encode())
    await send(
        {"type": "http.response.start", "status": result.status, "headers": [length, *headers]}
    )
    await send({"type": "http.response.body", "body": result.body})


class _Refused(Exception):
    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        super().__init__(payload.get("error"))
        self.status, self.payload = status, payload


def _not_ready(node_id: str, partition: int) -> dict[str, Any]:
    """421 (RFC 9110: cannot produce an authoritative answer): a proxy asks another replica.
    Until the node knows where its store stands against the partition's end (just started,
    restoring a lost store, broker not yet reached), an answer, a 404 above all, could be any
    age."""
    return {
        "error": "not_ready",
        "detail": f"partition {partition} on node {node_id}: how far the store is behind the "
        "topic is not known yet (starting or restoring); ask another replica",
        "partition": partition,
        "node": node_id,
    }
