"""Review of fe7fc40 (agents forget departed instances, `Agent.forget_departed`): the
invariants of the brief attacked against a real redis-server, with real agents (no Kafka: the
agent writes Redis from `held`; nothing here reads a log).

1. never forgotten while alive, while named in the assignment, or before `forget_after_ms` of
   absence as `dead_since` records it;
3. hostile Redis contents (malformed `dead_since`, a `tidy` key of another type, malformed
   assignments, odd ids, thousands of ids, `nodes` of the wrong type);
4. Redis errors mid-round;
5. many agents at once, and two rounds racing after a lease expiry.

(Invariant 2, a wrong call heals and a proxy routes again: test_review_agent_forget_heal.py.)

Where a round has to be interleaved with other writers "between its reads and its MULTI", the
module's `departures` (pure, called exactly there) is wrapped: what the wrapper does runs on
other connections, as another process would."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

import kroute.agent as agent_module
from common.contract import (
    Assignment,
    Hosting,
    Keys,
    NodeInfo,
    PartitionAssignment,
    StoreInfo,
    as_text,
    encode,
)
from common.departed import departures
from kroute.agent import Agent, AgentTiming
from kroute.contract_check import check
from kroute.embedded import RedisHandle

pytestmark = pytest.mark.integration

STORE = StoreInfo("customers", "customers", 4)
TIDY_MS = 200
FORGET_MS = 400
LONG_AGO_MS = 100 * FORGET_MS  # a `dead_since` far past the grace period


# -- helpers -------------------------------------------------------------------------------


def make_agent(
    url: str,
    keys: Keys,
    node_id: str,
    *,
    alive_ttl_ms: int = 2000,
    tidy_ms: int = TIDY_MS,
    forget_after_ms: int = FORGET_MS,
    redis_client: aioredis.Redis | None = None,
) -> Agent:
    made = Agent(
        redis=redis_client or aioredis.Redis.from_url(url),
        keys=keys,
        node=NodeInfo(node_id, "http://127.0.0.1:1", 0),
        store=STORE,
        bootstrap_servers="127.0.0.1:1",  # not used: nothing here reads Kafka
        timing=AgentTiming(
            alive_ttl_ms=alive_ttl_ms, tidy_ms=tidy_ms, forget_after_ms=forget_after_ms
        ),
    )
    _OPEN.append((asyncio.get_running_loop(), made))
    return made


_OPEN: list[tuple[asyncio.AbstractEventLoop, Agent]] = []


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    """`asyncio.run(scenario())`, closing every agent made on its loop however it ends (a
    failed assertion must not leave connections to the garbage collector)."""

    async def closing() -> Any:
        try:
            return await scenario()
        finally:
            loop = asyncio.get_running_loop()
            for owner, agent in list(_OPEN):
                if owner is loop:
                    await agent.redis.aclose()
            _OPEN[:] = [(o, a) for o, a in _OPEN if o is not loop and not o.is_closed()]

    return asyncio.run(closing())


@pytest.fixture
def client(redis_server: RedisHandle) -> Iterator[redis.Redis]:
    made = redis.Redis.from_url(redis_server.url)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"review-forget-{uuid.uuid4().hex[:8]}")


def redis_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def registered(client: redis.Redis, keys: Keys) -> set[str]:
    return {as_text(n) for n in client.smembers(keys.nodes)}


def dead_since(client: redis.Redis, keys: Keys) -> dict[str, bytes]:
    raw: dict[bytes, bytes] = client.hgetall(keys.dead_since)  # type: ignore[assignment]
    return {as_text(k): v for k, v in raw.items()}


def described_dead(
    client: redis.Redis, keys: Keys, node_id: str, *, since_ms: int | None = None
) -> None:
    """An instance that registered and whose heartbeat has lapsed (no `alive:<id>`), with a
    `dead_since` field `since_ms` when given (a sighting made by an earlier round)."""
    client.sadd(keys.nodes, node_id)
    client.set(keys.node(node_id), encode(NodeInfo(node_id, "http://127.0.0.1:1", 1)))
    client.set(keys.hosting(node_id), encode(Hosting(node_id, 0, {}, 1)))
    client.delete(keys.alive(node_id))
    if since_ms is not None:
        client.hset(keys.dead_since, node_id, since_ms)


def forgotten(client: redis.Redis, keys: Keys, node_id: str) -> bool:
    return not client.sismember(keys.nodes, node_id)


def in_thread(make: Callable[[], Awaitable[Any]]) -> Any:
    """Run a coroutine to the end on a loop of its own in another thread (another process,
    as far as Redis can tell), from inside a synchronous hook of the agent under test."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(run(make))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the interleaved writer hung"
    if errors:
        raise errors[0]
    return result[0] if result else None


