"""Forgetting departed nodes (docs/redis-contract.md, "Departed nodes"), for writers that
describe nodes other than themselves: the adapters that are the only writer of their cluster
(`kroute adapt faust`, `kroute adapt fixed`), the agents of a consumer group (`kroute.agent`,
one agent a round, by lease) and test fixtures.

A node gone for longer than the grace period, and placed nowhere, leaves the contract: its id
out of `nodes` and `dead_since`, its per-node keys deleted, and a `node` event so proxies drop
it at once instead of at their next head read. Without this `nodes`, which every proxy reads
every second, keeps every id that ever registered (Faust workers in pods get a new one each
time they are replaced). A node that comes back is described again by the writer's next round.

The grace period counts from `dead_since` in Redis (the earliest sighting wins: HSETNX), the
same field kroute's leader keeps (`materializer/cluster.py`, which forgets through
`queue_forget` too), so it survives a restarted writer and a change of writer. Everything
here is queued on the caller's pipeline: the adapters run it inside their fenced
transaction, so only the lease holder forgets anything.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from common.contract import Event, Keys, as_text, encode

# kroute's leader's default (`ClusterTiming.grace_ms`): ten minutes, longer than any restart
# or rebalance a node is expected to come back from.
DEFAULT_GRACE_MS = 600_000


def per_node_keys(keys: Keys, node_id: str) -> tuple[str, ...]:
    """Every key that describes one node (its heartbeat included: a forgotten node is dead)."""
    return (
        keys.node(node_id),
        keys.alive(node_id),
        keys.hosting(node_id),
        keys.lag(node_id),
        keys.report(node_id),
        keys.report_at(node_id),
    )


def queue_forget(pipe: Any, keys: Keys, node_ids: Collection[str]) -> None:
    """Queue on `pipe` (a Redis pipeline, sync or asyncio) what forgetting `node_ids` takes:
    out of `nodes` and `dead_since`, keys deleted, and one `node` event each (the event on
    which proxies already re-read a node)."""
    if not node_ids:
        return
    pipe.srem(keys.nodes, *node_ids)
    pipe.hdel(keys.dead_since, *node_ids)
    for node_id in node_ids:
        pipe.delete(*per_node_keys(keys, node_id))
        pipe.publish(keys.events, encode(Event("node", node_id=node_id)))


@dataclass(frozen=True)
class Membership:
    """What Redis says about who was described: `nodes`, and `dead_since` (readable fields in
    `since`, unreadable ones in `unreadable`: they are replaced, as if never seen gone)."""

    registered: frozenset[str]
    since: Mapping[str, int]
    unreadable: frozenset[str] = frozenset()


async def read_membership(redis: aioredis.Redis, keys: Keys) -> Membership:
    """`nodes` and `dead_since` in one round trip."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.smembers(keys.nodes)
        pipe.hgetall(keys.dead_since)
        members, raw_since = await pipe.execute()
    since: dict[str, int] = {}
    unreadable: set[str] = set()
    for raw_node, raw_ms in raw_since.items():
        node_id = _text_id(raw_node)
        if node_id is None:
            continue
        try:
            since[node_id] = int(raw_ms)
        except ValueError:
            unreadable.add(node_id)
    registered = frozenset(n for n in map(_text_id, members) if n is not None)
    return Membership(registered, since, frozenset(unreadable))


def _text_id(raw: bytes | str) -> str | None:
    """A node id as text, or None for one that is not UTF-8 (no kroute writer registers one;
    skipped, so one such id does not stop every other from being forgotten)."""
    try:
        return as_text(raw)
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True)
class Departures:
    """One round's bookkeeping: who starts a grace period, who came back, who is forgotten."""

    newly_gone: tuple[str, ...] = ()  # `dead_since` set now
    back: tuple[str, ...] = ()  # `dead_since` field removed
    departed: tuple[str, ...] = ()  # forgotten
    rewritten: tuple[str, ...] = ()  # unreadable `dead_since` replaced by now

    def queue(self, pipe: Any, keys: Keys, now_ms: int) -> None:
        for node_id in self.newly_gone:
            pipe.hsetnx(keys.dead_since, node_id, now_ms)  # the earliest sighting wins
        for node_id in self.rewritten:
            pipe.hset(keys.dead_since, node_id, now_ms)
        if self.back:
            pipe.hdel(keys.dead_since, *self.back)
        queue_forget(pipe, keys, self.departed)


def departures(
    membership: Membership,
    *,
    absent: Collection[str],
    present: Collection[str],
    placed: Collection[str],
    now_ms: int,
    grace_ms: int,
) -> Departures:
    """What a writer that knows its whole membership does this round.

    `absent`: ids it describes as gone this round (a failed probe, or registered but no longer
    among the nodes it describes); `present`: ids it describes as there (their grace period
    ends); `placed`: ids the assignment names (never forgotten, as the leader's rule says: their
    partitions have not moved yet). An absent node is forgotten once `dead_since` is at least
    `grace_ms` old."""
    present_ids = set(present)
    gone = set(absent) - present_ids
    since, unreadable = membership.since, membership.unreadable
    return Departures(
        newly_gone=tuple(sorted(n for n in gone if n not in since and n not in unreadable)),
        back=tuple(sorted(n for n in present_ids if n in since or n in unreadable)),
        departed=tuple(
            sorted(n for n in gone - set(placed) if n in since and now_ms - since[n] >= grace_ms)
        ),
        rewritten=tuple(sorted(gone & unreadable)),
    )
