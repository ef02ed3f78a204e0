"""What the proxy does with one parsed request: route it, choose replicas, start the exchange.

Keyed requests (a configured route matched) go to the replicas of the key's partition, in the
order `choose_replicas` gives; others go to any live registered node, round robin. Decisions
read the current snapshot once. The choice for (store, partition) under the configured budget
is cached until a snapshot changes that choice (`RoutingSnapshot.changed`) or the ejected set
changes, or until time alone could change it (`expiry_terms`); a request that tightens the
budget by header computes its own. A new report that leaves a partition's choice as it was (most
of them: every replica reports every 250 ms) does not touch its cached choice. A node's unchanged
report confirmed later moves its report clock, which cached choices read for their answers' time
lag and their expiry; a new report that leaves the choice as it was has it renewed from the new
replicas (`renew_choices`, off the request path, in steps), so the C path keeps serving it and
its answers' lag headers follow the reports.

The caches and the stores' partitioners are shared with the C path (`proxy._hotpath.Hub`),
which serves cached choices itself; a choice it finds missing or expired sends the request
here, which computes and caches it.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import structlog

from common.clock import now_ms
from partitioner import KeyFormatError, KeyPartitioner
from proxy._hotpath import Cached, Candidate, Hub
from proxy.choice import (
    Choice,
    ExpiryTerm,
    LagBudget,
    Replica,
    UnknownLagPolicy,
    choose_replicas,
    expires_at,
    expiry_terms,
    rotated,
)
from proxy.errors import (
    BadRequest,
    KeyRejected,
    MethodNotAllowed,
    NoTable,
    RequestRejected,
    UnknownStore,
)
from proxy.exchange import Client, Exchange, ExchangeContext, Target, provenance_lines
from proxy.freshness import (
    MIN_OFFSET,
    min_offset_of,
    node_budget,
    node_budget_lines,
    with_budget,
)
from proxy.hotpath_spec import hot_routes, hot_store, sync_clock
from proxy.http import ClientRequest, json_response
from proxy.metrics import ProxyMetrics
from proxy.routes import CompiledRoute, KeyedRequest, RouteTable
from proxy.routing import (
    EMPTY,
    PARTITION_CACHE,
    ChoiceStability,
    RoutingSnapshot,
    StoreRoute,
)

if TYPE_CHECKING:
    from proxy.settings import ProxySettings

log = structlog.get_logger("kroute.proxy.handler")

MAX_LAG_HEADER = b"x-kroute-max-lag"
MAX_LAG_MS_HEADER = b"x-kroute-max-lag-ms"
# Requests with freshness headers take the Python path (the C path has no per-request choice).
BUDGET_HEADERS = (MAX_LAG_HEADER, MAX_LAG_MS_HEADER, MIN_OFFSET)
IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS"})
KEYED_METHODS = frozenset({"GET", "HEAD"})


@dataclass(frozen=True)
class ChoicePolicy:
    budget: LagBudget
    unknown_lag: UnknownLagPolicy
    stale_after_ms: int
    spread: bool
    standby_reads: bool = True

    @property
    def stability(self) -> ChoiceStability:
        """What tells a change of a partition's replicas that leaves its choice alone (the
        watcher's, or the table process's, judge)."""
        return ChoiceStability(
            self.budget, self.unknown_lag, self.stale_after_ms, self.standby_reads
        )


def choice_policy(settings: ProxySettings) -> ChoicePolicy:
    return ChoicePolicy(
        budget=LagBudget(settings.max_lag, settings.max_lag_ms),
        unknown_lag=settings.unknown_lag,
        stale_after_ms=settings.lag_report_stale_ms,
        spread=settings.spread,
        standby_reads=settings.standby_reads,
    )


class RequestHandler:
    def __init__(
        self,
        *,
        routes: RouteTable,
        policy: ChoicePolicy,
        context: ExchangeContext,
        metrics: ProxyMetrics,
        hub: Hub,
    ) -> None:
        self.routes = routes
        self.policy = policy
        self.context = context
        self.metrics = metrics
        self.hub = hub
        self.snapshot: RoutingSnapshot = EMPTY
        # What the watcher asks to leave a cached choice in place when a partition's replicas
        # change (a new report every 250 ms) without changing its choice under this policy.
        self.choice_stability = policy.stability
        self._targets: dict[str, Target] = {}
        self._plain: dict[str, Candidate] = {}  # node -> candidate for passthrough requests
        # store -> per partition: the cached choice (Cached) or None; shared with the hub
        self._choices: dict[str, list[Cached | None]] = {}
        self._route_partitioners: dict[tuple[int, int], KeyPartitioner] = {}
        self._counter = 0
        # Kept choices left for later on clocks the table replaced (`renew_choices`): a heap
        # of (due ms, sequence, store, partition, the choice), and what each partition waits
        # with, so a choice is queued once however many reports leave it alone meanwhile.
        self._due: list[tuple[int, int, str, int, Cached]] = []
        self._queued: dict[tuple[str, int], Cached] = {}
        self._queued_count = 0
        # What a keyed read that asks for no budget carries to its node (proxy.freshness); an
        # exchange adopted from the C path carried the same lines, so its refusals are read.
        self._node_budget = node_budget(policy.budget, policy.unknown_lag)
        context.node_budget = self._node_budget
        hub.request_lines = node_budget_lines(self._node_budget)
        hub.set_routes(hot_routes(routes.routes))

    # -- table and health changes (from the watcher and the ejections) -------------------------

    def use_snapshot(self, snapshot: RoutingSnapshot) -> None:
        """Swap in a new table. Its cost follows what changed: targets are rebuilt only when a
        node's URL did, and when the stores are the same only the cached choices of the
        partitions the snapshot names as changed are forgotten (in place: the C path keeps
        serving the others from its cache)."""
        previous = self.snapshot
        urls_changed = snapshot.node_urls is not previous.node_urls or not self._targets
        if urls_changed:
            self._use_targets(snapshot.node_urls)
            self.metrics.forget_nodes(snapshot.node_urls.keys())
        self.snapshot = snapshot
        sync_clock(self.hub)  # the C path reads the wall clock plus this offset
        changed = snapshot.changed
        if not urls_changed and changed is not None and _same_stores(previous, snapshot):
            for name, partitions in changed.items():
                cache = self._choices[name]
                for partition in partitions:
                    cache[partition] = None
            return
        stores = snapshot.stores
        self._choices = {name: [None] * store.info.partitions for name, store in stores.items()}
        routes = self.routes.routes
        self.hub.set_stores(
            [
                hot_store(
                    name,
                    [self._partitioner(route, store).partition_of for route in routes],
                    self._choices[name],
                )
                for name, store in stores.items()
            ]
        )

    def renew_choices(self, snapshot: RoutingSnapshot, name: str, partitions: list[int]) -> None:
        """Renew cached choices that a new snapshot left standing (`snapshot.renewed`: their
        replicas changed, their choice did not): the same candidates in the same order, with
        the new replicas' lag for the answers' headers and the new replicas' expiry, so the
        C path keeps serving them instead of sending a request here when they expire.

        A choice whose replicas' lags are unchanged (a confirmation that only moved times) is
        renewed only when less than half the staleness limit (`stale_after_ms`) remains:
        every confirmation names all its node's partitions, and renewing each on every one
        (twice a second at the default sweep) was the largest part of the table's CPU at
        thousands of partitions. Left alone, it is the choice the new replicas give (that is
        what `renewed` means), and its answers' time lag comes from an older caught-up time:
        larger than the truth, never smaller. A changed lag is renewed at once, so the
        `x-kroute-lag` answers name follows the reports as before. At the default sweep
        (every node every 500 ms) and limit (3 s) a choice comes up for renewal at least
        three times in its last 1.5 s.

        A confirmation that only moved a node's report clock (`proxy.choice.ReportClock`,
        moved in place by the table) names nothing here: the cached choices read that clock,
        for their answers' time lag and for their expiry (`Cached.live`). So a choice left
        for later while its node's clock was replaced (a node read, or a body that changed)
        would read the old clock, which nothing moves any more, and expire although its
        replicas are fresh, unless a later report named it again: it is queued, and renewed
        when half its limit remains by `renew_due`."""
        if snapshot is not self.snapshot:
            return  # a newer table is in use: its replicas, not these, are the truth
        cache, route = self._choices.get(name), snapshot.stores.get(name)
        if cache is None or route is None:
            return
        at = now_ms()
        renew_after = at + self.policy.stale_after_ms // 2  # expiring sooner: renewed now
        for partition in partitions:
            cached = cache[partition]
            if cached is None or not cached.live(at):
                continue  # none, or expired: the next request computes it
            replicas = route.replicas[partition]
            if cached.expires_ms > renew_after and _same_lags(cached, replicas):
                # Only times moved, and it lives long enough: renewed later.
                if not _reads_clocks_of(cached, replicas):
                    self._renew_later(name, partition, cached)
                continue
            self._renew(cache, partition, cached, replicas, at)

    def renew_due(self, snapshot: RoutingSnapshot, limit: int) -> bool:
        """Renew up to `limit` of the choices `renew_choices` left for later on replaced
        clocks whose turn has come (half their limit remains), from `snapshot`'s replicas
        (the rows they were kept for: a row that changed since would have forgotten or
        renewed them). True when more are due now (the caller yields, then calls again)."""
        due = self._due
        if snapshot is not self.snapshot:
            return False  # a newer table is in use: called again with it
        at = now_ms()
        done = 0
        while due and due[0][0] <= at and done < limit:
            _, _, name, partition, cached = heapq.heappop(due)
            if self._queued.get((name, partition)) is cached:
                del self._queued[(name, partition)]
            cache, route = self._choices.get(name), snapshot.stores.get(name)
            if cache is None or route is None or partition >= len(cache):
                continue
            if cache[partition] is not cached or not cached.live(at):
                continue  # renewed, forgotten or expired since: nothing to do
            self._renew(cache, partition, cached, route.replicas[partition], at, follow=True)
            done += 1
        return bool(due) and due[0][0] <= at

    def _renew_later(self, name: str, partition: int, cached: Cached) -> None:
        if self._queued.get((name, partition)) is cached:
            return
        self._queued[(name, partition)] = cached
        self._queued_count += 1
        due_ms = expires_at(cached.cap_ms, cached.terms) - self.policy.stale_after_ms // 2
        heapq.heappush(self._due, (due_ms, self._queued_count, name, partition, cached))

    def _renew(
        self,
        cache: list[Cached | None],
        partition: int,
        cached: Cached,
        replicas: tuple[Replica, ...],
        at: int,
        *,
        follow: bool = False,
    ) -> None:
        """Replace the choice with one on `replicas` when that lives longer, or (`follow`)
        when it reads a replaced clock: the current row may expire when the choice does (its
        earliest replica not confirmed yet), yet only the current clocks move on later
        confirmations; on the old ones the choice would expire with fresh replicas."""
        policy = self.policy
        cap, terms = expiry_terms(
            replicas, policy.budget, now_ms=at, stale_after_ms=policy.stale_after_ms
        )
        if expires_at(cap, terms) > cached.expires_ms or (
            follow and not _reads_clocks_of(cached, replicas)
        ):
            cache[partition] = _renewed(cached, replicas, partition, cap, terms)

    def _use_targets(self, node_urls: Mapping[str, str]) -> None:
        """The nodes' targets and passthrough candidates, built again only for the nodes that
        are new or whose URL changed: at 1,000 nodes building them all took 7-10 ms of the
        loop on every node that joined, left or moved."""
        old_targets, old_plain = self._targets, self._plain
        targets: dict[str, Target] = {}
        plain: dict[str, Candidate] = {}
        for node_id, url in node_urls.items():
            target = old_targets.get(node_id)
            if target is not None and target.url == url and node_id in old_plain:
                # A passthrough candidate holds its target (this URL), the origin's idle list
                # and its node's tally, which `forget_nodes` drops only for nodes no longer
                # registered (not kept here): all still what a new one would hold.
                targets[node_id], plain[node_id] = target, old_plain[node_id]
                continue
            parts = urlsplit(url)
            assert parts.hostname is not None  # the watcher admits http://host:port only
            assert parts.port is not None
            targets[node_id] = target = Target.build(node_id, url, parts.hostname, parts.port)
            plain[node_id] = self._candidate(target)
        self._targets, self._plain = targets, plain

    def forget_choices(self) -> None:
        for cache in self._choices.values():
            cache[:] = [None] * len(cache)  # in place: the hub holds these lists

    def _candidate(
        self,
        target: Target,
        replica: Replica | None = None,
        store: str = "",
        partition: int | None = None,
    ) -> Candidate:
        metrics = self.metrics
        return Candidate(
            target=target,
            replica=replica,
            provenance=provenance_lines(target.node_id, partition, replica),
            idle=self.context.pool.idle_list(target.origin),
            host_line=target.host_line,
            choice_tally=None
            if replica is None or partition is None
            else metrics.choice_tally(store, partition, target.node_id, replica.role),
            node_tally=metrics.node_tally(target.node_id),
            lag=-1 if replica is None or replica.lag is None else replica.lag,
            caught_up_at_ms=-1
            if replica is None or replica.caught_up_at_as_given_ms is None
            else replica.caught_up_at_as_given_ms,
            clock=None if replica is None else replica.clock,
        )

    # -- requests ----------------------------------------------------------------------------

    def handle(self, request: ClientRequest, client: Client) -> None:
        try:
            keyed = self.routes.match(request.path, request.query, _header_reader(request))
            if keyed is None:
                self._passthrough(request, client)
            else:
                self._keyed(request, keyed, client)
        except RequestRejected as exc:
            self.reject(request, exc, client)

    def reject(self, request: ClientRequest, exc: RequestRejected, client: Client) -> None:
        ProxyMetrics.bump(self.metrics.rejected, exc.code)
        self.metrics.observe("rejected", exc.status, time.perf_counter() - request.received_at)
        headers = [(b"x-request-id", request.request_id)]
        if exc.status == 405:
            headers.append((b"allow", b"GET, HEAD"))
        elif exc.status == 503:  # no table yet: the next read of it is at most a second away
            headers.append((b"retry-after", b"1"))
        client.respond(
            json_response(
                exc.status,
                exc.payload(),
                keep_alive=request.keep_alive,
                extra_headers=headers,
                head_only=request.method == "HEAD",
            ),
            request.keep_alive,
        )

    def _keyed(self, request: ClientRequest, keyed: KeyedRequest, client: Client) -> None:
        if request.method not in KEYED_METHODS:
            raise _method_not_allowed(request.method)
        snapshot = self.snapshot
        store = snapshot.stores.get(keyed.store)
        if store is None and snapshot is EMPTY:
            raise NoTable(
                "the proxy has not read its routing table yet (Redis, or its table process, "
                "is not there yet); retry",
                store=keyed.store,
            )
        if store is None:
            raise UnknownStore(
                f"no store named {keyed.store!r} is registered",
                store=keyed.store,
                stores=sorted(snapshot.stores),
            )
        partitioner = self._partitioner(keyed.route, store)
        try:
            partition = partitioner.partition_of(keyed.key)
        except KeyFormatError as exc:
            raise KeyRejected(
                exc.reason, key=keyed.key, key_format=exc.key_format, store=keyed.store
            ) from None
        budget = self._request_budget(request)
        min_offset = min_offset_of(request.header(MIN_OFFSET), partition)
        sent = budget if budget is not None else self._node_budget
        if sent is not None:  # the node checks the budget the proxy applies, not a looser one
            request.headers = with_budget(request.headers, sent)
        choice, candidates = self._choice(store, keyed.store, partition, budget, min_offset)
        if self.policy.spread:
            self._counter += 1
            candidates = rotated(candidates, choice.spread_width, self._counter)
        Exchange(
            self.context,
            request,
            client,
            targets=candidates,
            store=keyed.store,
            partition=partition,
            rejected=choice.rejected,
            budget=sent,
            idempotent=True,
            min_offset=min_offset,
        ).start()

    def _passthrough(self, request: ClientRequest, client: Client) -> None:
        live = [self._plain[n] for n in sorted(self.snapshot.alive) if n in self._plain]
        ejected = self.context.ejections.ejected
        live = [c for c in live if c.target.node_id not in ejected] or live
        self._counter += 1
        live = list(rotated(tuple(live), len(live), self._counter))
        Exchange(
            self.context,
            request,
            client,
            targets=live,
            store=None,
            partition=None,
            rejected=(),
            budget=self.policy.budget,
            idempotent=request.method in IDEMPOTENT,
        ).start()

    def _partitioner(self, route: CompiledRoute, store: StoreRoute) -> KeyPartitioner:
        spec = route.spec
        if spec.key_format is None and spec.partitioner is None:
            return store.partitioner
        cache_key = (id(route), store.info.partitions)
        partitioner = self._route_partitioners.get(cache_key)
        if partitioner is None:
            partitioner = KeyPartitioner(
                spec.key_format or store.info.key_format,
                spec.partitioner or store.info.partitioner,
                store.info.partitions,
                cache_size=PARTITION_CACHE,
            )
            self._route_partitioners[cache_key] = partitioner
        return partitioner

    def _request_budget(self, request: ClientRequest) -> LagBudget | None:
        """The budget tightened by the request's headers; None when it sent none."""
        offsets = _strictest(request, MAX_LAG_HEADER)
        millis = _strictest(request, MAX_LAG_MS_HEADER)
        if offsets is None and millis is None:
            return None
        return self.policy.budget.tightened(LagBudget(offsets, millis))

    def _choice(
        self,
        store: StoreRoute,
        name: str,
        partition: int,
        budget: LagBudget | None,
        min_offset: int | None = None,
    ) -> tuple[Choice, tuple[Candidate, ...]]:
        at = now_ms()
        policy = self.policy
        cache = self._choices[name]
        cacheable = budget is None and min_offset is None
        if cacheable:
            cached = cache[partition]
            if cached is not None and cached.live(at):
                return cached.choice, cached.candidates
        replicas = store.replicas[partition]
        effective = budget or policy.budget
        choice = choose_replicas(
            replicas,
            effective,
            now_ms=at,
            ejected=self.context.ejections.ejected,
            unknown_lag=policy.unknown_lag,
            stale_after_ms=policy.stale_after_ms,
            standby_reads=policy.standby_reads,
            min_offset=min_offset,
        )
        candidates = tuple(
            self._candidate(self._targets[r.node_id], r, name, partition) for r in choice.candidates
        )
        if cacheable:
            cap, terms = expiry_terms(
                replicas, effective, now_ms=at, stale_after_ms=policy.stale_after_ms
            )
            cache[partition] = Cached(
                choice=choice,
                candidates=candidates,
                expires_ms=expires_at(cap, terms),
                spread_width=choice.spread_width,
                terms=terms,
                cap_ms=cap,
            )
        return choice, candidates


