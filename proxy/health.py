"""Ejection of nodes that failed a request, and the probes that bring them back.

A node whose connection was refused, reset or timed out is ejected: chosen only when no other
replica qualifies (a last resort, see proxy.choice) for at least `eject_ms`, and after that
until its heartbeat in Redis is alive *and* an HTTP probe of the health path
(KROUTE_HEALTH_PATH, `/health/live` by default) gets any answer below 500: a process that
answers at all is up, even if it does not know the path; a 5xx says it is not. The path is one
for every node, not per store: a probe asks about a node, and one node serves many stores.
The ejected set is an immutable frozenset swapped on change, so the replica choice (pure)
takes it as a plain value.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import structlog

from common.clock import now_ms

log = structlog.get_logger("kroute.proxy.health")


class Ejections:
    def __init__(
        self,
        *,
        eject_ms: int,
        probe_interval_ms: int,
        probe_timeout_s: float,
        health_path: str = "/health/live",
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.eject_ms = eject_ms
        self.probe_interval_ms = probe_interval_ms
        self.health_path = health_path
        self.ejected: frozenset[str] = frozenset()
        self._since: dict[str, tuple[int, str]] = {}  # node -> (ejected at, url)
        self.on_change = on_change  # the handler drops its cached choices
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(probe_timeout_s), trust_env=False, follow_redirects=False
        )

    def eject(self, node_id: str, url: str, reason: str) -> None:
        if node_id in self._since:
            return
        self._since[node_id] = (now_ms(), url)
        self.ejected = frozenset(self._since)
        log.warning("node ejected", node=node_id, url=url, reason=reason)
        self.on_change()

    def since(self, node_id: str) -> int | None:
        entry = self._since.get(node_id)
        return entry[0] if entry else None

    async def run(
        self, is_alive: Callable[[str], bool], url_of: Callable[[str], str | None]
    ) -> None:
        """Probe ejected nodes whose heartbeat is alive, at the address they now register:
        a node restarted on another port must not stay ejected for its old one."""
        while True:
            await asyncio.sleep(self.probe_interval_ms / 1000)
            at = now_ms()
            due = [
                (node_id, url_of(node_id) or url)
                for node_id, (ejected_at, url) in self._since.items()
                if at - ejected_at >= self.eject_ms and is_alive(node_id)
            ]
            if not due:
                continue
            healthy = await asyncio.gather(*(self._probe(url) for _, url in due))
            back = [node_id for (node_id, _), ok in zip(due, healthy, strict=True) if ok]
            for node_id in back:
                self._since.pop(node_id, None)
                log.info("node back in rotation", node=node_id)
            if back:
                self.ejected = frozenset(self._since)
                self.on_change()

    async def _probe(self, url: str) -> bool:
        try:
            response = await self._client.get(url.rstrip("/") + self.health_path)
        except httpx.HTTPError:
            return False
        return response.status_code < 500

    async def close(self) -> None:
        await self._client.aclose()
