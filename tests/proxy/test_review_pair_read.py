"""Review of the sweep's paired read (`_read_report_chunk`, commits 1f44836 and a928828): a
body whose version the first `report_at:<id>` MGET named is read with its stamp again, in one
MGET, and applied as of the stamp read with it. Attacked here with writes made between the
sweep's two reads (a hook on the watcher's `mget`, deterministic): a body is only ever applied
as of a stamp naming its version, a refused body is not read again until the stamp names
another version, and nothing a stamp or a body does between the reads raises out of the step
or keeps a node from being applied once Redis is consistent again."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from common.contract import ContractError, Keys, decode_report_at
from proxy import watcher as watcher_module
from proxy.watcher import THREAD_DECODE_BYTES, TableWatcher
from tests.proxy.test_watcher_compact import (
    EXPIRE_MS,
    NODES,
    BodyReads,
    bodies_known,
    compact_cluster,
    lag_of,
    reported_at,
    until,
    version_of,
    watch,
    whole_reads,
    write_node,
)

pytestmark = pytest.mark.integration

NODE = "n0"


@pytest.fixture
def client(redis_server) -> redis.Redis:  # type: ignore[no-untyped-def]
    connection = redis.Redis.from_url(redis_server.url)
    yield connection  # type: ignore[misc]
    connection.close()


@pytest.fixture
def rare_node_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No node read by the watcher's own round: what the sweep brings is the body alone."""
    monkeypatch.setattr(watcher_module, "NODE_READ_S", 3600.0)


def now_ms() -> int:
    return int(time.time() * 1000)


def _stamp(raw: Any) -> tuple[int, int] | None:
    if raw is None:
        return None
    try:
        return decode_report_at(raw)
    except ContractError:
        return None


def applied(watcher: TableWatcher, node_id: str = NODE) -> tuple[int, int] | None:
    """(version, at_ms) of the body the table last got from the node's compact report."""
    last = watcher._applied.get(node_id)
    return None if last is None else (last.body.version, last.at_ms)


def pair_in_redis(client: redis.Redis, keys: Keys, node_id: str = NODE) -> tuple[int, int]:
    stamp = _stamp(client.get(keys.report_at(node_id)))
    assert stamp is not None
    return stamp


def body_of(client: redis.Redis, keys: Keys, node_id: str = NODE) -> dict[str, Any]:
    body = json.loads(client.get(keys.report(node_id)) or b"{}")
    assert isinstance(body, dict)
    return body


class Between:
    """A hook on the watcher's MGETs. When the sweep's first MGET (`report_at:<id>` alone)
    shows the node naming a version the watcher neither holds nor refused (so the sweep reads
    that node's pair next), the next queued action runs: between the sweep's two reads. At
    the first stamps-only MGET naming the node after each action, what the table then held
    of the node (`applied`) is recorded in `after`: what the sweep that raced did."""

    def __init__(self, watcher: TableWatcher, keys: Keys, node_id: str = NODE) -> None:
        self.acts: list[Callable[[], Any]] = []
        self.raced: list[Any] = []  # what each action returned
        self.after: list[tuple[int, int] | None] = []
        self.refused_after: list[int | None] = []  # the version refused, at the same moments
        self.pair_reads = 0  # MGETs that read the node's body
        self.stamp_reads = 0  # stamps-only MGETs naming the node
        mget = watcher.redis.mget
        stamp_key, body_key = keys.report_at(node_id), keys.report(node_id)
        stamp_prefix = keys.report_at("")

        async def hooked(names, *args):  # type: ignore[no-untyped-def]
            stamps_only = all(n.startswith(stamp_prefix) for n in names)
            if stamps_only and stamp_key in names:
                self.stamp_reads += 1
                if len(self.after) < len(self.raced):
                    self.after.append(applied(watcher, node_id))
                    self.refused_after.append(watcher._refused.get(node_id))
            replies = await mget(names, *args)
            if body_key in names:
                self.pair_reads += 1
            if stamps_only and stamp_key in names and self.acts:
                stamp = _stamp(replies[names.index(stamp_key)])
                if (
                    stamp is not None
                    and node_id in watcher._infos
                    and stamp[0] != watcher._body_version(node_id)
                    and stamp[0] != watcher._refused.get(node_id)
                ):
                    self.raced.append(self.acts.pop(0)())
            return replies

        watcher.redis.mget = hooked  # type: ignore[method-assign]

    def queue(self, act: Callable[[], Any]) -> None:
        self.acts.append(act)

    async def raced_once(self, what: str = "the sweep never read the new stamp") -> Any:
        count = len(self.raced)
        await until(lambda: len(self.raced) > count, what)
        return self.raced[-1]

    async def next_sweep(self) -> tuple[int, int] | None:
        """What the table held of the node once the sweep that raced was over."""
        await until(lambda: len(self.after) >= len(self.raced), "no sweep after the race")
        return self.after[len(self.raced) - 1]


