"""Forward a lookup once to the node that hosts its partition (the seeds' internal fallback).

The forwarded request carries `x-kroute-forwarded-by: <this node>`; a node receiving a request
that was already forwarded answers it itself or refuses with 421, never forwards again, so two
nodes with different views cannot bounce a request between them.

The client is aiohttp's, over one pooled connector: a forward costs the node about three
lookups' worth of CPU, where httpx.AsyncClient cost it dozens (benchmarks/node_forward_bench.py
measures both side by side).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

FORWARDED_BY = "x-kroute-forwarded-by"
_FORWARDED_BY = FORWARDED_BY.encode()
_KROUTE_PREFIX = b"x-kroute-"
# Below uvicorn's 5 s keep-alive: an idle connection is retired here before the owner closes it.
_IDLE_CONNECTION_S = 4.0


class OwnerUnreachable(Exception):
    """The owner could not be reached or did not answer within the timeout."""


@dataclass(frozen=True)
class Forwarded:
    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


class Forwarder:
    def __init__(self, node_id: str, timeout_s: float = 2.0) -> None:
        self._node_id = node_id
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, 0.5))
        self._session: aiohttp.ClientSession | None = None

    def _pooled_session(self) -> aiohttp.ClientSession:
        # Made on first use: an aiohttp session belongs to the event loop it was made on.
        if self._session is None:
            connector = aiohttp.TCPConnector(
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
        Raises OwnerUnreachable when it cannot be reached or does not answer in time."""
        sent = {**(bounds or {}), FORWARDED_BY: self._node_id}
        try:
            async with self._pooled_session().get(
                base_url + path, headers=sent, allow_redirects=False
            ) as response:
                body = await response.read()
                status, raw_headers = response.status, response.raw_headers
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise OwnerUnreachable(str(exc) or type(exc).__name__) from exc
        headers = [
            (name.lower(), value)
            for name, value in raw_headers
            if name.lower().startswith(_KROUTE_PREFIX)
        ]
        headers.append((_FORWARDED_BY, self._node_id.encode()))
        return Forwarded(status, body, headers)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
            await asyncio.sleep(0)  # lets the connector's transports finish closing
