"""The proxy's settings, read once from KROUTE_* environment variables (`ProxySettings.from_env`).

Routes are JSON in KROUTE_ROUTES, a list of objects:
  {"path": "/stores/{store}/keys/{key}"}                       the nodes' own API (the default)
  {"path": "/customers/{key}", "store": "customers"}           key in the path, fixed store
  {"path": "/lookup", "store": "customers", "key": "query:id"} key in a query parameter
  {"path": "/fraud/check", "store": "cards", "key": "header:x-card-id", "key_format": "int64"}
`key_format` and `partitioner` default to what the store's nodes publish in Redis; set them when
the producers' choice must be pinned here.
"""

from __future__ import annotations

import ipaddress
import json
import os
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from common.settings import (
    EnvSettings,
    ExistingFile,
    Host,
    Name,
    RedisUrl,
    known_partitioning_choice,
)

DEFAULT_ROUTES = '[{"path": "/stores/{store}/keys/{key}"}]'
# More proxy processes than this is a typo, not a machine (each holds its own table and pools).
MAX_WORKERS = 256


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, cgroup cpusets), which
    can be fewer than the machine's."""
    return max(len(os.sched_getaffinity(0)), 1)


class RouteSpec(BaseModel):
    """One keyed route as configured; `proxy.routes` compiles it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str = Field(pattern=r"^/")
    store: str | None = None
    key: str = "path"  # path | query:<name> | header:<name>
    key_format: str | None = None
    partitioner: str | None = None

    @field_validator("key")
    @classmethod
    def _key_source(cls, value: str) -> str:
        kind, _, name = value.partition(":")
        if value == "path" or (kind in ("query", "header") and name):
            return value
        raise ValueError("key must be 'path', 'query:<name>' or 'header:<name>'")

    @field_validator("key_format", "partitioner")
    @classmethod
    def _known_choice(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else known_partitioning_choice(str(info.field_name), value)

    @model_validator(mode="after")
    def _names_key_and_store(self) -> RouteSpec:
        segments = self.path.strip("/").split("/")
        if self.key == "path" and "{key}" not in segments:
            raise ValueError(f"route {self.path}: key is 'path' but the path has no {{key}}")
        if self.key != "path" and "{key}" in segments:
            raise ValueError(f"route {self.path}: the key comes from {self.key}, not the path")
        if (self.store is None) == ("{store}" not in segments):
            raise ValueError(f"route {self.path}: name the store either in the path or as store")
        return self


class ProxySettings(EnvSettings):
    host: Host = Field(default="127.0.0.1", description="Address the proxy's data port binds to.")
    port: int = Field(default=8080, ge=0, le=65535, description="The data port (0: any free).")
    admin_host: Host = Field(
        default="127.0.0.1", description="Address of the admin listener (health, metrics, status)."
    )
    admin_port: int = Field(
        default=8090, ge=0, le=65535, description="Port of the admin listener (0: any free)."
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="If set, /metrics and /cluster* on the admin port need "
        "'Authorization: Bearer <token>'. Printed as ***.",
    )
    redis_url: RedisUrl = Field(
        description="Redis holding the routing data, e.g. redis://:password@host:6379/0 or "
        "rediss:// for TLS. Printed as ***."
    )
    redis_ca_file: ExistingFile | None = Field(
        default=None, description="CA bundle to verify Redis's TLS certificate (rediss:// URLs)."
    )
    cluster: Name = Field(
        default="default",
        description="Cluster name: the prefix of every Redis key.",
    )
    routes: str = Field(
        default=DEFAULT_ROUTES,
        description="Keyed routes, JSON: which path segment, query parameter or header holds the "
        "key, and the store (see proxy/settings.py).",
    )
    max_lag: int | None = Field(
        default=None,
        ge=0,
        description="Lag budget in offsets: replicas further behind are not used (unset: none). "
        "Requests can tighten it with the x-kroute-max-lag header.",
    )
    max_lag_ms: int | None = Field(
        default=None,
        ge=0,
        description="Lag budget in milliseconds of time lag (unset: none); header "
        "x-kroute-max-lag-ms tightens it.",
    )
    unknown_lag: Literal["reject", "accept"] = Field(
        default="reject",
        description="Under a budget, a replica with no fresh lag report is rejected (a silent "
        "stale read is worse than a 503) or accepted.",
    )
    lag_report_stale_ms: int = Field(
        default=3000, ge=100, le=600_000, description="A lag report older than this is unknown."
    )
    spread: bool = Field(
        default=False,
        description="Spread reads over every replica inside the budget instead of preferring "
        "the active.",
    )
    standby_reads: bool = Field(
        default=True,
        description="Let in-budget standbys answer when the active cannot (KIP-535); false: "
        "only actives answer, so reads fail while an active is down (the behaviour before it).",
    )
    connect_timeout_ms: int = Field(
        default=500, ge=1, le=60_000, description="Connecting to a node."
    )
    upstream_timeout_ms: int = Field(
        default=2000, ge=1, le=600_000, description="A node's whole response, once connected."
    )
    per_try_timeout_ms: int | None = Field(
        default=None,
        ge=1,
        le=600_000,
        description="A keyed read's try with no answer yet after this fails over like a timeout "
        "(and ejects the node); an answer already streaming keeps KROUTE_UPSTREAM_TIMEOUT_MS "
        "(unset: that timeout).",
    )
    hedge_after_ms: int | None = Field(
        default=None,
        ge=1,
        le=600_000,
        description="Hedged reads: a keyed read unanswered after this is also sent to the next "
        "replica; the first answer wins and the other try is closed. Hedges draw on the retry "
        "budget (unset: no hedging).",
    )
    retry_budget_percent: float = Field(
        default=20.0,
        ge=0,
        le=100,
        description="Failover retries may add at most this share of requests (a retry budget) ...",
    )
    min_retries_per_s: float = Field(
        default=10.0, ge=0, le=1_000_000, description="... plus this many retries a second ..."
    )
    retry_burst: int = Field(
        default=100,
        ge=0,
        le=1_000_000,
        description="... and at most this many at once (a node dying with requests in flight).",
    )
    eject_ms: int = Field(
        default=1000,
        ge=0,
        le=600_000,
        description="A node that failed is tried only after every other qualifying replica for "
        "at least this long, then until a probe of KROUTE_HEALTH_PATH succeeds and its heartbeat "
        "is alive.",
    )
    probe_interval_ms: int = Field(
        default=250, ge=10, le=60_000, description="How often ejected nodes are probed."
    )
    health_path: str = Field(
        default="/health/live",
        description="Path probed on an ejected node (any answer below 500 brings it back), the "
        "same on every node: for services whose health check lives elsewhere, e.g. /healthz.",
    )
    retry_statuses: str = Field(
        default="421",
        description="Comma-separated statuses (400-599) meaning 'not mine or not ready': a keyed "
        "request so answered goes to the next replica (the node is not ejected); when every "
        "replica answers one, the last answer is passed on. Empty: none. E.g. 421,404,503.",
    )
    eject_consecutive_5xx: int = Field(
        default=5,
        ge=0,
        le=1_000_000,
        description="A node whose answers were this many 5xx (or unusable) in a row is ejected "
        "(Envoy's consecutive_5xx; retry statuses do not count, any other answer resets). "
        "0: never.",
    )
    max_ejection_percent: int = Field(
        default=50,
        ge=0,
        le=100,
        description="Consecutive-5xx ejection never leaves more than this share of the live "
        "nodes ejected (at least one may be), so a bad deploy cannot eject everything.",
    )
    refresh_interval_ms: int = Field(
        default=1000,
        ge=50,
        le=600_000,
        description="Routing table poll from Redis (events trigger refreshes sooner).",
    )
    redis_timeout_ms: int = Field(
        default=1000, ge=10, le=60_000, description="Every Redis command and connect."
    )
    request_timeout_ms: int = Field(
        default=10_000,
        ge=10,
        le=600_000,
        description="A client must send a whole request (headers and body) within this.",
    )
    idle_timeout_ms: int = Field(
        default=30_000, ge=10, le=3_600_000, description="Idle keep-alive client connections."
    )
    send_timeout_ms: int = Field(
        default=30_000,
        ge=10,
        le=3_600_000,
        description="A client that takes none of its answer for this long is disconnected "
        "(reading it and its node connection pause meanwhile: back-pressure).",
    )
    close_timeout_ms: int = Field(
        default=5_000,
        ge=1,
        le=600_000,
        description="A connection the proxy closes may flush what it was sent for this long; "
        "then it is reset. It counts against KROUTE_MAX_CONNECTIONS until its socket is gone.",
    )
    max_header_bytes: int = Field(
        default=16_384, ge=256, le=1_048_576, description="Request line plus headers, bytes."
    )
    max_headers: int = Field(default=100, ge=1, le=10_000, description="Headers per request.")
    max_body_bytes: int = Field(
        default=1_048_576, ge=0, le=1 << 30, description="Request body (413 beyond)."
    )
    max_response_bytes: int = Field(
        default=16_777_216,
        ge=1024,
        le=1 << 31,
        description="A node's response body (502 beyond, or the answer is cut short if it "
        "was already streaming).",
    )
    max_connections: int = Field(
        default=10_000, ge=1, le=1_000_000, description="Client connections held at once."
    )
    upstream_idle_per_node: int = Field(
        default=64, ge=1, le=10_000, description="Idle keep-alive connections kept per node."
    )
    upstream_idle_timeout_ms: int = Field(
        default=4000,
        ge=100,
        le=3_600_000,
        description="An idle connection to a node is closed after this; keep it below the "
        "nodes' keep-alive timeout (uvicorn's: 5 s) so a node never closes one as a request "
        "is sent on it.",
    )
    allowed_networks: str | None = Field(
        default=None,
        description="Comma-separated CIDRs nodes must be in (unset: any registered node); a "
        "registration outside them is ignored and logged.",
    )
    shutdown_timeout_s: float = Field(
        default=10.0, ge=0, le=600, description="On SIGTERM, how long in-flight requests may run."
    )
    access_log: bool = Field(
        default=False,
        description="Log every request (costs CPU; every request then takes the Python path).",
    )
    hot_path: bool = Field(
        default=True,
        description="Serve the common case in C (proxy/_hotpath.c); false sends every request "
        "through the Python path, which behaves the same, about half as fast.",
    )
    table_process: bool | None = Field(
        default=None,
        description="Build the routing table in a process of its own (it reads Redis, decodes "
        "and rebuilds; the proxy only applies what changed): for tables of thousands of "
        "partitions, whose upkeep otherwise shares the event loop with requests. With "
        "KROUTE_WORKERS above 1, one such process (run by the supervisor) serves every worker. "
        "Unset: on when KROUTE_WORKERS is above 1, off for one proxy process.",
    )
    table_process_cpus: str | None = Field(
        default=None,
        description="With KROUTE_TABLE_PROCESS, the CPUs the table process runs on (a list such "
        "as 0,2-3; unset: the proxy's own). Pinned beside a proxy on a core of its own, it "
        "leaves that core to requests.",
    )
    workers: int = Field(
        default_factory=available_cores,
        ge=1,
        le=MAX_WORKERS,
        description="Proxy processes sharing the data port (SO_REUSEPORT), each with its own C "
        "path, under one parent that restarts a dead one and serves the admin port for all "
        "(metrics summed); 1: one process, no parent (default: one per core this process may "
        "run on).",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level of the proxy's JSON logs."
    )
    stall_report_ms: int | None = Field(
        default=None,
        ge=20,
        le=60_000,
        description="Find what holds the event loop: a stall longer than this logs a warning "
        "with its length and the CPU time the proxy used meanwhile (the rest it waited for a "
        "core), and one longer than this plus 100 ms prints every thread's stack to stderr "
        "while it lasts. Unset: off.",
    )

    @model_validator(mode="after")
    def _hedge_before_timeout(self) -> ProxySettings:
        if self.hedge_after_ms is not None and self.hedge_after_ms >= self.try_timeout_ms():
            raise ValueError(
                "KROUTE_HEDGE_AFTER_MS must be below the per-try timeout (KROUTE_PER_TRY_"
                "TIMEOUT_MS, else KROUTE_UPSTREAM_TIMEOUT_MS): a try that timed out is not hedged"
            )
        return self

    @field_validator("routes")
    @classmethod
    def _routes_json(cls, value: str) -> str:
        parse_routes(value)
        return value

    @field_validator("health_path")
    @classmethod
    def _health_path(cls, value: str) -> str:
        return check_health_path(value)

    @field_validator("retry_statuses")
    @classmethod
    def _retry_statuses(cls, value: str) -> str:
        parse_retry_statuses(value)
        return value

    @field_validator("table_process_cpus")
    @classmethod
    def _table_process_cpus(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpus(value)
        return value

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, value: str | None) -> str | None:
        if value is not None:
            parse_networks(value)
        return value

    def route_specs(self) -> tuple[RouteSpec, ...]:
        return parse_routes(self.routes)

    def try_timeout_ms(self) -> int:
        """How long a keyed read's try may go unanswered (never longer than a whole answer)."""
        if self.per_try_timeout_ms is None:
            return self.upstream_timeout_ms
        return min(self.per_try_timeout_ms, self.upstream_timeout_ms)

    def retry_status_codes(self) -> frozenset[int]:
        return parse_retry_statuses(self.retry_statuses)

    def networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
        return None if self.allowed_networks is None else parse_networks(self.allowed_networks)

    def table_process_on(self) -> bool:
        """KROUTE_TABLE_PROCESS, or when unset: one process for all the workers if there are
        several (their tables' upkeep then leaves their event loops, and Redis is read once
        per host, not per worker); for one process, off (its own child would share its core
        unless given one: KROUTE_TABLE_PROCESS_CPUS)."""
        return self.workers > 1 if self.table_process is None else self.table_process

    def table_cpus(self) -> frozenset[int] | None:
        return None if self.table_process_cpus is None else parse_cpus(self.table_process_cpus)


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as taskset and cpusets write it: numbers and ranges, comma-separated."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list (such as 0,2-3): {text!r}")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"a CPU range must go up: {part.strip()!r}")
        if high > MAX_CPU:
            raise ValueError(f"CPU {high} is beyond any machine's (at most {MAX_CPU})")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