async def a_new_version(client: redis.Redis, keys: Keys, lag: int) -> int:
    """The node writes a new body (another lag): the next sweep reads its pair."""
    before = version_of(client, keys, NODE)
    write_node(client, keys, NODE, now_ms(), lag=lag)
    assert version_of(client, keys, NODE) != before
    return version_of(client, keys, NODE)


def healthy(watcher: TableWatcher, failures: int) -> None:
    assert watcher.refresh_failures == failures, watcher.last_error
    assert not watcher.degraded


async def heals(watcher: TableWatcher, client: redis.Redis, keys: Keys, lag: int) -> None:
    """Redis consistent again (a whole report written): the node's compact report is applied
    within a couple of sweep rounds (here 200 ms each), as of its own stamp."""
    await asyncio.sleep(0.05)
    write_node(client, keys, NODE, now_ms(), lag=lag)
    pair = pair_in_redis(client, keys)
    start = time.monotonic()
    await until(lambda: applied(watcher) == pair, f"{pair} never applied", limit_s=3.0)
    assert time.monotonic() - start < 1.5, "took longer than a couple of rounds"
    # Applied is not yet published (swaps come at most every PUBLISH_GAP_S): a node that came
    # back may not be in the published row yet (seen in a CI run), and lag_of needs it there.
    row = lambda: watcher.snapshot.stores["s"].replicas[0]  # noqa: E731 - read at each poll
    await until(lambda: any(r.node_id == NODE for r in row()), "never back in the published row")
    await until(lambda: lag_of(watcher, 0, NODE) == lag, "the healed lag never published")
    assert reported_at(watcher, 0, NODE) == pair[1]


# -- invariant 4: the pairing itself -----------------------------------------------------------


def test_a_body_written_between_the_reads_is_applied_by_the_same_sweep(
    redis_server, client, rare_node_reads
):
    """Stronger than the commit's own test (which, with the pairing removed, fails only on
    the new `unpaired_bodies` counter: the body still arrives a round later, with the right
    time): the sweep that read the pair applied it, before the next sweep began."""
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        between = Between(watcher, keys)

        def write_again() -> tuple[int, int]:
            write_node(client, keys, NODE, now_ms(), lag=8)
            return pair_in_redis(client, keys)

        between.queue(write_again)
        await a_new_version(client, keys, lag=6)
        pair = await between.raced_once()
        assert await between.next_sweep() == pair, "not applied by the sweep that read it"
        await until(lambda: lag_of(watcher, 0, NODE) == 8, "the newest body never published")
        assert reported_at(watcher, 0, NODE) == pair[1]
        assert watcher.stats.unpaired_bodies == 0

    watch(redis_server.url, keys, scenario)


def test_a_node_writing_on_every_sweep_is_applied_only_with_pairs_it_wrote(
    redis_server, client, rare_node_reads
):
    """A lagging replica: a new body between the two reads of every sweep that reads its
    pair, several times over. Every (version, at_ms) the table ever held is one the node
    wrote together, each raced body is applied by the sweep that read it."""
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        failures = watcher.refresh_failures
        written: set[tuple[int, int]] = {pair_in_redis(client, keys)}
        seen: set[tuple[int, int] | None] = set()
        between = Between(watcher, keys)
        lags = iter(range(20, 40))

        def write_again() -> tuple[int, int]:
            write_node(client, keys, NODE, now_ms(), lag=next(lags))
            pair = pair_in_redis(client, keys)
            written.add(pair)
            seen.add(applied(watcher))
            return pair

        for round_ in range(6):
            between.queue(write_again)
            await a_new_version(client, keys, lag=100 + round_)
            written.add(pair_in_redis(client, keys))
            pair = await between.raced_once()
            held = await between.next_sweep()
            seen.add(held)
            assert held == pair, f"round {round_}: {held} after the sweep, {pair} raced"
        seen.discard(None)
        assert seen <= written, seen - written
        assert watcher.stats.unpaired_bodies == 0
        healthy(watcher, failures)

    watch(redis_server.url, keys, scenario)


# -- invariant 3: the stamp changes between the reads ------------------------------------------

