"""Types of the C module proxy/_hotpath.c (the proxy's common case in C).

The C/Python contract (docs/proxy-hotpath.md): C takes routes and
stores as proxy.hotpath_spec.HotRoute / HotStore (read by field name in set_routes and
set_stores), Candidate and Cached built by proxy.handler, and calls only transport.write,
slow_data_received, after_fast_response, adopt, close_now and the stores' partitioners.
"""

from typing import Any

from proxy.choice import Choice, Replica
from proxy.hotpath_spec import HotRoute, HotStore

MAX_SEGMENTS: int  # the longest route template (and request path) C matches
KEY_PATH: int
KEY_QUERY: int
KEY_HEADER: int

class Tally:
    value: int
    answered: int

class ReportClock:
    shift_ms: int  # every report time of the node moved this far since its rows were built
    def __init__(self, shift_ms: int = 0) -> None: ...

class Candidate:
    target: Any  # proxy.exchange.Target
    replica: Replica | None
    provenance: bytes
    idle: list[Any]
    choice_tally: Tally | None
    node_tally: Tally
    caught_up_at_ms: int  # as it reads now through `clock`; -1 when unknown
    clock: ReportClock | None
    def __init__(
        self,
        target: Any,
        replica: Replica | None,
        provenance: bytes,
        idle: list[Any],
        host_line: bytes,
        choice_tally: Tally | None,
        node_tally: Tally,
        lag: int = -1,
        caught_up_at_ms: int = -1,  # as given: `clock` moves it
        clock: ReportClock | None = None,
    ) -> None: ...

class Cached:
    choice: Choice
    candidates: tuple[Candidate, ...]
    expires_ms: int  # checked again from cap_ms and terms when it comes
    cap_ms: int
    terms: tuple[tuple[ReportClock, int], ...]
    spread_width: int
    def __init__(
        self,
        choice: Choice,
        candidates: tuple[Candidate, ...],
        expires_ms: int,
        spread_width: int = 1,
        terms: tuple[tuple[ReportClock, int], ...] = (),
        cap_ms: int | None = None,  # default: expires_ms
    ) -> None: ...
    def live(self, now_ms: int, /) -> bool: ...

class Hub:
    enabled: int
    draining: int  # 1 while the proxy stops: answers say connection: close
    in_flight: int
    clock_offset_ms: int  # wall clock + this = common.clock.SHARED.now_ms() (sync_clock)
    request_lines: bytes  # header lines (each ending CRLF) added to every request to a node
    def __init__(
        self,
        *,
        status_lines: dict[int, bytes],
        request_drop: tuple[bytes, ...],
        response_drop: tuple[bytes, ...],
        python_only: tuple[bytes, ...],
        id_prefix: bytes,
        response_timeout_s: float,
        idle_timeout_s: float,
        max_response_bytes: int,
        max_request_bytes: int,
        max_headers: int,
        idle_per_origin: int,
        spread: int,
    ) -> None: ...
    def set_routes(self, routes: list[HotRoute]) -> None: ...
    def set_stores(self, stores: list[HotStore]) -> None: ...
    def next_request_id(self) -> bytes: ...
    def take_deposits(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
    def latency_buckets(self) -> tuple[float, ...]: ...

class ClientBase:
    hub: Hub | None
    transport: Any
    client_ip_bytes: bytes | None
    closed: int
    busy: int
    reading: int
    attention: int
    deadline: float
    def data_received(self, data: bytes) -> None: ...

class UpstreamBase:
    hub: Hub | None
    transport: Any
    idle: list[Any] | None
    closed: int
    busy: int
    deadline: float
    idle_since: float
    fast_client: Any
    fast_cached: Any
    fast_shift: int
    fast_head: Any
    fast_request_id: Any
    fast_store: Any
    fast_partition: int
    fast_keep_alive: int
    fast_head_only: int
    fast_http11: int
    fast_received_at: float
    def data_received(self, data: bytes) -> None: ...
    def release_fast(self) -> None: ...
