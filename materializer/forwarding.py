"""Forward a lookup once to the node that hosts its partition (the seeds' internal fallback).

The forwarded request carries `x-kroute-forwarded-by: <this node>`; a node receiving a request
that was already forwarded answers it itself or refuses with 421, never forwards again, so two
nodes with different views cannot bounce a request between them.

The client is aiohttp's, over one pooled connector: a forward costs the node about three
lookups' worth of CPU, where httpx.AsyncClient cost it dozens (benchmarks/node_forward_bench.py
measures both side by side).

The owner is another node, but its answer is read as if it could be anything: a body past
`max_body_bytes` is refused as soon as it is seen (never held whole in this node's memory), and
answers no node gives (switching protocols, redirects, statuses outside 2xx/4xx/5xx) are
OwnerBadAnswer, which the node's server answers as 502 instead of passing them on.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
import yarl
from aiohttp.client_reqrep import ConnectionKey
from aiohttp.connector import Connection
from aiohttp.tracing import Trace

FORWARDED_BY = "x-kroute-forwarded-by"
_FORWARDED_BY = FORWARDED_BY.encode()
_KROUTE_PREFIX = b"x-kroute-"
# The body is passed on as the owner sent it (auto_decompress is off), so what says how to
# read it goes with it: gzip bytes labelled only as JSON would be garbage to the client.
_BODY_HEADERS = frozenset({b"content-type", b"content-encoding"})
# Below uvicorn's 5 s keep-alive: an idle connection is retired here before the owner closes it.
_IDLE_CONNECTION_S = 4.0
_READ_SIZE = 1 << 16


def answer_limit(max_value_bytes: int) -> int:
    """The largest answer a node gives for values up to max_value_bytes: a string value of
    control characters is escaped six-fold (\\u0000) in JSON; the rest of the answer is small."""
    return 6 * max_value_bytes + 64 * 1024


DEFAULT_MAX_BODY_BYTES = answer_limit(8 * 1024 * 1024)  # the nodes' default KROUTE_MAX_VALUE_BYTES


class _CleanPoolConnector(aiohttp.TCPConnector):
    """A pool that never lends a connection on which the owner sent bytes while it idled.

    aiohttp parses whatever arrives on an idle pooled connection and queues it as the next
    answer: a broken owner's late answer would be taken by the next request sent on it, for a
    different key (its response for the wrong request). aiohttp checks such bytes only when a
    connection is released, not when it is lent again; this checks them there too. (_get is
    aiohttp's private step that takes a pooled connection: aiohttp is pinned in pyproject.toml,
    and tests/materializer/test_forwarding_hostile.py fails if an upgrade bypasses it.)"""

    async def _get(self, key: ConnectionKey, traces: list[Trace]) -> Connection | None:
        while True:
            connection = await super()._get(key, traces)
            protocol = connection.protocol if connection is not None else None
            if connection is None or protocol is None or not protocol.should_close:
                return connection
            connection.close()  # its queued bytes answer nothing we asked


class OwnerUnreachable(Exception):
    """The owner could not be reached or did not answer within the timeout."""


class OwnerBadAnswer(Exception):
    """The owner answered, but not with anything a node answers: too large, or a status that
    would mean something else to the client (101, redirects)."""


@dataclass(frozen=True)
class Forwarded:
    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


class Forwarder:
    def __init__(
        self,
        node_id: str,
        timeout_s: float = 2.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self._node_id = node_id
        self._max_body_bytes = max_body_bytes
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 0.5))
        self._session: aiohttp.ClientSession | None = None

    def _pooled_session(self) -> aiohttp.ClientSession:
        # Made on first use: an aiohttp session belongs to the event loop it was made on.
        if self._session is None:
            connector = _CleanPoolConnector(
                limit=64, keepalive_timeout=_IDLE_CONNECTION_S, use_dns_cache=True
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                trust_env=False,
                auto_decompress=False,  # the body is passed on as the owner sent it
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
            )
        return self._session

    async def forward(
        self, base_url: str, path: str, bounds: Mapping[str, str] | None = None
    ) -> Forwarded:
        """GET path on another node, with `bounds` (the lookup's freshness headers, which the
        owner must check: this node's view of who owns what may be as stale as a proxy's).
        Raises OwnerUnreachable when it cannot be reached or does not answer in time,
        OwnerBadAnswer when its answer must not be passed on."""
        sent = {**(bounds or {}), FORWARDED_BY: self._node_id}
        try:
            async with self._pooled_session().get(
                _target(base_url, path), headers=sent, allow_redirects=False
            ) as response:
                try:
                    _check_status(response.status)
                    body = await self._bounded_body(response)
                except OwnerBadAnswer:
                    response.close()  # never pooled: the rest of its answer is still coming
                    raise
                status, raw_headers = response.status, response.raw_headers
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise OwnerUnreachable(str(exc) or type(exc).__name__) from exc
        headers = [
            (name.lower(), value)
            for name, value in raw_headers
            if name.lower().startswith(_KROUTE_PREFIX) or name.lower() in _BODY_HEADERS
        ]
        headers.append((_FORWARDED_BY, self._node_id.encode()))
        return Forwarded(status, body, headers)

    async def _bounded_body(self, response: aiohttp.ClientResponse) -> bytes:
        limit = self._max_body_bytes
        declared = response.content_length
        if declared is not None and declared > limit:
            raise OwnerBadAnswer(f"answer too large: content-length {declared} > {limit} bytes")
        parts: list[bytes] = []
        size = 0
        async for part in response.content.iter_chunked(_READ_SIZE):
            size += len(part)
            if size > limit:
                raise OwnerBadAnswer(f"answer too large: over {limit} bytes")
            parts.append(part)
        return b"".join(parts)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            await asyncio.sleep(0)  # lets the connector's transports finish closing


def _target(base_url: str, path: str) -> yarl.URL:
    """The owner's URL with the path exactly as the client sent it. Left to yarl, the path
    would be requoted and its dot segments resolved: a key ".." or "%2E%2E" would ask for
    /stores/{store}/ (404 "no such endpoint", read by the client as an absent key), "%41" would
    become "A". Only what may not stand in a request line is escaped."""
    return yarl.URL(base_url + quote(path, safe=string.punctuation), encoded=True)


def _check_status(status: int) -> None:
    # 1xx interim answers never get here (aiohttp reads past them), except 101, which would
    # tell the client its connection is now another protocol; a redirect loses its Location.
    if not (200 <= status < 300 or 400 <= status < 600):
        raise OwnerBadAnswer(f"owner answered status {status}, which a node never answers")