MALFORMED = {
    "missing": None,
    "abc": b"abc",
    "one number": b"1",
    "three numbers": b"1 2 3",
    "negative": b"-5 6",
    "empty": b"",
    "not UTF-8": b"\xff\xfe 1",
    "non-ASCII digits": "١٢ ٣".encode(),
}


@pytest.mark.parametrize("how", list(MALFORMED))
@pytest.mark.parametrize("body", ["same", "newer"])
def test_a_stamp_gone_or_malformed_between_the_reads(
    redis_server, client, rare_node_reads, how, body
):
    """The stamp vanishes or turns malformed between the reads. The body the first stamp
    named ("same") is applied as of that stamp; a body of another version ("newer", written
    by a writer that broke the pair) is never applied, neither with the first stamp's time
    nor any other. Nothing raises, and the node heals as soon as a whole report is written."""
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        failures = watcher.refresh_failures
        before = applied(watcher)
        between = Between(watcher, keys)
        first: list[tuple[int, int]] = []

        def break_stamp() -> int | None:
            first.append(pair_in_redis(client, keys))
            newer = None
            if body == "newer":
                forged = body_of(client, keys)
                forged["stores"]["s"]["lag"][0] = [77, 0, None]
                forged["version"] += 5
                newer = forged["version"]
                client.set(keys.report(NODE), json.dumps(forged), px=EXPIRE_MS)
            if MALFORMED[how] is None:
                client.delete(keys.report_at(NODE))
            else:
                client.set(keys.report_at(NODE), MALFORMED[how], px=EXPIRE_MS)
            return newer

        between.queue(break_stamp)
        await a_new_version(client, keys, lag=6)
        newer = await between.raced_once()
        held = await between.next_sweep()
        if newer is None:
            assert held == first[0], "the body named by the first stamp, as of that stamp"
            assert watcher.stats.unpaired_bodies == 0
        else:
            assert held == before, "a body of another version was applied"
            assert watcher.stats.unpaired_bodies == 1
        await asyncio.sleep(0.4)  # sweeps without a usable stamp: node reads, never the body
        assert lag_of(watcher, 0, NODE) != 77
        assert applied(watcher) in (before, first[0])
        healthy(watcher, failures)
        await heals(watcher, client, keys, lag=9)
        healthy(watcher, failures)

    watch(redis_server.url, keys, scenario)


@pytest.mark.parametrize("body", ["same", "newer"])
def test_a_stamp_from_the_future_between_the_reads_is_no_report(
    redis_server, client, rare_node_reads, body
):
    """Between the reads the stamp jumps a minute ahead (its writer's clock), with the same
    body or with a new one written with it: paired, and a future time is no report, never
    a fresh one."""
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        failures = watcher.refresh_failures
        between = Between(watcher, keys)
        ahead = now_ms() + 60_000

        def jump() -> None:
            if body == "newer":
                write_node(client, keys, NODE, ahead, lag=8)
            else:
                version = version_of(client, keys, NODE)
                client.set(keys.report_at(NODE), f"{version} {ahead}", px=EXPIRE_MS)

        between.queue(jump)
        await a_new_version(client, keys, lag=6)
        await between.raced_once()
        await between.next_sweep()
        await until(lambda: lag_of(watcher, 0, NODE) is None, "the future stamp was applied")
        for _ in range(5):
            at = reported_at(watcher, 0, NODE)
            assert at is None or at <= now_ms() + 1_000, at
            assert lag_of(watcher, 0, NODE) is None
            await asyncio.sleep(0.1)
        assert watcher.stats.unpaired_bodies == 0
        healthy(watcher, failures)
        # The writer's clock back in step (a version past the future one, as the writer's
        # rule makes it): applied again.
        await heals(watcher, client, keys, lag=9)

    watch(redis_server.url, keys, scenario)


