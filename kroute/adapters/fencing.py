"""One writer per cluster for the adapters that write a whole cluster (`adapt faust`, `adapt
fixed`): an owner lease in the contract's `leader` key, and fenced writes.

Two such adapters on one cluster (an old deployment not yet stopped, a restarted adapter with
an old file) would each write their own view, so the generation would go backwards and one
generation would name two assignments. So, as kroute's own leader does (`materializer/cluster.py`,
whose Lua scripts this reuses):
- the lease: `leader` holds this process's instance id, set with SET NX PX and renewed (only by
  its holder) every round; a second adapter writes nothing and says in its log who holds it;
- every round's writes run in one MULTI/EXEC under WATCH of `leader` and `assignment`, only if
  `leader` still holds our id, and the assignment itself goes through the leader's Lua write,
  which refuses a generation not greater than the stored one.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import WatchError

from common.contract import (
    Assignment,
    ContractError,
    Event,
    Keys,
    PartitionAssignment,
    as_text,
    decode_assignment,
    encode,
)

# Reused, not copied: the same lease renewal and fenced, generation-checked write as kroute's
# own leader (the module keeps them private; the contract is the same).
from materializer.cluster import RENEW_LEASE, WRITE_IF_LEADER, Written

log = structlog.get_logger("kroute.adapters.fencing")

# Delete the lease only if it is still ours (a clean stop hands over at once).
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

Placements = Mapping[str, Mapping[int, PartitionAssignment]]
QueueWrites = Callable[[Any, int], None]  # (pipeline in MULTI, generation in effect)


class OwnerLease:
    """This adapter's claim to be its cluster's only writer; see the module docstring."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, kind: str, lease_ms: int) -> None:
        self.redis = redis
        self.keys = keys
        self.lease_ms = lease_ms
        self.holder_id = f"{kind}/{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self.held = False
        self._waiting_for: str | None = None
        self.generation = 0  # the last generation this adapter wrote or found in effect

    async def hold(self) -> bool:
        """Renew or acquire the lease; False (and a log line per new holder) while another
        adapter holds it. Renew first: our own lease would refuse our SET NX."""
        me, key = self.holder_id, self.keys.leader
        if await self.redis.eval(RENEW_LEASE, 1, key, me, self.lease_ms):
            return self._now_holding(True)
        if await self.redis.set(key, me, nx=True, px=self.lease_ms):
            return self._now_holding(True)
        holder = await self.redis.get(key)
        other = as_text(holder) if holder is not None else "(lease just lapsed)"
        if other != self._waiting_for:
            self._waiting_for = other
            log.warning(
                "another adapter writes this cluster; waiting for its lease to lapse",
                cluster=self.keys.cluster,
                holder=other,
                me=me,
            )
        return self._now_holding(False)

    def _now_holding(self, held: bool) -> bool:
        if held and not self.held:
            log.info("holding the writer lease", cluster=self.keys.cluster, me=self.holder_id)
            self._waiting_for = None
        elif self.held and not held:
            log.warning("lost the writer lease: writing nothing", cluster=self.keys.cluster)
        self.held = held
        return held

    async def release(self) -> None:
        """A clean stop: let a successor take over now instead of after the lease."""
        await self.redis.eval(_RELEASE, 1, self.keys.leader, self.holder_id)
        self.held = False

    async def write(
        self, placements: Placements, leader: str, at_ms: int, queue: QueueWrites
    ) -> bool:
        """Write `placements` (a new generation only when Redis holds another placement or
        none) and whatever `queue` adds, atomically and only while we hold the lease. False
        when the lease or the assignment changed under us: nothing was written."""
        keys = self.keys
        async with self.redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(keys.leader, keys.assignment)
                holder = await pipe.get(keys.leader)
                if holder is None or as_text(holder) != self.holder_id:
                    await pipe.reset()  # type: ignore[no-untyped-call]
                    self._now_holding(False)
                    return False
                stored = _readable(await pipe.get(keys.assignment))
                generation, new = self._assignment(stored, placements, leader, at_ms)
                pipe.multi()  # type: ignore[no-untyped-call]
                queue(pipe, generation)
                if new is not None:
                    event = encode(Event("assignment", generation=new.generation))
                    pipe.eval(
                        WRITE_IF_LEADER, 3, keys.leader, keys.assignment, keys.events,
                        self.holder_id, encode(new), event, new.generation,
                    )  # fmt: skip
                replies = await pipe.execute()
            except WatchError:
                log.info("lease or assignment changed during the write; next round retries")
                return False
        if new is not None and Written(int(replies[-1])) is not Written.WRITTEN:
            return False  # cannot happen under WATCH; the script is the last line of defence
        if new is not None:
            log.info("assignment written", generation=new.generation)
        self.generation = generation
        return True

    def _assignment(
        self, stored: Assignment | None, placements: Placements, leader: str, at_ms: int
    ) -> tuple[int, Assignment | None]:
        """(generation in effect, assignment to write): nothing to write when Redis already
        holds this placement; else the next generation, past the stored one and past any we
        wrote (a Redis that lost its data never makes a generation repeat)."""
        if stored is not None and _same(stored.stores, placements):
            return stored.generation, None
        generation = max(stored.generation if stored else 0, self.generation) + 1
        return generation, Assignment(generation, leader, at_ms, placements)


def _same(stored: Placements, ours: Placements) -> bool:
    return {s: dict(p) for s, p in stored.items()} == {s: dict(p) for s, p in ours.items()}


def _readable(raw: bytes | str | None) -> Assignment | None:
    if raw is None:
        return None
    try:
        return decode_assignment(raw)
    except ContractError as exc:
        log.warning("stored assignment unreadable; replacing it", error=str(exc))
        return None
