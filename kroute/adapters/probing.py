"""HTTP probes an adapter can afford to send to backends it does not control.

httpx's timeouts apply to each read, so a backend that trickles a byte at a time never times
out, and a backend that answers 300 MB is read whole. Every probe here has one total deadline
and a body cap; going over either is a failed probe, like a refused connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

MAX_BODY_BYTES = 1_000_000  # a router map or a health answer is a few kB


class ProbeFailed(Exception):
    """The probe got no usable answer; the message says why (for logs)."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes


def redis_url_error(url: str) -> str | None:
    """Why a Redis URL is unusable (checked before connecting, for a one-line usage error)."""
    from redis.asyncio.connection import parse_url  # noqa: PLC0415 - only to validate

    try:
        parse_url(url)
    except ValueError as exc:
        return f"--redis {url!r}: {exc}"
    return None


async def get(
    client: httpx.AsyncClient,
    url: str,
    *,
    deadline_s: float,
    read_body: bool = True,
    max_bytes: int = MAX_BODY_BYTES,
) -> Answer:
    """GET url within `deadline_s` in total, reading at most `max_bytes` of body (none
    without `read_body`: a health probe needs only the status)."""
    try:
        return await asyncio.wait_for(_get(client, url, read_body, max_bytes), deadline_s)
    except TimeoutError:
        raise ProbeFailed(f"no complete answer within {deadline_s * 1000:.0f} ms") from None
    except httpx.HTTPError as exc:
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        raise ProbeFailed(detail) from exc


async def _get(client: httpx.AsyncClient, url: str, read_body: bool, max_bytes: int) -> Answer:
    async with client.stream("GET", url) as response:
        if not read_body:
            return Answer(response.status_code, b"")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise ProbeFailed(f"answer of {declared} bytes, more than {max_bytes}")
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise ProbeFailed(f"answer longer than {max_bytes} bytes")
        return Answer(response.status_code, bytes(body))