def between_reads_and_write(
    monkeypatch: pytest.MonkeyPatch, action: Callable[[], None]
) -> list[int]:
    """Run `action` once, in the first round that gets this far, after the round has read
    `nodes`, `dead_since`, the alive flags and the assignment and before its MULTI."""
    fired: list[int] = []
    real = departures

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(1)
            action()
        return real(*args, **kwargs)

    monkeypatch.setattr(agent_module, "departures", wrapped)
    return fired


async def holding_everything(agent: Agent) -> None:
    """`agent` alive and the active of every partition (an assignment exists, as the contract
    check wants)."""
    await agent.heartbeat()
    agent.held = frozenset(range(STORE.partitions))
    await agent._publish_holding()


async def round_or_error(agent: Agent) -> bool | BaseException:
    """One call as `Agent._every` makes it: an exception is logged there and the loop goes
    on, so it is a result here too."""
    try:
        return await agent.forget_departed()
    except Exception as exc:  # noqa: BLE001
        return exc


async def stop(*tasks: asyncio.Task[None]) -> None:
    """Cancel until done: on Python 3.11 a cancel can be swallowed by a Redis call (see
    test_one_cancel_stops_the_tidy_loop), and `Agent._every` then goes on."""
    while not all(task.done() for task in tasks):
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=0.2)


def assignment_naming(**placements: tuple[str | None, tuple[str, ...]]) -> bytes:
    """An assignment of STORE: partition "p<n>" -> (active, standbys)."""
    return encode(
        Assignment(
            7,
            "someone",
            1,
            {
                STORE.name: {
                    int(name[1:]): PartitionAssignment(active, standbys)
                    for name, (active, standbys) in placements.items()
                }
            },
        )
    )


# -- 1. never too early, never the live, never the placed -----------------------------------


def test_a_dead_instance_is_never_forgotten_before_the_grace_period_from_its_first_sighting(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys
) -> None:
    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier", tidy_ms=40)
        await tidier.heartbeat()
        described_dead(client, keys, "gone")
        first_sighting: int | None = None
        forgotten_at: int | None = None
        deadline = time.monotonic() + (FORGET_MS + 2000) / 1000
        while time.monotonic() < deadline:
            await tidier.heartbeat()
            await tidier.forget_departed()
            if forgotten(client, keys, "gone"):
                forgotten_at = redis_ms(client)
                break
            if first_sighting is None:
                first_sighting = int(dead_since(client, keys)["gone"])
            await asyncio.sleep(0.045)
        assert first_sighting is not None, "forgotten in the round that first saw it dead"
        assert forgotten_at is not None, "never forgotten"
        assert forgotten_at - first_sighting >= FORGET_MS, (
            f"forgotten {forgotten_at - first_sighting} ms after it was first seen dead"
        )
        assert registered(client, keys) == {"tidier"}
        await tidier.redis.aclose()

    run(scenario)