def _reads_clocks_of(cached: Cached, replicas: tuple[Replica, ...]) -> bool:
    """Whether every clock the choice's expiry reads is one of `replicas`' (the table's
    current clocks, which confirmations move)."""
    clocks = [replica.clock for replica in replicas]
    return all(any(clock is c for c in clocks) for clock, _base in cached.terms)


def _same_lags(cached: Cached, replicas: tuple[Replica, ...]) -> bool:
    """Whether every candidate's replica reports the lag it was cached with."""
    for candidate in cached.candidates:
        old = candidate.replica
        if old is None:
            return False
        for replica in replicas:
            if replica.node_id == old.node_id:
                if replica.lag != old.lag:
                    return False
                break
        else:
            return False
    return True


def _renewed(
    cached: Cached,
    replicas: tuple[Replica, ...],
    partition: int,
    cap: int,
    terms: tuple[ExpiryTerm, ...],
) -> Cached | None:
    """`cached` with the same candidates, in the same order, made of the new `replicas`
    (None, to be computed again, if one is missing: never expected of a renewed partition).
    Loops rather than generators: this runs for every cached choice on every sweep."""
    by_node = {replica.node_id: replica for replica in replicas}
    candidates = []
    for candidate in cached.candidates:
        old = candidate.replica
        new = None if old is None else by_node.get(old.node_id)
        if old is None or new is None:
            return None
        candidates.append(_renewed_candidate(candidate, old, new, partition))
    choice = cached.choice
    chosen = tuple([by_node[r.node_id] for r in choice.candidates])
    return Cached(
        choice=Choice(chosen, choice.rejected, choice.spread_width),
        candidates=tuple(candidates),
        expires_ms=expires_at(cap, terms),
        spread_width=cached.spread_width,
        terms=terms,
        cap_ms=cap,
    )


