"""Forward a lookup once to the node that hosts its partition (the seeds' internal fallback).

The forwarded request carries `x-kroute-forwarded-by: <this node>`; a node receiving a request
that was already forwarded answers it itself or refuses with 421, never forwards again, so two
nodes with different views cannot bounce a request between them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import httpx

FORWARDED_BY = "x-kroute-forwarded-by"


@dataclass(frozen=True)
class Forwarded:
    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]]


class Forwarder:
    def __init__(self, node_id: str, timeout_s: float = 2.0) -> None:
        self._node_id = node_id
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 0.5)),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16),
            trust_env=False,
        )

    async def forward(
        self, base_url: str, path: str, bounds: Mapping[str, str] | None = None
    ) -> Forwarded:
        """GET path on another node, with `bounds` (the lookup's freshness headers, which the
        owner must check: this node's view of who owns what may be as stale as a proxy's).
        Raises httpx.HTTPError when it cannot be reached."""
        sent = {**(bounds or {}), FORWARDED_BY: self._node_id}
        response = await self._client.get(base_url + path, headers=sent)
        headers = [
            (name.encode(), value.encode())
            for name, value in response.headers.items()
            if name.startswith("x-kroute-")
        ]
        headers.append((b"x-kroute-forwarded-by", self._node_id.encode()))
        return Forwarded(response.status_code, response.content, headers)

    async def close(self) -> None:
        await self._client.aclose()