def test_an_instance_seen_alive_again_starts_a_new_grace_period_when_it_dies_again(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys
) -> None:
    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier", tidy_ms=40)
        flapping = make_agent(redis_server.url, keys, "flap", alive_ttl_ms=150)
        await tidier.heartbeat()
        await flapping.heartbeat()
        await asyncio.sleep(0.2)  # dead
        assert await tidier.forget_departed()
        assert "flap" in dead_since(client, keys)
        await asyncio.sleep(FORGET_MS * 0.8 / 1000)
        await flapping.heartbeat()  # back for a moment, and a round sees it
        client.delete(keys.tidy)
        assert await tidier.forget_departed()
        assert "flap" not in dead_since(client, keys), "seen alive: its grace period ends"
        await asyncio.sleep(0.2)  # dead again
        second: int | None = None
        deadline = time.monotonic() + (FORGET_MS + 2000) / 1000
        while time.monotonic() < deadline:
            await tidier.heartbeat()
            await tidier.forget_departed()
            if forgotten(client, keys, "flap"):
                break
            second = second or int(dead_since(client, keys)["flap"])
            await asyncio.sleep(0.045)
        assert second is not None
        assert forgotten(client, keys, "flap"), "never forgotten"
        assert redis_ms(client) - second >= FORGET_MS, "forgotten on its first grace period"
        for agent in (tidier, flapping):
            await agent.redis.aclose()

    run(scenario)


@pytest.mark.parametrize(
    "assignment",
    [
        pytest.param(assignment_naming(p0=("gone", ())), id="active"),
        pytest.param(assignment_naming(p0=("tidier", ("gone",))), id="standby"),
        pytest.param(assignment_naming(p0=(None, ("x", "gone"))), id="standby-of-an-empty-entry"),
        pytest.param(
            encode(
                Assignment(
                    3,
                    "x",
                    1,
                    {
                        "another-store": {9: PartitionAssignment(None, ("gone",))},
                        STORE.name: {0: PartitionAssignment("tidier", ())},
                    },
                )
            ),
            id="standby-in-another-store",
        ),
    ],
)
def test_an_instance_the_assignment_names_is_never_forgotten(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys, assignment: bytes
) -> None:
    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        await tidier.heartbeat()
        described_dead(client, keys, "gone", since_ms=redis_ms(client) - LONG_AGO_MS)
        client.set(keys.assignment, assignment)
        assert await tidier.forget_departed()
        assert registered(client, keys) == {"tidier", "gone"}
        assert client.exists(keys.node("gone"), keys.hosting("gone")) == 2
        # Placed nowhere any more: the next round forgets it.
        client.set(keys.assignment, assignment_naming(p0=("tidier", ())))
        client.delete(keys.tidy)
        assert await tidier.forget_departed()
        assert registered(client, keys) == {"tidier"}
        await tidier.redis.aclose()

    run(scenario)


def test_a_live_instance_with_an_old_dead_since_field_loses_it_and_stays(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys
) -> None:
    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        live = make_agent(redis_server.url, keys, "live")
        for agent in (tidier, live):
            await agent.heartbeat()
        client.hset(keys.dead_since, "live", redis_ms(client) - LONG_AGO_MS)
        assert await tidier.forget_departed()
        assert registered(client, keys) == {"tidier", "live"}
        assert dead_since(client, keys) == {}
        for agent in (tidier, live):
            await agent.redis.aclose()

    run(scenario)


# -- 1 and 5: rounds interleaved with other writers ----------------------------------------