@pytest.mark.parametrize("how", ["older time", "older version", "older pair"])
def test_a_stamp_going_back_between_the_reads(redis_server, client, rare_node_reads, how):
    """Between the reads the stamp goes back: the same version at an earlier time (paired:
    applied as of that earlier time, staler, never fresher), an older version without its
    body (unpaired: not applied), or the older body and stamp together (paired: applied as
    of the older stamp)."""
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        failures = watcher.refresh_failures
        old_pair = pair_in_redis(client, keys)
        old_body = client.get(keys.report(NODE))
        before = applied(watcher)
        between = Between(watcher, keys)

        def back() -> tuple[int, int]:
            version, at = pair_in_redis(client, keys)
            with client.pipeline(transaction=True) as pipe:
                if how == "older time":
                    pipe.set(keys.report_at(NODE), f"{version} {at - 1_500}", px=EXPIRE_MS)
                else:
                    pipe.set(keys.report_at(NODE), f"{old_pair[0]} {old_pair[1]}", px=EXPIRE_MS)
                if how == "older pair":
                    pipe.set(keys.report(NODE), old_body, px=EXPIRE_MS)
                pipe.execute()
            return version, at

        between.queue(back)
        await a_new_version(client, keys, lag=6)
        version, at = await between.raced_once()
        held = await between.next_sweep()
        if how == "older time":
            assert held == (version, at - 1_500)
        elif how == "older version":
            assert held == before, "the new body applied with the older version's stamp"
            assert watcher.stats.unpaired_bodies >= 1
        else:
            assert held == old_pair
        healthy(watcher, failures)
        await heals(watcher, client, keys, lag=9)

    watch(redis_server.url, keys, scenario)


# -- invariant 3: the body, the node --------------------------------------------------------------


def test_a_body_gone_between_the_reads_falls_back_to_a_node_read(
    redis_server, client, rare_node_reads
):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        failures, whole = watcher.refresh_failures, whole_reads(watcher)
        before = applied(watcher)
        between = Between(watcher, keys)
        between.queue(lambda: client.delete(keys.report(NODE)))
        await a_new_version(client, keys, lag=6)  # lag:n0 says 6 too
        await between.raced_once()
        assert await between.next_sweep() == before
        assert NODE not in watcher._bodies
        assert NODE not in watcher._refused, "an absent body is no refusal"
        await until(lambda: whole_reads(watcher) > whole, "no node read instead")
        await until(lambda: lag_of(watcher, 0, NODE) == 6, "the legacy keys not applied")
        healthy(watcher, failures)
        await heals(watcher, client, keys, lag=9)

    watch(redis_server.url, keys, scenario)


@pytest.mark.parametrize("keys_too", [True, False], ids=["keys deleted", "keys left"])
def test_a_node_forgotten_between_the_reads(redis_server, client, rare_node_reads, keys_too):
    """The node leaves the `nodes` set between the reads (its keys deleted with it, or left
    to expire): it leaves the table and the watcher's state at the next head read, nothing
    raises, and once it is back its compact report is applied within a couple of rounds."""
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        # A smaller table is swapped in at once (not held as after a Redis restarted empty).
        watcher.hold_smaller_table_ms = 0
        await bodies_known(watcher)
        failures = watcher.refresh_failures
        between = Between(watcher, keys)
        node_value = client.get(keys.node(NODE))

        def forget() -> None:
            client.srem(keys.nodes, NODE)
            if keys_too:
                client.delete(
                    keys.node(NODE),
                    keys.alive(NODE),
                    keys.hosting(NODE),
                    keys.lag(NODE),
                    keys.report(NODE),
                    keys.report_at(NODE),
                )

        between.queue(forget)
        await a_new_version(client, keys, lag=6)
        await between.raced_once()
        await until(lambda: NODE not in watcher._node_ids, "never forgotten")
        await until(lambda: NODE not in watcher.snapshot.alive, "still alive in the table")
        await until(lambda: NODE not in watcher.snapshot.node_urls, "still in the table")
        for state in (watcher._bodies, watcher._applied, watcher._infos, watcher._refused):
            assert NODE not in state
        healthy(watcher, failures)
        # Back: registered again, then reporting.
        client.set(keys.node(NODE), node_value or b"")
        client.set(keys.alive(NODE), "1", px=EXPIRE_MS)
        client.sadd(keys.nodes, NODE)
        await until(lambda: NODE in watcher._infos, "never read again", limit_s=5.0)
        await heals(watcher, client, keys, lag=9)
        healthy(watcher, failures)

    watch(redis_server.url, keys, scenario)


def _huge(body: dict[str, Any], partitions: int, *, lag: int) -> dict[str, Any]:
    """The body with a store this proxy does not know, of many partitions (accepted: its
    rows are ignored), so the body is decoded in a thread."""
    body = json.loads(json.dumps(body))
    body["stores"]["s"]["lag"][0] = [lag, 0, None]
    body["stores"]["big"] = {
        "active": list(range(partitions)),
        "standby": [],
        "lag": [[0, 0, None]] * partitions,
    }
    return body