MAX_CPU = 8191  # Linux's largest NR_CPUS


def parse_routes(text: str) -> tuple[RouteSpec, ...]:
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(raw, list) or not raw:
        raise ValueError("expected a non-empty JSON list of route objects")
    return tuple(RouteSpec.model_validate(item) for item in raw)


def parse_networks(text: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    try:
        return tuple(
            ipaddress.ip_network(part.strip(), strict=False) for part in text.split(",") if part
        )
    except ValueError as exc:
        raise ValueError(f"not a list of CIDRs: {exc}") from None


def check_health_path(value: str) -> str:
    """An origin-form request target (RFC 9112 3.2.1): it goes on the probe's request line
    as is, so a space, CR or LF would split or end that line."""
    if not value.startswith("/"):
        raise ValueError("must start with '/' (a path on each node, e.g. /healthz)")
    bad = next((c for c in value if not "!" <= c <= "~"), None)
    if bad is not None:
        raise ValueError(
            f"contains {bad!r}: spaces, control characters (CR, LF) and non-ASCII characters "
            "cannot be sent in a request target (percent-encode them)"
        )
    return value


def parse_retry_statuses(text: str) -> frozenset[int]:
    """'421, 404,503' -> {404, 421, 503}; '' -> none. Only error statuses: a 2xx or 3xx is an
    answer, never a sign that another replica should be asked."""
    statuses = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if not (item.isascii() and item.isdigit()):
            raise ValueError(f"{item!r} is not an HTTP status code (expected e.g. 421,404,503)")
        status = int(item)
        if not 400 <= status <= 599:
            raise ValueError(
                f"{status} is not in 400-599: only an error answer can mean "
                "'not mine or not ready, ask the next replica'"
            )
        statuses.add(status)
    return frozenset(statuses)