def test_an_instance_that_heartbeats_between_the_rounds_reads_and_its_write_is_not_forgotten(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused instance (dead past the grace period, placed nowhere) resumes while a round is
    between its reads and its MULTI: when the MULTI runs its `alive:<id>` is present."""

    async def resume() -> None:
        away = make_agent(redis_server.url, keys, "away")
        await away.heartbeat()
        await away.redis.aclose()

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        await tidier.heartbeat()
        described_dead(client, keys, "away", since_ms=redis_ms(client) - LONG_AGO_MS)
        fired = between_reads_and_write(monkeypatch, lambda: in_thread(resume))
        assert await tidier.forget_departed()
        assert fired
        assert client.exists(keys.alive("away")), "a live instance's heartbeat was deleted"
        assert client.sismember(keys.nodes, "away"), "a live instance was forgotten"
        await tidier.redis.aclose()

    run(scenario)


def test_an_instance_placed_between_the_rounds_reads_and_its_write_is_not_forgotten(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paused instance resumes and the group gives it partition 0 (its agent merges it
    into the assignment and writes its hosting) while the round is between reads and MULTI."""

    async def resume_and_take() -> None:
        away = make_agent(redis_server.url, keys, "away")
        await away.heartbeat()
        await away.assigned([0])
        await away.redis.aclose()

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        await tidier.heartbeat()
        described_dead(client, keys, "away", since_ms=redis_ms(client) - LONG_AGO_MS)
        between_reads_and_write(monkeypatch, lambda: in_thread(resume_and_take))
        assert await tidier.forget_departed()
        raw = client.get(keys.assignment)
        assert raw is not None
        assert json.loads(raw)["stores"][STORE.name]["0"]["active"] == "away"
        assert client.sismember(keys.nodes, "away"), (
            "an instance the assignment names was forgotten"
        )
        assert client.exists(keys.hosting("away")), "its hosting was deleted"
        await tidier.redis.aclose()

    run(scenario)


def test_two_rounds_racing_after_a_lease_expiry_do_not_forget_a_live_instance(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round A reads (away dead long ago), then stalls past its lease; away comes back; agent
    B takes the next lease and its round sees away alive (its `dead_since` goes); then A's
    write lands."""

    async def meanwhile() -> bool:
        for _ in range(500):  # A stalls until its lease has expired (at most 5 s)
            if not client.exists(keys.tidy):
                break
            await asyncio.sleep(0.01)
        away = make_agent(redis_server.url, keys, "away")
        other = make_agent(redis_server.url, keys, "b")
        await away.heartbeat()
        await other.heartbeat()
        took = await other.forget_departed()
        for agent in (away, other):
            await agent.redis.aclose()
        return took

    outcome: list[bool] = []

    async def scenario() -> None:
        first = make_agent(redis_server.url, keys, "a")
        await first.heartbeat()
        described_dead(client, keys, "away", since_ms=redis_ms(client) - LONG_AGO_MS)
        between_reads_and_write(monkeypatch, lambda: outcome.append(in_thread(meanwhile)))
        assert await first.forget_departed()
        assert outcome == [True], "B did not get the lease after A's expired"
        assert client.exists(keys.alive("away")), "the live instance's heartbeat was deleted"
        assert registered(client, keys) == {"a", "b", "away"}, "a live instance was forgotten"
        await first.redis.aclose()

    run(scenario)


def test_many_agents_at_once_make_exactly_one_round_per_lease(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys
) -> None:
    async def scenario() -> None:
        agents = [make_agent(redis_server.url, keys, f"n{i}") for i in range(24)]
        for agent in agents:
            await agent.heartbeat()
        described_dead(client, keys, "gone", since_ms=redis_ms(client) - LONG_AGO_MS)
        rounds = []
        for _ in range(3):
            took = await asyncio.gather(*(a.forget_departed() for a in agents))
            assert sum(took) == 1, f"{sum(took)} rounds under one lease"
            holder = agents[took.index(True)].node.node_id
            assert as_text(client.get(keys.tidy) or b"") == holder
            assert 0 < client.pttl(keys.tidy) <= TIDY_MS
            # Everyone again before the lease ends: nobody else.
            assert not any(await asyncio.gather(*(a.forget_departed() for a in agents)))
            rounds.append(holder)
            await asyncio.sleep((TIDY_MS + 30) / 1000)
        assert forgotten(client, keys, "gone")
        assert registered(client, keys) == {a.node.node_id for a in agents}
        for agent in agents:
            await agent.redis.aclose()

    run(scenario)


# -- 3. hostile contents ---------------------------------------------------------------------


def test_malformed_dead_since_fields_restart_the_grace_period_and_never_forget_at_once(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys
) -> None:
    bad = {
        "word": b"abc",
        "empty": b"",
        "fraction": b"1.5",
        "exponent": b"1e3",
        "hex": b"0x10",
        "binary": b"\xff\xfe",
        "digits": b"9" * 5000,  # past Python's int-from-string limit
        "json": b'{"ms": 1}',
    }

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        live = make_agent(redis_server.url, keys, "live")
        await holding_everything(tidier)
        await live.heartbeat()
        client.hset(keys.dead_since, "live", b"garbage")
        for node_id, raw in bad.items():
            described_dead(client, keys, node_id)
            client.hset(keys.dead_since, node_id, raw)
        before = redis_ms(client)
        assert await tidier.forget_departed()
        assert registered(client, keys) == {"tidier", "live", *bad}, "forgotten at once"
        since = dead_since(client, keys)
        assert set(since) == set(bad), "a live instance keeps a dead_since field"
        for node_id in bad:
            assert before - 1000 <= int(since[node_id]) <= redis_ms(client) + 1000, node_id
        await asyncio.sleep((FORGET_MS + TIDY_MS + 50) / 1000)
        await tidier.heartbeat()
        await live.heartbeat()
        assert await tidier.forget_departed()
        assert registered(client, keys) == {"tidier", "live"}
        assert dead_since(client, keys) == {}
        report = check(client, keys.cluster)
        assert not report.errors, report.as_text()
        for agent in (tidier, live):
            await agent.redis.aclose()

    run(scenario)


@pytest.mark.parametrize("kind", ["hash", "list", "set", "zset"])
def test_a_tidy_key_of_another_type_neither_crashes_nor_forgets(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys, kind: str
) -> None:
    writers: dict[str, Callable[[], object]] = {
        "hash": lambda: client.hset(keys.tidy, "a", "b"),
        "list": lambda: client.rpush(keys.tidy, "a"),
        "set": lambda: client.sadd(keys.tidy, "a"),
        "zset": lambda: client.zadd(keys.tidy, {"a": 1}),
    }

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        await tidier.heartbeat()
        described_dead(client, keys, "gone", since_ms=redis_ms(client) - LONG_AGO_MS)
        writers[kind]()
        assert await round_or_error(tidier) is False
        assert registered(client, keys) == {"tidier", "gone"}
        report = check(client, keys.cluster)
        assert any(keys.tidy in line for line in report.as_text().splitlines()), (
            "the contract check does not point at the tidy key"
        )
        await tidier.redis.aclose()

    run(scenario)


def _assignment_body(stores: object) -> bytes:
    return json.dumps(
        {"v": 1, "generation": 5, "leader": "x", "computed_at_ms": 1, "stores": stores}
    ).encode()


@pytest.mark.parametrize(
    ("node_id", "raw"),
    [
        pytest.param("gone", b"{not json", id="not-json"),
        pytest.param("gone", b"[]", id="not-an-object"),
        pytest.param("gone", b"", id="empty"),
        pytest.param("gone", b"\xff\xfe", id="binary"),
        pytest.param("gone", b"[" * 100_000, id="deeply-nested"),
        pytest.param(
            "gone",
            json.dumps(
                {"v": 2, "generation": 5, "leader": "x", "computed_at_ms": 1, "stores": {}}
            ).encode(),
            id="newer-schema",
        ),
        pytest.param("gone", _assignment_body([]), id="stores-a-list"),
        pytest.param(
            "gone", _assignment_body({"customers": {"x": {"active": "gone"}}}), id="bad-partition"
        ),
        pytest.param(
            "gone",
            _assignment_body({"customers": {"0": {"active": "gone"}}}),
            id="standbys-missing",
        ),
        pytest.param(
            "gone",
            _assignment_body({"customers": {"0": {"active": {"id": "gone"}, "standbys": []}}}),
            id="active-an-object",
        ),
        pytest.param(
            "gone",
            _assignment_body({"customers": {"0": {"active": ["gone"], "standbys": []}}}),
            id="active-a-list",
        ),
        pytest.param(
            "gone",
            _assignment_body({"customers": {"0": {"active": None, "standbys": "gone"}}}),
            id="standbys-a-string",
        ),
        pytest.param(
            "7",
            _assignment_body({"customers": {"0": {"active": 7, "standbys": []}}}),
            id="active-a-number",
        ),
        pytest.param(
            "7",
            _assignment_body({"customers": {"0": {"active": None, "standbys": [7]}}}),
            id="standby-a-number",
        ),
    ],
)
def test_a_malformed_assignment_that_names_an_instance_does_not_get_it_forgotten(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys, node_id: str, raw: bytes
) -> None:
    """An assignment that does not follow the contract places nobody that can be known: the
    agent's rule is to forget nobody then. Each of these names the dead instance somewhere."""

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        await tidier.heartbeat()
        described_dead(client, keys, node_id, since_ms=redis_ms(client) - LONG_AGO_MS)
        client.set(keys.assignment, raw)
        outcome = await round_or_error(tidier)
        assert outcome is True or isinstance(outcome, Exception), outcome
        assert registered(client, keys) == {"tidier", node_id}, (
            f"forgotten under a malformed assignment {raw[:80]!r}"
        )
        assert client.exists(keys.node(node_id), keys.hosting(node_id)) == 2
        await tidier.redis.aclose()

    run(scenario)


ODD_IDS = [
    "a b",
    "x:y",
    "alive:z",
    "{tag}",
    "*",
    "?[a]",
    "ü-ñ",
    "🙂",
    "line\nbreak",
    "",
    "-",
    "a" * 500,
    'quote"d',
    "back\\slash",
]


def test_ids_with_odd_characters_are_forgotten_or_kept_exactly(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys
) -> None:
    """Every other odd id live, the rest dead long ago and placed nowhere: the dead ones go
    with all their keys, the live ones keep all theirs."""
    live_ids, dead_ids = ODD_IDS[::2], ODD_IDS[1::2]

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        await tidier.heartbeat()
        lives = [make_agent(redis_server.url, keys, n) for n in live_ids]
        for live in lives:
            await live.heartbeat()
            live.held = frozenset()
            await live._publish_holding()
        for node_id in dead_ids:
            described_dead(client, keys, node_id, since_ms=redis_ms(client) - LONG_AGO_MS)
        assert await tidier.forget_departed()
        assert registered(client, keys) == {"tidier", *live_ids}
        for node_id in live_ids:
            assert (
                client.exists(keys.node(node_id), keys.alive(node_id), keys.hosting(node_id)) == 3
            ), node_id
        for node_id in dead_ids:
            assert client.exists(keys.node(node_id), keys.hosting(node_id)) == 0, node_id
        assert dead_since(client, keys) == {}
        for agent in (tidier, *lives):
            await agent.redis.aclose()

    run(scenario)


@pytest.mark.parametrize("where", ["nodes", "dead_since"])
def test_an_id_that_is_not_utf8_does_not_stop_the_group_forgetting(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys, where: str
) -> None:
    """One id that is not UTF-8 (another writer's, or garbage) next to an ordinary departed
    instance: the ordinary one is still forgotten, by this round or a later one."""

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier", tidy_ms=30)
        await tidier.heartbeat()
        described_dead(client, keys, "gone", since_ms=redis_ms(client) - LONG_AGO_MS)
        if where == "nodes":
            client.sadd(keys.nodes, b"\xff\xfe")
        else:
            client.hset(keys.dead_since, b"\xff\xfe", redis_ms(client))
        outcomes = []
        for _ in range(5):
            outcomes.append(await round_or_error(tidier))
            if forgotten(client, keys, "gone"):
                break
            await asyncio.sleep(0.04)
        assert forgotten(client, keys, "gone"), f"never forgotten; the rounds gave {outcomes}"
        await tidier.redis.aclose()

    run(scenario)


def test_thousands_of_ids_in_one_round(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys
) -> None:
    count = 3000

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        live = make_agent(redis_server.url, keys, "live")
        for agent in (tidier, live):
            await agent.heartbeat()
        long_ago = redis_ms(client) - LONG_AGO_MS
        with client.pipeline(transaction=False) as pipe:
            for i in range(count):
                node_id = f"pod-{i}"
                pipe.sadd(keys.nodes, node_id)
                pipe.set(keys.node(node_id), encode(NodeInfo(node_id, "http://127.0.0.1:1", 1)))
                if i % 2 == 0:
                    pipe.hset(keys.dead_since, node_id, long_ago)  # the others: never seen
            pipe.execute()
        client.set(keys.assignment, assignment_naming(p0=("pod-0", ("pod-1",))))
        started = time.monotonic()
        assert await tidier.forget_departed()
        took_s = time.monotonic() - started
        assert took_s < 5, f"one round took {took_s:.1f} s"
        left = registered(client, keys)
        expected = {"tidier", "live", "pod-0", "pod-1"} | {
            f"pod-{i}" for i in range(count) if i % 2 == 1
        }
        assert left == expected
        since = dead_since(client, keys)
        assert set(since) == {f"pod-{i}" for i in range(count) if i % 2 == 1} | {"pod-0"}
        for agent in (tidier, live):
            await agent.redis.aclose()

    run(scenario)


@pytest.mark.parametrize("key", ["nodes", "dead_since", "assignment"])
def test_a_contract_key_of_the_wrong_type_forgets_nobody(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys, key: str
) -> None:
    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier")
        await tidier.heartbeat()
        long_ago = redis_ms(client) - LONG_AGO_MS
        described_dead(client, keys, "gone", since_ms=long_ago)
        name = getattr(keys, key)
        if key == "nodes":
            client.delete(name)
            client.set(name, b"gone")
        elif key == "dead_since":
            client.delete(name)
            client.rpush(name, b"gone")
        else:
            client.hset(name, "gone", "x")
        outcome = await round_or_error(tidier)
        assert isinstance(outcome, redis.RedisError | aioredis.RedisError), outcome
        assert client.exists(keys.node("gone"), keys.hosting("gone")) == 2, "its keys went"
        if key != "dead_since":
            assert dead_since(client, keys) == {"gone": str(long_ago).encode()}
        await tidier.redis.aclose()

    run(scenario)


# -- 4. Redis errors mid-round ---------------------------------------------------------------


def _kill_connections_named(client: redis.Redis, name: str) -> int:
    killed = 0
    for entry in client.client_list():
        if entry.get("name") == name:
            client.client_kill_filter(_id=entry["id"])
            killed += 1
    return killed


@pytest.mark.parametrize("retrying", [True, False], ids=["client-retries", "no-retry"])
def test_a_connection_dropped_between_the_reads_and_the_multi_leaves_a_whole_round_or_none(
    redis_server: RedisHandle,
    client: redis.Redis,
    keys: Keys,
    monkeypatch: pytest.MonkeyPatch,
    retrying: bool,
) -> None:
    name = f"tidier-{uuid.uuid4().hex[:6]}"

    async def scenario() -> None:
        options: dict[str, Any] = {"client_name": name, "socket_timeout": 2.0}  # as connect
        if not retrying:
            options["retry"] = Retry(NoBackoff(), 0)
            options["retry_on_error"] = []
        tidier = make_agent(
            redis_server.url,
            keys,
            "tidier",
            redis_client=aioredis.Redis.from_url(redis_server.url, **options),
        )
        await holding_everything(tidier)
        long_ago = redis_ms(client) - LONG_AGO_MS
        described_dead(client, keys, "gone", since_ms=long_ago)
        described_dead(client, keys, "new")  # first sighting this round
        killed: list[int] = []
        between_reads_and_write(
            monkeypatch, lambda: killed.append(_kill_connections_named(client, name))
        )
        outcome = await asyncio.wait_for(round_or_error(tidier), 20)
        assert killed
        assert killed[0] >= 1
        since = dead_since(client, keys)
        if outcome is True:  # the MULTI went through on a new connection: all of it
            assert registered(client, keys) == {"tidier", "new"}
            assert set(since) == {"new"}
            assert client.exists(keys.node("gone"), keys.hosting("gone")) == 0
        else:  # none of it
            assert isinstance(outcome, redis.RedisError | aioredis.RedisError | OSError), outcome
            assert registered(client, keys) == {"tidier", "gone", "new"}
            assert since == {"gone": str(long_ago).encode()}
            assert client.exists(keys.node("gone"), keys.hosting("gone")) == 2
        report = check(client, keys.cluster)
        assert not report.errors, report.as_text()

        # The loop goes on: its next round, once the lease has expired, completes.
        monkeypatch.undo()
        loop = asyncio.create_task(tidier._every(TIDY_MS, tidier.forget_departed))
        heart = asyncio.create_task(tidier._every(100, tidier.heartbeat))
        try:
            for _ in range((FORGET_MS + 4 * TIDY_MS + 2000) // 50):
                if registered(client, keys) == {"tidier"}:
                    break
                await asyncio.sleep(0.05)
        finally:
            await stop(loop, heart)
        assert registered(client, keys) == {"tidier"}, "the loop made no later round"
        await tidier.redis.aclose()

    run(scenario)


def test_the_loop_goes_on_through_rounds_that_fail_and_forgets_once_redis_is_sane(
    redis_server: RedisHandle, client: redis.Redis, keys: Keys
) -> None:
    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier", tidy_ms=50)
        await tidier.heartbeat()
        described_dead(client, keys, "gone", since_ms=redis_ms(client) - LONG_AGO_MS)
        members = client.smembers(keys.nodes)
        client.delete(keys.nodes)
        client.set(keys.nodes, b"not a set")  # every round fails on SMEMBERS
        loop = asyncio.create_task(tidier._every(50, tidier.forget_departed))
        try:
            await asyncio.sleep(0.4)
            assert not loop.done(), "the loop ended"
            assert client.exists(keys.node("gone")), "forgotten while nodes was unreadable"
            client.delete(keys.nodes)
            client.sadd(keys.nodes, *members)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and not forgotten(client, keys, "gone"):
                await tidier.heartbeat()
                await asyncio.sleep(0.05)
        finally:
            await stop(loop)
        assert forgotten(client, keys, "gone"), "the loop stopped forgetting"
        assert registered(client, keys) == {"tidier"}
        await tidier.redis.aclose()

    run(scenario)


def test_one_cancel_stops_the_tidy_loop(redis_server: RedisHandle, keys: Keys) -> None:
    """`Agent.running` stops its loops (the tidy loop among them) with one `cancel()` each and
    then awaits them. On Python 3.11 `asyncio.wait_for` (which redis-py awaits in its calls)
    returns normally when the cancel lands as its inner future completes, so `forget_departed`
    returns as if not cancelled and `Agent._every` sleeps and loops on: that agent's
    `running()` never exits. A hundred cancels at random moments of a round."""
    chance = random.Random(7)

    async def scenario() -> None:
        tidier = make_agent(redis_server.url, keys, "tidier", tidy_ms=1)
        await tidier.heartbeat()
        ignored = 0
        for _ in range(100):
            loop = asyncio.create_task(tidier._every(1, tidier.forget_departed))
            await asyncio.sleep(chance.uniform(0, 0.003))
            loop.cancel()
            done, _ = await asyncio.wait({loop}, timeout=0.3)
            if not done:
                ignored += 1
                await stop(loop)
        assert ignored == 0, f"{ignored} of 100 cancels left the tidy loop running"

    run(scenario)