def test_a_huge_body_written_between_the_reads_is_applied_with_its_own_time(
    redis_server, client, rare_node_reads
):
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        failures = watcher.refresh_failures
        between = Between(watcher, keys)

        def write_huge() -> tuple[int, int]:
            body = _huge(body_of(client, keys), 4_000, lag=5)
            body["version"] += 3
            raw = json.dumps(body)
            assert len(raw) > THREAD_DECODE_BYTES
            at = now_ms()
            with client.pipeline(transaction=True) as pipe:
                pipe.set(keys.report(NODE), raw, px=EXPIRE_MS)
                pipe.set(keys.report_at(NODE), f"{body['version']} {at}", px=EXPIRE_MS)
                pipe.execute()
            return body["version"], at

        between.queue(write_huge)
        await a_new_version(client, keys, lag=6)
        pair = await between.raced_once()
        assert await between.next_sweep() == pair
        await until(lambda: lag_of(watcher, 0, NODE) == 5, "the huge body never published")
        assert reported_at(watcher, 0, NODE) == pair[1]
        assert watcher.stats.unpaired_bodies == 0
        healthy(watcher, failures)

    watch(redis_server.url, keys, scenario)


# -- invariant 2: a refused body ---------------------------------------------------------------


def _hostile(body: dict[str, Any], how: str) -> bytes:
    store = body["stores"]["s"]
    if how == "not JSON":
        return b'{"v":1,'
    if how == "negative lag":
        store["lag"][0] = [-5, 0, 0]
    elif how == "another node":
        body["node_id"] = "n1"
    elif how == "outside the store":
        store["active"][0] = 600  # the store has 6 partitions
    elif how == "huge, misaligned":
        body = _huge(body, 4_000, lag=0)
        body["stores"]["big"]["lag"].pop()
    elif how == "huge, outside the store":
        body["stores"]["s"]["active"] = [*store["active"], *range(100, 4_100)]
        store["lag"] = [*store["lag"], *[[0, 0, None]] * 4_000]
    return json.dumps(body).encode()


@pytest.mark.parametrize(
    "how",
    [
        "not JSON",
        "negative lag",
        "another node",
        "outside the store",
        "huge, misaligned",
        "huge, outside the store",
    ],
)
def test_a_body_refused_between_the_reads_is_not_read_again_until_a_new_version(
    redis_server, client, rare_node_reads, how
):
    """Between the reads the node writes a whole report whose body breaks the contract (the
    legacy keys say lag 11). The refusal is of the version named by the stamp read with that
    body, not by the first stamp: while the node confirms that version the body is not read
    again (node reads instead, lag 11), and its next good version is applied at once."""
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        failures, whole = watcher.refresh_failures, whole_reads(watcher)
        between = Between(watcher, keys)

        def hostile() -> int:
            write_node(client, keys, NODE, now_ms(), lag=11)
            version = version_of(client, keys, NODE)
            client.set(keys.report(NODE), _hostile(body_of(client, keys), how), px=EXPIRE_MS)
            return version

        between.queue(hostile)
        first = await a_new_version(client, keys, lag=6)
        refused = await between.raced_once()
        assert refused != first
        await between.next_sweep()
        assert between.refused_after[-1] == refused, "refused as another version"
        reads = between.pair_reads
        await until(lambda: whole_reads(watcher) > whole, "no node read instead")
        await until(lambda: lag_of(watcher, 0, NODE) == 11, "the legacy keys never applied")
        for _ in range(5):  # the node confirms the refused version: never read again
            client.set(keys.report_at(NODE), f"{refused} {now_ms()}", px=EXPIRE_MS)
            await asyncio.sleep(0.15)
        assert between.pair_reads == reads, "a refused body read again"
        assert lag_of(watcher, 0, NODE) == 11
        healthy(watcher, failures)
        await heals(watcher, client, keys, lag=9)
        assert NODE not in watcher._refused
        healthy(watcher, failures)

    watch(redis_server.url, keys, scenario)


def test_body_reads_count_each_pair_once(redis_server, client, rare_node_reads):
    """The commit's cost: a changed body costs one pair read, then none while confirmed."""
    keys = compact_cluster(client)

    async def scenario(watcher: TableWatcher) -> None:
        await bodies_known(watcher)
        reads = BodyReads(watcher, keys)
        await a_new_version(client, keys, lag=6)
        await until(lambda: lag_of(watcher, 0, NODE) == 6, "the new body never applied")
        await asyncio.sleep(0.5)
        assert reads.nodes.count(NODE) == 1, reads.nodes
        assert set(reads.nodes) <= set(NODES)

    watch(redis_server.url, keys, scenario)