def _renewed_candidate(
    candidate: Candidate, old: Replica, new: Replica, partition: int
) -> Candidate:
    """The candidate naming `new` instead of `old` (the same node): the same target, tallies
    and idle connections; provenance lines made again only when what they say changed."""
    target = candidate.target
    same_lines = (
        old.lag == new.lag
        and old.role == new.role
        and (old.caught_up_at_ms is None) == (new.caught_up_at_ms is None)
    )
    return Candidate(  # by keyword, as docs/proxy-hotpath.md has it
        target=target,
        replica=new,
        provenance=candidate.provenance
        if same_lines
        else provenance_lines(target.node_id, partition, new),
        idle=candidate.idle,
        host_line=target.host_line,
        choice_tally=candidate.choice_tally,
        node_tally=candidate.node_tally,
        lag=-1 if new.lag is None else new.lag,
        caught_up_at_ms=-1
        if new.caught_up_at_as_given_ms is None
        else new.caught_up_at_as_given_ms,
        clock=new.clock,
    )


def _same_stores(previous: RoutingSnapshot, snapshot: RoutingSnapshot) -> bool:
    """Whether both tables have the same stores, described alike (so the same caches)."""
    if previous.stores.keys() != snapshot.stores.keys():
        return False
    return all(route.info == previous.stores[name].info for name, route in snapshot.stores.items())


def _header_reader(request: ClientRequest) -> Callable[[str], str | None]:
    def read(name: str) -> str | None:
        value = request.header(name.encode("ascii"))
        if value is None:
            return None
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise KeyRejected(f"header {name!r} is not UTF-8") from None

    return read


def _strictest(request: ClientRequest, header: bytes) -> int | None:
    """The strictest of the request's lines for `header`: a repeated budget never loosens."""
    values = [_budget_value(value, header) for name, value in request.headers if name == header]
    return min((v for v in values if v is not None), default=None)


def _budget_value(raw: bytes | None, header: bytes) -> int | None:
    if raw is None:
        return None
    text = raw.strip()
    if not text.isdigit() or len(text) > 18:
        raise BadRequest(
            f"{header.decode()} must be a non-negative integer",
            header=header.decode(),
            value=raw.decode("latin-1"),
        )
    return int(text)


def _method_not_allowed(method: str) -> RequestRejected:
    return MethodNotAllowed(f"keyed routes answer GET and HEAD, not {method}", method=method)
